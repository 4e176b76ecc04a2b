"""The compute copy gathered once per optimizer step (train.gather_weights "per_step", update.py) gives the same
update as today's per-micro-batch gathers and as one device, on 8 faked CPU devices, and moves fewer bytes.

tests/update_gather_worker.py runs the meshes (data, fsdp, tensor) = (1, 8, 1) and (2, 2, 2) in a fresh process
(the faked device count is read before JAX starts); the reference is the one-device padded update.
"""
import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from astarpo_jax import run_config
from astarpo_jax.infra import sharding
from astarpo_jax.training import update
from tests.worker_processes import run_json_worker

WORKER = os.path.join(os.path.dirname(__file__), "update_gather_worker.py")
VARIANTS = ["per_micro_batch", "per_step", "per_micro_batch_packed", "per_step_packed"]


@pytest.fixture(scope="module")
def results():
  out = run_json_worker(WORKER, timeout=2400)
  assert out["device_count"] == 8
  return out


@pytest.mark.parametrize("mesh", ["(1, 8, 1)", "(2, 2, 2)"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_once_per_step_copy_updates_as_one_device(results, mesh, variant):
  r = results["meshes"][mesh][variant]
  assert r["loss"] == pytest.approx(results["reference_loss"], rel=1e-5, abs=1e-6)
  assert r["grad_norm"] == pytest.approx(results["reference_grad_norm"], rel=1e-5)
  assert r["params_max_diff"] < 1e-5 and r["moments_max_diff"] < 1e-6
  assert r["state_out_shardings_match"]  # master weights and AdamW state stay sharded as the rule table says


def test_once_per_step_copy_moves_fewer_collective_bytes(results):
  """On the FSDP mesh (1, 8, 1) today's step gathers the fp32 weights for each micro-batch's forward and again
  for its backward (2 micro-batches: at least 4 x 7/8 of the params' bytes); the once-per-step copy gathers them
  once, plus a reduce-scatter of each micro-batch's gradient."""
  r = results["meshes"]["(1, 8, 1)"]
  gathers = 7 / 8 * results["param_bytes"]
  assert r["per_micro_batch"]["collective_bytes"] >= 4 * gathers
  # 2 micro-batches x 2 gathers become 1: at least 2 gathers' bytes saved (3 by the count, less what XLA moves)
  assert r["per_micro_batch"]["collective_bytes"] - r["per_step"]["collective_bytes"] >= 2 * gathers


def test_gathered_shardings_drop_the_batch_axes_and_keep_the_tensor_split():
  mesh = jax.sharding.AbstractMesh((2, 2, 2), sharding.MESH_AXES)
  sh = NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp"), "tensor"))
  assert update.gathered_shardings({"w": sh})["w"].spec == PartitionSpec(None, None, "tensor")
  assert sharding.without_axes(NamedSharding(mesh, PartitionSpec(("fsdp", "tensor"))), ("fsdp",)).spec == \
      PartitionSpec("tensor")


def test_auto_gathers_once_per_step_only_when_the_copy_and_its_gradient_fit():
  assert update.resolve_gather("auto", copy_bytes=3, free_bytes=6) == "per_step"
  assert update.resolve_gather("auto", copy_bytes=3, free_bytes=5) == "per_micro_batch"
  assert update.resolve_gather("auto", copy_bytes=3, free_bytes=None) == "per_step"
  assert update.resolve_gather("per_micro_batch", copy_bytes=0, free_bytes=None) == "per_micro_batch"
  with pytest.raises(ValueError, match="train.gather_weights='once'"):
    update.resolve_gather("once", 1, 1)
  with pytest.raises(ValueError, match="resolves first"):
    update.jit_update_step(None, None, None, gather_weights="auto")
  np.testing.assert_equal(update.GATHER_MODES, ("auto", "per_step", "per_micro_batch"))


def test_config_refuses_an_unknown_gather_mode():
  from configs import base
  c = base.get_config()
  c.train.gather_weights = "once"
  with pytest.raises(ValueError, match="config.train.gather_weights"):
    run_config.validate_config(c)
