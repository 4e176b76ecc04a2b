"""Checkpoints written before the method layer (issue 15) restore into today's train state unchanged."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from astarpo_jax import methods
from astarpo_jax.infra import checkpoint
from astarpo_jax.model import decoder
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.training import update

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "checkpoints", "before_method_layer")
# The tiny model the fixtures were written with (tests/fixtures/checkpoints/README.md).
CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=8, max_position_embeddings=64)


def _flat(tree) -> dict[str, np.ndarray]:
  return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): np.asarray(x)
          for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("name", ["astarpo", "ppo"])
def test_a_checkpoint_of_the_old_layout_restores_every_leaf(name):
  method = methods.get(name, {})
  critic = name == "ppo"
  optimizers = update.Optimizers(update.make_optimizer(1e-2), update.make_optimizer(1e-2) if critic else None)
  _, params = decoder.init_params(CFG, seed=1)  # other values than the saved ones: they must be overwritten
  fresh = method.init_state(CFG, jax.tree.map(jnp.copy, params), optimizers, seed=0)
  with checkpoint.Checkpointer(os.path.join(FIXTURES, name), read_only=True) as ckpt:
    state, host = checkpoint.restore_train_state(ckpt, fresh)
  assert host["rollout_step"] == 1 and int(state["step"]) == 1
  want = dict(np.load(os.path.join(FIXTURES, f"{name}_leaves.npz")))
  got = _flat(checkpoint.to_saveable(state))
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  assert jax.tree.structure(state) == jax.tree.structure(fresh)
