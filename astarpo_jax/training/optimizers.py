"""The policy optimizer's scaling rule: AdamW (official) or a memory-saving deviation, chosen by name.

Full fine-tuning of a 7B model on 16 GB chips (v5e-8) does not fit with AdamW's two fp32 moments (2 x 4 bytes a
parameter beside 4 bytes of fp32 master weights); these options shrink the optimizer state, each a deviation from
the paper's fp32 AdamW, named in the config (optim.kind, optim.mu_dtype) and off by default:

- mu_dtype "bfloat16": AdamW's first moment stored in bf16 (optax's `mu_dtype`), 2 bytes a parameter saved. The
  second moment stays in the param dtype: with b2 = 0.999 its decay b2 * nu rounds back to nu in bf16 (8 bits of
  mantissa resolve 1 - 2^-8 = 0.996 at best), so a bf16 nu would stop decaying.
- kind "adafactor": a factored second moment (a row and a column vector per matrix, Shazeer & Stern 2018) and no
  first moment, so the state is ~0 bytes a parameter; AdamW's decoupled weight decay and lr kept, Adafactor's own
  parameter-scaled step and update clipping off (the global-norm clip stays), its decay schedule 1 - t^-0.8.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

KINDS = ("adamw", "adafactor")
MU_DTYPES = ("", "bfloat16", "float32")


def check(kind: str, mu_dtype: str) -> None:
  """Raises ValueError naming the field when the optimizer settings are unknown or do not combine."""
  if kind not in KINDS:
    raise ValueError(f"optim.kind={kind!r}: use one of {KINDS} ('adamw' is the official recipe)")
  if mu_dtype not in MU_DTYPES:
    raise ValueError(f"optim.mu_dtype={mu_dtype!r}: use one of {MU_DTYPES} ('' = the param dtype, official)")
  if kind == "adafactor" and mu_dtype:
    raise ValueError(f"optim.mu_dtype={mu_dtype!r} with optim.kind='adafactor': Adafactor keeps no first moment; "
                     "leave optim.mu_dtype ''")


def scale_rule(kind: str, learning_rate, b1: float, b2: float, eps: float, weight_decay: float,
               mu_dtype: str = "") -> optax.GradientTransformation:
  """The step after clipping: `optax.adamw` (kind "adamw", mu in `mu_dtype` when set) or the factored second
  moment without momentum (kind "adafactor"), both with decoupled weight decay scaled by `learning_rate`, wrapped
  in `optax.inject_hyperparams` so the loop reads the learning rate from the state."""
  check(kind, mu_dtype)
  if kind == "adamw":
    return optax.inject_hyperparams(optax.adamw)(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
                                                 weight_decay=weight_decay,
                                                 mu_dtype=jnp.dtype(mu_dtype) if mu_dtype else None)
  return optax.chain(optax.scale_by_factored_rms(), optax.add_decayed_weights(weight_decay),
                     optax.inject_hyperparams(optax.scale_by_learning_rate)(learning_rate=learning_rate))


def policy_optimizer(learning_rate, grad_clip: float = 1.0, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                     weight_decay: float = 0.01, kind: str = "adamw",
                     mu_dtype: str = "") -> optax.GradientTransformation:
  """Global-norm clipping (off at `grad_clip` 0), then `scale_rule`: update.make_optimizer's chain with the
  optimizer named by `kind` and `mu_dtype` (the defaults are its AdamW)."""
  return optax.chain(optax.clip_by_global_norm(grad_clip) if grad_clip > 0 else optax.identity(),
                     scale_rule(kind, learning_rate, b1, b2, eps, weight_decay, mu_dtype))


def place_state(opt_shapes, opt_shardings):
  """`opt_shardings` with each leaf the param's sharding does not fit replicated: update.state_shardings gives every
  param-structured optimizer leaf its param's sharding, which a factored moment (Adafactor's row and column vectors,
  its placeholder (1,) leaves) has fewer dims for or cannot split. They are small: a vector per matrix."""
  def fit(shape, sh):
    spec = tuple(sh.spec)
    ok = len(spec) <= len(shape.shape) and all(
        d % sh.mesh.shape[a] == 0 for d, e in zip(shape.shape, spec) if e
        for a in ((e,) if isinstance(e, str) else e))
    return sh if ok else jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec())
  return jax.tree.map(fit, opt_shapes, opt_shardings)
