"""Token log-probs and entropies from hidden states, without ever holding a [B, T, V] fp32 array.

The scoring and training heads every method shares. `chunked_logprobs_entropy` (training) forms the
logits a block of positions at a time and has a hand-written backward: one recomputed matmul and ONE
elementwise pass over the block, where autodiff of log-softmax + entropy + gather makes several and
a scatter. `vocab_chunked_logprobs` (scoring, no gradient) also splits the vocabulary so each block
stays in cache. `token_logprobs` / `token_entropy` are the plain full-logits forms (tests, small models).

Axis letters: B batch, T positions, K positions of one chunk, V vocab, D model dim.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from astarpo_jax.infra.masks import check_shapes, f32


def _shifted_lse_entropy(logits_fp32: jax.Array):
  """(z = logits − max, max, lse(z), entropy) over the last axis, from one read of z.

  Shift by the row max first: with logits of size 1e4, log p = logits − lse would carry lse's
  rounding (~1e-3) into every term of the entropy; with z ≤ 0 it does not. H = lse(z) − Σ e^z·z / Σ e^z:
  both sums come from one pass, and nothing [..., V] is written besides z.
  """
  max_ = jax.lax.stop_gradient(logits_fp32.max(-1))
  z = logits_fp32 - max_[..., None]
  e = jnp.exp(z)
  total = e.sum(-1)
  ez = jnp.where(e > 0, e * z, 0.0).sum(-1)  # a -inf logit has e^z = 0, not NaN
  lse = jnp.log(total)
  return z, max_, lse, lse - ez / total


def token_logprobs(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
  """log softmax(logits)[target] per token, computed in fp32 whatever the logits' dtype."""
  check_shapes("token_logprobs", logits_BTV=(logits_BTV, ("B", "T", None)), targets_BT=(targets_BT, ("B", "T")))
  logits = logits_BTV.astype(f32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  return jnp.take_along_axis(logits, targets_BT[..., None].astype(jnp.int32), axis=-1)[..., 0] - lse


def token_entropy(logits_BTV: jax.Array) -> jax.Array:
  """Entropy −Σ_v p_v log p_v of softmax(logits) per token, in fp32."""
  check_shapes("token_entropy", logits_BTV=(logits_BTV, (None, None, None)))
  return _shifted_lse_entropy(logits_BTV.astype(f32))[3]


def _chunk_logits(h_BKD, unembed_DV, temperature: float) -> jax.Array:
  logits_BKV = jnp.einsum("bkd,dv->bkv", h_BKD, unembed_DV, preferred_element_type=f32)
  return logits_BKV / temperature if temperature != 1.0 else logits_BKV


def _chunk_forward(h_BKD, unembed_DV, targets_BK, temperature: float):
  """(logp, entropy, (max, lse)) of one chunk; the row max and log-sum-exp are what the backward keeps.

  The target's shifted logit is taken from the logits, not from z = logits − max: the same fp32 subtraction, but
  z then stays inside the reductions' fusion, where taking it from z made XLA write the [B, K, V] fp32 z out for
  the gather (10 of the 1.5B update's 446 GB a step on v6e-8, compile-only)."""
  logits_BKV = _chunk_logits(h_BKD, unembed_DV, temperature)
  _, max_BK, lse_BK, ent_BK = _shifted_lse_entropy(logits_BKV)
  target_BK = jnp.take_along_axis(logits_BKV, targets_BK[..., None], axis=-1)[..., 0]
  return (target_BK - max_BK) - lse_BK, ent_BK, (max_BK, lse_BK)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fused_chunk(h_BKD, unembed_DV, targets_BK, temperature: float):
  logp_BK, ent_BK, _ = _chunk_forward(h_BKD, unembed_DV, targets_BK, temperature)
  return logp_BK, ent_BK


def _fused_chunk_fwd(h_BKD, unembed_DV, targets_BK, temperature):
  logp_BK, ent_BK, stats = _chunk_forward(h_BKD, unembed_DV, targets_BK, temperature)
  return (logp_BK, ent_BK), (h_BKD, unembed_DV, targets_BK, stats, ent_BK)


def _fused_chunk_bwd(temperature, residuals, cotangents):
  # One recomputed matmul, ONE elementwise pass over the [B, K, V] block, then the two gradient
  # matmuls. With z the logits, p = softmax(z) and H the entropy:
  #   d logp_y / dz = onehot(y) − p          d H / dz = −p·(log p + H)
  h_BKD, unembed_DV, targets_BK, (max_BK, lse_BK), ent_BK = residuals
  g_logp_BK, g_ent_BK = cotangents
  logp_all_BKV = (_chunk_logits(h_BKD, unembed_DV, temperature) - max_BK[..., None]) - lse_BK[..., None]
  p_BKV = jnp.exp(logp_all_BKV)
  onehot_BKV = jnp.arange(p_BKV.shape[-1], dtype=jnp.int32) == targets_BK[..., None]
  # a -inf logit: p = 0 and log p clamped finite, so its term is 0, not NaN (a where(p > 0, ...) made XLA:TPU read
  # the chunk's logits once more for the predicate: 10 GB of the 1.5B update's step on v6e-8, compile-only)
  logp_finite_BKV = jnp.maximum(logp_all_BKV, jnp.finfo(f32).min)
  g_z_BKV = (g_logp_BK[..., None] * (onehot_BKV.astype(f32) - p_BKV)
             - g_ent_BK[..., None] * (p_BKV * (logp_finite_BKV + ent_BK[..., None])))
  if temperature != 1.0:
    g_z_BKV = g_z_BKV / temperature
  g_z_BKV = g_z_BKV.astype(unembed_DV.dtype)
  g_h_BKD = jnp.einsum("bkv,dv->bkd", g_z_BKV, unembed_DV, preferred_element_type=f32).astype(h_BKD.dtype)
  g_unembed_DV = jnp.einsum("bkd,bkv->dv", h_BKD, g_z_BKV, preferred_element_type=f32).astype(unembed_DV.dtype)
  return g_h_BKD, g_unembed_DV, None


_fused_chunk.defvjp(_fused_chunk_fwd, _fused_chunk_bwd)


def chunked_logprobs_entropy(hidden_BTD: jax.Array, unembed_DV: jax.Array, targets_BT: jax.Array, *,
                             chunk: int = 256, temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """(logp_BT, ent_BT) of logits = hidden @ unembed / temperature, T processed `chunk` at a time.

  Only a [B, chunk, V] fp32 block of logits exists at once, forward and backward, so a
  151936-word vocab never needs the full [B, T, V] fp32 array. The gradient is written by hand
  (custom_vjp): the backward recomputes a chunk's logits once and makes a single elementwise pass
  over them, where autodiff of log-softmax + entropy + gather makes several and a scatter. The
  matmuls accumulate in fp32 even for bf16 inputs.
  """
  check_shapes("chunked_logprobs_entropy", hidden_BTD=(hidden_BTD, ("B", "T", "D")),
               unembed_DV=(unembed_DV, ("D", None)), targets_BT=(targets_BT, ("B", "T")))
  if not isinstance(chunk, int) or chunk < 1:
    raise ValueError(f"chunked_logprobs_entropy: `chunk` must be a positive int, got {chunk!r}")
  if not isinstance(temperature, (int, float)) or not temperature > 0:
    raise ValueError(f"chunked_logprobs_entropy: `temperature` must be a Python number > 0, got {temperature!r}")
  temperature = float(temperature)
  return _over_position_chunks(hidden_BTD, targets_BT, chunk,
                               lambda h_BKD, t_BK: _fused_chunk(h_BKD, unembed_DV, t_BK, temperature))


def _over_position_chunks(hidden_BTD, targets_BT, chunk: int, fn):
  """fn(hidden_BKD, targets_BK) -> tuple of [B, K] arrays, applied `chunk` positions at a time
  (lax.scan, so one chunk's temporaries are live at once); returns the tuple of [B, T] arrays."""
  B, T, D = hidden_BTD.shape
  chunk = min(chunk, T)
  n_chunks = -(-T // chunk)
  pad = n_chunks * chunk - T
  hidden_CBKD = jnp.pad(hidden_BTD, ((0, 0), (0, pad), (0, 0))).reshape(B, n_chunks, chunk, D).swapaxes(0, 1)
  targets_CBK = jnp.pad(targets_BT.astype(jnp.int32), ((0, 0), (0, pad))).reshape(B, n_chunks, chunk).swapaxes(0, 1)
  _, outs_CBK = jax.lax.scan(lambda _, xs: (None, fn(*xs)), None, (hidden_CBKD, targets_CBK))
  return tuple(x_CBK.swapaxes(0, 1).reshape(B, n_chunks * chunk)[:, :T] for x_CBK in outs_CBK)


def vocab_chunked_logprobs(hidden_BTD: jax.Array, unembed_DV: jax.Array, targets_BT: jax.Array, *,
                           chunk: int = 32, vocab_chunk: int = 4096) -> jax.Array:
  """logp_BT of logits = hidden @ unembed, for scoring without gradients (π_ref, old-policy log-probs).

  Positions `chunk` at a time (lax.scan) and within that the vocabulary `vocab_chunk` columns at a
  time: each [B, chunk, vocab_chunk] block of logits stays in cache for its max, Σexp and the
  target's logit, and the blocks combine as log Σ_c e^(m_c − M)·s_c. On the CPU the whole-vocabulary
  block runs at ~115-130 GFLOP/s, these blocks at ~145. Differentiable, but `chunked_logprobs_entropy`
  is the one with a fast backward.
  """
  check_shapes("vocab_chunked_logprobs", hidden_BTD=(hidden_BTD, ("B", "T", "D")),
               unembed_DV=(unembed_DV, ("D", None)), targets_BT=(targets_BT, ("B", "T")))
  for name, v in (("chunk", chunk), ("vocab_chunk", vocab_chunk)):
    if not isinstance(v, int) or v < 1:
      raise ValueError(f"vocab_chunked_logprobs: `{name}` must be a positive int, got {v!r}")
  V = unembed_DV.shape[1]

  def block(h_BKD, tgt_BK):
    max_C, sum_C, target_logit_BK = [], [], 0.0
    for a in range(0, V, vocab_chunk):
      b = min(a + vocab_chunk, V)
      z_BKv = jnp.einsum("bkd,dv->bkv", h_BKD, unembed_DV[:, a:b], preferred_element_type=f32)
      m_BK = z_BKv.max(-1)
      max_C.append(m_BK)
      sum_C.append(jnp.exp(z_BKv - m_BK[..., None]).sum(-1))
      picked_BK = jnp.take_along_axis(z_BKv, jnp.clip(tgt_BK - a, 0, b - a - 1)[..., None], axis=-1)[..., 0]
      target_logit_BK = target_logit_BK + jnp.where((tgt_BK >= a) & (tgt_BK < b), picked_BK, 0.0)
    max_CBK, sum_CBK = jnp.stack(max_C), jnp.stack(sum_C)
    max_BK = max_CBK.max(0)
    # (target − max) first: with logits of size 1e4 it is exact, where target − lse would round.
    return ((target_logit_BK - max_BK) - jnp.log((jnp.exp(max_CBK - max_BK) * sum_CBK).sum(0)),)

  return _over_position_chunks(hidden_BTD, targets_BT, chunk, block)[0]
