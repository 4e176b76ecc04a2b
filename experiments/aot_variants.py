"""Before/after TPU compiles of changes the compiled HLO suggests, applied here as patches (not yet in
the library), so each proposal comes with its compiled figures. One phase per variant.

  python experiments/aot_variants.py --config=configs/qwen1p5b.py --topology=v5e-8 --variants=all
  LIBTPU_INIT_ARGS=--xla_tpu_enable_windowed_einsum_for_all_gather=false \
      python experiments/aot_variants.py --config=configs/qwen1p5b.py --topology=v5e-8 --variants=baseline

Variants (each against `baseline`, the code as it is):
  unembed_grad_rs   the tied unembedding's per-chunk gradient constrained to its FSDP sharding
                    (losses._fused_chunk_bwd): reduce-scatter instead of an all-reduce of the whole [D, V]
  reference_64, reference_256   the reference forward on 64 / 256 rows at once instead of train.micro_batch
  packed_50, packed_25   the update and the reference forward on packed rows (train.pack_rows) when each
                    batch shard's rows pack into 50% / 25% of their count (responses ending early)
(The decode's vocabulary split is no longer a variant: the library's token choice draws on each device's
vocabulary shard, token_choice.choose_tokens_split.)
"""
from __future__ import annotations

import dataclasses
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from astarpo_jax.run_config import run_shape  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py[:variant]).", lock_config=True)
_TOPOLOGY = flags.DEFINE_string("topology", "v5e-8", "TPU slice or topology")
_VARIANTS = flags.DEFINE_list("variants", ["all"], "baseline, unembed_grad_rs, reference_64, "
                              "reference_256, packed_50, packed_25, or all")
flags.mark_flags_as_required(["config"])

PHASE = {"baseline": ("astarpo_update", "rollout_decode", "reference", "stage1_prefill"),
         "unembed_grad_rs": ("astarpo_update",),
         "reference_64": ("reference",), "reference_256": ("reference",),
         "packed_50": ("astarpo_update", "reference"), "packed_25": ("astarpo_update", "reference")}


def _patch_unembed_grad():
  """Constrain the chunk's [D, V] unembedding gradient to the embedding's FSDP split (logical axes)."""
  from astarpo_jax.infra.sharding import constrain
  from astarpo_jax.model import kernels
  bwd = kernels._fused_chunk_bwd

  def patched(temperature, residuals, cotangents):
    g_h, g_unembed_DV, g_t = bwd(temperature, residuals, cotangents)
    return g_h, constrain(g_unembed_DV, ("embed", "vocab")), g_t
  kernels._fused_chunk.defvjp(kernels._fused_chunk_fwd, patched)


def main(argv):
  del argv
  c = _CONFIG.value
  from astarpo_jax import experiment
  from astarpo_jax.aot import chips, compiling, layouts
  from astarpo_jax.infra import sharding
  spec = chips.slice_spec(_TOPOLOGY.value)
  cfg, run = experiment.model_config(c), run_shape(c)
  settings = dict(c.algo.to_dict(), logp_chunk=c.train.logp_chunk)
  shape = sharding.resolve_mesh_shape(tuple(c.mesh.shape), spec.num_devices)
  mesh = layouts.abstract_mesh_devices(chips.topology_devices(_TOPOLOGY.value), shape)
  names = list(PHASE) if _VARIANTS.value == ["all"] else _VARIANTS.value
  unknown = [n for n in names if n not in PHASE]
  if unknown:
    raise SystemExit(f"--variants: unknown {unknown}; known: {list(PHASE)} or all")
  print(f"{c.model.name_or_path} on {spec.name}, mesh {shape}, LIBTPU_INIT_ARGS="
        f"{os.environ.get('LIBTPU_INIT_ARGS', '')!r}\n")
  print("| variant | phase | compile s | temp GiB | peak GiB | TFLOP | HBM GB | ICI GB | compute ms | HBM ms | "
        "ICI ms | roofline ms |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for name in names:
    r, s = run, settings
    if name == "unembed_grad_rs":
      _patch_unembed_grad()
    if name.startswith("reference_"):
      r = dataclasses.replace(run, reference_batch=int(name.split("_")[1]))
    if name.startswith("packed_"):
      s = dict(settings, pack_fill=int(name.split("_")[1]) / 100)
    for phase in PHASE[name]:
      res = compiling.compile_phase(phase, cfg, r, mesh, s)
      if res.error:
        print(f"| {name} | {phase} | {res.compile_s:.0f} | {res.error[:200]} |")
        continue
      t, g = res.times(spec.chip), 2**30
      print(f"| {name} | {phase} | {res.compile_s:.0f} | {res.memory['temp'] / g:.2f} | {res.peak / g:.2f} | "
            f"{res.cost['flops'] / 1e12:.4g} | {res.cost['hbm_bytes'] / 1e9:.4g} | "
            f"{res.cost['collective_bytes'] / 1e9:.4g} | {t['compute_s'] * 1e3:.4g} | {t['hbm_s'] * 1e3:.4g} | "
            f"{t['ici_s'] * 1e3:.4g} | {t['projected_s'] * 1e3:.4g} |", flush=True)


if __name__ == "__main__":
  app.run(main)
