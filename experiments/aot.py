"""Compile every phase of a config for a TPU slice ahead of time, on this CPU-only machine (needs libtpu).

  python experiments/aot.py --config=configs/qwen7b.py --topology=v5e:2x4
  python experiments/aot.py --config=configs/qwen1p5b.py --topology=v5e-8 --phases=astarpo_update
  python experiments/aot.py --config=configs/grpo_qwen1p5b.py --topology=v4-8      # the baseline's update
  python experiments/aot.py --config=configs/qwen3b.py --topology=v5e-32 --config.mesh.shape='(1,8,4)'

Prints per phase the compiled per-device memory (arguments, outputs, temporaries, code, and the
resident state the phase does not take as arguments: peak against the chip's HBM), compiled FLOPs,
HBM bytes and collective bytes with loop trip counts, the roofline time and the useful-FLOP
utilisation; then the projected seconds per Stage-2 step, Stage-1 hours and a full MATH run. Any
config field can be overridden as in experiments/main.py. --json_out writes everything as JSON.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only TPU devices come from libtpu, not a backend
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no TPU metadata server to ask on this machine
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # configs/ and the package

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from run_shapes import model_config, run_shape  # noqa: E402  (experiments/run_shapes.py)

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py[:variant]).", lock_config=True)
_TOPOLOGY = flags.DEFINE_string("topology", "v5e-8", "v4-8, v5e-8, v5p-8, v6e-8, v5e-32, ... or v5e:2x4, v4:2x2x4")
_PHASES = flags.DEFINE_list("phases", [], "phases to compile (default: the config's method; 'all' = every phase)")
_JSON = flags.DEFINE_string("json_out", "", "write the results as JSON to this file")
flags.mark_flags_as_required(["config"])

ASTARPO_PHASES = ("stage1_prefill", "stage1_decode", "rollout_prefill", "rollout_decode", "reference",
                  "astarpo_update")


def _g(n: float) -> str:
  return f"{n / 2**30:.2f}"


def phase_row(name, r, chip) -> str:
  if r.error:
    return f"| {name} | {r.compile_s:.0f} | does not compile: {r.error} |"
  m, t = r.memory, r.times(chip)
  fits = "yes" if r.peak <= 0.95 * chip.hbm_bytes else "**no**"
  per = " (per step)" if r.segments else ""
  return (f"| {name}{per} | {r.compile_s:.0f} | {_g(m['argument'])} | {_g(m['output'] - m['alias'])} | "
          f"{_g(m['temp'])} | {_g(m['code'])} | {_g(r.resident_other)} | {_g(r.peak)} | {fits} | "
          f"{r.cost['flops'] / 1e12:.3g} | {r.useful_flops / 1e12:.3g} | {r.cost['hbm_bytes'] / 1e9:.3g} | "
          f"{r.cost['collective_bytes'] / 1e9:.3g} | {t['compute_s'] * 1e3:.4g} | {t['hbm_s'] * 1e3:.4g} | "
          f"{t['ici_s'] * 1e3:.4g} | {t['projected_s'] * 1e3:.4g} | {100 * r.mfu(chip):.0f}% |")


HEADER = ("| phase | compile s | args GiB | out GiB | temp GiB | code GiB | resident GiB | peak GiB | fits | "
          "TFLOP | useful TFLOP | HBM GB | ICI GB | compute ms | HBM ms | ICI ms | roofline ms | MFU |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def main(argv):
  del argv
  c = _CONFIG.value
  from astarpo_jax import aot, chips, memory_plan, projection
  spec = chips.slice_spec(_TOPOLOGY.value)
  cfg = model_config(c)
  run = run_shape(c)
  default = ASTARPO_PHASES if c.algo.name == "astarpo" else (f"{c.algo.name}_update",)
  phases = list(aot.PHASES) if _PHASES.value == ["all"] else (_PHASES.value or list(default))
  unknown = [p for p in phases if p not in aot.PHASES]
  if unknown:
    raise SystemExit(f"--phases: unknown {unknown}; known: {list(aot.PHASES)}")
  try:
    shape = memory_plan.resolve_mesh_shape(tuple(c.mesh.shape), spec.num_devices)
    mesh = aot.abstract_mesh_devices(chips.topology_devices(_TOPOLOGY.value), shape)
  except (ValueError, RuntimeError) as e:
    raise SystemExit(f"cannot compile for {_TOPOLOGY.value}: {e}")
  print(f"{c.model.name_or_path} ({cfg.num_params / 1e9:.2f}B params, {cfg.dtype} compute, {cfg.param_dtype} "
        f"params, remat={cfg.remat}, attention_block={cfg.attention_block}) on {spec.name} ({spec.topology}, "
        f"{spec.num_devices} devices, {spec.num_hosts} host(s), {spec.chip.hbm_bytes / 2**30:.1f} GiB HBM each), "
        f"mesh (data, fsdp, tensor) = {shape}")
  print(f"P={run.prompt_len} R={run.response_len} rollout={run.rollout_batch} mini={run.mini_rows} "
        f"micro={run.micro_batch} sample_batch={run.sample_batch} stage1_batch={run.stage1_rows} rows\n")
  results, wall = {}, time.perf_counter()
  for p in phases:
    results[p] = aot.compile_phase(p, cfg, run, mesh)
    print(f"compiled {p} in {results[p].compile_s:.0f} s" + (f": {results[p].error}" if results[p].error else ""),
          flush=True)
  print("\nPer device; TFLOP / GB per call (decode: per step at the full cache); roofline = max(compute, HBM, ICI)\n")
  print(HEADER)
  for p, r in results.items():
    print(phase_row(p, r, spec.chip))
  proj = projection.project(results, spec.chip, run)
  paper = projection.PAPER_HOURS_4XH100.get(c.model.name_or_path)
  if proj:
    print("\nProjections (roofline times, perfect overlap assumed; not measurements):")
    for k, v in proj.items():
      print(f"  {k}: {v:.4g}")
    if paper is not None:
      print(f"  paper, A*-PO on 4 x H100: {paper} h")
  print(f"\nwall time {time.perf_counter() - wall:.0f} s")
  if _JSON.value:
    out = {"model": c.model.name_or_path, "slice": spec.name, "topology": spec.topology, "mesh": shape,
           "run": dataclasses.asdict(run), "cfg": dataclasses.asdict(cfg), "chip": dataclasses.asdict(spec.chip),
           "phases": {p: dict(dataclasses.asdict(r), peak=r.peak, times=r.times(spec.chip) if r.cost else {},
                              mfu=r.mfu(spec.chip)) for p, r in results.items()},
           "projection": proj, "paper_hours_4xh100": paper}
    with open(_JSON.value, "w") as f:
      json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
  app.run(main)
