"""A per-phase sampling mesh (config mesh.sample_shape): sampling on another mesh over the same devices
draws the same rows as sampling on the training mesh, and leaves the training params where they were.

The 8-device cases run in one subprocess (tests/sample_mesh_worker.py: the faked device count must be set
before JAX starts). The reference is the same call without a sampling mesh (the training mesh (1, 8, 1),
FSDP over 8): each row's uniforms depend only on the key and the row index (sampler.py), so any mesh
must give the same tokens; the expected weight specs are written out by hand from the rule table.
"""
import os

import jax
import pytest

from astarpo_jax.infra import sharding
from configs import base
from tests.worker_processes import run_json_worker

WORKER = os.path.join(os.path.dirname(__file__), "sample_mesh_worker.py")
# wq [L, D, N, H]: embed -> fsdp, heads -> tensor (4 heads split 4 ways), replicated where the axis is 1.
EXPECTED_WQ = {"(2, 4, 1)": [None, "fsdp", None, None], "(8, 1, 1)": [None, None, None, None],
               "(1, 2, 4)": [None, "fsdp", "tensor", None], "(2, -1, 1)": [None, "fsdp", None, None]}


@pytest.fixture(scope="module")
def results():
  return run_json_worker(WORKER, timeout=600)


@pytest.mark.parametrize("shape", list(EXPECTED_WQ))
def test_sampling_on_another_mesh_draws_the_training_mesh_rows(results, shape):
  r = results["meshes"][shape]
  assert results["rows"] == 24  # 12 prompts x 2 samples
  assert r["tokens_equal"] and r["lengths_equal"]
  assert r["logp_max_diff"] < 1e-5
  assert r["sampled_wq_spec"] == EXPECTED_WQ[shape]  # the params really moved to the sampling mesh
  assert r["output_mesh_shape"] == r["mesh_shape"]
  assert r["train_params_kept"]  # the training copy is neither moved nor donated


def test_sampling_mesh_of_the_training_shape_is_the_training_mesh(results):
  assert results["meshes"]["(2, -1, 1)"]["mesh_shape"] == [2, 4, 1]  # -1 takes the devices left over
  assert results["same_mesh_is_none"]


def test_default_config_leaves_the_sampling_mesh_to_the_backend():
  assert tuple(base.get_config().mesh.sample_shape) == ()


@pytest.mark.parametrize("shape, why", [((2, 1, 1), "needs 2 devices"), ((1, 1), "3 entries"),
                                        ((0, 1, 1), "ints >= 1"), ((-1, -1, 1), "at most one")])
def test_bad_sample_shape_is_refused_naming_the_field(shape, why):
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  with pytest.raises(ValueError, match=rf"mesh\.sample_shape=.*{why}.*devices of the training mesh"):
    sharding.sample_mesh(shape, mesh)


@pytest.mark.parametrize("backend, train, heads, want", [
    ("tpu", (1, 8, 1), (12, 2), (4, 1, 2)), ("tpu", (1, 4, 1), (28, 4), (1, 1, 4)),
    ("tpu", (1, 8, 1), (14, 1), (8, 1, 1)),  # one KV head: replicated weights, rows over every chip
    ("tpu", (2, 16, 1), (16, 8), (4, 1, 8)), ("tpu", (1, 2, 4), (12, 2), (4, 1, 2)),
    ("tpu", (8, 1, 1), (12, 2), (4, 1, 2)),
    ("cpu", (1, 8, 1), (12, 2), (1, 8, 1)), ("gpu", (1, 8, 1), (12, 2), (4, 1, 2)), ("gpu", (1, 8, 1), (28, 4), (2, 1, 4))])
def test_unset_sample_shape_on_accelerators_splits_heads_and_replicates_over_the_rest(backend, train, heads, want):
  assert sharding.default_sample_shape(train, backend, *heads) == want
