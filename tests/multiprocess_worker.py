"""One of N JAX processes joined with jax.distributed on this machine (CPU, gloo collectives).

Usage: multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT WORKDIR. Each process has 2 faked CPU
devices; together they form one (data, fsdp, tensor) = (1, N, 2) mesh. Every process builds the
same global batch and writes only its own shards; two train steps run, the state is saved with
Orbax and restored, and a third step runs from the restored state. Process 0 writes the gathered
results to WORKDIR/result.npz for tests/test_multiprocess.py to compare with one process.
"""
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
                           " --xla_backend_optimization_level=0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

PROCESS_ID, NUM_PROCESSES, PORT, WORKDIR = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
jax.distributed.initialize(f"localhost:{PORT}", NUM_PROCESSES, PROCESS_ID, initialization_timeout=120)

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from astarpo_jax.infra import checkpoint  # noqa: E402
from astarpo_jax.infra.sharding import make_mesh  # noqa: E402
from astarpo_jax.model import decoder  # noqa: E402
from astarpo_jax.training import update  # noqa: E402
from tests import method_steps as MS  # noqa: E402
from tests.multiprocess_case import CFG, MICRO, PROMPT_LEN, batch, method, optimizer  # noqa: E402


def global_array(x: np.ndarray, sharding) -> jax.Array:
  """A global array from a host value every process holds; each process places only its shards."""
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])



def main():
  assert jax.process_count() == NUM_PROCESSES and jax.device_count() == 2 * NUM_PROCESSES
  mesh = make_mesh((1, NUM_PROCESSES, 2))
  opt = optimizer()
  shardings = update.state_shardings(CFG, update.Optimizers(opt), mesh)
  host_state = jax.device_get(MS.init_state(decoder.init_params(CFG, seed=0)[1], opt))
  state = jax.tree.map(global_array, host_state, shardings)
  bsh = update.batch_sharding(mesh, MICRO)
  step_fn = MS.jit_step(CFG, method(), opt, PROMPT_LEN, state_shardings=shardings, batch_sharding=bsh)
  losses = []
  with jax.set_mesh(mesh):
    for i in range(3):
      if i == 2:  # save after two steps, restore into a fresh abstract state, continue from the restored copy
        before = multihost_utils.process_allgather(state["params"], tiled=True)
        with checkpoint.Checkpointer(os.path.join(WORKDIR, "ckpt")) as ckpt:
          ckpt.save(2, checkpoint.to_saveable(state), {"losses": losses}, force=True)
          ckpt.wait()
          shapes = jax.eval_shape(lambda: checkpoint.to_saveable(state))
          abstract = checkpoint.abstract_state(shapes, checkpoint.to_saveable(shardings))
          restored, host = ckpt.restore(abstract)
        state = checkpoint.from_saveable(restored, state)
        after = multihost_utils.process_allgather(state["params"], tiled=True)
        restore_diff = max(float(np.max(np.abs(a - b)))
                           for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
        restored_losses = host["losses"]
        sharded_like_before = all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in
                                  zip(jax.tree.leaves(state), jax.tree.leaves(shardings)))
      b = jax.tree.map(lambda x: global_array(x, bsh), update.split_microbatches(batch(i), MICRO))
      state, m = step_fn(state, b)
      losses.append(float(m["loss"]))
  params = multihost_utils.process_allgather(state["params"], tiled=True)
  if PROCESS_ID == 0:
    flat_params = {"/".join(str(k.key) for k in path): v for path, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    np.savez(os.path.join(WORKDIR, "result.npz"), losses=np.array(losses), restore_diff=restore_diff,
             restored_losses=np.array(restored_losses), sharded_like_before=sharded_like_before,
             step=int(state["step"]), wq_spec=str(shardings["params"]["layers"]["wq"].spec), **flat_params)
  multihost_utils.sync_global_devices("done")


if __name__ == "__main__":
  main()
