"""Shape checks and masked reductions of [B, T] arrays: the conventions every loss shares.

`mask_BT` is 1 on response tokens (EOS included) and 0 on padding and anything after EOS. Masked-out
entries are zeroed before any arithmetic, so garbage in padding (even inf or NaN) never reaches a
value or a gradient. Shapes are static, so the checks run at trace time, before anything deep fails.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

f32 = jnp.float32


def check_shapes(where: str, **arrays_and_shapes) -> None:
  """Raise ValueError naming `where` and the argument when an array's shape is not as expected.

  Each keyword is `name=(array, expected_shape)`; None in expected_shape matches any size, and a
  string is a symbolic size that must agree across arguments.
  """
  sizes: dict[str, tuple[int, str]] = {}
  for name, (arr, expected) in arrays_and_shapes.items():
    if arr is None:
      continue
    shape = tuple(jnp.shape(arr))
    if len(shape) != len(expected):
      raise ValueError(f"{where}: `{name}` must have {len(expected)} dims {expected}, got shape {shape}")
    for got, want in zip(shape, expected):
      if want is None:
        continue
      if isinstance(want, str):
        if want in sizes and sizes[want][0] != got:
          first = sizes[want]
          raise ValueError(f"{where}: size {want} of `{name}` is {got} but `{first[1]}` has {first[0]};"
                           f" shapes must agree")
        sizes.setdefault(want, (got, name))
      elif got != want:
        raise ValueError(f"{where}: `{name}` must have shape {expected}, got {shape}")


def check_nonneg(where: str, **values) -> None:
  for name, v in values.items():
    if isinstance(v, (int, float)) and not v >= 0:
      raise ValueError(f"{where}: `{name}` must be >= 0, got {v}")


def is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def zero_masked(x_BT: jax.Array, mask_BT: jax.Array) -> jax.Array:
  """x in fp32 with masked-out entries set to 0 *before* any arithmetic.

  Doing this first (not multiplying by the mask at the end) keeps garbage in padding, even inf or
  NaN, out of both the value and the gradient: `inf * 0` would be NaN.
  """
  return jnp.where(mask_BT.astype(bool), x_BT.astype(f32), 0.0)


def masked_sum(x_BT: jax.Array, mask_BT: jax.Array) -> jax.Array:
  """Σ over masked-in entries of x, in fp32."""
  return zero_masked(x_BT, mask_BT).sum()


def masked_mean(x_BT: jax.Array, mask_BT: jax.Array, normalizer=None) -> jax.Array:
  """Σ masked x / normalizer; normalizer defaults to the mask count (at least 1, so never NaN)."""
  n = mask_BT.astype(f32).sum() if normalizer is None else jnp.asarray(normalizer, f32)
  return masked_sum(x_BT, mask_BT) / jnp.maximum(n, 1.0)
