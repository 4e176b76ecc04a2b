"""A measured phase beside its roofline projection, on the accelerator this process runs on.

  python experiments/measure_step.py --config=configs/qwen1p5b.py --chip=h200 --config.mesh.shape='(1,1,1)' \
      --decode_slots=64,256 --json_out=measure.json     # on one H200 (experiments/device_check.py runs this)
  python experiments/measure_step.py --config=configs/qwen1p5b.py --chip=h200 --config.mesh.shape='(1,1,1)' --dry_run
  python experiments/measure_step.py --config=configs/demo.py --chip=h200 --reps=2   # CPU smoke run

docs/tpu.md's tables are roofline projections from compile-only devices; this script is the check a lent
accelerator allows (issue 16: "compare one projection with a measured step and print both"). Each phase
is the program aot/phases.py builds for its tables (phases.PHASES, the config's shapes and shardings), compiled
here for this process's devices; its roofline time is read from that compiled HLO as aot/compiling.py reads it
(hlo_cost.py's FLOPs, HBM and collective bytes against the `--chip` table entry), then the program runs
on random inputs with those shardings: a warm-up call and `--reps` timed calls, fresh inputs before each
(the update donates its state), the median reported, with MFU (projection.useful_flops / (s x peak)) and
tokens/s. A decode phase is timed per step: one segment in which every slot decodes `--decode_steps` tokens
(aot/measure.py), at each of `--decode_slots` slot counts. `--json_out` is rewritten after every phase, so
a run cut short keeps what it measured. `--dry_run` compiles and runs nothing: it prints each phase's shapes,
useful FLOPs and floors on the chip (aot/measure.floors). On the CPU the chip figures are not this machine's,
so only the script is checked.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from astarpo_jax.run_config import run_shape  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py[:variant]).", lock_config=True)
_CHIP = flags.DEFINE_string("chip", None, "chips.CHIPS entry whose peaks the roofline uses (h200, v5e, ...)")
_PHASES = flags.DEFINE_list("phases", ["reference", "astarpo_update", "stage1_prefill", "rollout_decode"],
                            "aot.PHASES to measure")
_REPS = flags.DEFINE_integer("reps", 5, "timed calls per phase (after one warm-up call)")
_DECODE_SLOTS = flags.DEFINE_list("decode_slots", [], "slot counts of each decode phase (default: the run's)")
_DECODE_LAYOUTS = flags.DEFINE_list("decode_layouts", ["paged", "dense"],
                                    "KV cache layouts each decode phase is measured in (sampling/engine.py)")
_DECODE_STEPS = flags.DEFINE_integer("decode_steps", 32, "decode steps per timed segment (the time is per step)")
_JSON_OUT = flags.DEFINE_string("json_out", "", "write the header and every finished phase here (after each)")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "print the phases, shapes and floors; compile and run nothing")


def _write(path: str, record: dict) -> None:
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(record, f, indent=1)
  os.replace(tmp, path)


def _runs(phase: str, run, settings: dict) -> list:
  """(label, run, settings) per measurement: a decode phase once per `--decode_slots` entry and layout."""
  from astarpo_jax.aot import phases
  if phase not in phases.DECODE_PHASES:
    return [(phase, run, settings)]
  field = "stage1_batch" if phase.startswith("stage1") else "sample_batch"
  slots = _DECODE_SLOTS.value or [getattr(run, field)]
  return [(f"{phase}@{s}/{layout}", dataclasses.replace(run, **{field: int(s)}), dict(settings, decode_layout=layout))
          for layout in _DECODE_LAYOUTS.value for s in slots]


def main(argv):
  del argv
  c = _CONFIG.value
  if c is None or not _CHIP.value:
    raise SystemExit("--config and --chip are required")
  from astarpo_jax import experiment, run_config
  from astarpo_jax.aot import chips, layouts, measure, phases
  from astarpo_jax.infra import sharding
  if _CHIP.value not in chips.CHIPS:
    raise SystemExit(f"--chip={_CHIP.value!r}: one of {sorted(chips.CHIPS)}")
  unknown = [p for p in _PHASES.value if p not in phases.PHASES or p in phases.RESHARD_PHASES]
  if unknown:
    known = sorted(set(phases.PHASES) - set(phases.RESHARD_PHASES))
    raise SystemExit(f"--phases: {unknown} not measurable here; one of {known}")
  chip = chips.CHIPS[_CHIP.value]
  settings = dict(c.algo.to_dict(), logp_chunk=c.train.logp_chunk)
  if _DRY_RUN.value:  # the device run as the chip would get it: its mesh's devices, its backend's decode slots
    gpu = chip.kind in ("h100", "h200")
    shape = tuple(c.mesh.shape)
    count = 1 if -1 in shape else int(shape[0] * shape[1] * shape[2])
    run_config.resolve_micro_batch(c, count)
    cfg, run = experiment.model_config(c), run_shape(c, backend="gpu" if gpu else "tpu")
    print(f"dry run: {count} x {chip.kind}, mesh {sharding.resolve_mesh_shape(shape, count)}; P={run.prompt_len} "
          f"R={run.response_len}, {cfg.num_params / 1e9:.2f}B params ({cfg.param_dtype} policy, {cfg.dtype} compute, "
          f"{run.ref_param_dtype} reference); floors at {chip.peak_flops / 1e12:.0f} TFLOP/s and "
          f"{chip.hbm_bandwidth / 1e9:.0f} GB/s. The roofline is read from the program compiled on the device.")
    print("| phase | tokens per call | useful TFLOP | ideal ms (100% MFU) | HBM floor ms (decode: weights + cache) |")
    print("|---|---:|---:|---:|---:|")
    rows = []
    for phase in _PHASES.value:
      for label, r, r_settings in _runs(phase, run, settings):
        f = dict(measure.floors(phase, cfg, r, r_settings, chip), phase=label)
        rows.append(f)
        hbm = f"{f['hbm_floor_s'] * 1e3:.3g}" if "hbm_floor_s" in f else ""
        print(f"| {label} | {f['tokens']} | {f['useful_flops'] / 1e12:.3g} | {f['ideal_s'] * 1e3:.3g} | {hbm} |")
    if _JSON_OUT.value:
      _write(_JSON_OUT.value, dict(dry_run=True, chip=chip.kind, run=dataclasses.asdict(run), phases=rows))
    return
  devices = jax.devices()
  run_config.resolve_micro_batch(c, len(devices))
  cfg, run = experiment.model_config(c), run_shape(c, backend=None)
  shape = sharding.resolve_mesh_shape(tuple(c.mesh.shape), len(devices))
  mesh = layouts.abstract_mesh_devices(devices, shape)
  record = dict(jax=jax.__version__, backend=jax.default_backend(), devices=len(devices),
                device_kind=devices[0].device_kind, mesh=shape, chip=chip.kind, run=dataclasses.asdict(run),
                model=dict(params=cfg.num_params, dtype=cfg.dtype, param_dtype=cfg.param_dtype), phases=[])
  print(f"{len(devices)} x {devices[0].device_kind} ({jax.default_backend()}), mesh {shape}; roofline from the "
        f"{chip.kind} table entry ({chip.peak_flops / 1e12:.0f} TFLOP/s, {chip.hbm_bandwidth / 1e9:.0f} GB/s HBM)")
  print("| phase | compile s | compute / HBM / ICI ms | roofline ms (bound) | measured ms (min-max) "
        "| measured / roofline | MFU (roofline's) | tokens/s |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|")
  for phase in _PHASES.value:
    for label, r_run, r_settings in _runs(phase, run, settings):
      t = time.perf_counter()
      try:
        r = measure.measure(phase, cfg, r_run, mesh, r_settings, chip, _REPS.value, _DECODE_STEPS.value)
      except Exception as e:  # noqa: BLE001  one phase's failure (an out-of-memory) is its result
        record["phases"].append(dict(phase=label, error=f"{type(e).__name__}: {str(e)[:1500]}",
                                     seconds=time.perf_counter() - t))
        print(f"| {label} | failed: {type(e).__name__}: {str(e)[:300]} |", flush=True)
      else:
        r = dict(r, phase=label, seconds=time.perf_counter() - t)
        record["phases"].append(r)
        per = " per step" if r.get("per") == "step" else ""
        print(f"| {label} | {r['compile_s']:.0f} | {r['compute_s'] * 1e3:.3g} / {r['hbm_s'] * 1e3:.3g} / "
              f"{r['ici_s'] * 1e3:.3g} | {r['roofline_s'] * 1e3:.4g} ({r['bound']}) | {r['measured_s'] * 1e3:.4g} "
              f"({r['spread_s'][0] * 1e3:.4g}-{r['spread_s'][1] * 1e3:.4g}){per} | "
              f"{r['measured_s'] / r['roofline_s']:.2f}x | {r['mfu']:.0%} ({r['roofline_mfu']:.0%}) | "
              f"{r['tokens_per_s']:.4g} |", flush=True)
      if _JSON_OUT.value:
        _write(_JSON_OUT.value, record)


if __name__ == "__main__":
  app.run(main)
