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

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only TPU devices come from libtpu, not a backend
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no TPU metadata server to ask on this machine
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # configs/ and the package

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from astarpo_jax.aot import chips  # noqa: E402
from astarpo_jax.run_config import run_shape  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py[:variant]).", lock_config=True)
_TOPOLOGY = flags.DEFINE_string("topology", "v5e-8", "v4-8, v5e-8, v5p-8, v6e-8, v5e-32, ... or v5e:2x4, v4:2x2x4")
_PHASES = flags.DEFINE_list("phases", [], "phases to compile (default: the config's method; 'all' = every phase)")
_JSON = flags.DEFINE_string("json_out", "", "write the results as JSON to this file")
_TOP = flags.DEFINE_integer("top", 0, "also print, per phase, the N ops moving the most HBM bytes (loops counted)")
_HLO_DIR = flags.DEFINE_string("hlo_dir", "", "save each phase's optimised HLO text in this folder")
_REREAD = flags.DEFINE_list("reread", [], "instead of compiling: re-read the saved HLO of these --json_out files "
                            "(written with --hlo_dir) with the current cost model, and rewrite them")
_GPU_FRACTION = flags.DEFINE_float("gpu_mem_fraction", chips.GPU_MEM_FRACTION,
                                   "XLA_PYTHON_CLIENT_MEM_FRACTION assumed for GPUs (JAX's default unless the run sets it)")
_CHOOSE = flags.DEFINE_bool("choose_sample_layout", False, "compile the rollout decode on each (data, 1, tensor) "
                             "sampling mesh, print their projected steps and the one chosen (layouts.choose_sample_layout)")
_CHOOSE_SCORE = flags.DEFINE_bool("choose_score_batch", False, "compile pi_ref's scoring forward at 1, 2, 4, ... "
                                   "update micro-batches a call, print each and the largest that fits "
                                   "(train.score_micro_batches; layouts.choose_score_batch)")
_CHOOSE_UPDATE = flags.DEFINE_bool("choose_update_batch", False, "compile the config's update at its micro-batch, "
                                    "x2, x4, ... up to the optimizer step, print each and the fastest that fits "
                                    "(train.micro_batch; layouts.choose_update_batch)")
_TABLES = flags.DEFINE_list("tables", [], "instead of compiling: print the summary tables of these --json_out files")

ASTARPO_PHASES = ("stage1_prefill", "stage1_decode", "rollout_prefill", "rollout_decode", "reference",
                  "astarpo_update")


def _g(n: float) -> str:
  return f"{n / 2**30:.2f}"


def _usable(kind: str, hbm_bytes: int) -> int:
  """The "fits" line: a TPU's compiler-stated HBM; on a GPU --gpu_mem_fraction of its memory (JAX's
  default unless the run sets XLA_PYTHON_CLIENT_MEM_FRACTION), as experiments/memory_plan.py judges it."""
  return chips.usable_hbm_bytes(kind, hbm_bytes, gpu_mem_fraction=_GPU_FRACTION.value)


def phase_row(name, r, chip) -> str:
  if r.error:
    return f"| {name} | {r.compile_s:.0f} | does not compile: {r.error} |"
  m, t = r.memory, r.times(chip)
  fits = "yes" if r.peak <= _usable(chip.kind, chip.hbm_bytes) else "**no**"
  per = " (per step)" if r.segments else ""
  return (f"| {name}{per} | {r.compile_s:.0f} | {_g(m['argument'])} | {_g(m['output'] - m['alias'])} | "
          f"{_g(m['temp'])} | {_g(m['code'])} | {_g(r.resident_other)} | {_g(r.peak)} | {fits} | "
          f"{r.cost['flops'] / 1e12:.3g} | {r.useful_flops / 1e12:.3g} | {r.cost['hbm_bytes'] / 1e9:.3g} | "
          f"{r.cost['collective_bytes'] / 1e9:.3g} | {t['compute_s'] * 1e3:.4g} | {t['hbm_s'] * 1e3:.4g} | "
          f"{t['ici_s'] * 1e3:.4g} | {t['projected_s'] * 1e3:.4g} | {_ms(modeled_s(r, chip))} | "
          f"{100 * r.mfu(chip):.0f}%" + (f" ({100 * r.live_mfu(chip):.0f}% live, fill {r.rows_fill:.2f})"
                                          if r.live_flops else "") + " |")


def modeled_s(r, chip) -> float | None:
  """A call's (decode: a step's, at the full cache) modeled seconds: the roofline with the fixed costs read from
  its compile (fixed_costs.modeled_step); None where none were read (a CPU compile)."""
  from astarpo_jax.aot import layouts
  return layouts.call_seconds(r, chip) if r.fixed and r.cost else None


def _ms(s: float | None) -> str:
  return "" if s is None else f"{s * 1e3:.4g}"


def whole_run(results: dict, cfg, chip, run, settings: dict, multi_host: bool) -> dict:
  """The config's whole run at both edges, as experiments/project_methods.py projects each method's
  (method_runs.whole_runs: continuous batching at the config's slots; the modeled edge's fixed costs, host trips,
  grading, evaluation and saves): {edge: {stage1_h, step_s, stage2_h, besides_h, total_h}}; {} without the phases."""
  from astarpo_jax.aot import method_runs
  name = settings.get("name", "astarpo")
  need = ("stage1_prefill", "stage1_decode", "rollout_prefill", "rollout_decode", "reference", f"{name}_update")
  if any(p not in results or results[p].error for p in need):
    return {}
  shapes = {name: method_runs.method_shape(name, settings)}
  out = {}
  for edge in ("roofline", "modeled"):
    plan = method_runs.Plan(modeled=edge == "modeled", multi_host=multi_host)
    rows = method_runs.whole_runs(results, cfg, chip, {"astarpo": run, name: run}, shapes,
                                  {run.sample_batch: results["rollout_decode"]}, plan)
    row = next(r for r in rows if r["setting"] == "config")
    out[edge] = {k: row[k] for k in ("stage1_h", "step_s", "stage2_h", "besides_h", "total_h")}
  return out


HEADER = ("| phase | compile s | args GiB | out GiB | temp GiB | code GiB | resident GiB | peak GiB | fits | "
          "TFLOP | useful TFLOP | HBM GB | ICI GB | compute ms | HBM ms | ICI ms | roofline ms | modeled ms | MFU "
          "(useful-token MFU, rows computed) |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def summary_tables(paths) -> str:
  """Markdown: per run, each phase's peak and roofline time, and the projected run times."""
  runs = [json.load(open(p)) for p in paths]
  phases = ("stage1_prefill", "stage1_decode", "rollout_reshard", "rollout_decode", "reference", "astarpo_update",
            "grpo_update", "ppo_update", "rebel_update", "rloo_update")
  phases = [p for p in phases if any(p in r["phases"] for r in runs)]
  head = "| model | slice | mesh | sampling mesh | " + " | ".join(phases) + " |"
  lines = ["Peak GiB per device (fits?) / roofline ms / modeled ms per call (decode: per step at the full cache; "
           "modeled: the fixed costs read from the compile)\n", head,
           "|" + "---|" * (4 + len(phases))]
  for r in runs:
    cells = []
    for p in phases:
      ph = r["phases"].get(p)
      if ph is None:
        cells.append("")
      elif ph["error"]:
        cells.append("OOM" if "memory" in ph["error"].lower() else "error")
      else:
        fits = "" if ph["peak"] <= _usable(r["chip"]["kind"], r["chip"]["hbm_bytes"]) else " **no**"
        modeled = f" / {ph['modeled_s'] * 1e3:.4g}" if ph.get("modeled_s") is not None else ""
        cells.append(f"{ph['peak'] / 2**30:.1f}{fits} / {ph['times']['projected_s'] * 1e3:.4g}{modeled}")
    sm = tuple(r["sample_mesh"]) if r.get("sample_mesh") else "="
    lines.append(f"| {r['model'].split('/')[-1]} | {r['slice']} | {tuple(r['mesh'])} | {sm} | " + " | ".join(cells)
                 + " |")
  lines += ["", "Projections, roofline / modeled (not measurements; a file without the modeled edge: roofline "
            "only, rollouts without continuous batching)\n",
            "| model | slice | update MFU | rollout decode ms/step | s / Stage-2 step | Stage-1 h "
            "| Stage-2 h (725 steps) | besides h | total h | paper 4xH100 h | compile wall s |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in runs:
    p, up, w = r["projection"], r["phases"].get("astarpo_update", {}), r.get("whole_run") or {}
    mfu = f"{100 * up['mfu']:.0f}%" if up and not up.get("error") else ""
    if w:
      fmt = lambda k: f"{w['roofline'][k]:.3g} / {w['modeled'][k]:.3g}"  # noqa: E731
    else:
      fmt = lambda k: f"{p[k]:.3g}" if k in p else ""  # noqa: E731
    dec = r["phases"].get("rollout_decode", {})
    dec_ms = f"{dec['times']['projected_s'] * 1e3:.3g}" if dec and not dec.get("error") else ""
    if dec_ms and dec.get("modeled_s") is not None:
      dec_ms += f" / {dec['modeled_s'] * 1e3:.3g}"
    wall = f"{r['wall_s']:.0f}" if "wall_s" in r else ""
    lines.append(f"| {r['model'].split('/')[-1]} | {r['slice']} | {mfu} | {dec_ms} | {fmt('step_s')} | "
                 f"{fmt('stage1_h')} | {fmt('stage2_h')} | {fmt('besides_h') if w else ''} | {fmt('total_h')} | "
                 f"{r.get('paper_hours_4xh100') or ''} | {wall} |")
  return "\n".join(lines + ["", formula_table(runs)])


def formula_table(runs) -> str:
  """The memory plan's formulas (memory_plan.estimate_*) against the TPU compile, GiB per device beyond
  the resident state, per plan phase."""
  from astarpo_jax.aot import memory_plan as mp
  from astarpo_jax.aot.layouts import plan_phases
  from astarpo_jax.aot.phases import method_of
  from astarpo_jax.model.config import ModelConfig
  lines = ["Memory plan: formula vs TPU compile, GiB per device on top of the resident state (ratio)\n",
           "| model | slice | resident (exact) | sample | reference | update |", "|---|---|---:|---:|---:|---:|"]
  for r in runs:
    cfg = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in r["cfg"].items()})
    run = mp.RunShape(**r["run"])
    settings = r.get("settings") or {"name": "astarpo"}
    plan = mp.plan_memory(cfg, run, tuple(r["mesh"]), num_devices=int(np.prod(r["mesh"])),
                          ref_param_dtype=run.ref_param_dtype, method=method_of(settings["name"], settings),
                          mini_batch=run.mini_batch or run.micro_batch, sample_shape=r.get("sample_mesh"))
    cells = []
    for k, phase in plan_phases(settings["name"]).items():
      res = r["phases"].get(phase)
      if res is None or res["error"]:
        cells.append(f"{plan.phases[k].total / 2**30:.2f} vs " + ("OOM" if res else "-"))
        continue
      m = res["memory"]
      compiled = m["argument"] + m["output"] - m["alias"] + m["temp"] + m["code"] - (plan.resident_total -
                                                                                      res["resident_other"])
      cells.append(f"{plan.phases[k].total / 2**30:.2f} vs {compiled / 2**30:.2f} "
                   f"({plan.phases[k].total / max(compiled, 1):.2f})")
    lines.append(f"| {r['model'].split('/')[-1]} | {r['slice']} | {plan.resident_total / 2**30:.2f} | "
                 + " | ".join(cells) + " |")
  return "\n".join(lines)


def _json_result(r, chip) -> dict:
  return dict({k: v for k, v in dataclasses.asdict(r).items() if k != "hlo"}, peak=r.peak,
              times=r.times(chip) if r.cost else {}, mfu=r.mfu(chip), live_mfu=r.live_mfu(chip),
              modeled_s=modeled_s(r, chip))


def reread(path: str) -> None:
  """Recompute a --json_out file's costs, times and projections from the HLO its run saved (--hlo_dir)."""
  from astarpo_jax.aot import chips, compiling, memory_plan, phases, projection
  from astarpo_jax.model.config import ModelConfig
  out = json.load(open(path))
  cfg = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in out["cfg"].items()})
  run, chip = memory_plan.RunShape(**out["run"]), chips.ChipSpec(**out["chip"])
  fields = {f.name for f in dataclasses.fields(compiling.PhaseResult)} - {"segments", "hlo"}
  results = {}
  for name, ph in out["phases"].items():
    res = compiling.PhaseResult(**{k: v for k, v in ph.items() if k in fields})
    res.mesh_shape = tuple(res.mesh_shape)
    if not res.error:
      files = sorted(f for f in os.listdir(out["hlo_dir"]) if f == f"{name}.hlo" or f.startswith(f"{name}_"))
      texts = {None if f == f"{name}.hlo" else int(f[len(name) + 1:-4]): open(os.path.join(out["hlo_dir"], f)).read()
               for f in files}
      settings = out.get("settings") or {}
      phase_run = phases.method_run(run, phases.method_of(phases.update_method(name), settings)) if phases.update_method(name) \
          else run
      compiling.read_hlo(res, dict(sorted(texts.items(), key=lambda kv: kv[0] or 0)), cfg, phase_run,
                   int(np.prod(out["mesh"])))
    results[name] = res
  out["phases"] = {p: _json_result(r, chip) for p, r in results.items()}
  out["projection"] = projection.project(results, chip, run)
  out["whole_run"] = whole_run(results, cfg, chip, run, out.get("settings") or {}, out.get("num_hosts", 1) > 1)
  with open(path, "w") as f:
    json.dump(out, f, indent=1, default=str)


def _choose(cfg, run, spec, settings, shape) -> None:
  """The sampling layout by compiling: every candidate's decode step at 390 live tokens a slot, and the choice."""
  from astarpo_jax.aot import chips, layouts
  rows, chosen = layouts.choose_sample_layout(cfg, run, chips.topology_devices(_TOPOLOGY.value), shape, spec.chip,
                                             _usable(spec.chip.kind, spec.chip.hbm_bytes), settings)
  print("| sampling mesh (data, fsdp, tensor) | peak GiB | fits | HBM GB/step | ICI MB/step | collectives | "
        "compute / HBM / ICI ms | step ms | copy per rollout ms |")
  print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    if r["error"]:
      print(f"| {r['shape']} | {'OOM' if 'memory' in r['error'].lower() else 'error'} | no | | | | | | |")
      continue
    print(f"| {r['shape']} | {r['peak'] / 2**30:.1f} | {'yes' if r['fits'] else '**no**'} | "
          f"{r['hbm_bytes'] / 1e9:.2f} | {r['collective_bytes'] / 1e6:.1f} | {r['collectives']:.0f} | "
          f"{r['compute_s'] * 1e3:.2f} / {r['hbm_s'] * 1e3:.2f} / {r['ici_s'] * 1e3:.2f} | "
          f"{r['projected_s'] * 1e3:.3f} | {r['copy_s'] * 1e3:.1f} |")
  print(f"chosen: {chosen} (the fastest step, with its copy once per rollout, among the layouts that fit)")
  row = next((r for r in rows if r["shape"] == chosen), None)
  if row is None:
    return
  from astarpo_jax.aot import decode_roofline
  print(f"\nThe chosen layout's step against its floor (bf16 weights held + live KV of its slots, per chip) and "
        f"the slice's memory roofline ({run.sample_batch} slots):\n")
  print("| live tokens / slot | HBM GB / chip | weights + live KV GB | ratio | step ms | modeled ms | slice roofline ms "
        "| x roofline |")
  print("|---:|---:|---:|---:|---:|---:|---:|---:|")
  for r in decode_roofline.live_bytes_rows(row["result"], cfg, run, spec.chip, row["mesh"], row["page_size"]):
    print(f"| {r['live_len']} | {r['hbm_bytes'] / 1e9:.2f} | {r['weights'] / 1e9:.2f} + {r['kv'] / 1e9:.2f} = "
          f"{(r['weights'] + r['kv']) / 1e9:.2f} | {r['bytes_ratio']:.2f} | {r['step_s'] * 1e3:.3f} | "
          f"{r['modeled_s'] * 1e3:.3f} | {r['roofline_s'] * 1e3:.3f} | {r['roofline_ratio']:.2f} |")


def _choice_table(header: str, rows: list[dict], lead, cells) -> None:
  """A chooser's candidates as a markdown table: `lead(r)` the cells every row has, `cells(r)` those of a compiled
  one after its peak and fit; a refused compile says why."""
  print(header)
  print("|---:|---:|---|---:|---|---:|---:|")
  for r in rows:
    if r["error"]:
      print(f"| {lead(r)} | does not compile: {r['error'][:80]} | | | |")
      continue
    print(f"| {lead(r)} | {r['peak'] / 2**30:.2f} | {'yes' if r['fits'] else '**no**'} | {cells(r)} |")


def _choose_score(cfg, run, spec, settings, shape) -> None:
  """π_ref's scoring micro-batch by compiling: each candidate's peak and projected seconds a rollout, the choice."""
  from astarpo_jax.aot import chips, layouts
  mesh = layouts.abstract_mesh_devices(chips.topology_devices(_TOPOLOGY.value), shape)
  usable = _usable(spec.chip.kind, spec.chip.hbm_bytes)
  rows, chosen = layouts.choose_score_batch(cfg, run, mesh, settings, usable, spec.chip)
  _choice_table("| train.score_micro_batches | rows a call | weights | peak GiB | fits | ms a call | s a rollout |", rows,
                lambda r: f"{r['score_micro_batches']} | {r['rows']} | {r['weights']}",
                lambda r: f"{r['call_s'] * 1e3:.1f} | {r['step_s']:.3f}")
  print(f"chosen: train.score_micro_batches={chosen} (the largest that fits {usable / 2**30:.2f} GiB beside the "
        "resident state: fewest calls, each gathering the weights once if at all)")


def _choose_update(cfg, run, spec, settings, shape, phase) -> None:
  """The update's micro-batch by compiling: each candidate's peak, seconds and MFU per optimizer step, the choice."""
  from astarpo_jax.aot import chips, layouts
  mesh = layouts.abstract_mesh_devices(chips.topology_devices(_TOPOLOGY.value), shape)
  usable = _usable(spec.chip.kind, spec.chip.hbm_bytes)
  rows, chosen = layouts.choose_update_batch(phase, cfg, run, mesh, settings, usable, spec.chip)
  _choice_table("| train.micro_batch | micro-batches a step | weights | peak GiB | fits | s a step | MFU |", rows,
                lambda r: f"{r['micro_batch']} | {r['micro_batches']} | {r['weights']}",
                lambda r: f"{r['step_s']:.3f} | {100 * r['mfu']:.0f}%")
  print(f"chosen: train.micro_batch={chosen} (the fastest optimizer step, modeled where the compile gave fixed costs, "
        f"among those that fit {usable / 2**30:.2f} GiB beside the resident state)")


def main(argv):
  del argv
  for path in _REREAD.value:
    reread(path)
  if _REREAD.value:
    return
  if _TABLES.value:
    print(summary_tables(_TABLES.value))
    return
  c = _CONFIG.value
  if c is None:
    raise SystemExit("--config is required (or --tables=FILES)")
  from astarpo_jax.aot import chips, layouts, phases, projection
  from astarpo_jax.infra import sharding
  spec = chips.slice_spec(_TOPOLOGY.value)
  from astarpo_jax import experiment, run_config
  try:
    run_config.resolve_micro_batch(c, spec.num_devices)
  except ValueError as e:
    raise SystemExit(str(e)) from None
  cfg = experiment.model_config(c)
  if run_config.lora_settings(c) is not None:  # model.lora: the update compiles on the adapter, the base beside it
    from astarpo_jax.model import lora
    cfg = lora.model_config(cfg, run_config.lora_settings(c))
  run = run_shape(c)
  settings = dict(c.algo.to_dict(), logp_chunk=c.train.logp_chunk, decode_layout=c.sampling.kv_layout,
                  page_size=c.sampling.page_size, paged_attention=c.sampling.paged_attention)
  if c.train.pack_rows:  # packed at the fill the length mix gives each phase's rows (phases.mix_fill)
    settings["pack_fill"] = "mix"
  settings["gather_weights"] = c.train.get("gather_weights", "auto")
  if _CHOOSE_SCORE.value:
    _choose_score(cfg, run, spec, settings, sharding.resolve_mesh_shape(tuple(c.mesh.shape), spec.num_devices))
    return
  if _CHOOSE_UPDATE.value:
    _choose_update(cfg, run, spec, settings, sharding.resolve_mesh_shape(tuple(c.mesh.shape), spec.num_devices),
                   f"{c.algo.name}_update")
    return
  if _CHOOSE.value:
    _choose(cfg, run, spec, settings, sharding.resolve_mesh_shape(tuple(c.mesh.shape), spec.num_devices))
    return
  default = ASTARPO_PHASES if c.algo.name == "astarpo" else (f"{c.algo.name}_update",)
  every = [p for p in phases.PHASES if run_config.lora_settings(c) is not None or p not in phases.LORA_PHASES]
  names = every if _PHASES.value == ["all"] else (_PHASES.value or list(default))
  unknown = [p for p in names if p not in phases.PHASES]
  if unknown:
    raise SystemExit(f"--phases: unknown {unknown}; known: {list(phases.PHASES)}")
  try:
    shape = sharding.resolve_mesh_shape(tuple(c.mesh.shape), spec.num_devices)
    devices = chips.topology_devices(_TOPOLOGY.value)
    mesh = layouts.abstract_mesh_devices(devices, shape)
    backend = "gpu" if spec.chip.kind in ("h100", "h200") else "tpu"
    sample_mesh = layouts.sampling_mesh(cfg, devices, shape, tuple(c.mesh.sample_shape), backend)
  except (ValueError, RuntimeError) as e:
    raise SystemExit(f"cannot compile for {_TOPOLOGY.value}: {e}")
  sample_shape = tuple(sample_mesh.devices.shape) if sample_mesh is not None else None
  if sample_mesh is None:
    names = [p for p in names if p not in phases.RESHARD_PHASES]
  elif not _PHASES.value and c.algo.name == "astarpo":
    names = list(phases.RESHARD_PHASES) + names
  print(f"{c.model.name_or_path} ({cfg.num_params / 1e9:.2f}B params, {cfg.dtype} compute, {cfg.param_dtype} "
        f"params, remat={cfg.remat}, attention_block={cfg.attention_block}, optimizer {run.optimizer}"
        + (f" (mu {run.mu_dtype})" if run.mu_dtype else "") + f") on {spec.name} ({spec.topology}, "
        f"{spec.num_devices} devices, {spec.num_hosts} host(s), {spec.chip.hbm_bytes / 2**30:.1f} GiB HBM each), "
        f"mesh (data, fsdp, tensor) = {shape}"
        + (f", sampling mesh {sample_shape}" if sample_mesh is not None else ""))
  print(f"{c.algo.name}: P={run.prompt_len} R={run.response_len}; prompts: rollout={run.rollout_batch} "
        f"mini={run.mini_batch} micro={run.micro_batch} ({run.rows_per_prompt} rows each); rows: "
        f"sample_batch={run.sample_batch} stage1_batch={run.stage1_rows}\n")
  results, wall = {}, time.perf_counter()
  usable = _usable(spec.chip.kind, spec.chip.hbm_bytes)
  for p in names:
    results[p], how, why = layouts.compile_gathered(p, cfg, run, mesh, settings, usable, keep_hlo=bool(_HLO_DIR.value),
                                                    sample_mesh=sample_mesh)
    if how:
      whole = "held whole over the batch axes (no gather a call)"
      said = {"reference": {"per_step": whole, "per_step_local": whole,
                            "per_micro_batch": "gathered in every call"}}.get(p, {}).get(
          how, {"per_step_local": "gathered once per step, gradients accumulated per device and reduced once"}.get(
              how, f"gathered {how.replace('_', ' ')}"))
      print(f"{p}: weights {said} (train.gather_weights={settings['gather_weights']}: {why})")
    if _HLO_DIR.value and results[p].hlo:
      os.makedirs(_HLO_DIR.value, exist_ok=True)
      for slots, text in results[p].hlo.items():  # decode: one file per segment, named by its cache slots
        with open(os.path.join(_HLO_DIR.value, f"{p}.hlo" if slots is None else f"{p}_{slots}.hlo"), "w") as f:
          f.write(text)
    print(f"compiled {p} in {results[p].compile_s:.0f} s" + (f": {results[p].error}" if results[p].error else ""),
          flush=True)
  print("\nPer device; TFLOP / GB per call (decode: per step at the full cache); roofline = max(compute, HBM, ICI)\n")
  print(HEADER)
  for p, r in results.items():
    print(phase_row(p, r, spec.chip))
  for p, r in results.items() if _TOP.value else ():
    print(f"\n{p}: ops moving the most HBM bytes (per call; decode: the segment's loop with one step)\n"
          "| op | JAX op | TFLOP | HBM GB | all spaces GB |\n|---|---|---:|---:|---:|")
    for op, name, f, h, b in r.top_ops[:_TOP.value]:
      print(f"| {op} | {name} | {f:.3g} | {h:.3g} | {b:.3g} |")
  proj = projection.project(results, spec.chip, run)
  paper = projection.PAPER_HOURS_4XH100.get(c.model.name_or_path)
  edges = whole_run(results, cfg, spec.chip, run, settings, spec.num_hosts > 1)
  if edges:
    print("\nThe whole run, roofline / modeled (projections, not measurements; method_runs.py, as "
          "experiments/project_methods.py):")
    for k in edges["roofline"]:
      print(f"  {k}: {edges['roofline'][k]:.4g} / {edges['modeled'][k]:.4g}")
  elif proj:
    print("\nProjections (roofline times, perfect overlap assumed; not measurements):")
    for k, v in proj.items():
      print(f"  {k}: {v:.4g}")
  if (edges or proj) and paper is not None:
    print(f"  paper, A*-PO on 4 x H100: {paper} h")
  print(f"\nwall time {time.perf_counter() - wall:.0f} s")
  if _JSON.value:
    out = {"model": c.model.name_or_path, "slice": spec.name, "topology": spec.topology, "mesh": shape,
           "sample_mesh": sample_shape if sample_mesh is not None else None, "wall_s": time.perf_counter() - wall,
           "run": dataclasses.asdict(run), "settings": settings, "cfg": dataclasses.asdict(cfg),
           "chip": dataclasses.asdict(spec.chip),
           "phases": {p: _json_result(r, spec.chip) for p, r in results.items()},
           "projection": proj, "whole_run": edges, "num_hosts": spec.num_hosts, "paper_hours_4xh100": paper, "hlo_dir": os.path.abspath(_HLO_DIR.value or "")}
    with open(_JSON.value, "w") as f:
      json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
  app.run(main)
