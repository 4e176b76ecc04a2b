"""The paper's claim projected (issue 37): the whole MATH run of A*-PO, GRPO, RLOO, PPO and REBEL on one slice,
every phase from its compile, and each method's time over GRPO's beside the paper's 0.46-0.55 (4 x H100).

  python experiments/project_methods.py --model=qwen1p5b --topology=v5e:2x4 --csv_out=q15_v5e-8_methods.csv
  PYTHONPATH=CUDA_PLUGIN python experiments/project_methods.py --model=qwen1p5b --topology=h100x4   # compile-only CUDA

Compiles once what the methods share (Stage 1's prefill/decode, the rollout's prefill and decode, π_ref's scoring,
the copies onto the sampling mesh), PPO's critic forward, each method's update at its own config's micro-batch
(configs/{method}_{model}.py; A*-PO: configs/{model}.py), and the rollout decode again at each --wide slot count.
A wide decode the chip cannot hold is reported and left out. Every figure two projections, not measurements: the
roofline (lower edge) and the modeled time with the fixed costs read from each compile (method_runs.py).
"""
import csv
import dataclasses
import importlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from absl import app, flags  # noqa: E402

_MODEL = flags.DEFINE_string("model", "qwen1p5b", "config module of A*-PO's run (configs/MODEL.py)")
_TOPOLOGY = flags.DEFINE_string("topology", "v5e:2x4", "a TPU slice (v5e:2x4, v5p-8, v6e-8) or GPUs (h100x4, h200x8)")
_WIDE = flags.DEFINE_list("wide", ["512", "1024", "2048"], "rollout decode slot counts compiled beside the config's")
_METHODS = flags.DEFINE_list("methods", ["astarpo", "grpo", "rloo", "ppo", "rebel"],
                              "methods projected (A*-PO and GRPO always: the ratios are to GRPO's run)")
_SCORE = flags.DEFINE_integer("score_micro_batches", 0, "train.score_micro_batches for every method (0: the configs')")
_CSV = flags.DEFINE_string("csv_out", "", "write every row here (both edges, every phase time)")
_SAVE = flags.DEFINE_string("results_out", "", "write the compiled phases' figures here (JSON, no HLO)")
_COMPILED_AT = flags.DEFINE_string("compiled_at", "", "the commit the phases were compiled at (the CSV's column)")
_LOAD = flags.DEFINE_string("results_in", "", "read the compiled phases from a --results_out file: no compile")

SHARED = ("stage1_reshard", "stage1_prefill", "stage1_decode", "rollout_reshard", "rollout_prefill", "rollout_decode",
          "reference", "ppo_values")


def method_config(model: str, name: str, derive_from: str = "qwen1p5b"):
  """The config of `name`'s run on `model`: configs/{name}_{model}.py (A*-PO: configs/{model}.py). Where there is
  none, configs/{model}.py with the method settings (algo, optim) of configs/{name}_{derive_from}.py and the same
  rows per micro-batch as A*-PO's (at least one prompt of G rows; said in the output)."""
  module = model if name == "astarpo" else f"{name}_{model}"
  try:
    return importlib.import_module(f"configs.{module}").get_config()
  except ModuleNotFoundError:
    pass
  try:
    donor = importlib.import_module(f"configs.{name}_{derive_from}").get_config()
  except ModuleNotFoundError:
    raise SystemExit(f"no config configs/{module}.py nor configs/{name}_{derive_from}.py to derive one") from None
  c = importlib.import_module(f"configs.{model}").get_config()
  c.algo, c.optim = donor.algo, donor.optim
  G = donor.algo.group_size
  if c.train.micro_batch_per_device:
    c.train.micro_batch_per_device = max(1, c.train.micro_batch_per_device // G)
  else:
    c.train.micro_batch = max(1, c.train.micro_batch // G)
  print(f"{name} on {model}: configs/{module}.py missing; derived from configs/{name}_{derive_from}.py "
        f"(micro-batch {c.train.micro_batch or c.train.micro_batch_per_device} prompt(s)"
        f"{' per device' if c.train.micro_batch_per_device else ''} of {G} rows)")
  return c


def settings_of(c) -> dict:
  return dict(c.algo.to_dict(), logp_chunk=c.train.logp_chunk, decode_layout=c.sampling.kv_layout,
              page_size=c.sampling.page_size, paged_attention=c.sampling.paged_attention,
              gather_weights=c.train.get("gather_weights", "auto"))


def save_results(path: str, results: dict, decode: dict) -> None:
  """The compiled figures a projection reads (PhaseResult less its HLO), to model again without compiling."""
  row = lambda r: {k: v for k, v in dataclasses.asdict(r).items() if k != "hlo"}  # noqa: E731
  with open(path, "w") as f:
    json.dump({"results": {k: row(r) for k, r in results.items()},
               "decode": {str(s): row(r) for s, r in decode.items()}}, f, default=str)


def load_results(path: str) -> tuple[dict, dict]:
  """`save_results`'s (results, decode), decode segments keyed by live tokens again."""
  from astarpo_jax.aot.compiling import PhaseResult

  def res(d: dict) -> PhaseResult:
    return PhaseResult(**dict(d, mesh_shape=tuple(d["mesh_shape"]), segments={int(k): v for k, v in
                                                                               d["segments"].items()}))
  data = json.load(open(path))
  return ({k: res(v) for k, v in data["results"].items()}, {int(s): res(v) for s, v in data["decode"].items()})


def print_ratios(edges: dict, names) -> None:
  """Each method's whole run as roofline / modeled hours, and its ratio to GRPO's at each edge as columns."""
  from astarpo_jax.aot import method_runs
  others = [m for m in names if m != "grpo"]
  print("\nEach method's whole run (h, roofline / modeled) and its time over GRPO's at each edge\n")
  print("| slots | " + " | ".join(f"{m} h" for m in names) + " | "
        + " | ".join(f"{m} / grpo, roofline | modeled" for m in others) + " |")
  print("|---|" + "---:|" * (len(names) + 2 * len(others)))
  for setting in ("config", "wide"):
    lo, hi = ({r["method"]: r for r in edges[e] if r["setting"] == setting} for e in ("roofline", "modeled"))
    print(f"| {setting} | " + " | ".join(f"{lo[m]['total_h']:.2f} / {hi[m]['total_h']:.2f}" for m in names) + " | "
          + " | ".join(f"{lo[m]['vs_grpo']:.2f} | {hi[m]['vs_grpo']:.2f}" for m in others) + " |")
  print(f"paper (4 x H100, its own stack): A*-PO / GRPO {method_runs.PAPER_RATIO_4XH100}")


def stated_costs(plan, gpu: bool) -> str:
  """The modeled edge's per-unit costs: each an assumption (fixed_costs, method_runs.Plan), not a measurement."""
  from astarpo_jax.aot import fixed_costs as fc
  device = (f"{fc.GPU_LAUNCH_S * 1e6:.0f} us a kernel launch outside a command buffer, {fc.GPU_SYNC_S * 1e6:.0f} us "
            "a host-read loop predicate" if gpu else f"{fc.GRID_STEP_S * 1e6:.2f} us a Pallas grid step")
  trip = fc.HOST_TRIP_S["pod" if plan.multi_host else "host"]
  return (f"Modeled edge's stated costs (assumptions): {device}; {trip * 1e3:.1f} ms a host round trip; grading "
          f"{plan.grade_per_s:.0f} responses/s; an evaluation of {plan.eval_rows} rows every {plan.eval_every} "
          f"steps; a checkpoint (12 bytes a parameter) every {plan.checkpoint_every} steps at "
          f"{plan.checkpoint_bytes_per_s / 1e9:.0f} GB/s")


def main(argv):
  del argv
  from astarpo_jax import experiment, run_config
  from astarpo_jax.aot import chips, compiling, layouts, method_runs, phases
  from astarpo_jax.infra import sharding
  spec = chips.slice_spec(_TOPOLOGY.value)
  unknown = set(_METHODS.value) - set(method_runs.METHODS)
  if unknown:
    raise SystemExit(f"--methods: unknown {sorted(unknown)}; known: {method_runs.METHODS}")
  chosen = [m for m in method_runs.METHODS if m in {"astarpo", "grpo", *_METHODS.value}]
  configs = {m: method_config(_MODEL.value, m) for m in chosen}
  for c in configs.values():
    run_config.resolve_micro_batch(c, spec.num_devices)
    c.train.score_micro_batches = _SCORE.value or c.train.score_micro_batches
  base = configs["astarpo"]
  cfg, run = experiment.model_config(base), run_config.run_shape(base)
  devices = chips.topology_devices(_TOPOLOGY.value)
  shape = sharding.resolve_mesh_shape(tuple(base.mesh.shape), spec.num_devices)
  mesh = layouts.abstract_mesh_devices(devices, shape)
  backend = "gpu" if spec.chip.kind in ("h100", "h200") else "tpu"
  sample_mesh = layouts.sampling_mesh(cfg, devices, shape, tuple(base.mesh.sample_shape), backend)
  names = tuple(p for p in SHARED if (sample_mesh is not None or p not in phases.RESHARD_PHASES)
                and (p != "ppo_values" or "ppo" in chosen))
  print(f"{base.model.name_or_path} on {spec.name}: mesh {shape}, sampling mesh "
        f"{tuple(sample_mesh.devices.shape) if sample_mesh is not None else shape}, slots {run.sample_batch}")
  wall, results = time.perf_counter(), {}

  usable = chips.usable_hbm_bytes(spec.chip.kind, spec.chip.hbm_bytes)

  def compile_one(key, phase, c, r):  # π_ref's scoring and the updates: train.gather_weights ("auto": by compiling)
    res, how, why = layouts.compile_gathered(phase, cfg, r, mesh, settings_of(c), usable, sample_mesh=sample_mesh)
    print(f"compiled {key} in {res.compile_s:.0f} s, peak {res.peak / 2**30:.1f} GiB"
          + (f", weights {how} ({why})" if how else "") + (f": {res.error[:200]}" if res.error else ""), flush=True)
    return res

  shapes, runs = {}, {}
  for m, c in configs.items():
    shapes[m] = method_runs.method_shape(m, settings_of(c))
    runs[m] = dataclasses.replace(run_config.run_shape(c), sample_batch=run.sample_batch)
  decode = {}
  if _LOAD.value:  # compiles only what the file lacks
    results, decode = load_results(_LOAD.value)
    print(f"compiled phases read from {_LOAD.value}: {sorted(results)}, decode slots {sorted(decode)}")

  def keep(key, phase, c, r, into, at):
    if at not in into:
      into[at] = compile_one(key, phase, c, r)
      if _SAVE.value:
        save_results(_SAVE.value, results, decode)
    return into[at]

  for p in names:
    keep(p, p, base, run, results, p)
  for m, c in configs.items():
    keep(f"{m}_update", f"{m}_update", c, runs[m], results, f"{m}_update")
  decode[run.sample_batch] = results["rollout_decode"]
  for w in sorted(int(x) for x in _WIDE.value):
    res = keep(f"rollout_decode at {w} slots", "rollout_decode", base, dataclasses.replace(run, sample_batch=w),
               decode, w)
    if res.error or res.peak > usable:
      print(f"  {w} slots do not fit ({res.peak / 2**30:.1f} GiB of {usable / 2**30:.1f}): left out")
      decode.pop(w)
      break
  failed = [k for k, r in results.items() if r.error]
  if failed:
    raise SystemExit(f"phases that did not compile: {failed}; no projection")
  plan = {e: method_runs.Plan(modeled=e == "modeled", multi_host=spec.num_hosts > 1) for e in ("roofline", "modeled")}
  edges = {e: method_runs.whole_runs(results, cfg, spec.chip, runs, shapes, decode, p) for e, p in plan.items()}
  every = edges["roofline"] + edges["modeled"]
  print(f"\ncompiled in {time.perf_counter() - wall:.0f} s. Whole MATH run, projected (not measured): each cell "
        "roofline (the lower edge) / modeled (fixed costs counted: method_runs.py)\n")
  print("| method | slots | rows | Stage 1 h | rollout s | reference s | old log-probs s | values s | update s | "
        "grade s | step s | host trips / rollout | besides h | total h | / GRPO |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  two = lambda a, b, k, f=".2f": f"{a.get(k, 0.0):{f}} / {b.get(k, 0.0):{f}}"  # noqa: E731
  for lo, hi in zip(edges["roofline"], edges["modeled"]):
    print(f"| {lo['method']} | {lo['slots']} ({lo['setting']}) | {lo['rows']} | {two(lo, hi, 'stage1_h')} | "
          f"{two(lo, hi, 'rollout_s')} | {two(lo, hi, 'reference_s')} | {two(lo, hi, 'old_logp_s')} | "
          f"{two(lo, hi, 'values_s')} | "
          f"{two(lo, hi, 'update_s')} | {hi['grade_s']:.2f} | {two(lo, hi, 'step_s')} | {hi['trips']:.0f} | "
          f"{hi['besides_h']:.2f} | {two(lo, hi, 'total_h')} | {two(lo, hi, 'vs_grpo')} |")
  print_ratios(edges, chosen)
  s1 = next(r for r in edges["modeled"] if r["method"] == "astarpo" and r["setting"] == "config")
  print(f"\nStage 1 modeled: {s1['stage1_h']:.2f} h (roofline "
        f"{next(r for r in edges['roofline'] if r['method'] == 'astarpo')['stage1_h']:.2f} h), "
        f"{s1['stage1_trips']:.0f} host round trips, {100 * s1['stage1_host_share']:.1f}% of it")
  print(stated_costs(plan["modeled"], spec.chip.kind in ("h100", "h200")))
  if _CSV.value:
    with open(_CSV.value, "w", newline="") as f:
      w = csv.DictWriter(f, fieldnames=["model", "slice", "compiled_at"] + list(every[0]))
      w.writeheader()
      for r in every:
        w.writerow(dict(r, model=base.model.name_or_path, slice=spec.name, compiled_at=_COMPILED_AT.value))


if __name__ == "__main__":
  app.run(main)
