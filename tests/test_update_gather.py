"""The compute copy gathered once per optimizer step (train.gather_weights "per_step", update.py), and its gradients
accumulated per device and reduce-scattered once ("per_step_local"), give the same update as the per-micro-batch
gathers and as one device, on 8 faked CPU devices, and move fewer bytes.

tests/update_gather_worker.py runs the meshes (data, fsdp, tensor) = (1, 8, 1) and (2, 2, 2) in one fresh process
(the faked device count is read before JAX starts), one compile a variant; the reference is the one-device padded
update.
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
VARIANTS = ["per_micro_batch", "per_step", "per_step_local", "per_step_local_packed"]


@pytest.fixture(scope="module")
def results():
  out = run_json_worker(WORKER, timeout=2400)
  assert out["device_count"] == 8
  return out


@pytest.mark.parametrize("mesh", ["(1, 8, 1)", "(2, 2, 2)"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_once_per_step_copy_updates_as_one_device(results, mesh, variant):
  r, ref = results["meshes"][mesh][variant], results["reference_metrics"]
  assert set(r["metrics"]) == set(ref)  # every metric (loss, kl, entropy, ...) summed over the devices once
  for k, v in ref.items():
    assert r["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
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


def test_local_accumulation_reduces_the_gradient_once_a_step(results):
  """per_step_local on (1, 8, 1) moves the compute copy's one gather (7/8 of its bytes) and one reduce-scatter of
  the fp32 gradient (7/8 of the params' bytes), whatever the micro-batch count; per_step also reduces each
  micro-batch's gradient (2 here), so it moves at least one more such reduction."""
  r = results["meshes"]["(1, 8, 1)"]
  once = 7 / 8 * (results["copy_bytes"] + results["param_bytes"])
  assert r["per_step_local"]["collective_bytes"] <= 1.05 * once
  saved = r["per_step"]["collective_bytes"] - r["per_step_local"]["collective_bytes"]
  assert saved >= 0.9 * 7 / 8 * results["param_bytes"]


def test_reference_scores_on_the_gathered_copy_as_on_one_device(results):
  """A run's π_ref scoring (loop.reference_copy) reads a compute-dtype copy whole over the batch axes with the tensor
  split kept: the same log-probs as one device and as the training placement, without the per-call weight gathers
  (what is left is the tensor split's own collectives)."""
  r = results["scoring"]
  assert r["training"]["max_diff"] < 1e-5 and r["copy"]["max_diff"] < 1e-5
  assert all("data" not in s and "fsdp" not in s for s in r["copy_specs"])
  assert any("tensor" in s for s in r["copy_specs"]) and r["copy_dtypes"] == ["float32"]  # CFG computes in fp32
  # a call on the training placement gathers each weight over fsdp = 2 (half of a tensor half: 1/4 of the bytes)
  assert r["copy"]["collective_bytes"] < r["training"]["collective_bytes"] - 0.9 * results["copy_bytes"] / 4
  assert r["none_per_micro_batch"]  # train.gather_weights=per_micro_batch scores as placed, as before


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
  # a whole local accumulator (4 bytes a param) beside the copy and its gradient, where it applies
  assert update.resolve_gather("auto", copy_bytes=3, free_bytes=12, acc_bytes=6) == "per_step_local"
  assert update.resolve_gather("auto", copy_bytes=3, free_bytes=11, acc_bytes=6) == "per_step"
  assert update.resolve_gather("auto", copy_bytes=3, free_bytes=None, acc_bytes=6) == "per_step_local"
  assert update.resolve_gather("per_micro_batch", copy_bytes=0, free_bytes=None) == "per_micro_batch"
  with pytest.raises(ValueError, match="train.gather_weights='once'"):
    update.resolve_gather("once", 1, 1)
  with pytest.raises(ValueError, match="resolves first"):
    update.jit_update_step(None, None, None, gather_weights="auto")
  with pytest.raises(ValueError, match="with a LoRA base or a critic use 'per_step'"):
    update.jit_update_step(None, None, None, lora_base=True, gather_weights="per_step_local")
  np.testing.assert_equal(update.GATHER_MODES, ("auto", "per_step_local", "per_step", "per_micro_batch"))


def test_config_refuses_an_unknown_gather_mode():
  from configs import base
  c = base.get_config()
  c.train.gather_weights = "once"
  with pytest.raises(ValueError, match="config.train.gather_weights"):
    run_config.validate_config(c)
