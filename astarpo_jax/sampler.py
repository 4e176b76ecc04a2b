"""Batched autoregressive sampling with a KV cache: bucketed prefill, then one `lax.while_loop`.

Prompts are left-padded to a length bucket (`bucket_length`), so a run compiles one prefill per
bucket instead of one per batch. Prefill (the model's own cached forward) writes the prompts into
a cache and samples the first token; the decode loop then runs entirely inside one jitted
`lax.while_loop` (no Python per token) whose state, cache included, is donated, and stops when
every row has emitted a stop token or `max_new_tokens` tokens exist. Decoding runs in phases that
end after 64, 128, 256, ... tokens, the cache growing between them, so attention never reads more
than about twice the filled slots; a phase is skipped once every row has stopped. The decode step
is the model's one-token forward (`model.decode_step`, in its fused CPU layout on the CPU).

Sampling never sorts the vocabulary. Temperature scales the logits; top-k and top-p become
thresholds on the unnormalised probabilities, found by bisection over their float bit patterns
(exact, 31 masked reductions over [V, B]); a token is drawn by inverse-CDF sampling in two levels
(blocks of the vocabulary, then within the chosen block) from one uniform per row and step.
Each row's uniforms come from `fold_in(key, global row index)`, so a row's sample does not depend
on which other rows share its batch or chunk.

Axis letters as in model.py; here T is the number of generated tokens, P the padded prompt
length, S the decode cache slots (P + phase end - 1), O a fused output dim.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from astarpo_jax import model as model_lib
from astarpo_jax.model import ModelConfig, Params


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
  cache: dict  # model.DecodeCache with S = P + (phase end) - 1 columns
  attend_BS: jax.Array  # [B, S] bool, slots holding a real token


# ----------------------------------------------------------------------------- token choice
#
# Logits arrive vocab-major, [V, B]: that is the fast orientation of the lm-head matmul on CPU
# (see the decode step), and every reduction below runs over axis 0 with the batch contiguous.


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


def _pick_index(w_VB, u_B):
  """Index i with probability w_i / sum(w) per column, from one uniform per column (w >= 0).

  Two-level inverse CDF (block masses, then within the chosen block) so no cumsum runs over all
  of V; an index with w = 0 is never returned (rounding at a boundary falls back to the mode).
  """
  V, B = w_VB.shape
  bs = max(8, 1 << int(np.ceil(np.log2(np.sqrt(V)))))  # block size ~ sqrt(V), a power of two
  nb = -(-V // bs)
  w_NSB = jnp.pad(w_VB, ((0, nb * bs - V), (0, 0))).reshape(nb, bs, B)
  mass_NB = jnp.sum(w_NSB, axis=1)
  cdf_NB = jnp.cumsum(mass_NB, axis=0)
  target_B = u_B * cdf_NB[-1]
  blk_B = jnp.minimum(jnp.sum(cdf_NB <= target_B, axis=0), nb - 1)
  blk_B = jnp.where(_take_V(mass_NB, blk_B) > 0, blk_B, jnp.argmax(mass_NB, axis=0))
  before_B = _take_V(cdf_NB, blk_B) - _take_V(mass_NB, blk_B)
  w_SB = jnp.take_along_axis(w_NSB, blk_B[None, None, :], axis=0)[0]
  cdf_SB = jnp.cumsum(w_SB, axis=0)
  j_B = jnp.minimum(jnp.sum(cdf_SB <= target_B - before_B, axis=0), bs - 1)
  j_B = jnp.where(_take_V(w_SB, j_B) > 0, j_B, jnp.argmax(w_SB, axis=0))
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


# ----------------------------------------------------------------------------- prefill and decode


def _record(st: DecodeState, tok_B, logp_B, scfg: SamplingConfig, **updates) -> DecodeState:
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
      **updates,
  )


def _phase_ends(T: int, first: int = 64) -> list[int]:
  """Decode phases end after 64, 128, 256, ... tokens (the last after T). Each phase's cache has
  only the slots that phase can reach, so attention reads at most about twice the filled slots."""
  ends = []
  while first < T:
    ends.append(first)
    first *= 2
  return ends + [T]


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _prefill(cfg: ModelConfig, scfg: SamplingConfig, S: int, fused: bool, params: Params, tokens_BP, mask_BP, key,
             row0) -> DecodeState:
  """Run the prompts through the model, sample the first token, and lay out an S-slot decode cache."""
  B, P = tokens_BP.shape
  T = scfg.max_new_tokens
  row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, row0 + jnp.arange(B))
  u_BT = jax.vmap(lambda k: jax.random.uniform(k, (T,), jnp.float32))(row_keys)
  cache = model_lib.init_cache(cfg, B, P)
  h_BPD, cache = model_lib.hidden_states(
      cfg, params, tokens_BP, model_lib.positions_from_mask(mask_BP), mask_BP, cache)
  logits_BV = model_lib.logits_from_hidden(cfg, params, h_BPD[:, -1:])[:, 0]  # last slot is real: left padding
  # Slot P-1+t receives the token generated at step t-1 (the last token is never fed back).
  dcache = model_lib.decode_cache_write(model_lib.init_decode_cache(cfg, B, S, fused),
                                        model_lib.decode_cache_from_prefill(cache, fused), 0)
  st = DecodeState(
      step=jnp.zeros((), jnp.int32),
      last_B=jnp.zeros((B,), jnp.int32),
      pos_B=jnp.sum(mask_BP, axis=-1, dtype=jnp.int32) - 1,  # the last prompt token's
      done_B=jnp.zeros((B,), bool),
      length_B=jnp.zeros((B,), jnp.int32),
      tokens_BT=jnp.full((B, T), scfg.pad_id, jnp.int32),
      logp_BT=jnp.zeros((B, T), jnp.float32),
      u_BT=u_BT,
      cache=dcache,
      attend_BS=jnp.pad(mask_BP, ((0, 0), (0, S - P))),
  )
  tok_B, logp_B = choose_tokens(logits_BV.T, u_BT[:, 0], scfg)
  return _record(st, tok_B, logp_B, scfg)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _grow(cfg: ModelConfig, S: int, fused: bool, st: DecodeState) -> DecodeState:
  """The same state with an S-slot cache (the new slots empty)."""
  B, extra = st.attend_BS.shape[0], S - st.attend_BS.shape[1]
  cache = model_lib.decode_cache_write(model_lib.init_decode_cache(cfg, B, S, fused), st.cache, 0)
  return dataclasses.replace(st, cache=cache, attend_BS=jnp.pad(st.attend_BS, ((0, 0), (0, extra))))


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(4,))
def _decode(cfg: ModelConfig, scfg: SamplingConfig, P: int, dparams: Params, st: DecodeState) -> DecodeState:
  """Feed back the last token until every row is done or the cache is full (one while_loop)."""
  end = min(scfg.max_new_tokens, st.attend_BS.shape[1] - P + 1)  # steps whose input fits in the cache

  def cond(st):
    return (st.step < end) & ~jnp.all(st.done_B)

  def body(st):
    slot = P - 1 + st.step
    attend_BS = jax.lax.dynamic_update_slice(st.attend_BS, jnp.ones((st.last_B.shape[0], 1), bool), (0, slot))
    col_B = jnp.full(st.last_B.shape, slot, jnp.int32)
    logits_VB, cache = model_lib.decode_step(cfg, dparams, st.cache, st.last_B, st.pos_B, col_B, attend_BS)
    u_B = jax.lax.dynamic_index_in_dim(st.u_BT, st.step, axis=1, keepdims=False)
    tok_B, logp_B = choose_tokens(logits_VB, u_B, scfg)
    return _record(st, tok_B, logp_B, scfg, cache=cache, attend_BS=attend_BS)

  return jax.lax.while_loop(cond, body, st)


# ----------------------------------------------------------------------------- host-side API


def bucket_length(n: int) -> int:
  """Padded prompt length: the next power of two (at least 16) up to 128, then a multiple of 128."""
  if n <= 128:
    return max(16, 1 << (max(n, 1) - 1).bit_length())
  return -(-n // 128) * 128


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, length: int | None = None):
  """Token lists -> left-padded (tokens [B, P] int32, mask [B, P] bool) numpy arrays."""
  if not len(prompts):
    raise ValueError("prompts is empty: pass at least one prompt")
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


@functools.partial(jax.jit, static_argnums=0)
def _output(T: int, st: DecodeState) -> SampleOutput:
  """The user-facing arrays of a finished decode state."""
  mask_BT = jnp.arange(T)[None, :] < st.length_B[:, None]
  return SampleOutput(tokens_BT=st.tokens_BT, logp_BT=st.logp_BT, mask_BT=mask_BT, length_B=st.length_B,
                      finished_B=st.done_B, truncated_B=~st.done_B)


def _sample_chunk(cfg, scfg, params, dparams, tokens_BP, mask_BP, lengths_B, key, row0) -> SampleOutput:
  """Trim the common left padding, re-pad to the bucket, prefill, decode phase by phase."""
  B, P_in = tokens_BP.shape
  P = bucket_length(int(lengths_B.max()))
  cut = max(P_in - P, 0)
  xp = np if isinstance(tokens_BP, np.ndarray) else jnp  # host arrays stay on the host until the jit
  widths = ((0, 0), (P - (P_in - cut), 0))
  tokens_BP = xp.pad(tokens_BP[:, cut:].astype(np.int32), widths, constant_values=scfg.pad_id)
  mask_BP = xp.pad(mask_BP[:, cut:].astype(bool), widths)
  ends = _phase_ends(scfg.max_new_tokens)
  fused = dparams is not None and model_lib.is_fused(dparams)
  st = _prefill(cfg, scfg, P + ends[0] - 1, fused, params, tokens_BP, mask_BP, key, np.int32(row0))
  for i, end in enumerate(ends):
    if end == 1 or (i and bool(jnp.all(st.done_B))):  # nothing to run, or every row has stopped
      break
    if i:
      st = _grow(cfg, P + end - 1, fused, st)
    st = _decode(cfg, scfg, P, dparams, st)
  return _output(scfg.max_new_tokens, st)


def sample_padded(cfg: ModelConfig, params: Params, tokens_BP, mask_BP, key: jax.Array,
                  scfg: SamplingConfig, max_batch: int | None = None) -> SampleOutput:
  """Sample one response per left-padded prompt row; `max_batch` rows at a time.

  Log-probs are those of the distribution each token was drawn from (after temperature, top-k
  and top-p); at temperature 1 without filtering they are the model's log π(y_t | x, y_<t).
  Rows beyond a multiple of `max_batch` are run in a last chunk padded to `max_batch` rows, so
  every chunk reuses one compiled program; chunking does not change any row's result. Memory:
  the params, on the CPU a fused copy of the layer weights (`model.decode_params`), and per chunk a
  cache of 2·L·max_batch·(P + T)·K·H values in the compute dtype.
  """
  mask_np = np.asarray(mask_BP).astype(bool)
  if not isinstance(tokens_BP, jax.Array):
    tokens_BP = np.asarray(tokens_BP)
  if np.ndim(tokens_BP) != 2 or np.shape(tokens_BP) != mask_np.shape:
    raise ValueError(f"tokens {np.shape(tokens_BP)} and mask {mask_np.shape} must both be [B, P]")
  lengths_B = _check_inputs(cfg, scfg, mask_np)
  if not (isinstance(key, jax.Array) and (jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
                                          or (key.dtype == jnp.uint32 and key.shape == (2,)))):
    raise ValueError(f"key must be one PRNG key, e.g. jax.random.key(0); got {type(key).__name__} "
                     f"{getattr(key, 'dtype', '')}{getattr(key, 'shape', '')}")
  B = mask_np.shape[0]
  if max_batch is not None and max_batch < 1:
    raise ValueError(f"max_batch={max_batch}: must be >= 1 (or None for one batch)")
  dparams = model_lib.decode_params(cfg, params) if scfg.max_new_tokens > 1 else None
  if max_batch is None or B <= max_batch:
    return _sample_chunk(cfg, scfg, params, dparams, tokens_BP, mask_np, lengths_B, key, 0)
  outs = []
  for start in range(0, B, max_batch):
    rows = np.minimum(np.arange(start, start + max_batch), B - 1)  # the last chunk repeats its last row
    tokens_rows = tokens_BP[rows] if isinstance(tokens_BP, np.ndarray) else jnp.asarray(tokens_BP)[rows]
    outs.append(_sample_chunk(cfg, scfg, params, dparams, tokens_rows, mask_np[rows], lengths_B[rows], key, start))
  out = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *outs)
  return jax.tree.map(lambda x: x[:B], out)


def sample(cfg: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], key: jax.Array,
           scfg: SamplingConfig, max_batch: int | None = None) -> SampleOutput:
  """Sample one response per prompt (lists of token ids of any lengths); see `sample_padded`."""
  if not len(prompts):
    raise ValueError("prompts is empty: pass at least one prompt")
  tokens_BP, mask_BP = left_pad(prompts, scfg.pad_id)
  return sample_padded(cfg, params, tokens_BP, mask_BP, key, scfg, max_batch)
