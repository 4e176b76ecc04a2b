"""What the ratio-based baselines (GRPO, PPO, REBEL, RLOO) share: their settings checks and the rollout
arrays they all need (old-policy log-probs, from the training forward by default, π_ref's when a KL term wants
them, truncated importance weights when asked), with the sampler-vs-trainer mismatch metrics."""
from __future__ import annotations

import dataclasses
import time
from typing import ClassVar

import numpy as np

from astarpo_jax.methods import Footprint
from astarpo_jax.sampling import rollout
from astarpo_jax.training import baseline_losses as BL, scoring


@dataclasses.dataclass(frozen=True)
class RatioSettings:
  """The settings of every baseline that clips a ratio to the sampling policy (GRPO, PPO, RLOO). A method's
  Config extends it with its own fields and says, as class attributes, its METHOD name, the SOURCE of its
  defaults and its GROUP: (default, minimum, why) of its responses per prompt."""
  METHOD: ClassVar[str] = ""
  SOURCE: ClassVar[str] = ""
  GROUP: ClassVar[tuple[int, int, str]] = (1, 1, "must be a positive int")
  group_size: int = 0  # responses per prompt; 0 = GROUP's default
  clip_eps: float = 0.2
  kl_coef: float = 1e-3  # 0 = no reference forward
  entropy_coef: float = 0.0
  logp_chunk: int = 256
  old_logp: str = "trainer"  # π_old's log-probs: "trainer" (verl's recompute) or "sampler" (scoring.OLD_LOGP_SOURCES)
  tis_cap: float = 0.0  # > 0: the surrogate weighted by min(π_old / π_sampler, tis_cap) (TIS); 0 = off
  mismatch_blocks: int = 1  # under old_logp="sampler": fixed-score calls the trainer spends on the mismatch metric

  def __post_init__(self):
    settle_group_size(self, self.METHOD, *self.GROUP)
    check_settings(self, self.METHOD)


def settle_group_size(c, name: str, default: int, minimum: int, why: str) -> None:
  """Sets `c.group_size` to `default` when it is 0 (on a frozen Config), then refuses one below `minimum`."""
  if c.group_size == 0:
    object.__setattr__(c, "group_size", default)
  if not isinstance(c.group_size, int) or c.group_size < minimum:
    raise ValueError(f"{name}.Config.group_size: {why}, got {c.group_size!r}")


def group_size(c) -> int:
  """responses_per_prompt of a method whose Config holds its group size."""
  return c.group_size


def scored_policy(c) -> tuple[str, ...]:
  """("policy",) when the policy scores the whole rollout itself (its old log-probs from the training forward)."""
  return ("policy",) if c.old_logp == "trainer" else ()


def reference_if_kl(c) -> Footprint:
  """footprint of a method that scores π_ref only for its KL term (weight `kl_coef`), and π_old by `old_logp`."""
  return Footprint(scored=(("reference",) if c.kl_coef > 0 else ()) + scored_policy(c))


def check_settings(c, name: str) -> None:
  """The common fields' ranges, with the method and field named."""
  def bad(field, why):
    raise ValueError(f"{name}.Config.{field}: {why}, got {getattr(c, field)!r}")
  for f in ("clip_eps", "value_clip", "rebel_eta", "gae_gamma", "gae_lambda"):
    if hasattr(c, f) and not getattr(c, f) > 0:
      bad(f, "must be > 0")
  for f in ("kl_coef", "entropy_coef"):
    if hasattr(c, f) and not getattr(c, f) >= 0:
      bad(f, "must be >= 0")
  if hasattr(c, "loss_agg") and c.loss_agg not in BL.LOSS_AGG_MODES:
    bad("loss_agg", f"not one of {BL.LOSS_AGG_MODES}")
  if not isinstance(c.logp_chunk, int) or c.logp_chunk < 1:
    bad("logp_chunk", "must be a positive int")
  if c.old_logp not in scoring.OLD_LOGP_SOURCES:
    bad("old_logp", f"not one of {scoring.OLD_LOGP_SOURCES} (the training forward, verl's way; or the sampler's own)")
  if not isinstance(c.mismatch_blocks, int) or c.mismatch_blocks < 0:
    bad("mismatch_blocks", "must be an int >= 0 (0 = no mismatch metric where the trainer does not score π_old)")
  if hasattr(c, "tis_cap"):
    if not c.tis_cap >= 0:
      bad("tis_cap", "must be >= 0 (0 = no truncated importance sampling; Yao et al. use 2)")
    if c.tis_cap > 0 and c.old_logp != "trainer":
      bad("tis_cap", "weighs by π_old / π_sampler, which is 1 when π_old is the sampler's: set old_logp='trainer'")


def policy_arrays(ctx, c, state, ro: rollout.Rollout, blocks: scoring.Blocks, with_reference: bool,
                  tis_per: str = "token") -> tuple[dict[str, np.ndarray], dict[str, float]]:
  """tokens, mask, resp_mask, rewards, old_logp (and ref_logp when `with_reference`, tis_w when `c.tis_cap` > 0:
  per token or, `tis_per="sequence"`, per response), and the metrics: phase seconds, the sampler-vs-trainer mismatch.

  Forwards run `blocks.rows` rows at a time (the micro-batch), packed or not, as A*-PO's reference forward. The
  trainer's forward is the policy the update differentiates (with LoRA the adapter attached to the base, not the
  sampler's merged copy), so under old_logp="trainer" the first optimizer step's ratio is exactly 1.
  """
  tokens_BS, mask_BS, resp_mask_BR = rollout.trim_response(ro)
  policy = ctx.policy(state["params"])
  old_logp_BR, secs = scoring.old_policy_logprobs(ctx.cfg, policy, ctx.scfg, ro, tokens_BS, mask_BS, resp_mask_BR,
                                                  blocks.rows, ctx.row_sharding, blocks.pack, source=c.old_logp)
  trainer = scoring.old_logp_from_trainer(c.old_logp, ctx.scfg)
  secs.update(scoring.policy_mismatch(ctx.cfg, policy, ctx.scfg, ro, tokens_BS, mask_BS, resp_mask_BR, blocks.rows,
                                      ctx.row_sharding, blocks.pack, old_logp_BR if trainer else None,
                                      c.mismatch_blocks))
  batch = {"tokens": tokens_BS, "mask": mask_BS, "resp_mask": resp_mask_BR, "old_logp": old_logp_BR,
           "rewards": ro.rewards_B}
  if getattr(c, "tis_cap", 0.0) > 0:
    if not scoring.sampler_gives_policy_logprobs(ctx.scfg):
      raise ValueError("algo.tis_cap > 0 weighs by π_old / π_sampler of the policy's own samples: sample at "
                       "temperature 1 without top-k / top-p, or set algo.tis_cap=0")
    batch["tis_w"] = np.asarray(BL.tis_weights(old_logp_BR, scoring.sampler_logprobs(ro, resp_mask_BR), resp_mask_BR,
                                               c.tis_cap, tis_per), np.float32)
  t = time.perf_counter()
  if with_reference:
    batch["ref_logp"] = scoring.logprobs_in_blocks(ctx.cfg, ctx.ref_params, tokens_BS, mask_BS, ro.prompt_len,
                                                   blocks.rows, ctx.row_sharding, blocks.pack)
  secs["sec_ref"] = time.perf_counter() - t
  return batch, secs


def kl_and_group_metrics(batch: dict[str, np.ndarray], group_size: int) -> dict[str, float]:
  """Per-rollout numbers that need no model: KL of the sampling policy to π_ref, groups without signal."""
  m: dict[str, float] = {}
  mask = batch["resp_mask"]
  if "ref_logp" in batch:  # k1 estimate, token mean, as A*-PO's `kl`
    m["kl_old_ref"] = float(np.where(mask, batch["old_logp"] - batch["ref_logp"], 0.0).sum() / max(mask.sum(), 1))
  if group_size > 1:
    r_PG = batch["rewards"].reshape(-1, group_size)
    m["no_signal_frac"] = float((r_PG.max(-1) == r_PG.min(-1)).mean())  # groups whose rewards are all equal
  return m
