"""GRPO (Shao et al. 2024, DeepSeekMath) as verl implements it: G responses per prompt, group-normalised
advantages, the clipped ratio to the sampling policy, a k3 KL loss to π_ref (baseline_losses.grpo_loss)."""
from __future__ import annotations

import dataclasses

import numpy as np

from astarpo_jax.methods import _baseline_arrays as arrays, common_batch_shapes
from astarpo_jax.sampling import rollout
from astarpo_jax.training import baseline_losses as BL, scoring, update


@dataclasses.dataclass(frozen=True)
class Config(arrays.RatioSettings):
  """group_size (G, default 8), clip_eps, kl_coef (the k3 KL loss's weight), entropy_coef, logp_chunk, old_logp,
  tis_cap (per token), mismatch_blocks, and:"""
  METHOD, GROUP = "grpo", (8, 2, "GRPO needs >= 2 responses per prompt for its group statistics")
  SOURCE = "Shao et al. 2024 (DeepSeekMath); the official repo's verl copy (ppo_trainer.yaml): kl 0.001 low_var_kl"
  loss_agg: str = "token_mean"  # see baseline_losses.aggregate


responses_per_prompt = arrays.group_size
footprint = arrays.reference_if_kl


def batch_shapes(c: Config, rows: int, prompt_len: int, response_len: int) -> dict:
  out = dict(common_batch_shapes(rows, prompt_len, response_len), old_logp=((rows, response_len), np.float32),
             adv=((rows,), np.float32))
  if c.kl_coef > 0:
    out["ref_logp"] = ((rows, response_len), np.float32)
  if c.tis_cap > 0:
    out["tis_w"] = ((rows, response_len), np.float32)
  return out


def prepare(ctx, c: Config, state, ro: rollout.Rollout, prompts, blocks: scoring.Blocks):
  """Old-policy log-probs, π_ref's (for the KL loss) and each response's group-normalised advantage."""
  batch, secs = arrays.policy_arrays(ctx, c, state, ro, blocks, with_reference=c.kl_coef > 0)
  batch["adv"] = np.asarray(BL.grpo_advantages(ro.rewards_B.reshape(-1, c.group_size))).reshape(-1)
  return batch, dict(arrays.kl_and_group_metrics(batch, c.group_size), **secs)


def loss(cfg, c: Config, prompt_len: int, params, unembed_DV, mb, counts: update.Counts):
  logp_bR, ent_bR = scoring.batch_logprobs_and_entropy(cfg, params, mb, prompt_len, c.logp_chunk,
                                                       unembed_DV=unembed_DV)
  return BL.grpo_loss(logp_bR, mb["old_logp"], mb.get("ref_logp"), mb["resp_mask"], mb["adv"], ent_bR,
                      clip_eps=c.clip_eps, kl_coef=c.kl_coef, entropy_coef=c.entropy_coef, loss_agg=c.loss_agg,
                      num_seqs=counts.num_seqs, num_tokens=counts.num_tokens, tis_BT=mb.get("tis_w"))
