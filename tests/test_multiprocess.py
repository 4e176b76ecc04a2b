"""Two JAX processes joined with jax.distributed (CPU, gloo) train like one process.

tests/multiprocess_worker.py runs in two processes with 2 CPU devices each, one (1, 2, 2) mesh
across them: two train steps on the same global batches, an Orbax save and restore of the
sharded state, a third step from the restored state. The reference is the same three steps in
this process on one device.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from astarpo_jax.model import decoder
from astarpo_jax.training import update
from tests import method_steps as MS
from tests.multiprocess_case import CFG, MICRO, PROMPT_LEN, batch, method, optimizer
from tests.worker_processes import free_port, run_workers

WORKER = os.path.join(os.path.dirname(__file__), "multiprocess_worker.py")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("multiprocess"))
  port = str(free_port())
  run_workers([[WORKER, str(i), "2", port, workdir] for i in range(2)], timeout=400)
  return dict(np.load(os.path.join(workdir, "result.npz")))


@pytest.fixture(scope="module")
def one_process():
  opt = optimizer()
  state = MS.init_state(decoder.init_params(CFG, seed=0)[1], opt)
  step = MS.jit_step(CFG, method(), opt, PROMPT_LEN)
  losses = []
  for i in range(3):
    state, m = step(state, update.split_microbatches(batch(i), MICRO))
    losses.append(float(m["loss"]))
  params = {"/".join(str(k.key) for k in path): np.asarray(v)
            for path, v in jax.tree_util.tree_flatten_with_path(state["params"])[0]}
  return np.array(losses), params


def test_two_processes_train_like_one(result, one_process):
  losses, params = one_process
  np.testing.assert_allclose(result["losses"], losses, rtol=1e-5)
  for name, value in params.items():
    np.testing.assert_allclose(result[name], value, atol=1e-5, err_msg=name)
  assert int(result["step"]) == 3
  assert str(result["wq_spec"]) == "P(None, 'fsdp', 'tensor', None)"  # split across both processes


def test_checkpoint_saved_by_two_processes_restores_exactly_into_the_same_shardings(result):
  assert float(result["restore_diff"]) == 0.0
  assert bool(result["sharded_like_before"])
  np.testing.assert_array_equal(result["restored_losses"], result["losses"][:2])  # host state round trip


def test_one_process_reference_really_moves_the_params(one_process):
  _, params = one_process
  _, init = decoder.init_params(CFG, seed=0)
  assert np.max(np.abs(params["layers/wq"] - np.asarray(init["layers"]["wq"]))) > 1e-3
  assert not jnp.allclose(params["embed"], init["embed"])
