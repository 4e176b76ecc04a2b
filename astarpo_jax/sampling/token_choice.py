"""How each token is chosen: temperature, top-k, top-p, one uniform per row and step; and the
configuration and output types the sampler shares with its engine.

Sampling never sorts the vocabulary. Temperature scales the logits; top-k and top-p become
thresholds on the unnormalised probabilities, found by bisection over their float bit patterns
(exact, 31 masked reductions over [V, B]); a token is drawn by inverse-CDF sampling in two levels
(blocks of the vocabulary, then within the chosen block) from one uniform per row and step.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How to pick each token. Frozen and hashable: it is a static argument of the jitted code."""
  temperature: float = 1.0  # 0 = greedy (argmax, first index on ties)
  top_p: float = 1.0  # nucleus: keep the most likely tokens holding >= top_p of the mass; 1 = off
  top_k: int = 0  # keep the k most likely tokens (ties at the k-th kept too); 0 = off
  max_new_tokens: int = 512
  stop_ids: tuple[int, ...] = ()  # a row ends after emitting any of these (e.g. EOS, <|im_end|>)
  pad_id: int = 0  # written after a row's stop token, and used to left-pad prompts
  # How the decode keeps its KV cache (engine.generate; no effect on the tokens): "" the backend's (dense on the
  # CPU, paged on TPU/GPU), "dense" or "paged"; page_size 0 = the backend's; max_pages 0 = no cap on the pool;
  # paged_attention "" = the backend's kernel (model/paged_attention.py: pallas on TPU, triton on GPU, xla on the
  # CPU), or one of them by name ("xla" reads every page a row's table names: a fallback, not fast).
  kv_layout: str = ""
  page_size: int = 0
  max_pages: int = 0
  paged_attention: str = ""

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 means greedy)")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p={self.top_p}: must be in (0, 1] (1 disables nucleus filtering)")
    if not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f"top_k={self.top_k!r}: must be an int >= 0 (0 disables top-k filtering)")
    if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: must be an int >= 1")
    if self.kv_layout not in ("", "dense", "paged"):
      raise ValueError(f"kv_layout={self.kv_layout!r}: '', 'dense' or 'paged'")
    if self.paged_attention not in ("", "xla", "pallas", "triton"):
      raise ValueError(f"paged_attention={self.paged_attention!r}: '' (the backend's), 'xla', 'pallas' (TPU) or "
                       "'triton' (GPU)")
    if not isinstance(self.stop_ids, tuple) or not all(isinstance(s, int) for s in self.stop_ids):
      raise ValueError(f"stop_ids={self.stop_ids!r}: must be a tuple of ints (hashable), e.g. (eos_id,)")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleOutput:
  """Sampled responses; a pytree, so `jax.device_get(out)` gives the same with numpy arrays."""
  tokens_BT: jax.Array  # [B, T] int32, pad_id after the stop token
  logp_BT: jax.Array  # [B, T] f32 log-prob under the sampling distribution (see `sample_padded`); 0 on pads
  mask_BT: jax.Array  # [B, T] bool, True on response tokens (the stop token included)
  length_B: jax.Array  # [B] int32, number of response tokens
  finished_B: jax.Array  # [B] bool, the row emitted a stop token
  truncated_B: jax.Array  # [B] bool, the row reached max_new_tokens without a stop token


# ----------------------------------------------------------------------------- token choice
#
# Logits arrive vocab-major, [V, B] (model.decode_step): the fast orientation of the CPU lm-head matmul
# and every reduction below runs over axis 0 with the batch contiguous.


def _take_V(x_VB, idx_B):
  """x[idx_b, b] for each column b."""
  return jnp.take_along_axis(x_VB, idx_B[None, :], axis=0)[0]


def _bisect_threshold(e_VB, enough, iters=31):
  """Keep-mask [V, B] for the largest int32 bit pattern b such that `enough(bits >= b)` holds.

  `e_VB` must be >= 0, so its int32 bit patterns sort like its values; `enough(keep_VB) -> [B]`
  must be monotone and true for b = 0 (keep everything). The kept set is the smallest set of
  highest values that is enough, plus ties at the boundary: exact, with `iters` masked passes.
  """
  bits_VB = jax.lax.bitcast_convert_type(e_VB, jnp.int32)
  lo_B = jnp.zeros(e_VB.shape[1:], jnp.int32)  # enough(lo) holds
  hi_B = jnp.max(bits_VB, axis=0) + 1  # enough(hi) fails: nothing kept

  def body(_, lo_hi):
    lo_B, hi_B = lo_hi
    mid_B = lo_B + (hi_B - lo_B) // 2
    ok_B = enough(bits_VB >= mid_B)
    return jnp.where(ok_B, mid_B, lo_B), jnp.where(ok_B, hi_B, mid_B)

  lo_B, _ = jax.lax.fori_loop(0, iters, body, (lo_B, hi_B))
  return bits_VB >= lo_B


def _choose_block(mass_NB, u_B):
  """The inverse CDF's first level over block masses [N, B]: (block [B], the target's offset into it, the total
  mass); a block with mass 0 is never chosen (rounding at a boundary falls back to the heaviest)."""
  cdf_NB = jnp.cumsum(mass_NB, axis=0)
  target_B = u_B * cdf_NB[-1]
  blk_B = jnp.minimum(jnp.sum(cdf_NB <= target_B, axis=0), mass_NB.shape[0] - 1)
  blk_B = jnp.where(_take_V(mass_NB, blk_B) > 0, blk_B, jnp.argmax(mass_NB, axis=0))
  before_B = _take_V(cdf_NB, blk_B) - _take_V(mass_NB, blk_B)
  return blk_B, target_B - before_B, cdf_NB[-1]


def _choose_within(w_SB, offset_B):
  """The second level: the index in the chosen block's weights [S, B] at `offset_B`, never one of weight 0."""
  cdf_SB = jnp.cumsum(w_SB, axis=0)
  j_B = jnp.minimum(jnp.sum(cdf_SB <= offset_B, axis=0), w_SB.shape[0] - 1)
  return jnp.where(_take_V(w_SB, j_B) > 0, j_B, jnp.argmax(w_SB, axis=0))


def _pick_index(w_VB, u_B):
  """Index i with probability w_i / sum(w) per column, from one uniform per column (w >= 0).

  Two-level inverse CDF (block masses, then within the chosen block) so no cumsum runs over all
  of V; an index with w = 0 is never returned (rounding at a boundary falls back to the mode).
  """
  V, B = w_VB.shape
  bs = max(8, 1 << int(np.ceil(np.log2(np.sqrt(V)))))  # block size ~ sqrt(V), a power of two
  nb = -(-V // bs)
  w_NSB = jnp.pad(w_VB, ((0, nb * bs - V), (0, 0))).reshape(nb, bs, B)
  blk_B, offset_B, _ = _choose_block(jnp.sum(w_NSB, axis=1), u_B)
  j_B = _choose_within(jnp.take_along_axis(w_NSB, blk_B[None, None, :], axis=0)[0], offset_B)
  return (blk_B * bs + j_B).astype(jnp.int32)


def _first_argmax(x_VB):
  """argmax over axis 0, first index on ties; two plain reductions, faster than XLA:CPU's argmax."""
  V = x_VB.shape[0]
  is_max_VB = x_VB == jnp.max(x_VB, axis=0)
  return jnp.min(jnp.where(is_max_VB, jnp.arange(V, dtype=jnp.int32)[:, None], V), axis=0)


def choose_tokens(logits_VB, u_B, scfg: SamplingConfig):
  """Token [B] and its log-prob under p ∝ softmax(logits/τ)·[top-k]·[top-p], from vocab-major logits.

  `u_B` are uniforms in [0, 1). Greedy (τ = 0) returns the argmax and its log-prob under the
  unfiltered model at τ = 1, since the greedy distribution itself is a point mass.
  """
  logits_VB = logits_VB.astype(jnp.float32)
  if scfg.temperature == 0:
    tok_B = _first_argmax(logits_VB)
    return tok_B, _take_V(logits_VB, tok_B) - jax.nn.logsumexp(logits_VB, axis=0)
  x_VB = logits_VB / scfg.temperature
  x_VB = x_VB - jnp.max(x_VB, axis=0)
  e_VB = jnp.exp(x_VB)  # unnormalised probabilities, max 1
  if scfg.top_k and scfg.top_k < logits_VB.shape[0]:
    keep_VB = _bisect_threshold(e_VB, lambda keep: jnp.sum(keep, axis=0) >= scfg.top_k)
    e_VB = jnp.where(keep_VB, e_VB, 0.0)
  if scfg.top_p < 1.0:
    need_B = scfg.top_p * jnp.sum(e_VB, axis=0)
    keep_VB = _bisect_threshold(e_VB, lambda keep: jnp.sum(jnp.where(keep, e_VB, 0.0), axis=0) >= need_B)
    e_VB = jnp.where(keep_VB, e_VB, 0.0)
  tok_B = _pick_index(e_VB, u_B)
  return tok_B, _take_V(x_VB, tok_B) - jnp.log(jnp.sum(e_VB, axis=0))


# ----------------------------------------------------------------------------- vocabulary split over devices
#
# With the LM head split over the tensor axis each device holds [V / t, B] of the logits. Moving them (XLA
# gathered every row's logits on every device; then an all-to-all gave each device its rows) wrote and read
# the fp32 logits several times a step: 7B on v5p-8, ~0.5 GB a chip, the live KV of ~140-token rows. The
# draw needs per-row scalars and one block of the vocabulary: a max, the blocks' masses (all-gathered,
# [blocks, B]), the chosen block's weights from the device holding it (a psum of a [block, B] slab the others
# fill with zeros, so exact) and the chosen token's logit the same way. The logits stay in the LM head's
# dtype (bf16 on the accelerators: an fp32 cast of them was a second copy) and are read for the max and for
# the blocks' masses (exp computed on the way). The same inverse CDF over the vocabulary in order as
# `choose_tokens`; the block boundaries differ (a device's blocks do not straddle its shard), so sums round
# differently and a uniform within ~1e-7 of a token's CDF boundary may pick its neighbour.


def splits_vocab(scfg: SamplingConfig) -> bool:
  """Whether `choose_tokens_split` serves `scfg`: temperature and greedy; top-k/top-p search thresholds
  over the whole vocabulary (31 rounds), so they take the rows whole."""
  return scfg.top_k == 0 and scfg.top_p == 1.0


def _block(v: int) -> int:
  """The within-shard block size: 128 for a shard of 1,024 tokens or more (the TPU's lane width: for 7B's
  38,016-token shards XLA:TPU then summed the blocks with exp fused in, where blocks of 192 wrote exp out
  first), else ~sqrt(v), a power of two."""
  return 128 if v >= 1024 else min(v, max(8, 1 << int(np.ceil(np.log2(np.sqrt(v))))))


def choose_tokens_split(logits_vB, u_B, scfg: SamplingConfig, axis: str):
  """`choose_tokens` for one device's vocabulary shard `logits_vB` [V / t, B] (shard i holds tokens
  [i v, (i + 1) v)), under a collective `axis` of size t (shard_map or vmap): token [B] (global ids) and
  its log-prob, the same on every device of the axis. Moves O(B sqrt(V / t)) values, never the logits."""
  if not splits_vocab(scfg):
    raise ValueError("choose_tokens_split: top_k / top_p need the whole vocabulary (choose_tokens)")
  v, B = logits_vB.shape
  me = jax.lax.axis_index(axis)
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731  (the logits stay in their dtype: no wider copy of them)

  def owned(x_vB, idx_B, owner_B):  # x[idx, b] from the device owning column b's token, exact (others add 0)
    return jax.lax.psum(jnp.where(owner_B == me, f32(_take_V(x_vB, idx_B)), 0.0), axis)

  m_B = jax.lax.pmax(f32(jnp.max(logits_vB, axis=0)), axis)
  if scfg.temperature == 0:
    logits_vB = f32(logits_vB)
    local_B = jnp.min(jnp.where(logits_vB == m_B, jnp.arange(v, dtype=jnp.int32)[:, None], v), axis=0)
    t = jax.lax.psum(1, axis)
    tok_B = jax.lax.pmin(jnp.where(local_B < v, me * v + local_B, t * v), axis)
    lse_B = m_B + jnp.log(jax.lax.psum(jnp.sum(jnp.exp(logits_vB - m_B), axis=0), axis))
    return tok_B.astype(jnp.int32), m_B - lse_B
  m_B = m_B / scfg.temperature
  bs = _block(v)
  full, rest = divmod(v, bs)  # a ragged last block is summed on its own: a padded copy would be written
  weights = lambda x: jnp.exp(f32(x) / scfg.temperature - m_B)  # noqa: E731
  mass_lB = jax.lax.reduce_window(weights(logits_vB[:full * bs]), 0.0, jax.lax.add, (bs, 1), (bs, 1), "VALID")
  if rest:
    mass_lB = jnp.concatenate([mass_lB, jnp.sum(weights(logits_vB[full * bs:]), axis=0, keepdims=True)])
  nl = mass_lB.shape[0]
  mass_NB = jax.lax.all_gather(mass_lB, axis, axis=0, tiled=True)  # [t nl, B], in vocabulary order
  blk_B, offset_B, total_B = _choose_block(mass_NB, u_B)
  owner_B, lblk_B = blk_B // nl, blk_B % nl
  idx_SB = lblk_B[None, :] * bs + jnp.arange(bs)[:, None]  # past v only in a ragged last block: weight 0
  slab_SB = jnp.take_along_axis(logits_vB, jnp.minimum(idx_SB, v - 1), axis=0)
  j_B = _choose_within(jax.lax.psum(jnp.where((owner_B == me) & (idx_SB < v), weights(slab_SB), 0.0), axis),
                       offset_B)
  local_B = lblk_B * bs + j_B  # < v: past v the weight is 0, never chosen
  x_B = owned(logits_vB, jnp.minimum(local_B, v - 1), owner_B) / scfg.temperature - m_B
  return (owner_B * v + local_B).astype(jnp.int32), x_B - jnp.log(total_B)
