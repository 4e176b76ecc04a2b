"""Tests' shorthand for a method's jitted update step (the loop builds the same with update.jit_update_step)."""
import functools

from astarpo_jax import methods, update


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
