"""The memory-saving optimizer options (optim.kind, optim.mu_dtype; training/optimizers.py): their first steps
against Adam's and Adafactor's closed forms, the state each keeps, per-device bytes in the memory plan, and the
config's refusals."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh

from astarpo_jax import methods, run_config
from astarpo_jax.aot import memory_plan as mp
from astarpo_jax.infra.sharding import MESH_AXES
from astarpo_jax.training import optimizers, update
from configs import base
from tests.test_memory_plan import TINY, _hand_param_count


def _first_step(opt, params, grads):
  state = opt.init(params)
  updates, _ = opt.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def test_adafactor_first_step_on_a_rank_one_gradient_is_lr_times_its_sign():
  # g = u v^T: g^2 = (u^2)(v^2)^T is rank one, so the factored second moment (row means x column means / mean)
  # is g^2 exactly at the first step (decay 1 - 1^-0.8 = 0), and the step is lr * g / |g|
  u = jnp.linspace(-1.0, 1.0, 128).at[64].set(0.5)
  v = jnp.linspace(0.5, 2.0, 256) * jnp.where(jnp.arange(256) % 2, 1.0, -1.0)
  g = jnp.outer(u, v)
  w = jnp.ones((128, 256))
  opt = optimizers.policy_optimizer(1e-2, grad_clip=0.0, weight_decay=0.0, kind="adafactor")
  new, state = _first_step(opt, w, g)
  np.testing.assert_allclose(np.asarray(w - new), 1e-2 * np.sign(np.asarray(g)), rtol=1e-4, atol=1e-7)
  # the state: a row and a column vector for the matrix (fp32), no first moment
  leaves = [x for x in jax.tree.leaves(state) if hasattr(x, "shape") and x.size > 1]
  assert sorted(x.size for x in leaves) == [128, 256]


def test_adafactor_weight_decay_is_decoupled_and_scaled_by_lr_as_adamw():
  w, g = jnp.full((4,), 2.0), jnp.zeros((4,))  # no gradient: the step is the decay alone, -lr * wd * w
  new, _ = _first_step(optimizers.policy_optimizer(1e-1, grad_clip=0.0, weight_decay=0.5, kind="adafactor"), w, g)
  np.testing.assert_allclose(np.asarray(new), 2.0 - 1e-1 * 0.5 * 2.0, rtol=1e-6)


def test_bf16_first_moment_keeps_adams_first_step_and_an_fp32_second_moment():
  g = jnp.array([[3e-3, -2.0], [0.5, -7e-5]])
  w = jnp.zeros((2, 2))
  new, state = _first_step(optimizers.policy_optimizer(1e-3, grad_clip=0.0, weight_decay=0.0, mu_dtype="bfloat16"),
                           w, g)
  # Adam's first step: m_hat = g, v_hat = g^2, so -lr * g / (|g| + eps); mu rounded to bf16 moves it by < 2^-8
  want = -1e-3 * np.asarray(g) / (np.abs(np.asarray(g)) + 1e-8)
  np.testing.assert_allclose(np.asarray(new), want, rtol=2 ** -8)
  dtypes = sorted(str(x.dtype) for x in jax.tree.leaves(state) if getattr(x, "shape", ()) == (2, 2))
  assert dtypes == ["bfloat16", "float32"]  # mu, nu


def test_memory_plan_counts_each_options_optimizer_state_per_device():
  n = _hand_param_count()
  mesh, method = AbstractMesh((1, 1, 1), MESH_AXES), methods.get("astarpo")
  opt = lambda **kw: update.Optimizers(optimizers.policy_optimizer(1e-6, **kw))  # noqa: E731
  adamw = mp.resident_bytes(TINY, "bfloat16", opt(), mesh, method)["opt_state"]
  mu16 = mp.resident_bytes(TINY, "bfloat16", opt(mu_dtype="bfloat16"), mesh, method)["opt_state"]
  factored = mp.resident_bytes(TINY, "bfloat16", opt(kind="adafactor"), mesh, method)["opt_state"]
  assert 8 * n <= adamw <= 8 * n + 64
  assert 6 * n <= mu16 <= 6 * n + 64  # mu 2 bytes a param, nu 4
  # TINY's dims are below Adafactor's 128 to factor: its second moment is whole (4 bytes a param), no first moment
  assert 4 * n <= factored <= 4 * n + 64 * 64


def test_memory_plan_places_adafactors_row_and_column_vectors_beside_sharded_params():
  # dims of 128 and more are factored: embed [256, 128] -> 256 + 128 floats, w_gate / w_up / w_down [2, 128, 256]
  # -> [2, 128] + [2, 256] each, replicated (their params' FSDP sharding does not fit them: optimizers.place_state);
  # every other leaf keeps a whole second moment sharded as its param (4 bytes a local element)
  cfg = dataclasses.replace(TINY, vocab_size=256, hidden_size=128, intermediate_size=256, head_dim=32)
  mesh, method = AbstractMesh((1, 8, 1), MESH_AXES), methods.get("astarpo")
  opt = update.Optimizers(optimizers.policy_optimizer(1e-6, kind="adafactor"))
  res = mp.resident_bytes(cfg, "bfloat16", opt, mesh, method)
  factored_local = 4 * (256 * 128 // 8 + 3 * 2 * (128 // 8) * 256)  # their fp32 params' bytes on one device
  vectors = 4 * (256 + 128 + 3 * (2 * 128 + 2 * 256))
  want = res["params"] - factored_local + vectors
  assert want <= res["opt_state"] <= want + 256  # + placeholders (1,) and the step count


@pytest.mark.parametrize("field, value, says", [
    ("kind", "lion", "optim.kind"),
    ("mu_dtype", "float16", "optim.mu_dtype"),
])
def test_config_refuses_unknown_optimizer_settings_naming_the_field(field, value, says):
  c = base.get_config()
  c.optim[field] = value
  with pytest.raises(ValueError, match=says):
    run_config.validate_config(c)


def test_config_refuses_a_first_moment_dtype_with_adafactor():
  c = base.get_config()
  c.optim.kind, c.optim.mu_dtype = "adafactor", "bfloat16"
  with pytest.raises(ValueError, match="optim.mu_dtype.*no first moment"):
    run_config.validate_config(c)


def test_a_run_trains_with_the_optimizer_the_config_names():
  """experiment.settings builds the policy's optimizer from optim.kind: Adafactor's first step on a rank-one
  gradient is lr x its sign (the closed form above; no decay, no clip), the loop reads its lr, and the state is
  placed on a mesh with its factored vectors replicated; a critic keeps AdamW."""
  from astarpo_jax import experiment
  from astarpo_jax.training import loop
  c = base.get_config()
  c.optim.kind, c.optim.lr, c.optim.weight_decay, c.optim.grad_clip = "adafactor", 1e-2, 0.0, 0.0
  c.optim.zero_lr_first_rollout = False
  _, opts, _ = experiment.settings(c, run_config.build_method(c))
  w = jnp.ones((4, 3), jnp.float32)
  g = jnp.outer(jnp.array([1.0, -2.0, 3.0, -4.0]), jnp.array([0.5, -1.0, 2.0]))
  st = opts.policy.init(w)
  upd, st = opts.policy.update(g, st, w)
  np.testing.assert_allclose(np.asarray(-upd), 1e-2 * np.sign(np.asarray(g)), rtol=1e-4, atol=1e-7)
  assert loop.current_lr(st) == pytest.approx(1e-2)
  c.algo.name = "ppo"
  _, opts, _ = experiment.settings(c, run_config.build_method(c))
  assert "adafactor" not in repr(opts.critic.init(w)).lower() and "mu=" in repr(opts.critic.init(w))
  mesh = jax.make_mesh((1, 1, 1), MESH_AXES)
  sh = update.state_shardings(dataclasses.replace(TINY), update.Optimizers(update.make_optimizer(kind="adafactor")),
                              mesh)
  assert all(isinstance(x, jax.sharding.NamedSharding) for x in jax.tree.leaves(sh["opt_state"]))


def test_run_shape_carries_the_optimizer_the_compiles_build():
  c = base.get_config()
  c.optim.kind = "adafactor"
  run = run_config.run_shape(c)
  assert (run.optimizer, run.mu_dtype) == ("adafactor", "")
