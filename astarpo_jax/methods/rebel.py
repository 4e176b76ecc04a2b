"""REBEL (Gao et al. 2024): two responses per prompt; regress the difference of their log-ratios to the
sampling policy (scaled by 1/η) onto the difference of their rewards (baseline_losses.rebel_loss)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from astarpo_jax.infra import masks
from astarpo_jax.methods import Footprint, _baseline_arrays as arrays, common_batch_shapes
from astarpo_jax.sampling import rollout
from astarpo_jax.training import baseline_losses as BL, scoring, update


@dataclasses.dataclass(frozen=True)
class Config:
  METHOD: ClassVar[str] = "rebel"
  SOURCE: ClassVar[str] = "Gao et al. 2024 (REBEL), η = 1 as its code's default"
  group_size: int = 2  # a pair per prompt (0 = 2)
  rebel_eta: float = 1.0  # REBEL's step size η
  entropy_coef: float = 0.0
  logp_chunk: int = 256
  old_logp: str = "trainer"  # as the ratio methods' (_baseline_arrays.RatioSettings); no TIS: a pair regression
  mismatch_blocks: int = 1

  def __post_init__(self):
    arrays.settle_group_size(self, "rebel", 2, 2, "REBEL regresses on pairs: it needs exactly 2 responses per prompt")
    if self.group_size != 2:
      raise ValueError(f"rebel.Config.group_size: REBEL regresses on pairs: it needs exactly 2 responses per prompt, "
                       f"got {self.group_size!r}")
    arrays.check_settings(self, "rebel")


def responses_per_prompt(c: Config) -> int:
  return 2


def footprint(c: Config) -> Footprint:
  return Footprint(scored=arrays.scored_policy(c))


def batch_shapes(c: Config, rows: int, prompt_len: int, response_len: int) -> dict:
  return dict(common_batch_shapes(rows, prompt_len, response_len), old_logp=((rows, response_len), np.float32))


def prepare(ctx, c: Config, state, ro: rollout.Rollout, prompts, blocks: scoring.Blocks):
  """The pair's old-policy log-probs (REBEL needs no π_ref forward)."""
  batch, secs = arrays.policy_arrays(ctx, c, state, ro, blocks, with_reference=False)
  return batch, dict(arrays.kl_and_group_metrics(batch, 2), **secs)


def loss(cfg, c: Config, prompt_len: int, params, unembed_DV, mb, counts: update.Counts):
  logp_bR, ent_bR = scoring.batch_logprobs_and_entropy(cfg, params, mb, prompt_len, c.logp_chunk,
                                                       unembed_DV=unembed_DV)
  pairs = lambda x: x.reshape(x.shape[0] // 2, 2, *x.shape[1:])  # noqa: E731  rows 2i, 2i+1 -> pair i
  loss_, m = BL.rebel_loss(pairs(logp_bR), pairs(mb["old_logp"]), pairs(mb["resp_mask"]), pairs(mb["rewards"]),
                           eta=c.rebel_eta, num_seqs=counts.num_seqs / 2)
  entropy = masks.masked_sum(ent_bR, mb["resp_mask"]) / counts.num_tokens
  loss_ = loss_ - c.entropy_coef * entropy
  return loss_, dict(m, entropy=entropy, loss=loss_)
