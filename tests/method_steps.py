"""Tests' shorthand for a method's jitted update step (the loop builds the same with update.jit_update_step)."""
import functools

import jax.numpy as jnp
import numpy as np

from astarpo_jax import methods
from astarpo_jax.model import decoder
from astarpo_jax.training import update


def method(name: str, **settings) -> methods.Method:
  return methods.get(name, settings)


def jit_step(cfg, method_: methods.Method, optimizer, prompt_len: int, critic_optimizer=None, state_shardings=None,
             batch_sharding=None):
  """`step(state, [M, b, ...] batch) -> (state, metrics)` of `method_` with its loss bound to `prompt_len`."""
  return update.jit_update_step(cfg, functools.partial(method_.loss, cfg, prompt_len),
                                update.Optimizers(optimizer, critic_optimizer), state_shardings, batch_sharding)


def astarpo_step(cfg, optimizer, prompt_len: int, **settings):
  """A*-PO's update step with `settings` (beta2, entropy_coef, logp_chunk)."""
  return jit_step(cfg, method("astarpo", **settings), optimizer, prompt_len)


def init_state(params, optimizer, critic=None, critic_optimizer=None):
  return update.init_train_state(params, update.Optimizers(optimizer, critic_optimizer), critic)


def full_forward_logp_entropy(cfg, params, b, prompt_len: int):
  """log pi and the entropy of each response token from full-forward logits, in float64 numpy: the
  independent reference the step tests compare the chunked heads against."""
  mask = jnp.asarray(b["mask"])
  logits, _ = decoder.forward(cfg, params, jnp.asarray(b["tokens"]), decoder.positions_from_mask(mask), mask)
  logits = np.asarray(logits, np.float64)[:, prompt_len - 1:-1]
  logz = np.log(np.exp(logits).sum(-1))
  logp = np.take_along_axis(logits, b["tokens"][:, prompt_len:, None], -1)[..., 0] - logz
  probs = np.exp(logits - logz[..., None])
  return logp, -(probs * np.log(probs)).sum(-1)
