"""Log-probs of response tokens under any param tree: the policy being trained, π_ref, the old policy.

Every method scores responses the same way: one forward over prompt + response, the hidden state at
P+t-1 predicting response token t, the logits formed in blocks (kernels.py) so that no [B, R, V] fp32
array exists. `logprobs_and_entropy` is the differentiable form a loss calls; `logprobs` the jitted,
gradient-free form for the fixed scores a rollout needs before its updates; `in_row_blocks` runs such
a function over a whole rollout a micro-batch of rows at a time (the whole rollout at once would be
the run's memory peak), placing each block's rows per process in a multi-process run. `old_policy_logprobs`
gives π_old's log-probs (the training forward's, or the sampler's own), `policy_mismatch` how far the sampler's
numbers are from the trainer's on the same tokens (the step's mismatch metrics).

Axis letters as in model.py; P is the padded prompt length, R the response length, S = P + R.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from astarpo_jax.infra import multihost, sharding
from astarpo_jax.model import decoder as model_lib, kernels
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.model.decoder import Params
from astarpo_jax.training import packing

# Block of logits [B, SCORE_CHUNK, SCORE_VOCAB_CHUNK] of the gradient-free scoring forward.
SCORE_CHUNK, SCORE_VOCAB_CHUNK = 32, 4096


def _gather_in_shards(h_WCD, src_WgR):
  """h_WCD[w][src_WgR[w]] for every batch shard w: [W, g, R, D].

  A gather batched over W, which XLA partitions per device when W is split over the batch axes; the same
  gather with indices into the flattened [W * C] is not (permutes and all-gathers, forward and
  backward). tests/sharded_worker.py checks that no collective comes from this scope.
  """
  with jax.named_scope("packed_gather"):
    return jax.vmap(lambda h_CD, src_gR: h_CD[src_gR])(h_WCD, src_WgR)


def response_hidden(cfg: ModelConfig, params: Params, tokens_BS, mask_BS, prompt_len: int, unembed_DV=None,
                    pack=None):
  """Hidden states [B, R, D] that predict the response tokens, and the [D, V] unembedding, in the compute dtype.

  `unembed_DV` overrides the output projection taken from `params` (see update.accumulate_gradients).
  `pack` (packing.pack_microbatches' arrays of these rows, one micro-batch): the forward runs over the
  packed rows instead and the response's hidden states are gathered back, within each batch shard, into
  the [B, R] layout.
  """
  dt = jnp.dtype(cfg.dtype)
  if unembed_DV is None:  # whole over the batch axes once per call, not once per log-prob chunk
    unembed_DV = model_lib.gathered_unembed(cfg, params)
  if pack is not None:  # [W, Q, S] packed rows per batch shard; src [W, b/W, R] indexes its shard's [Q * S]
    W, Q, S = pack["pack_tokens"].shape
    tok_XS, pos_XS, seg_XS = (pack[k].reshape(W * Q, S) for k in ("pack_tokens", "pack_positions", "pack_segments"))
    h_XSD, _ = model_lib.hidden_states(cfg, params, tok_XS, pos_XS, seg_XS > 0, segments_BT=seg_XS)
    h_WgRD = _gather_in_shards(h_XSD.reshape(W, Q * S, -1), pack["pack_src"])
    return h_WgRD.reshape(-1, *h_WgRD.shape[2:]).astype(dt), unembed_DV.astype(dt)
  positions_BS = model_lib.positions_from_mask(mask_BS)
  h_BSD, _ = model_lib.hidden_states(cfg, params, tokens_BS, positions_BS, mask_BS)
  return h_BSD[:, prompt_len - 1:-1].astype(dt), unembed_DV.astype(dt)


def logprobs_and_entropy(cfg: ModelConfig, params: Params, tokens_BS, mask_BS, prompt_len: int, chunk: int = 256,
                         unembed_DV=None, pack=None) -> tuple[jax.Array, jax.Array]:
  """(logp_BR, entropy_BR) of the response tokens `tokens_BS[:, P:]`, differentiable (the losses' input).

  The logits of response position t come from the hidden state at P+t-1; they are formed `chunk`
  positions at a time with the hand-written backward of `kernels.chunked_logprobs_entropy`.
  """
  h_BRD, unembed_DV = response_hidden(cfg, params, tokens_BS, mask_BS, prompt_len, unembed_DV, pack)
  return kernels.chunked_logprobs_entropy(h_BRD, unembed_DV, tokens_BS[:, prompt_len:], chunk=chunk)


def batch_logprobs_and_entropy(cfg: ModelConfig, params: Params, mb: dict, prompt_len: int, chunk: int = 256,
                               unembed_DV=None) -> tuple[jax.Array, jax.Array]:
  """`logprobs_and_entropy` of a micro-batch dict (its "tokens", "mask" and, when packed, packing.KEYS):
  what every method's loss calls."""
  return logprobs_and_entropy(cfg, params, mb["tokens"], mb["mask"], prompt_len, chunk, unembed_DV,
                              packing.from_batch(mb))


@functools.partial(jax.jit, static_argnames=("cfg", "prompt_len", "chunk", "vocab_chunk"))
def logprobs(cfg: ModelConfig, params: Params, tokens_BS, mask_BS, *, prompt_len: int, chunk: int = SCORE_CHUNK,
             vocab_chunk: int = SCORE_VOCAB_CHUNK, pack=None) -> jax.Array:
  """log π(y_t | x, y_<t) [B, R] of the response tokens under `params`: one forward, no gradients.

  Without a backward to feed, the logits are formed in [B, chunk, vocab_chunk] blocks that stay in
  cache (`kernels.vocab_chunked_logprobs`), never the whole [B, chunk, V]. `pack`: as response_hidden.
  """
  h_BRD, unembed_DV = response_hidden(cfg, params, tokens_BS, mask_BS, prompt_len, pack=pack)
  return kernels.vocab_chunked_logprobs(h_BRD, unembed_DV, tokens_BS[:, prompt_len:], chunk=chunk,
                                        vocab_chunk=vocab_chunk)


def _placer(row_sharding):
  """How a block of host rows goes to the devices: each process places its rows, or one device takes all."""
  return (lambda a: multihost.from_host(a, row_sharding)) if jax.process_count() > 1 else jnp.asarray


def in_row_blocks(fn: Callable[..., jax.Array], rows: int, *arrays_BX: np.ndarray,
                  row_sharding: jax.sharding.Sharding | None = None) -> np.ndarray:
  """fn over consecutive blocks of `rows` rows of the host arrays, concatenated on the host.

  Across several processes each places only its rows of a block (`row_sharding`) and the result is
  gathered back, so every process returns the whole [B, ...] array.
  """
  n = len(arrays_BX[0])
  place = _placer(row_sharding)
  return np.concatenate([multihost.to_host(fn(*(place(a[i:i + rows]) for a in arrays_BX))) for i in range(0, n, rows)])


def in_packed_blocks(fn: Callable[..., jax.Array], rows: int, tokens_BS: np.ndarray, mask_BS: np.ndarray,
                     prompt_len: int, row_sharding: jax.sharding.Sharding | None = None,
                     pack: bool = False) -> np.ndarray:
  """`fn(tokens, mask, pack)` -> [b, R] over a whole rollout, `rows` rows at a time (`in_row_blocks`).

  `pack` (train.pack_rows): each block's rows are packed first, per batch shard of `row_sharding`
  (packing.pack_microbatches), so the forward skips the response padding as the packed update does; the
  whole blocks share one packed row count (one compile per width), a shorter last block is packed apart.
  """
  if not pack:
    return in_row_blocks(fn, rows, tokens_BS, mask_BS, row_sharding=row_sharding)
  place = _placer(row_sharding)
  shards = sharding.batch_ways(row_sharding.mesh if row_sharding is not None else None)
  full = len(tokens_BS) // rows * rows
  S = tokens_BS.shape[1]
  groups = [(tokens_BS[:full].reshape(-1, rows, S), mask_BS[:full].reshape(-1, rows, S)),
            (tokens_BS[None, full:], mask_BS[None, full:])]
  out = []
  for tok_MbS, mask_MbS in groups:
    if not tok_MbS.size:
      continue
    packed = packing.pack_microbatches({"tokens": tok_MbS, "mask": mask_MbS}, prompt_len, shards)
    for m in range(len(tok_MbS)):
      block = {k: place(v[m]) for k, v in packed.items()}
      out.append(multihost.to_host(fn(block["tokens"], block["mask"], packing.from_batch(block))))
  return np.concatenate(out)


@dataclasses.dataclass(frozen=True)
class Blocks:
  """How a rollout's fixed-score forwards (π_ref, π_old, a critic's values) cut its rows: `rows` at a time (the
  update's micro-batch) and packed or not (train.pack_rows). The loop builds it from LoopSettings, its one
  source, so the forwards and the update always agree on packing."""
  rows: int
  pack: bool = False


def logprobs_in_blocks(cfg: ModelConfig, params: Params, tokens_BS: np.ndarray, mask_BS: np.ndarray, prompt_len: int,
                       rows: int, row_sharding: jax.sharding.Sharding | None = None, pack: bool = False
                       ) -> np.ndarray:
  """`logprobs` of a whole rollout [B, R] on the host, `rows` rows at a time, packed or not (`in_packed_blocks`)."""
  score = lambda tok, m, pk=None: logprobs(cfg, params, tok, m, prompt_len=prompt_len, pack=pk)  # noqa: E731
  return in_packed_blocks(score, rows, tokens_BS, mask_BS, prompt_len, row_sharding, pack)


OLD_LOGP_SOURCES = ("trainer", "sampler")  # algo.old_logp: the training forward (verl's), or the sampler's own


def sampler_gives_policy_logprobs(scfg) -> bool:
  """Whether the sampler's log-probs are the policy's (temperature 1, no top-k / top-p filter)."""
  return scfg.temperature == 1.0 and scfg.top_p == 1.0 and scfg.top_k == 0


def sampler_logprobs(ro, resp_mask_BR) -> np.ndarray:
  """The sampler's log-probs of the response tokens [B, R] (fp32), 0 off the response mask."""
  return np.where(resp_mask_BR, ro.sample_logp_BR[:, :resp_mask_BR.shape[1]], 0.0).astype(np.float32)


def old_logp_from_trainer(source: str, scfg) -> bool:
  """Whether π_old's log-probs come from the training forward: always under "trainer", and under "sampler" where the
  sampler's are not the policy's (temperature, top-k / top-p)."""
  if source not in OLD_LOGP_SOURCES:
    raise ValueError(f"old_logp={source!r}: one of {OLD_LOGP_SOURCES}")
  return source == "trainer" or not sampler_gives_policy_logprobs(scfg)


def old_policy_logprobs(cfg: ModelConfig, params: Params, scfg, ro, tokens_BS, mask_BS, resp_mask_BR, rows: int,
                        row_sharding=None, pack: bool = False, source: str = "trainer"
                        ) -> tuple[np.ndarray, dict[str, float]]:
  """log π_old [B, R] of a rollout's responses (0 off the mask) and the seconds spent.

  "trainer": the training forward over the rollout, as verl recomputes them after every rollout (the official
  code's verl/workers/fsdp_workers.py generate_sequences -> actor.compute_log_prob), so the first optimizer step's
  ratio is exactly 1 under the update's own numerics; "sampler": the sampler's own log-probs where they are the
  policy's (`old_logp_from_trainer`), which a bf16 paged decode computes differently (`logprob_mismatch`).
  """
  if not old_logp_from_trainer(source, scfg):
    return sampler_logprobs(ro, resp_mask_BR), {}
  t = time.perf_counter()
  old_logp_BR = logprobs_in_blocks(cfg, params, tokens_BS, mask_BS, ro.prompt_len, rows, row_sharding, pack)
  return np.where(resp_mask_BR, old_logp_BR, 0.0).astype(np.float32), {"sec_old_logp": time.perf_counter() - t}


def logprob_mismatch(trainer_logp_BR: np.ndarray, sampler_logp_BR: np.ndarray, resp_mask_BR: np.ndarray
                     ) -> dict[str, float]:
  """How far the sampler's log-probs of its own tokens are from the trainer's: Δ = log π_trainer − log π_sampler,
  its mean and max |Δ| over response tokens, and the sequence-level KL(π_sampler ‖ π_trainer) by Schulman's k3,
  Σ_t (e^Δ − 1 − Δ) per response, averaged over responses.

  k3, not k1 (−Σ_t Δ): both are unbiased for that KL on the sampler's draws, but k3 is >= 0 term by term, where
  k1's sum over hundreds of tokens is noise of either sign around a small KL. Float64 on the host.
  """
  m = np.asarray(resp_mask_BR, bool)
  d_BR = np.where(m, np.asarray(trainer_logp_BR, np.float64) - np.asarray(sampler_logp_BR, np.float64), 0.0)
  n = int(m.sum())
  return {"mismatch_abs_mean": float(np.abs(d_BR).sum() / max(n, 1)),
          "mismatch_abs_max": float(np.abs(d_BR).max(initial=0.0)),
          "mismatch_seq_kl_k3": float((np.expm1(d_BR) - d_BR).sum(-1).mean()) if len(m) else 0.0,
          "mismatch_tokens": float(n)}


def policy_mismatch(cfg: ModelConfig, params: Params, scfg, ro, tokens_BS, mask_BS, resp_mask_BR, rows: int,
                    row_sharding=None, pack: bool = False, trainer_logp_BR: np.ndarray | None = None,
                    blocks: int = 1) -> dict[str, float]:
  """The rollout's sampler-vs-trainer mismatch (`logprob_mismatch`) for the step's metrics; {} where the sampler's
  log-probs are not the policy's (temperature, top-k / top-p: they differ by design, not by numerics).

  `trainer_logp_BR`: the trainer's log-probs of the whole rollout when the method has them (its old log-probs),
  at no cost; else the trainer scores the first `blocks` blocks of `rows` rows (one fixed-score call each; 0: no
  metric), its seconds as sec_mismatch.
  """
  if not sampler_gives_policy_logprobs(scfg):
    return {}
  sampler_BR = sampler_logprobs(ro, resp_mask_BR)
  if trainer_logp_BR is not None:
    return logprob_mismatch(trainer_logp_BR, sampler_BR, resp_mask_BR)
  n = min(blocks * rows, len(tokens_BS))
  if n <= 0:
    return {}
  t = time.perf_counter()
  trainer_nR = logprobs_in_blocks(cfg, params, tokens_BS[:n], mask_BS[:n], ro.prompt_len, rows, row_sharding, pack)
  return dict(logprob_mismatch(trainer_nR, sampler_BR[:n], resp_mask_BR[:n]), sec_mismatch=time.perf_counter() - t)
