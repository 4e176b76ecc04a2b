"""Stage 1's and a Stage-2 rollout's decode simulated with the compiled per-step cost of the paged decode
(issue 37): rows admitted in order with lengths unknown to the scheduler, finished slots refilled at once.

  python experiments/simulate_decode.py qwen1p5b v5e:2x4 4,1,2    # config module, slice, sampling mesh

The step cost is the compiled stage1_decode step (aot/compiling.py) with the kernel's bytes for the live tokens of
that step (method_runs.paged_step), the rest of the step as compiled; lengths from projection's mix.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import importlib  # noqa: E402

from astarpo_jax import experiment  # noqa: E402
from astarpo_jax.aot import chips, compiling, layouts, method_runs, projection  # noqa: E402
from astarpo_jax.infra import sharding  # noqa: E402
from astarpo_jax.run_config import run_shape  # noqa: E402


def main(argv):
  c = importlib.import_module(f"configs.{argv[0]}").get_config()
  cfg, run = experiment.model_config(c), run_shape(c)
  spec, devices = chips.slice_spec(argv[1]), chips.topology_devices(argv[1])
  shape = sharding.resolve_mesh_shape(tuple(c.mesh.shape), spec.num_devices)
  sshape = tuple(int(x) for x in argv[2].split(","))
  mesh = layouts.abstract_mesh_devices(devices, shape)
  sample = None if sshape == shape else layouts.abstract_mesh_devices(devices, sshape)
  settings = dict(c.algo.to_dict(), logp_chunk=c.train.logp_chunk)
  res = compiling.compile_phase("stage1_decode", cfg, run, mesh, settings, sample_mesh=sample)
  step_s = method_runs.paged_step(res, cfg, spec.chip, run.stage1_rows, res.page_size)
  P_eff = method_runs.PROMPT_TOKENS
  L = projection.sample_lengths(run.response_len, 8 * 1024, seed=0)
  s1 = projection.simulate_continuous(L, run.stage1_rows, step_s, P_eff)
  print("stage1", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in s1.items()}, "mean", L.mean())
  R = projection.sample_lengths(run.response_len, run.sample_batch, seed=1)
  ro = projection.simulate_continuous(R, run.sample_batch, step_s, P_eff)
  first_done = int(R.min())
  tail = sum(step_s(int((R > s).sum()), int(sum(P_eff + min(s, r) for r in R[R > s])))
             for s in range(first_done, int(R.max())))
  print("rollout", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in ro.items()},
        "tail share (after the first row ends)", round(tail / ro["seconds"], 3))


if __name__ == "__main__":
  main(sys.argv[1:])
