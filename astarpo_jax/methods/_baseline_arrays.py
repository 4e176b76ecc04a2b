"""What the ratio-based baselines (GRPO, PPO, REBEL, RLOO) share: their settings checks and the rollout
arrays they all need (old-policy log-probs, and π_ref's when a KL term wants them)."""
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


def reference_if_kl(c) -> Footprint:
  """footprint of a method that scores π_ref only for its KL term (weight `kl_coef`)."""
  return Footprint(scored=("reference",) if c.kl_coef > 0 else ())


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


def policy_arrays(ctx, state, ro: rollout.Rollout, blocks: scoring.Blocks, with_reference: bool
                  ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
  """tokens, mask, resp_mask, rewards, old_logp (and ref_logp when `with_reference`), and phase seconds.

  Forwards run `blocks.rows` rows at a time (the micro-batch), packed or not, as A*-PO's reference forward.
  """
  tokens_BS, mask_BS, resp_mask_BR = rollout.trim_response(ro)
  old_logp_BR, secs = scoring.old_policy_logprobs(ctx.cfg, ctx.policy(state["params"]), ctx.scfg, ro, tokens_BS, mask_BS,
                                                  resp_mask_BR, blocks.rows, ctx.row_sharding, blocks.pack)
  batch = {"tokens": tokens_BS, "mask": mask_BS, "resp_mask": resp_mask_BR, "old_logp": old_logp_BR,
           "rewards": ro.rewards_B}
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
