"""A measured phase beside its roofline projection, on the accelerator this process runs on.

  python experiments/measure_step.py --config=configs/qwen1p5b.py --chip=h200 --config.mesh.shape='(1,1,1)'
  python experiments/measure_step.py --config=configs/demo.py --chip=h200 --reps=2   # CPU smoke run

docs/tpu.md's tables are roofline projections from compile-only devices; this script is the check a lent
accelerator allows (issue 16: "compare one projection with a measured step and print both"). Each phase
is the program phases.py compiles for its tables (phases.PHASES, the config's shapes and shardings), compiled
here for this process's devices; its roofline time is read from that compiled HLO as phases.py reads it
(hlo_cost.py's FLOPs, HBM and collective bytes against the `--chip` table entry), then the program runs
on random inputs with those shardings: a warm-up call and `--reps` timed calls, fresh inputs before each
(the update donates its state), the median reported. Decode segments are left out: their trip count
depends on the rows. On the CPU the chip figures are not this machine's, so only the script is checked.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from astarpo_jax.run_config import run_shape  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py[:variant]).", lock_config=True)
_CHIP = flags.DEFINE_string("chip", None, "chips.CHIPS entry whose peaks the roofline uses (h200, v5e, ...)")
_PHASES = flags.DEFINE_list("phases", ["reference", "astarpo_update", "rollout_prefill"], "aot.PHASES to measure")
_REPS = flags.DEFINE_integer("reps", 5, "timed calls per phase (after one warm-up call)")


def main(argv):
  del argv
  c = _CONFIG.value
  if c is None or not _CHIP.value:
    raise SystemExit("--config and --chip are required")
  from astarpo_jax import experiment, run_config
  from astarpo_jax.aot import chips, measure, phases
  from astarpo_jax.infra import sharding
  if _CHIP.value not in chips.CHIPS:
    raise SystemExit(f"--chip={_CHIP.value!r}: one of {sorted(chips.CHIPS)}")
  chip = chips.CHIPS[_CHIP.value]
  devices = jax.devices()
  run_config.resolve_micro_batch(c, len(devices))
  cfg, run = experiment.model_config(c), run_shape(c, backend=None)
  shape = sharding.resolve_mesh_shape(tuple(c.mesh.shape), len(devices))
  mesh = phases.abstract_mesh_devices(devices, shape)
  settings = dict(c.algo.to_dict(), logp_chunk=c.train.logp_chunk)
  print(f"{len(devices)} x {devices[0].device_kind} ({jax.default_backend()}), mesh {shape}; roofline from the "
        f"{chip.kind} table entry ({chip.peak_flops / 1e12:.0f} TFLOP/s, {chip.hbm_bandwidth / 1e9:.0f} GB/s HBM)")
  print("| phase | compile s | compute / HBM / ICI ms | roofline ms (bound) | measured ms (min-max) | measured / roofline | MFU |")
  print("|---|---:|---:|---:|---:|---:|---:|")
  for phase in _PHASES.value:
    r = measure.measure(phase, cfg, run, mesh, settings, chip, _REPS.value)
    mfu = r["useful_flops"] / (r["measured_s"] * chip.peak_flops)
    print(f"| {phase} | {r['compile_s']:.0f} | {r['compute_s'] * 1e3:.3g} / {r['hbm_s'] * 1e3:.3g} / "
          f"{r['ici_s'] * 1e3:.3g} | {r['roofline_s'] * 1e3:.4g} ({r['bound']}) | {r['measured_s'] * 1e3:.4g} "
          f"({r['spread_s'][0] * 1e3:.4g}-{r['spread_s'][1] * 1e3:.4g}) | {r['measured_s'] / r['roofline_s']:.2f}x | "
          f"{mfu:.0%} |", flush=True)


if __name__ == "__main__":
  app.run(main)
