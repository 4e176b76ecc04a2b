"""Sharded train step and sampler on 8 faked CPU devices agree with one device.

The meshes (data, fsdp, tensor) = (8,1,1), (1,8,1), (2,2,2), (1,2,4) run in one subprocess
(tests/sharded_worker.py): the faked device count must be set before JAX starts, and this process
has already started it with one device. Expected shardings below are written out by hand from the
rule table (embed -> fsdp; heads, kv_heads, mlp, vocab -> tensor; replicated when indivisible).
"""
import os

import pytest
from jax.sharding import AbstractMesh

from astarpo_jax.infra.sharding import MESH_AXES
from astarpo_jax.training import update
from tests.worker_processes import run_json_worker

WORKER = os.path.join(os.path.dirname(__file__), "sharded_worker.py")
MESHES = ["(8, 1, 1)", "(1, 8, 1)", "(2, 2, 2)", "(1, 2, 4)"]

# Tiny model: D=32, F=64, V=64, N=4 heads, K=2 kv heads. Specs by mesh for the watched params.
EXPECTED_SPECS = {
    "(8, 1, 1)": {  # pure data parallel: everything replicated
        "embed": [None, None], "wq": [None, None, None, None], "wk": [None, None, None, None],
        "bq": [None, None, None], "w_gate": [None, None, None], "w_down": [None, None, None],
        "attn_norm": [None, None]},
    "(1, 8, 1)": {  # FSDP over the model dim only
        "embed": [None, "fsdp"], "wq": [None, "fsdp", None, None], "wk": [None, "fsdp", None, None],
        "bq": [None, None, None], "w_gate": [None, "fsdp", None], "w_down": [None, None, "fsdp"],
        "attn_norm": [None, None]},
    "(2, 2, 2)": {  # tensor=2 divides both the 4 query heads and the 2 kv heads
        "embed": ["tensor", "fsdp"], "wq": [None, "fsdp", "tensor", None], "wk": [None, "fsdp", "tensor", None],
        "bq": [None, "tensor", None], "w_gate": [None, "fsdp", "tensor"], "w_down": [None, "tensor", "fsdp"],
        "attn_norm": [None, None]},
    "(1, 2, 4)": {  # tensor=4 splits the 4 query heads; the 2 kv heads stay whole
        "embed": ["tensor", "fsdp"], "wq": [None, "fsdp", "tensor", None], "wk": [None, "fsdp", None, None],
        "bq": [None, "tensor", None], "w_gate": [None, "fsdp", "tensor"], "w_down": [None, "tensor", "fsdp"],
        "attn_norm": [None, None]},
}
BATCH_SPEC = {"(8, 1, 1)": ["data"], "(1, 8, 1)": ["fsdp"], "(2, 2, 2)": [["data", "fsdp"]], "(1, 2, 4)": ["fsdp"]}


@pytest.fixture(scope="module")
def results():
  out = run_json_worker(WORKER, timeout=900)
  assert out["device_count"] == 8, out["device_count"]
  return out


@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_train_step_matches_one_device(results, mesh):
  r = results["meshes"][mesh]
  assert r["loss"] == pytest.approx(results["reference_loss"], rel=1e-5, abs=1e-6)
  assert r["grad_norm"] == pytest.approx(r["reference_grad_norm"], rel=1e-5)
  assert r["params_max_diff"] < 1e-5
  assert r["moments_max_diff"] < 1e-7
  assert r["num_moments"] == 2 * r["num_params"]  # AdamW mu and nu for every param


@pytest.mark.parametrize("mesh", MESHES)
def test_params_and_adam_moments_are_sharded_by_the_rule_table(results, mesh):
  r = results["meshes"][mesh]
  assert r["param_specs_in"] == EXPECTED_SPECS[mesh]
  assert r["moment_specs_match_params"]
  if mesh != "(8, 1, 1)":
    assert any(any(s is not None for s in spec) for spec in r["param_specs_in"].values())


@pytest.mark.parametrize("mesh", MESHES)
def test_step_keeps_state_shardings_and_donates_its_input(results, mesh):
  r = results["meshes"][mesh]
  assert r["state_out_shardings_match"]
  assert r["state_donated"]


@pytest.mark.parametrize("mesh", MESHES)
def test_greedy_sampling_with_sharded_params_matches_one_device(results, mesh):
  r = results["meshes"][mesh]
  assert r["sample_tokens_equal"]
  assert r["sample_logp_max_diff"] < 1e-5
  assert r["sampled_param_wq_spec"] == EXPECTED_SPECS[mesh]["wq"]
  assert r["sample_tokens_spec"] == BATCH_SPEC[mesh]  # rows split over the batch axes


def test_batch_sharding_rejects_a_micro_batch_the_mesh_cannot_split():
  mesh = AbstractMesh((2, 2, 2), MESH_AXES)
  with pytest.raises(ValueError, match="micro_batch=6 .* multiple of 4"):
    update.batch_sharding(mesh, 6)
  assert tuple(update.batch_sharding(mesh, 8).spec) == (None, ("data", "fsdp"))


# Rows of at most 5 tokens (prompt <= 3, response <= 2) in 11 columns: two to a packed row. A micro-batch of
# 8 rows split over the batch shards: 8 shards of one row each keep one row; 4 shards of 2 rows pack into 1;
# 2 shards of 4 rows into 2. [shards, packed rows per shard]
PACKED_ROWS = {"(8, 1, 1)": [8, 1], "(1, 8, 1)": [8, 1], "(2, 2, 2)": [4, 1], "(1, 2, 4)": [2, 2]}


@pytest.mark.parametrize("mesh", MESHES)
def test_packed_rows_per_batch_shard_train_as_padded_rows_and_stay_on_their_devices(results, mesh):
  r = results["meshes"][mesh]
  assert r["packed_loss"] == pytest.approx(r["packed_reference_loss"], rel=1e-5)  # one device, padded
  assert r["packed_params_max_diff"] < 1e-5
  assert r["packed_shards_rows"] == PACKED_ROWS[mesh]
  ops = r["packed_collectives"]
  assert ops["packed_gather_ops"] > 0 and ops["packed_gather"] == 0, ops  # the gather back needs no collective
