"""Batched autoregressive sampling with a KV cache: bucketed prefill, then one `lax.while_loop`.

Prompts are left-padded to a length bucket (`bucket_length`), so a run compiles one prefill per
bucket instead of one per batch. Prefill writes the prompt into a fresh cache and samples the
first token; the decode loop then runs entirely inside one jitted `lax.while_loop` (no Python per
token) whose state, cache included, is donated. The loop stops when every row has emitted a stop
token or `max_new_tokens` tokens have been produced.

Sampling never sorts the vocabulary. Temperature scales the logits; top-k and top-p become
thresholds on the unnormalised probabilities, found by bisection over their float bit patterns
(exact, 31 masked reductions over [B, V]); a token is drawn by inverse-CDF sampling in two levels
(blocks of the vocabulary, then within the chosen block) from one uniform per row and step.
Each row's uniforms come from `fold_in(key, global row index)`, so a row's sample does not depend
on which other rows share its batch or chunk.

Axis letters as in model.py; here T is the number of generated tokens and P the padded prompt
length.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from astarpo_jax import model as model_lib
from astarpo_jax.model import Cache, ModelConfig, Params


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How to pick each token. Frozen and hashable: it is a static argument of the jitted code."""
  temperature: float = 1.0  # 0 = greedy (argmax, first index on ties)
  top_p: float = 1.0  # nucleus: keep the most likely tokens holding >= top_p of the mass; 1 = off
  top_k: int = 0  # keep the k most likely tokens (ties at the k-th kept too); 0 = off
  max_new_tokens: int = 512
  stop_ids: tuple[int, ...] = ()  # a row ends after emitting any of these (e.g. EOS, <|im_end|>)
  pad_id: int = 0  # written after a row's stop token, and used to left-pad prompts

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 means greedy)")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p={self.top_p}: must be in (0, 1] (1 disables nucleus filtering)")
    if not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f"top_k={self.top_k!r}: must be an int >= 0 (0 disables top-k filtering)")
    if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: must be an int >= 1")
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  """Carry of the decode loop."""
  step: jax.Array  # [] int32, columns of tokens_BT filled so far
  last_B: jax.Array  # [B] int32, the token fed to the model at the next step
  pos_B: jax.Array  # [B] int32, position of last_B
  done_B: jax.Array  # [B] bool, the row has emitted a stop token
  length_B: jax.Array  # [B] int32
  tokens_BT: jax.Array  # [B, T] int32
  logp_BT: jax.Array  # [B, T] f32
  u_BT: jax.Array  # [B, T] f32, the uniforms that pick each token
  cache: Cache  # k, v: [L, B, P+T, K, H]


# ----------------------------------------------------------------------------- token choice


def _bisect_threshold(e_BV, enough, iters=31):
  """Largest int32 bit pattern b such that `enough(bits >= b)` holds, per row.

  `e_BV` must be >= 0, so its int32 bit patterns sort like its values; `enough(keep_BV) -> [B]`
  must be monotone (true for b = 0, i.e. keeping everything). The result keeps the smallest set
  of highest values that is enough, plus ties at the boundary.
  """
  bits_BV = jax.lax.bitcast_convert_type(e_BV, jnp.int32)
  lo_B = jnp.zeros(e_BV.shape[:1], jnp.int32)  # enough(lo) holds
  hi_B = jnp.max(bits_BV, axis=-1) + 1  # enough(hi) fails: nothing kept

  def body(_, lo_hi):
    lo_B, hi_B = lo_hi
    mid_B = lo_B + (hi_B - lo_B) // 2
    ok_B = enough(bits_BV >= mid_B[:, None])
    return jnp.where(ok_B, mid_B, lo_B), jnp.where(ok_B, hi_B, mid_B)

  lo_B, _ = jax.lax.fori_loop(0, iters, body, (lo_B, hi_B))
  return bits_BV >= lo_B[:, None]


def _pick_index(w_BV, u_B):
  """Index i with probability w_i / sum(w) from one uniform per row (w >= 0, some w > 0).

  Two-level inverse CDF (block masses, then within the block) so no cumsum runs over all of V;
  an index with w = 0 is never returned (rounding at a boundary falls back to the block's mode).
  """
  B, V = w_BV.shape
  bs = max(8, 1 << int(np.ceil(np.log2(np.sqrt(V)))))  # block size ~ sqrt(V), a power of two
  nb = -(-V // bs)
  w_BNS = jnp.pad(w_BV, ((0, 0), (0, nb * bs - V))).reshape(B, nb, bs)
  mass_BN = jnp.sum(w_BNS, axis=-1)
  cdf_BN = jnp.cumsum(mass_BN, axis=-1)
  target_B = u_B * cdf_BN[:, -1]
  blk_B = jnp.minimum(jnp.sum(cdf_BN <= target_B[:, None], axis=-1), nb - 1)
  blk_mass_B = jnp.take_along_axis(mass_BN, blk_B[:, None], axis=-1)[:, 0]
  blk_B = jnp.where(blk_mass_B > 0, blk_B, jnp.argmax(mass_BN, axis=-1))
  before_B = jnp.take_along_axis(cdf_BN, blk_B[:, None], axis=-1)[:, 0] - jnp.take_along_axis(
      mass_BN, blk_B[:, None], axis=-1)[:, 0]
  w_BS = jnp.take_along_axis(w_BNS, blk_B[:, None, None], axis=1)[:, 0]
  cdf_BS = jnp.cumsum(w_BS, axis=-1)
  j_B = jnp.minimum(jnp.sum(cdf_BS <= (target_B - before_B)[:, None], axis=-1), bs - 1)
  w_j_B = jnp.take_along_axis(w_BS, j_B[:, None], axis=-1)[:, 0]
  j_B = jnp.where(w_j_B > 0, j_B, jnp.argmax(w_BS, axis=-1))
  return (blk_B * bs + j_B).astype(jnp.int32)


def _first_argmax(x_BV):
  """argmax with the first index on ties; two plain reductions, faster than XLA:CPU's argmax."""
  V = x_BV.shape[-1]
  is_max_BV = x_BV == jnp.max(x_BV, axis=-1, keepdims=True)
  return jnp.min(jnp.where(is_max_BV, jnp.arange(V, dtype=jnp.int32), V), axis=-1)


def choose_tokens(logits_BV, u_B, scfg: SamplingConfig):
  """Token and its log-prob under the filtered distribution p ∝ softmax(logits/τ)·[top-k]·[top-p].

  Greedy (τ = 0) returns the argmax and its log-prob under the unfiltered model at τ = 1, since
  the greedy distribution itself is a point mass.
  """
  logits_BV = logits_BV.astype(jnp.float32)
  if scfg.temperature == 0:
    tok_B = _first_argmax(logits_BV)
    tok_logit_B = jnp.take_along_axis(logits_BV, tok_B[:, None], axis=-1)[:, 0]
    return tok_B, tok_logit_B - jax.nn.logsumexp(logits_BV, axis=-1)
  x_BV = logits_BV / scfg.temperature
  x_BV = x_BV - jnp.max(x_BV, axis=-1, keepdims=True)
  e_BV = jnp.exp(x_BV)  # unnormalised probabilities, max 1
  if scfg.top_k and scfg.top_k < logits_BV.shape[-1]:
    keep_BV = _bisect_threshold(e_BV, lambda keep: jnp.sum(keep, axis=-1) >= scfg.top_k)
    e_BV = jnp.where(keep_BV, e_BV, 0.0)
  if scfg.top_p < 1.0:
    need_B = scfg.top_p * jnp.sum(e_BV, axis=-1)
    keep_BV = _bisect_threshold(e_BV, lambda keep: jnp.sum(jnp.where(keep, e_BV, 0.0), axis=-1) >= need_B)
    e_BV = jnp.where(keep_BV, e_BV, 0.0)
  tok_B = _pick_index(e_BV, u_B)
  tok_x_B = jnp.take_along_axis(x_BV, tok_B[:, None], axis=-1)[:, 0]
  return tok_B, tok_x_B - jnp.log(jnp.sum(e_BV, axis=-1))


# ----------------------------------------------------------------------------- prefill and decode


def _record(st: DecodeState, tok_B, logp_B, cache, scfg: SamplingConfig) -> DecodeState:
  """Write this step's token into column `step`; rows already done get pad_id and log-prob 0."""
  active_B = ~st.done_B
  tok_B = jnp.where(active_B, tok_B, scfg.pad_id).astype(jnp.int32)
  logp_B = jnp.where(active_B, logp_B, 0.0)
  hit_stop_B = functools.reduce(jnp.logical_or, [tok_B == s for s in scfg.stop_ids], jnp.zeros_like(active_B))
  return dataclasses.replace(
      st,
      step=st.step + 1,
      last_B=tok_B,
      pos_B=st.pos_B + 1,
      done_B=st.done_B | (active_B & hit_stop_B),
      length_B=st.length_B + active_B.astype(jnp.int32),
      tokens_BT=jax.lax.dynamic_update_slice(st.tokens_BT, tok_B[:, None], (0, st.step)),
      logp_BT=jax.lax.dynamic_update_slice(st.logp_BT, logp_B[:, None], (0, st.step)),
      cache=cache,
  )


@functools.partial(jax.jit, static_argnums=(0, 1))
def _prefill(cfg: ModelConfig, scfg: SamplingConfig, params: Params, tokens_BP, mask_BP, key, row0) -> DecodeState:
  """Run the prompts through the model into a fresh cache and sample the first token."""
  B, P = tokens_BP.shape
  T = scfg.max_new_tokens
  row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, row0 + jnp.arange(B))
  u_BT = jax.vmap(lambda k: jax.random.uniform(k, (T,), jnp.float32))(row_keys)
  cache = model_lib.init_cache(cfg, B, P + T)
  h_BPD, cache = model_lib.hidden_states(
      cfg, params, tokens_BP, model_lib.positions_from_mask(mask_BP), mask_BP, cache)
  logits_BV = model_lib.logits_from_hidden(cfg, params, h_BPD[:, -1:])[:, 0]  # last slot is real: left padding
  st = DecodeState(
      step=jnp.zeros((), jnp.int32),
      last_B=jnp.zeros((B,), jnp.int32),
      pos_B=jnp.sum(mask_BP, axis=-1, dtype=jnp.int32) - 1,  # the last prompt token's
      done_B=jnp.zeros((B,), bool),
      length_B=jnp.zeros((B,), jnp.int32),
      tokens_BT=jnp.full((B, T), scfg.pad_id, jnp.int32),
      logp_BT=jnp.zeros((B, T), jnp.float32),
      u_BT=u_BT,
      cache=cache,
  )
  tok_B, logp_B = choose_tokens(logits_BV, u_BT[:, 0], scfg)
  return _record(st, tok_B, logp_B, cache, scfg)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def _decode(cfg: ModelConfig, scfg: SamplingConfig, params: Params, st: DecodeState) -> DecodeState:
  """Feed back the last token until every row is done or T tokens exist (one while_loop)."""
  T = scfg.max_new_tokens
  ones_B1 = jnp.ones(st.last_B.shape + (1,), bool)

  def cond(st):
    return (st.step < T) & ~jnp.all(st.done_B)

  def body(st):
    logits_B1V, cache = model_lib.forward(cfg, params, st.last_B[:, None], st.pos_B[:, None], ones_B1, st.cache)
    u_B = jax.lax.dynamic_index_in_dim(st.u_BT, st.step, axis=1, keepdims=False)
    tok_B, logp_B = choose_tokens(logits_B1V[:, 0], u_B, scfg)
    return _record(st, tok_B, logp_B, cache, scfg)

  return jax.lax.while_loop(cond, body, st)


# ----------------------------------------------------------------------------- host-side API


def bucket_length(n: int) -> int:
  """Padded prompt length: the next power of two (at least 16) up to 128, then a multiple of 128."""
  if n <= 128:
    return max(16, 1 << (max(n, 1) - 1).bit_length())
  return -(-n // 128) * 128


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, length: int | None = None):
  """Token lists -> left-padded (tokens [B, P] int32, mask [B, P] bool) numpy arrays."""
  lengths = [len(p) for p in prompts]
  P = max(lengths) if length is None else length
  if P < max(lengths):
    raise ValueError(f"length={length} is shorter than the longest prompt ({max(lengths)} tokens)")
  tokens_BP = np.full((len(prompts), P), pad_id, np.int32)
  mask_BP = np.zeros((len(prompts), P), bool)
  for i, p in enumerate(prompts):
    if len(p):
      tokens_BP[i, P - len(p):] = p
      mask_BP[i, P - len(p):] = True
  return tokens_BP, mask_BP


def _check_inputs(cfg: ModelConfig, scfg: SamplingConfig, mask_BP: np.ndarray) -> np.ndarray:
  """Prompt lengths [B]; rejects empty prompts, right padding and overlong requests."""
  lengths_B = mask_BP.sum(axis=-1)
  P = mask_BP.shape[1]
  if (lengths_B == 0).any():
    raise ValueError(f"prompts {np.flatnonzero(lengths_B == 0)[:8].tolist()} are empty: each needs >= 1 token")
  left_padded_BP = np.arange(P)[None, :] >= (P - lengths_B)[:, None]
  if (mask_BP != left_padded_BP).any():
    bad = np.flatnonzero((mask_BP != left_padded_BP).any(axis=-1))[:8].tolist()
    raise ValueError(f"rows {bad} of the prompt mask are not left-padded (pads must all come first)")
  if scfg.top_k > cfg.vocab_size:
    raise ValueError(f"top_k={scfg.top_k} exceeds vocab_size={cfg.vocab_size}")
  for s in scfg.stop_ids + (scfg.pad_id,):
    if not 0 <= s < cfg.vocab_size:
      raise ValueError(f"token id {s} in stop_ids/pad_id is outside the vocabulary [0, {cfg.vocab_size})")
  need = int(lengths_B.max()) + scfg.max_new_tokens
  if need > cfg.max_position_embeddings:
    raise ValueError(f"prompt ({int(lengths_B.max())}) + max_new_tokens ({scfg.max_new_tokens}) = {need} "
                     f"exceeds max_position_embeddings={cfg.max_position_embeddings}")
  return lengths_B


def _sample_chunk(cfg, scfg, params, tokens_BP, mask_BP, lengths_B, key, row0) -> SampleOutput:
  """Trim the common left padding, re-pad to the bucket, prefill, decode."""
  B, P_in = tokens_BP.shape
  P = bucket_length(int(lengths_B.max()))
  cut = max(P_in - P, 0)
  tokens_BP = jnp.pad(jnp.asarray(tokens_BP[:, cut:], jnp.int32), ((0, 0), (P - (P_in - cut), 0)),
                      constant_values=scfg.pad_id)
  mask_BP = jnp.pad(jnp.asarray(mask_BP[:, cut:], bool), ((0, 0), (P - (P_in - cut), 0)))
  st = _prefill(cfg, scfg, params, tokens_BP, mask_BP, key, jnp.int32(row0))
  if scfg.max_new_tokens > 1:  # (saves compiling a loop that would not run)
    st = _decode(cfg, scfg, params, st)
  mask_BT = jnp.arange(scfg.max_new_tokens)[None, :] < st.length_B[:, None]
  return SampleOutput(tokens_BT=st.tokens_BT, logp_BT=st.logp_BT, mask_BT=mask_BT, length_B=st.length_B,
                      finished_B=st.done_B, truncated_B=~st.done_B)


def sample_padded(cfg: ModelConfig, params: Params, tokens_BP, mask_BP, key: jax.Array,
                  scfg: SamplingConfig, max_batch: int | None = None) -> SampleOutput:
  """Sample one response per left-padded prompt row; `max_batch` rows at a time.

  Log-probs are those of the distribution each token was drawn from (after temperature, top-k
  and top-p); at temperature 1 without filtering they are the model's log π(y_t | x, y_<t).
  Rows beyond a multiple of `max_batch` are run in a last chunk padded to `max_batch` rows, so
  every chunk reuses one compiled program; chunking does not change any row's result.
  """
  mask_np = np.asarray(mask_BP).astype(bool)
  if np.ndim(tokens_BP) != 2 or np.shape(tokens_BP) != mask_np.shape:
    raise ValueError(f"tokens {np.shape(tokens_BP)} and mask {mask_np.shape} must both be [B, P]")
  lengths_B = _check_inputs(cfg, scfg, mask_np)
  B = mask_np.shape[0]
  if max_batch is not None and max_batch < 1:
    raise ValueError(f"max_batch={max_batch}: must be >= 1 (or None for one batch)")
  if max_batch is None or B <= max_batch:
    return _sample_chunk(cfg, scfg, params, tokens_BP, mask_np, lengths_B, key, 0)
  outs = []
  for start in range(0, B, max_batch):
    rows = np.minimum(np.arange(start, start + max_batch), B - 1)  # the last chunk repeats its last row
    outs.append(_sample_chunk(cfg, scfg, params, jnp.asarray(tokens_BP)[rows], mask_np[rows], lengths_B[rows],
                              key, start))
  out = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *outs)
  return jax.tree.map(lambda x: x[:B], out)


def sample(cfg: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], key: jax.Array,
           scfg: SamplingConfig, max_batch: int | None = None) -> SampleOutput:
  """Sample one response per prompt (lists of token ids of any lengths); see `sample_padded`."""
  if not len(prompts):
    raise ValueError("prompts is empty: pass at least one prompt")
  tokens_BP, mask_BP = left_pad(prompts, scfg.pad_id)
  return sample_padded(cfg, params, tokens_BP, mask_BP, key, scfg, max_batch)
