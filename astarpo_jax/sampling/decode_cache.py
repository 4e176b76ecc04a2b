"""The decode cache: the keys/values of the sampler's slots, in the layout `decoder.decode_step` reads.

Two layouts, as `decoder.decode_params` chooses: per-layer tuples with keys [B, K, H, S] and values
[B, K, S, H] (the fused CPU path: QK^T and PV are plain batched matmuls), or the stacked [L, B, S, K, H]
of a prefill (TPU/GPU). The engine moves rows between a prompt pool and decode slots with these
functions, whichever the layout.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from astarpo_jax.infra import sharding
from astarpo_jax.model import decoder
from astarpo_jax.model.config import ModelConfig


def init(cfg: ModelConfig, batch: int, length: int, fused: bool) -> decoder.DecodeCache:
  """An empty decode cache of `length` columns per row, in the fused (CPU) or stacked layout."""
  L, K, H, dt = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype)
  if fused:
    return {"k": tuple(jnp.zeros((batch, K, H, length), dt) for _ in range(L)),
            "v": tuple(jnp.zeros((batch, K, length, H), dt) for _ in range(L))}
  return {"k": jnp.zeros((L, batch, length, K, H), dt), "v": jnp.zeros((L, batch, length, K, H), dt)}


def from_prefill(cache: decoder.Cache, fused: bool) -> decoder.DecodeCache:
  """The keys/values of a `hidden_states` cache ([L, B, S, K, H]) in the decode layout."""
  if not fused:
    return {"k": cache["k"], "v": cache["v"]}
  return {"k": tuple(cache["k"].transpose(0, 1, 3, 4, 2)), "v": tuple(cache["v"].transpose(0, 1, 3, 2, 4))}


def _cache_axes(cache: decoder.DecodeCache) -> decoder.DecodeCache:
  """(row axis, column axis) of every leaf."""
  if isinstance(cache["k"], tuple):
    return {"k": tuple((0, 3) for _ in cache["k"]), "v": tuple((0, 2) for _ in cache["v"])}
  return {"k": (1, 2), "v": (1, 2)}


def _map_cache(fn, cache: decoder.DecodeCache, *others: decoder.DecodeCache) -> decoder.DecodeCache:
  return jax.tree.map(fn, _cache_axes(cache), cache, *others, is_leaf=lambda x: isinstance(x, tuple) and
                      len(x) == 2 and all(isinstance(a, int) for a in x))


def write(cache: decoder.DecodeCache, src: decoder.DecodeCache, row0) -> decoder.DecodeCache:
  """`cache` with rows [row0, row0 + rows of src) and columns [0, columns of src) replaced by `src`
  (e.g. prefilled prompts written into decode slots)."""
  def write(axes, c, s):
    return jax.lax.dynamic_update_slice(c, s.astype(c.dtype), tuple(row0 if a == axes[0] else 0 for a in range(c.ndim)))
  return _map_cache(write, cache, src)


def take_rows(cache: decoder.DecodeCache, rows_B) -> decoder.DecodeCache:
  """The cache of rows `rows_B` only (in that order)."""
  return _map_cache(lambda axes, c: jnp.take(c, rows_B, axis=axes[0]), cache)


def concat(caches: list[decoder.DecodeCache]) -> decoder.DecodeCache:
  """The rows of several caches (same layout and columns), one after the other."""
  return _map_cache(lambda axes, *cs: jnp.concatenate(cs, axis=axes[0]), *caches)


def constrain(cache: decoder.DecodeCache, rows: str | None = "batch") -> decoder.DecodeCache:
  """Sharding constraint on a decode cache: its rows over the logical axis `rows` (None: replicated),
  kv heads as the params split them (a no-op outside a mesh)."""
  if isinstance(cache["k"], tuple):
    names = {"k": (rows, "kv_heads", "head_dim", "cache_length"), "v": (rows, "kv_heads", "cache_length", "head_dim")}
    return {key: tuple(sharding.constrain(x, names[key]) for x in cache[key]) for key in ("k", "v")}
  return {key: sharding.constrain(cache[key], ("layers", rows, "cache_length", "kv_heads", "head_dim")) for key in ("k", "v")}
