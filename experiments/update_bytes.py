"""The update's HBM bytes as compiled beside the bytes it must touch (astarpo_jax/aot/update_bytes.py).

  python experiments/aot.py --config=configs/qwen7b.py --topology=h200x8 --phases=astarpo_update \
      --json_out=a.json --hlo_dir=hlo_a            # PYTHONPATH=PLUGIN for a GPU target (docs/tpu.md 0)
  python experiments/update_bytes.py --json=a.json,b.json

Per file: the compiled HBM bytes of each update phase (loops counted, `hlo_cost`), the part of them that only
moves data (copies, slices, in-place updates, converts; `Cost.moved`, by op), and the formula's terms for the run,
mesh and packed rows the compile used (the gradient accumulator split as the master params).
"""
from __future__ import annotations

import json
import os

from absl import app, flags

from astarpo_jax.aot import hlo_cost, phases, update_bytes
from astarpo_jax.aot.run_shape import RunShape
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.training import packing

_JSON = flags.DEFINE_list("json", [], "experiments/aot.py --json_out files written with --hlo_dir")
_ACC_WAYS = flags.DEFINE_integer("acc_ways", 0, "the gradient accumulator's split (0: the batch ways, as today)")


def _packed_rows(run: RunShape, mesh_shape, settings: dict) -> int | None:
  """Rows a device's micro-batch packs into as the compile packed them (phases._packed), None when unpacked."""
  fill, n = settings.get("pack_fill"), mesh_shape[0] * mesh_shape[1]
  if not fill:
    return None
  if fill == "mix":
    fill = phases.mix_fill(run, n, run.micro_rows, run.mini_rows // run.micro_rows)
  return packing.packed_shapes(run.micro_rows, run.prompt_len, run.response_len, n, fill)["pack_tokens"][0][1]


def main(_):
  for path in _JSON.value:
    d = json.load(open(path))
    cfg = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in d["cfg"].items()})
    for name, ph in d["phases"].items():
      method = phases.update_method(name)
      if not method:
        continue
      run = phases.method_run(RunShape(**{k: v for k, v in d["run"].items() if k != "lora"}),
                              phases.method_of(method, d["settings"]))
      hlo = os.path.join(d.get("hlo_dir") or os.path.dirname(path), f"{name}.hlo")
      cost, _ = hlo_cost.analyze(open(hlo).read())
      shape = update_bytes.of_run(cfg, run, d["mesh"], _packed_rows(run, d["mesh"], d["settings"]),
                                  _ACC_WAYS.value or None)
      floor = update_bytes.update_bytes(cfg, shape)
      moved = sorted(cost.moved.items(), key=lambda kv: -kv[1])
      print(f"{path} {name}: compiled HBM {cost.hbm_bytes / 1e12:.2f} TB a call, of it moving data only "
            f"{sum(cost.moved.values()) / 1e12:.2f} TB ({', '.join(f'{k} {v / 1e9:.0f} GB' for k, v in moved[:5])})")
      print(f"  must touch {floor['total'] / 1e12:.2f} TB ({shape}): "
            + ", ".join(f"{k} {v / 1e9:.1f} GB" for k, v in floor.items() if k != "total"))


if __name__ == "__main__":
  app.run(main)
