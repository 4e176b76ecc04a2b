"""RLOO, REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv 2402.14740, "Back to Basics"): k responses per
prompt, the whole response one action, each response's baseline the mean reward of the other k − 1.

  shaped reward   r̃_i = r_i − kl_coef·Σ_t (log π_old(y_it) − log π_ref(y_it))   (the KL as part of the reward)
  advantage       A_i = r̃_i − 1/(k−1)·Σ_{j≠i} r̃_j
  loss            mean_i max(−ρ_i·A_i, −clip(ρ_i, 1−ε, 1+ε)·A_i),  ρ_i = exp(Σ_t log π(y_it) − log π_old(y_it))

With one optimizer step per rollout ρ = 1 and the gradient is REINFORCE's −A_i·∇ log π(y_i); a rollout's
later mini-batches are slightly off-policy, so the sequence-level ratio is clipped as TRL's RLOOTrainer
does. Defaults: k = 4 (the paper compares k = 2 and 4), kl_coef 0.05 and clip 0.2 (TRL's RLOOConfig).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from astarpo_jax.infra import masks
from astarpo_jax.methods import _baseline_arrays as arrays, common_batch_shapes
from astarpo_jax.sampling import rollout
from astarpo_jax.training import scoring, update


@dataclasses.dataclass(frozen=True)
class Config(arrays.RatioSettings):
  """group_size (k, default 4), clip_eps (the sequence-level ratio clip), entropy_coef, logp_chunk, old_logp,
  tis_cap (per response: the loss is a sequence's), mismatch_blocks, and kl_coef: the weight of the sequence KL to
  π_ref in the reward (0 = no reference forward)."""
  METHOD, GROUP = "rloo", (4, 2, "the leave-one-out baseline needs >= 2 responses per prompt")
  SOURCE = "Ahmadian et al. 2024 (arXiv 2402.14740): k in {2, 4}; TRL RLOOConfig: kl_coef 0.05, cliprange 0.2"
  kl_coef: float = 0.05


responses_per_prompt = arrays.group_size
footprint = arrays.reference_if_kl


def batch_shapes(c: Config, rows: int, prompt_len: int, response_len: int) -> dict:
  out = dict(common_batch_shapes(rows, prompt_len, response_len), old_logp=((rows, response_len), np.float32),
             adv=((rows,), np.float32))
  if c.tis_cap > 0:
    out["tis_w"] = ((rows,), np.float32)
  return out


def leave_one_out_advantages(rewards_PK: np.ndarray) -> np.ndarray:
  """A_i = r_i − mean of the other k − 1 rewards of the same prompt, [P, K]."""
  k = rewards_PK.shape[1]
  return rewards_PK - (rewards_PK.sum(-1, keepdims=True) - rewards_PK) / (k - 1)


def prepare(ctx, c: Config, state, ro: rollout.Rollout, prompts, blocks: scoring.Blocks):
  """Old-policy log-probs, the KL-shaped rewards and their leave-one-out advantages."""
  batch, secs = arrays.policy_arrays(ctx, c, state, ro, blocks, with_reference=c.kl_coef > 0, tis_per="sequence")
  metrics = arrays.kl_and_group_metrics(batch, c.group_size)
  shaped_B = ro.rewards_B.astype(np.float64)
  if "ref_logp" in batch:  # the k1 estimate of the response's KL, summed over its tokens
    kl_B = np.where(batch["resp_mask"], batch["old_logp"] - batch.pop("ref_logp"), 0.0).sum(-1)
    shaped_B = shaped_B - c.kl_coef * kl_B
    metrics["seq_kl"] = float(kl_B.mean())
  batch["adv"] = leave_one_out_advantages(shaped_B.reshape(-1, c.group_size)).reshape(-1).astype(np.float32)
  return batch, dict(metrics, **secs)


def loss(cfg, c: Config, prompt_len: int, params, unembed_DV, mb, counts: update.Counts):
  """The clipped sequence-level REINFORCE loss of one micro-batch, normalised by the mini-batch's counts."""
  logp_bR, ent_bR = scoring.batch_logprobs_and_entropy(cfg, params, mb, prompt_len, c.logp_chunk,
                                                       unembed_DV=unembed_DV)
  mask = mb["resp_mask"]
  log_ratio_b = (masks.zero_masked(logp_bR, mask) - jax.lax.stop_gradient(masks.zero_masked(mb["old_logp"], mask))
                 ).sum(-1)
  ratio_b = jnp.exp(log_ratio_b)
  adv_b = jax.lax.stop_gradient(mb["adv"].astype(jnp.float32))
  pg_b = jnp.maximum(-ratio_b * adv_b, -jnp.clip(ratio_b, 1.0 - c.clip_eps, 1.0 + c.clip_eps) * adv_b)
  if "tis_w" in mb:  # the response's truncated importance weight min(Π_t π_old / π_sampler, tis_cap)
    pg_b = pg_b * jax.lax.stop_gradient(mb["tis_w"].astype(jnp.float32))
  entropy = masks.masked_sum(ent_bR, mask) / counts.num_tokens
  pg = pg_b.sum() / counts.num_seqs
  loss_ = pg - c.entropy_coef * entropy
  clipped = (jnp.abs(ratio_b - 1.0) > c.clip_eps).astype(jnp.float32)
  return loss_, {"loss": loss_, "pg_loss": pg, "entropy": entropy, "clipfrac": clipped.sum() / counts.num_seqs,
                 "approx_kl_old": -log_ratio_b.sum() / counts.num_tokens}
