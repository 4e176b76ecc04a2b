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
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from absl import app, flags  # noqa: E402

_MODEL = flags.DEFINE_string("model", "qwen1p5b", "config module of A*-PO's run (configs/MODEL.py)")
_TOPOLOGY = flags.DEFINE_string("topology", "v5e:2x4", "a TPU slice (v5e:2x4, v5p-8, v6e-8) or GPUs (h100x4, h200x8)")
_WIDE = flags.DEFINE_list("wide", ["512", "1024", "2048"], "rollout decode slot counts compiled beside the config's")
_SCORE = flags.DEFINE_integer("score_micro_batches", 0, "train.score_micro_batches for every method (0: the configs')")
_CSV = flags.DEFINE_string("csv_out", "", "write the table's rows here (every floor)")

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
              page_size=c.sampling.page_size, paged_attention=c.sampling.paged_attention)


def main(argv):
  del argv
  from astarpo_jax import experiment, run_config
  from astarpo_jax.aot import chips, compiling, layouts, method_runs, phases
  from astarpo_jax.infra import sharding
  spec = chips.slice_spec(_TOPOLOGY.value)
  configs = {m: method_config(_MODEL.value, m) for m in method_runs.METHODS}
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
  names = SHARED if sample_mesh is not None else tuple(p for p in SHARED if p not in phases.RESHARD_PHASES)
  print(f"{base.model.name_or_path} on {spec.name}: mesh {shape}, sampling mesh "
        f"{tuple(sample_mesh.devices.shape) if sample_mesh is not None else shape}, slots {run.sample_batch}")
  wall, results = time.perf_counter(), {}

  def compile_one(key, phase, c, r):
    res = compiling.compile_phase(phase, cfg, r, mesh, settings_of(c), sample_mesh=sample_mesh)
    print(f"compiled {key} in {res.compile_s:.0f} s, peak {res.peak / 2**30:.1f} GiB"
          + (f": {res.error[:200]}" if res.error else ""), flush=True)
    return res

  for p in names:
    results[p] = compile_one(p, p, base, run)
  shapes, runs = {}, {}
  for m, c in configs.items():
    shapes[m] = method_runs.method_shape(m, settings_of(c))
    runs[m] = dataclasses.replace(run_config.run_shape(c), sample_batch=run.sample_batch)
    results[f"{m}_update"] = compile_one(f"{m}_update", f"{m}_update", c, runs[m])
  usable = chips.usable_hbm_bytes(spec.chip.kind, spec.chip.hbm_bytes)
  decode = {run.sample_batch: results["rollout_decode"]}
  for w in sorted(int(x) for x in _WIDE.value):
    res = compile_one(f"rollout_decode at {w} slots", "rollout_decode", base, dataclasses.replace(run, sample_batch=w))
    if res.error or res.peak > usable:
      print(f"  {w} slots do not fit ({res.peak / 2**30:.1f} GiB of {usable / 2**30:.1f}): left out")
      break
    decode[w] = res
  failed = [k for k, r in results.items() if r.error]
  if failed:
    raise SystemExit(f"phases that did not compile: {failed}; no projection")
  edges = {e: method_runs.whole_runs(results, cfg, spec.chip, runs, shapes, decode,
                                     method_runs.Plan(modeled=e == "modeled", multi_host=spec.num_hosts > 1))
           for e in ("roofline", "modeled")}
  every = edges["roofline"] + edges["modeled"]
  print(f"\ncompiled in {time.perf_counter() - wall:.0f} s. Whole MATH run, projected (not measured): each cell "
        "roofline (the lower edge) / modeled (fixed costs counted: method_runs.py)\n")
  print("| method | slots | rows | Stage 1 h | rollout s | reference s | values s | update s | grade s | step s "
        "| host trips / rollout | besides h | total h | / GRPO |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  two = lambda a, b, k, f=".2f": f"{a[k]:{f}} / {b[k]:{f}}"  # noqa: E731
  for lo, hi in zip(edges["roofline"], edges["modeled"]):
    print(f"| {lo['method']} | {lo['slots']} ({lo['setting']}) | {lo['rows']} | {two(lo, hi, 'stage1_h')} | "
          f"{two(lo, hi, 'rollout_s')} | {two(lo, hi, 'reference_s')} | {two(lo, hi, 'values_s')} | "
          f"{two(lo, hi, 'update_s')} | {hi['grade_s']:.2f} | {two(lo, hi, 'step_s')} | {hi['trips']:.0f} | "
          f"{hi['besides_h']:.2f} | {two(lo, hi, 'total_h')} | {two(lo, hi, 'vs_grpo')} |")
  names = list(method_runs.METHODS)
  print("\nEach method's whole run over GRPO's, at the roofline and modeled\n")
  print("| edge | slots | " + " | ".join(f"{m} h" for m in names) + " | " +
        " | ".join(f"{m} / grpo" for m in names if m != "grpo") + " |")
  print("|---|---|" + "---:|" * (2 * len(names) - 1))
  for edge, rows in edges.items():
    for setting in ("config", "wide"):
      by = {r["method"]: r for r in rows if r["setting"] == setting}
      print(f"| {edge} | {setting} | " + " | ".join(f"{by[m]['total_h']:.2f}" for m in names) + " | "
            + " | ".join(f"{by[m]['vs_grpo']:.2f}" for m in names if m != "grpo") + " |")
  s1 = next(r for r in edges["modeled"] if r["method"] == "astarpo" and r["setting"] == "config")
  print(f"\nStage 1 modeled: {s1['stage1_h']:.2f} h (roofline "
        f"{next(r for r in edges['roofline'] if r['method'] == 'astarpo')['stage1_h']:.2f} h), "
        f"{s1['stage1_trips']:.0f} host round trips, {100 * s1['stage1_host_share']:.1f}% of it")
  print(f"paper (4 x H100, its own stack): A*-PO / GRPO {method_runs.PAPER_RATIO_4XH100}")
  if _CSV.value:
    with open(_CSV.value, "w", newline="") as f:
      w = csv.DictWriter(f, fieldnames=["model", "slice"] + list(every[0]))
      w.writeheader()
      for r in every:
        w.writerow(dict(r, model=base.model.name_or_path, slice=spec.name))


if __name__ == "__main__":
  app.run(main)
