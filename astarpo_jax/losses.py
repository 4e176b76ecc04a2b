"""A*-PO loss and the token-level helpers every policy loss shares; pure JAX, fp32 math.

A*-PO (arXiv 2505.20686) in two stages:
  Stage 1  V̂*(x) = β1·log mean_i exp(r_i/β1) over N responses of π_ref (plain mean when β1 = 0).
  Stage 2  one response y ~ π per prompt; regress β2·Σ_t log π(y_t)/π_ref(y_t) onto r − V̂*(x):
           loss = mean_b (β2·Σ_t [log π − log π_ref] − (r_b − V̂*_b))² − entropy_coef·H̄,
           H̄ the token-mean entropy over all response tokens of the batch. No critic, no clipping.

Axis letters: B batch, T response length, V vocab, D model dim, P prompts, N samples per prompt.
`mask_BT` is 1 on response tokens (EOS included) and 0 on padding and anything after EOS.

Micro-batching: every loss here takes optional `num_seqs` / `num_tokens`, the counts of the whole
mini-batch. Passed on each micro-batch, the micro-batch losses (and gradients, and metrics) sum to
the full-batch ones exactly. Left as None, they default to the counts of the arrays given.
"""
from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp

f32 = jnp.float32


# ---------------------------------------------------------------------------------------------
# Input checks (shapes are static, so these run at trace time, before anything deep fails).

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


def _check_nonneg(where: str, **values) -> None:
  for name, v in values.items():
    if isinstance(v, (int, float)) and not v >= 0:
      raise ValueError(f"{where}: `{name}` must be >= 0, got {v}")


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


# ---------------------------------------------------------------------------------------------
# Token-level helpers.

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
  """(logp, entropy, (max, lse)) of one chunk; the row max and log-sum-exp are what the backward keeps."""
  z_BKV, max_BK, lse_BK, ent_BK = _shifted_lse_entropy(_chunk_logits(h_BKD, unembed_DV, temperature))
  logp_BK = jnp.take_along_axis(z_BKV, targets_BK[..., None], axis=-1)[..., 0] - lse_BK
  return logp_BK, ent_BK, (max_BK, lse_BK)


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
  g_z_BKV = (g_logp_BK[..., None] * (onehot_BKV.astype(f32) - p_BKV)
             - g_ent_BK[..., None] * jnp.where(p_BKV > 0, p_BKV * (logp_all_BKV + ent_BK[..., None]), 0.0))
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


# ---------------------------------------------------------------------------------------------
# Stage 1: the optimal value of π_ref's samples.

def vstar(rewards_PN: jax.Array, beta1: float, mask_PN: jax.Array | None = None) -> jax.Array:
  """V̂*(x) = β1·log( mean_i exp(r_i/β1) ) over the masked-in samples of each prompt (log-sum-exp).

  β1 = 0 gives the plain mean (the β1 → 0 limit is the max; the paper uses the mean there).
  `mask_PN` allows a different N per prompt (adaptive sampling); every prompt needs ≥ 1 sample.
  """
  check_shapes("vstar", rewards_PN=(rewards_PN, ("P", "N")), mask_PN=(mask_PN, ("P", "N")))
  if not isinstance(beta1, (int, float)) or beta1 < 0:
    raise ValueError(f"vstar: `beta1` must be a Python number >= 0, got {beta1!r}")
  r = rewards_PN.astype(f32)
  mask = jnp.ones(r.shape, bool) if mask_PN is None else mask_PN.astype(bool)
  count_P = mask.sum(-1)
  if _is_concrete(count_P) and bool((count_P == 0).any()):
    empty = [int(i) for i in jnp.nonzero(count_P == 0)[0]]
    raise ValueError(f"vstar: prompts {empty[:10]} have no sample in `mask_PN`; V* is undefined for them")
  if beta1 == 0:
    return jnp.where(mask, r, 0.0).sum(-1) / jnp.maximum(count_P, 1)
  scaled = jnp.where(mask, r / beta1, -jnp.inf)
  return beta1 * (jax.nn.logsumexp(scaled, axis=-1) - jnp.log(jnp.maximum(count_P, 1).astype(f32)))


# ---------------------------------------------------------------------------------------------
# Stage 2: the A*-PO regression.

def astarpo_loss(logp_BT: jax.Array, ref_logp_BT: jax.Array, mask_BT: jax.Array, rewards_B: jax.Array,
                 vstar_B: jax.Array, entropy_BT: jax.Array | None = None, *, beta2: float,
                 entropy_coef: float, num_seqs=None, num_tokens=None
                 ) -> tuple[jax.Array, Mapping[str, jax.Array]]:
  """A*-PO loss Σ_b (β2·Σ_t m·(logp − ref_logp) − (r_b − V̂*_b))² / num_seqs − c_H·Σ m·H / num_tokens.

  Gradients flow only through `logp_BT` and `entropy_BT`. With the paper's β2 = 1e-3 and
  entropy_coef = 1e-3. `num_seqs`/`num_tokens` default to this batch's B and mask count; pass the
  mini-batch's totals on each micro-batch to make the summed gradients equal the full-batch one.
  (The official code instead averages per-micro-batch token means, which differs slightly.)
  Metrics are normalised the same way, so they too sum over micro-batches.
  """
  check_shapes("astarpo_loss", logp_BT=(logp_BT, ("B", "T")), ref_logp_BT=(ref_logp_BT, ("B", "T")),
               mask_BT=(mask_BT, ("B", "T")), rewards_B=(rewards_B, ("B",)), vstar_B=(vstar_B, ("B",)),
               entropy_BT=(entropy_BT, ("B", "T")))
  _check_nonneg("astarpo_loss", beta2=beta2, entropy_coef=entropy_coef)
  n_seq = jnp.maximum(jnp.asarray(logp_BT.shape[0] if num_seqs is None else num_seqs, f32), 1.0)
  n_tok = jnp.maximum(jnp.asarray(mask_BT.astype(f32).sum() if num_tokens is None else num_tokens, f32), 1.0)

  log_ratio_BT = zero_masked(logp_BT, mask_BT) - jax.lax.stop_gradient(zero_masked(ref_logp_BT, mask_BT))
  log_ratio_B = log_ratio_BT.sum(-1)
  adv_B = jax.lax.stop_gradient(rewards_B.astype(f32) - vstar_B.astype(f32))
  residual_B = beta2 * log_ratio_B - adv_B
  regression = (residual_B ** 2).sum() / n_seq
  metrics = {
      "regression_loss": regression,
      "kl": log_ratio_BT.sum() / n_tok,
      "advantage_mean": adv_B.sum() / n_seq,
      "beta_log_ratio_mean": (beta2 * log_ratio_B).sum() / n_seq,
  }
  loss = regression
  if entropy_BT is not None:
    entropy = masked_sum(entropy_BT, mask_BT) / n_tok
    metrics["entropy"] = entropy
    loss = loss - entropy_coef * entropy
  elif not isinstance(entropy_coef, (int, float)) or entropy_coef != 0:
    raise ValueError("astarpo_loss: `entropy_BT` is None but `entropy_coef` is not 0; pass token entropies")
  metrics["loss"] = loss
  return loss, metrics
