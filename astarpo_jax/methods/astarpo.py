"""A*-PO, Algorithm 1 of arXiv 2505.20686 ("optimal advantage regression"), as a plug-in of the loop.

  1. Stage 1, once, offline (stage1.py): N responses of π_ref per training prompt, graded, give the
     table V̂*(x) = β1·log mean_i exp(r_i/β1).
  2. Each rollout step (loop.py): ONE response y ~ π per prompt and its reward r (group_size k > 1: k of them,
     each its own regression term against the same V̂*(x); the comparison's study of the sample count).
  3. `prepare`: log π_ref(y_t) of every response token (scoring.logprobs) and V̂*(x) from the table (and, for the
     step's sampler-vs-trainer mismatch metric only, the trainer's log-probs of the first `mismatch_blocks` blocks).
  4. `loss`: (β2·Σ_t log π(y_t)/π_ref(y_t) − (r − V̂*(x)))², minus entropy_coef × entropy
     (losses.astarpo_loss). No critic, no clipping, no second sample.
"""
from __future__ import annotations

import dataclasses
import time
from typing import ClassVar

import numpy as np

from astarpo_jax.methods import Footprint, common_batch_shapes
from astarpo_jax.sampling import rollout
from astarpo_jax.training import losses, scoring, update


@dataclasses.dataclass(frozen=True)
class Config:
  """A*-PO's Stage-2 hyper-parameters (the paper's values as defaults)."""
  METHOD: ClassVar[str] = "astarpo"
  SOURCE: ClassVar[str] = "arXiv 2505.20686; official code github.com/ZhaolinGao/A-PO (scripts/apo_math.sh)"
  NEEDS_VALUE_TABLE: ClassVar[bool] = True
  beta2: float = 1e-3
  entropy_coef: float = 1e-3
  logp_chunk: int = 256  # response positions per block of [b, chunk, V] logits in the update
  entropy_agg: str = "seq_mean_token_mean"  # official; or "token_mean" (losses.astarpo_loss)
  group_size: int = 0  # on-policy responses per prompt; 0 = the paper's 1
  # The sampler-vs-trainer mismatch metric (scoring.policy_mismatch): A*-PO needs no old log-probs, so the trainer
  # scores only the rollout's first this-many fixed-score blocks for it (one call: 1/16 of a pi_ref pass for 1.5B,
  # 1/32 for 7B at 256 prompts); 0 = no metric. The official trainer recomputes every row (verl generate_sequences).
  mismatch_blocks: int = 1

  def __post_init__(self):
    if not self.beta2 > 0:
      raise ValueError(f"astarpo.Config.beta2: must be > 0 (the paper uses 1e-3), got {self.beta2}")
    if not self.entropy_coef >= 0:
      raise ValueError(f"astarpo.Config.entropy_coef: must be >= 0, got {self.entropy_coef}")
    if not isinstance(self.logp_chunk, int) or self.logp_chunk < 1:
      raise ValueError(f"astarpo.Config.logp_chunk: must be a positive int, got {self.logp_chunk!r}")
    if self.entropy_agg not in losses.ENTROPY_AGGS:
      raise ValueError(f"astarpo.Config.entropy_agg: must be one of {losses.ENTROPY_AGGS}, got {self.entropy_agg!r}")
    if not isinstance(self.group_size, int) or self.group_size < 0:
      raise ValueError(f"astarpo.Config.group_size: responses per prompt, >= 1 (0 = the paper's 1), got "
                       f"{self.group_size!r}")
    if not isinstance(self.mismatch_blocks, int) or self.mismatch_blocks < 0:
      raise ValueError(f"astarpo.Config.mismatch_blocks: fixed-score calls the trainer spends on the mismatch metric, "
                       f"an int >= 0 (0 = no metric), got {self.mismatch_blocks!r}")


def responses_per_prompt(c: Config) -> int:
  return c.group_size or 1


def footprint(c: Config) -> Footprint:
  return Footprint(scored=("reference",))


def batch_shapes(c: Config, rows: int, prompt_len: int, response_len: int) -> dict:
  return dict(common_batch_shapes(rows, prompt_len, response_len), ref_logp=((rows, response_len), np.float32),
              vstar=((rows,), np.float32))


def prepare(ctx, c: Config, state, ro: rollout.Rollout, prompts, blocks: scoring.Blocks):
  """The arrays of the regression: π_ref's log-probs of the responses and V̂* of their prompts."""
  tokens_BS, mask_BS, resp_mask_BR = rollout.trim_response(ro)
  t = time.perf_counter()
  ref_logp_BR = scoring.logprobs_in_blocks(ctx.cfg, ctx.ref_params, tokens_BS, mask_BS, ro.prompt_len,
                                           blocks.rows, ctx.row_sharding, blocks.pack)
  sec_ref = time.perf_counter() - t
  vstar_B = np.repeat(ctx.value_table.lookup(prompts), responses_per_prompt(c))  # rows are prompt-major groups
  batch = {"tokens": tokens_BS, "mask": mask_BS, "resp_mask": resp_mask_BR, "ref_logp": ref_logp_BR,
           "rewards": ro.rewards_B, "vstar": vstar_B}
  # The official trainer's KL metric (critic/kl): per response, the token mean of log π_old − log π_ref.
  R = resp_mask_BR.shape[1]
  len_B = np.maximum(resp_mask_BR.sum(-1), 1)
  kl_B = np.where(resp_mask_BR, ro.sample_logp_BR[:, :R] - ref_logp_BR, 0.0).sum(-1) / len_B
  mismatch = scoring.policy_mismatch(ctx.cfg, ctx.policy(state["params"]), ctx.scfg, ro, tokens_BS, mask_BS,
                                     resp_mask_BR, blocks.rows, ctx.row_sharding, blocks.pack, blocks=c.mismatch_blocks)
  return batch, {"vstar_mean": float(vstar_B.mean()), "kl_rollout_seq_mean": float(kl_B.mean()), "sec_ref": sec_ref,
                 **mismatch}


def loss(cfg, c: Config, prompt_len: int, params, unembed_DV, mb, counts: update.Counts):
  """The A*-PO regression on one micro-batch, normalised by the mini-batch's counts."""
  logp_bR, ent_bR = scoring.batch_logprobs_and_entropy(cfg, params, mb, prompt_len, c.logp_chunk,
                                                       unembed_DV=unembed_DV)
  return losses.astarpo_loss(logp_bR, mb["ref_logp"], mb["resp_mask"], mb["rewards"], mb["vstar"], ent_bR,
                             beta2=c.beta2, entropy_coef=c.entropy_coef, num_seqs=counts.num_seqs,
                             num_tokens=counts.num_tokens, entropy_agg=c.entropy_agg)
