"""A sampling call's decode on a slice: the compiled step's roofline beside its modeled time, and the host round
trips of Stage 1 from the engine's own scheduler, before (min_free 1) and after (decode_plan.default_min_free).

  python experiments/simulate_decode.py qwen1p5b v5e:2x4              # config module, slice
  python experiments/simulate_decode.py qwen7b v5p-8 --no_engine      # skip the CPU engine run (minutes)

1. Compiles stage1_decode on the config's sampling mesh and prints, at 128 / 390 / 1,024 live tokens a slot, the
   step's roofline (aot/compiling.py) and modeled time (aot/fixed_costs.py) with each fixed cost's share: the
   kernels' grid steps (past their bytes), the collectives the schedule can not hide.
2. Runs one Stage-1 call (stage1_prompts x N rows, lengths from projection's mix) through the real engine on
   this CPU (fixed_costs.engine_trips: a one-layer random model, each row ending at its budget) at both
   min_free settings; projection.simulate_continuous's trips beside them, and the call's modeled seconds with
   the trips at fixed_costs.HOST_TRIP_S (a pod's on a multi-host slice): their share.
Projections from compiles, not measurements.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import importlib  # noqa: E402

from astarpo_jax import experiment  # noqa: E402
from astarpo_jax.aot import chips, compiling, fixed_costs, layouts, method_runs, projection  # noqa: E402
from astarpo_jax.infra import sharding  # noqa: E402
from astarpo_jax.run_config import resolve_micro_batch, run_shape  # noqa: E402
from astarpo_jax.sampling import decode_plan  # noqa: E402

N_SAMPLES = 8  # Stage 1's N (method_runs.Plan)


def step_table(res, cfg, run, chip) -> None:
  fixed = fixed_costs.from_dict(res.fixed)
  kernel = compiling.kernel_of(res)
  print(f"stage1_decode on {res.mesh_shape}, {run.stage1_rows} slots: grid steps {fixed.grid_steps:.0f} a step "
        f"({fixed.grid_steps_parallel:.0f} on a parallel dimension), collectives {res.fixed.get('collectives')}")
  print("| live tokens | roofline ms | modeled ms | x | grid past bytes | DMA waits | exposed collectives |")
  print("|---:|---:|---:|---:|---:|---:|---:|")
  for n in (128, 390, 1024):
    cost = compiling.decode_step_at(res, cfg, run, n, res.page_size)
    kb = compiling.paged_kernel_bytes(cfg, run.stage1_rows, res.mesh_shape, res.page_size, n, kernel=kernel)
    cols = -(-(run.prompt_len + run.response_len - 1) // res.page_size)
    waits = (fixed_costs.pallas_dma_waits(cfg, run.stage1_rows, n, res.mesh_shape, res.page_size, cols, chip)
             if kernel == "pallas" else 0.0)
    m = fixed_costs.modeled_step(cost, fixed, chip, kb, waits)
    roof = res.times(chip, cost)["projected_s"]
    print(f"| {n} | {roof * 1e3:.2f} | {m['modeled_s'] * 1e3:.2f} | {m['modeled_s'] / roof:.2f} | "
          f"{max(m['grid_s'] - waits, 0) * 1e3:.2f} ms ({100 * max(m['grid_s'] - waits, 0) / m['modeled_s']:.0f}%) | "
          f"{waits * 1e3:.2f} ms ({100 * waits / m['modeled_s']:.0f}%) | "
          f"{m['exposed_collective_s'] * 1e3:.2f} ms ({100 * m['exposed_collective_s'] / m['modeled_s']:.0f}%) |")


def stage1_trips(res, cfg, run, spec, use_engine: bool) -> None:
  prompts = run.stage1_prompts or run.rollout_batch
  rows, slots = prompts * N_SAMPLES, run.stage1_rows
  lengths = projection.sample_lengths(run.response_len, rows, seed=0)
  step = method_runs.paged_step(res, cfg, spec.chip, slots, res.page_size, modeled=True)
  multi = spec.num_hosts > 1
  calls = -(-method_runs.Plan().num_prompts // prompts)
  print(f"\nStage 1: {calls} calls of {rows} rows ({prompts} prompts x {N_SAMPLES}) through {slots} slots, cap "
        f"{run.response_len}, mean length {lengths.mean():.0f}; a host trip {fixed_costs.HOST_TRIP_S['pod' if multi else 'host'] * 1e3:g} ms")
  print("| min_free | engine trips / call | simulator trips / call | Stage-1 trips | decode s / call (modeled) "
        "| host share |")
  print("|---:|---:|---:|---:|---:|---:|")
  for min_free in (1, decode_plan.default_min_free(slots)):
    sim = projection.simulate_continuous(lengths, slots, step, projection.PROMPT_TOKENS, min_free)
    real = fixed_costs.engine_trips(lengths, slots, prompts, min_free)["trips"] if use_engine else float("nan")
    trips = real if use_engine else sim["trips"]
    host = fixed_costs.host_seconds(trips, multi)
    print(f"| {min_free} | {real} | {sim['trips']} | {calls * trips:.0f} | {sim['seconds'] + host:.2f} | "
          f"{100 * host / (sim['seconds'] + host):.1f}% |")


def main(argv):
  c = importlib.import_module(f"configs.{argv[0]}").get_config()
  spec, devices = chips.slice_spec(argv[1]), chips.topology_devices(argv[1])
  resolve_micro_batch(c, spec.num_devices)
  cfg, run = experiment.model_config(c), run_shape(c)
  shape = sharding.resolve_mesh_shape(tuple(c.mesh.shape), spec.num_devices)
  mesh = layouts.abstract_mesh_devices(devices, shape)
  backend = "gpu" if spec.chip.kind in ("h100", "h200") else "tpu"
  sample = layouts.sampling_mesh(cfg, devices, shape, tuple(c.mesh.sample_shape), backend)
  settings = dict(c.algo.to_dict(), logp_chunk=c.train.logp_chunk, decode_layout=c.sampling.kv_layout,
                  page_size=c.sampling.page_size, paged_attention=c.sampling.paged_attention)
  res = compiling.compile_phase("stage1_decode", cfg, run, mesh, settings, sample_mesh=sample)
  if res.error:
    raise SystemExit(f"stage1_decode did not compile: {res.error}")
  step_table(res, cfg, run, spec.chip)
  stage1_trips(res, cfg, run, spec, "--no_engine" not in argv)


if __name__ == "__main__":
  main(sys.argv[1:])
