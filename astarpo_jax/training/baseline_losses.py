"""Losses of the baselines A*-PO is compared against: GRPO, PPO and REBEL; pure JAX, fp32 math.

Defaults follow the commonly published settings (DeepSeekMath GRPO as implemented in verl, the
verl / TRL PPO for LLMs, the REBEL paper), stated on each function. Conventions as in losses.py:
`mask_BT` marks response tokens (EOS included); padding and post-EOS entries never reach a value
or a gradient; `num_seqs` / `num_tokens` are the mini-batch's counts for exact micro-batching.
"""
from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from astarpo_jax.infra.masks import check_shapes, f32, masked_sum, zero_masked

LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")

Metrics = Mapping[str, jax.Array]


def _counts(mask_BT, num_seqs, num_tokens):
  n_seq = jnp.asarray(mask_BT.shape[0] if num_seqs is None else num_seqs, f32)
  n_tok = jnp.asarray(mask_BT.astype(f32).sum() if num_tokens is None else num_tokens, f32)
  return jnp.maximum(n_seq, 1.0), jnp.maximum(n_tok, 1.0)


def _check_positive(where: str, **values) -> None:
  for name, v in values.items():
    if isinstance(v, (int, float)) and not v > 0:
      raise ValueError(f"{where}: `{name}` must be > 0, got {v}")


def _uses(where: str, coef_name: str, coef, array_name: str, array) -> bool:
  """Whether the term weighted by `coef` is on; refuses it on without its input array."""
  on = not (isinstance(coef, (int, float)) and coef == 0)
  if on and array is None:
    raise ValueError(f"{where}: {coef_name} != 0 needs `{array_name}`")
  return on


def tis_weights(old_logp_BT, sampler_logp_BT, mask_BT, cap: float, per: str = "token") -> jax.Array:
  """Truncated importance-sampling weights min(π_old / π_sampler, C) of the sampler's tokens (Yao et al. 2025,
  "Your efficient RL framework secretly brings you off-policy RL training"; verl's actor.tis_imp_ratio_cap),
  π_old the trainer's forward: per token [B, T] (0 off the mask), or `per="sequence"` one per response [B] from its
  summed log-ratio (a sequence-level loss: RLOO)."""
  if not cap > 0:
    raise ValueError(f"tis_weights: cap must be > 0 (algo.tis_cap; 0 turns the correction off), got {cap}")
  if per not in ("token", "sequence"):
    raise ValueError(f"tis_weights: per={per!r}: 'token' or 'sequence'")
  log_w_BT = zero_masked(jnp.asarray(old_logp_BT, f32) - jnp.asarray(sampler_logp_BT, f32), mask_BT)
  if per == "sequence":
    return jnp.minimum(jnp.exp(log_w_BT.sum(-1)), cap)
  return zero_masked(jnp.minimum(jnp.exp(log_w_BT), cap), mask_BT)


def clipped_surrogate(logp_BT: jax.Array, old_logp_BT: jax.Array, adv: jax.Array, mask_BT: jax.Array,
                      clip_eps: float, n_tok, tis_BT: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """PPO's per-token clipped surrogate max(−ρ·A, −clip(ρ, 1−ε, 1+ε)·A), ρ = exp(logp − old_logp), with its
  token-mean metrics; `logp_BT` already zeroed off the mask, `adv` [B, T] or [B, 1] and gradient-free.
  `tis_BT` (`tis_weights`): each token's term multiplied by its weight, as verl's TIS does."""
  old = jax.lax.stop_gradient(zero_masked(old_logp_BT, mask_BT))
  ratio = jnp.exp(logp_BT - old)
  clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
  pg_BT = jnp.maximum(-ratio * adv, -clipped * adv)
  if tis_BT is not None:
    pg_BT = pg_BT * jax.lax.stop_gradient(tis_BT.astype(f32))
  return pg_BT, {"pg_loss": masked_sum(pg_BT, mask_BT) / n_tok,
                 "clipfrac": masked_sum((-clipped * adv > -ratio * adv).astype(f32), mask_BT) / n_tok,
                 "approx_kl_old": masked_sum(old - logp_BT, mask_BT) / n_tok}


def aggregate(loss_BT: jax.Array, mask_BT: jax.Array, mode: str, *, num_seqs=None, num_tokens=None) -> jax.Array:
  """Reduce per-token losses to a scalar.

  token_mean           Σ_bt m·ℓ / num_tokens           (DAPO; every token weighs the same)
  seq_mean_token_mean  Σ_b (Σ_t m·ℓ / |y_b|) / num_seqs (original GRPO; every sequence weighs the same)
  seq_mean_token_sum   Σ_b Σ_t m·ℓ / num_seqs           (no length normalisation, as in Dr. GRPO)
  """
  if mode not in LOSS_AGG_MODES:
    raise ValueError(f"aggregate: unknown loss_agg {mode!r}; choose one of {LOSS_AGG_MODES}")
  n_seq, n_tok = _counts(mask_BT, num_seqs, num_tokens)
  sum_B = zero_masked(loss_BT, mask_BT).sum(-1)
  if mode == "token_mean":
    return sum_B.sum() / n_tok
  if mode == "seq_mean_token_mean":
    len_B = jnp.maximum(mask_BT.astype(f32).sum(-1), 1.0)
    return (sum_B / len_B).sum() / n_seq
  return sum_B.sum() / n_seq


# ---------------------------------------------------------------------------------------------
# GRPO (Shao et al. 2024, DeepSeekMath).

def grpo_advantages(rewards_PG: jax.Array, *, eps: float = 1e-6) -> jax.Array:
  """(r − mean_G r) / (std_G r + eps) within each prompt's group of G responses.

  std is the unbiased (ddof=1) one, as torch.std in verl; a group whose rewards are all equal gets 0.
  """
  check_shapes("grpo_advantages", rewards_PG=(rewards_PG, ("P", "G")))
  if rewards_PG.shape[1] < 2:
    raise ValueError(f"grpo_advantages: need G >= 2 responses per prompt for a group std, got G={rewards_PG.shape[1]}")
  r = rewards_PG.astype(f32)
  return (r - r.mean(-1, keepdims=True)) / (r.std(-1, ddof=1, keepdims=True) + eps)


def k3_kl(logp_BT: jax.Array, ref_logp_BT: jax.Array) -> jax.Array:
  """Schulman's k3 estimator of KL(π‖π_ref) per token: exp(ref − logp) − (ref − logp) − 1 ≥ 0.

  Clamped at 10 like verl's `low_var_kl`, so one very unlikely token cannot dominate the loss.
  """
  d = ref_logp_BT - logp_BT
  return jnp.minimum(jnp.exp(d) - d - 1.0, 10.0)


def grpo_loss(logp_BT: jax.Array, old_logp_BT: jax.Array, ref_logp_BT: jax.Array | None, mask_BT: jax.Array,
              adv_B: jax.Array, entropy_BT: jax.Array | None = None, *, clip_eps: float = 0.2,
              kl_coef: float = 0.0, entropy_coef: float = 0.0, loss_agg: str = "token_mean",
              num_seqs=None, num_tokens=None, tis_BT: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
  """GRPO: per token ℓ = −min(ρ·A, clip(ρ, 1−ε, 1+ε)·A) + kl_coef·k3(π‖π_ref) − entropy_coef·H,
  ρ = exp(logp − old_logp), A the sequence's group-normalised advantage; reduced by `loss_agg`.

  Published settings: ε = 0.2; kl_coef 0.04 (DeepSeekMath) or 0.001 (verl); "seq_mean_token_mean"
  is the original GRPO reduction, "token_mean" verl's default. `ref_logp_BT` may be None when
  kl_coef = 0. Metrics are token means over num_tokens, so they sum over micro-batches. `tis_BT`: the
  surrogate's truncated importance weights (`tis_weights`; the KL and entropy terms are not weighted, as verl).
  """
  check_shapes("grpo_loss", logp_BT=(logp_BT, ("B", "T")), old_logp_BT=(old_logp_BT, ("B", "T")),
               ref_logp_BT=(ref_logp_BT, ("B", "T")), mask_BT=(mask_BT, ("B", "T")), adv_B=(adv_B, ("B",)),
               entropy_BT=(entropy_BT, ("B", "T")), tis_BT=(tis_BT, ("B", "T")))
  _check_positive("grpo_loss", clip_eps=clip_eps)
  if loss_agg not in LOSS_AGG_MODES:
    raise ValueError(f"grpo_loss: unknown loss_agg {loss_agg!r}; choose one of {LOSS_AGG_MODES}")
  use_kl = _uses("grpo_loss", "kl_coef", kl_coef, "ref_logp_BT", ref_logp_BT)
  use_ent = _uses("grpo_loss", "entropy_coef", entropy_coef, "entropy_BT", entropy_BT)
  _, n_tok = _counts(mask_BT, num_seqs, num_tokens)

  logp = zero_masked(logp_BT, mask_BT)
  adv_B1 = jax.lax.stop_gradient(adv_B.astype(f32))[:, None]
  pg_BT, metrics = clipped_surrogate(logp, old_logp_BT, adv_B1, mask_BT, clip_eps, n_tok, tis_BT)
  loss_BT = pg_BT
  if use_kl or ref_logp_BT is not None:
    kl_BT = k3_kl(logp, jax.lax.stop_gradient(zero_masked(ref_logp_BT, mask_BT)))
    metrics["kl"] = masked_sum(kl_BT, mask_BT) / n_tok
    if use_kl:
      loss_BT = loss_BT + kl_coef * kl_BT
  if entropy_BT is not None:
    ent_BT = zero_masked(entropy_BT, mask_BT)
    metrics["entropy"] = masked_sum(ent_BT, mask_BT) / n_tok
    if use_ent:
      loss_BT = loss_BT - entropy_coef * ent_BT
  loss = aggregate(loss_BT, mask_BT, loss_agg, num_seqs=num_seqs, num_tokens=num_tokens)
  metrics["loss"] = loss
  return loss, metrics


# ---------------------------------------------------------------------------------------------
# PPO (Schulman et al. 2017) for LLMs: token-level MDP, outcome reward on the last token.

def last_token_mask(mask_BT: jax.Array) -> jax.Array:
  """True at the last masked-in token of each row (the EOS, or the cut-off token); rows contiguous."""
  m = mask_BT.astype(bool)
  next_m = jnp.pad(m[:, 1:], ((0, 0), (0, 1)))
  return m & ~next_m


def outcome_token_rewards(rewards_B: jax.Array, mask_BT: jax.Array, kl_BT: jax.Array | None = None,
                          kl_coef: float = 0.0) -> jax.Array:
  """Per-token rewards: the scalar reward at the last response token, minus kl_coef·kl_BT on every
  token when given (the RLHF-style KL-in-reward, kl_BT = old_logp − ref_logp; verl uses 0.001)."""
  check_shapes("outcome_token_rewards", rewards_B=(rewards_B, ("B",)), mask_BT=(mask_BT, ("B", "T")),
               kl_BT=(kl_BT, ("B", "T")))
  r_BT = jnp.where(last_token_mask(mask_BT), rewards_B.astype(f32)[:, None], 0.0)
  if kl_BT is not None:
    r_BT = r_BT - kl_coef * zero_masked(kl_BT, mask_BT)
  return r_BT


def masked_whiten(x_BT: jax.Array, mask_BT: jax.Array, eps: float = 1e-8) -> jax.Array:
  """(x − mean) / sqrt(var + eps) over masked-in entries (unbiased var, as verl); 0 elsewhere."""
  m = mask_BT.astype(f32)
  n = jnp.maximum(m.sum(), 1.0)
  x = zero_masked(x_BT, mask_BT)
  mean = x.sum() / n
  var = (zero_masked((x - mean) ** 2, mask_BT)).sum() / jnp.maximum(n - 1.0, 1.0)
  return zero_masked((x - mean) * jax.lax.rsqrt(var + eps), mask_BT)


def gae_advantages(token_rewards_BT: jax.Array, values_BT: jax.Array, mask_BT: jax.Array, *,
                   gamma: float = 1.0, lam: float = 1.0, whiten: bool = True) -> tuple[jax.Array, jax.Array]:
  """Generalised advantage estimation: δ_t = r_t + γ·V_{t+1} − V_t, A_t = δ_t + γλ·A_{t+1}.

  The episode ends at the last masked-in token (V and A after it are 0). Returns (advantages,
  returns = A + V), both 0 off the mask; advantages whitened over the batch when `whiten` (verl
  always whitens; do it over the whole batch before micro-batching). γ = λ = 1 is verl's default.
  """
  check_shapes("gae_advantages", token_rewards_BT=(token_rewards_BT, ("B", "T")),
               values_BT=(values_BT, ("B", "T")), mask_BT=(mask_BT, ("B", "T")))
  m_TB = mask_BT.astype(bool).T
  r_TB = zero_masked(token_rewards_BT, mask_BT).T
  v_TB = jax.lax.stop_gradient(zero_masked(values_BT, mask_BT)).T

  def step(carry, xs):
    next_v_B, next_adv_B = carry
    r_B, v_B, m_B = xs
    adv_B = r_B + gamma * next_v_B - v_B + gamma * lam * next_adv_B
    adv_B = jnp.where(m_B, adv_B, 0.0)
    return (v_B, adv_B), adv_B  # v_B is already 0 off the mask: the episode restarts cleanly

  zeros_B = jnp.zeros(m_TB.shape[1], f32)
  _, adv_TB = jax.lax.scan(step, (zeros_B, zeros_B), (r_TB, v_TB, m_TB), reverse=True)
  adv_BT = adv_TB.T
  returns_BT = adv_BT + v_TB.T
  if whiten:
    adv_BT = masked_whiten(adv_BT, mask_BT)
  return adv_BT, returns_BT


def ppo_policy_loss(logp_BT: jax.Array, old_logp_BT: jax.Array, mask_BT: jax.Array, adv_BT: jax.Array,
                    entropy_BT: jax.Array | None = None, *, clip_eps: float = 0.2, entropy_coef: float = 0.0,
                    num_tokens=None, tis_BT: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
  """PPO clipped surrogate, token mean: Σ m·max(−ρ·A, −clip(ρ, 1−ε, 1+ε)·A)/num_tokens − c_H·H̄.

  ε = 0.2 (PPO paper, verl). Advantages come from `gae_advantages`. `tis_BT`: as grpo_loss.
  """
  check_shapes("ppo_policy_loss", logp_BT=(logp_BT, ("B", "T")), old_logp_BT=(old_logp_BT, ("B", "T")),
               mask_BT=(mask_BT, ("B", "T")), adv_BT=(adv_BT, ("B", "T")), entropy_BT=(entropy_BT, ("B", "T")),
               tis_BT=(tis_BT, ("B", "T")))
  _check_positive("ppo_policy_loss", clip_eps=clip_eps)
  _uses("ppo_policy_loss", "entropy_coef", entropy_coef, "entropy_BT", entropy_BT)
  _, n_tok = _counts(mask_BT, None, num_tokens)
  logp = zero_masked(logp_BT, mask_BT)
  adv = jax.lax.stop_gradient(zero_masked(adv_BT, mask_BT))
  pg_BT, metrics = clipped_surrogate(logp, old_logp_BT, adv, mask_BT, clip_eps, n_tok, tis_BT)
  loss = metrics["pg_loss"]
  if entropy_BT is not None:
    entropy = masked_sum(entropy_BT, mask_BT) / n_tok
    metrics["entropy"] = entropy
    loss = loss - entropy_coef * entropy
  metrics["loss"] = loss
  return loss, metrics


def ppo_value_loss(values_BT: jax.Array, old_values_BT: jax.Array, returns_BT: jax.Array, mask_BT: jax.Array, *,
                   value_clip: float = 0.5, num_tokens=None) -> tuple[jax.Array, Metrics]:
  """Clipped value loss ½·Σ m·max((V − R)², (V_old + clip(V − V_old, ±c) − R)²)/num_tokens.

  c = `value_clip` = 0.5 is verl's `cliprange_value` default (TRL uses 0.2).
  """
  check_shapes("ppo_value_loss", values_BT=(values_BT, ("B", "T")), old_values_BT=(old_values_BT, ("B", "T")),
               returns_BT=(returns_BT, ("B", "T")), mask_BT=(mask_BT, ("B", "T")))
  _check_positive("ppo_value_loss", value_clip=value_clip)
  _, n_tok = _counts(mask_BT, None, num_tokens)
  v = zero_masked(values_BT, mask_BT)
  v_old = jax.lax.stop_gradient(zero_masked(old_values_BT, mask_BT))
  ret = jax.lax.stop_gradient(zero_masked(returns_BT, mask_BT))
  v_clipped = v_old + jnp.clip(v - v_old, -value_clip, value_clip)
  sq, sq_clipped = (v - ret) ** 2, (v_clipped - ret) ** 2
  loss = 0.5 * masked_sum(jnp.maximum(sq, sq_clipped), mask_BT) / n_tok
  return loss, {"value_loss": loss,
                "value_clipfrac": masked_sum((sq_clipped > sq).astype(f32), mask_BT) / n_tok}


# ---------------------------------------------------------------------------------------------
# REBEL (Gao et al. 2024): regress relative rewards with relative log-ratios.

def rebel_loss(logp_B2T: jax.Array, old_logp_B2T: jax.Array, mask_B2T: jax.Array, rewards_B2: jax.Array, *,
               eta: float, num_seqs=None) -> tuple[jax.Array, Metrics]:
  """REBEL: Σ_b ((1/η)·([log π/π_old](y1) − [log π/π_old](y2)) − (r(y1) − r(y2)))² / num_seqs.

  Axis 1 holds the two responses to the same prompt; the log-ratio of a response is summed over
  its tokens. π_old is the policy that sampled both. η is REBEL's mirror-descent step size: the
  exact minimiser is π ∝ π_old·exp(η·r), so larger η moves further. `num_seqs` counts pairs.
  """
  check_shapes("rebel_loss", logp_B2T=(logp_B2T, ("B", 2, "T")), old_logp_B2T=(old_logp_B2T, ("B", 2, "T")),
               mask_B2T=(mask_B2T, ("B", 2, "T")), rewards_B2=(rewards_B2, ("B", 2)))
  _check_positive("rebel_loss", eta=eta)
  n_pairs = jnp.maximum(jnp.asarray(logp_B2T.shape[0] if num_seqs is None else num_seqs, f32), 1.0)
  log_ratio_B2 = (zero_masked(logp_B2T, mask_B2T)
                  - jax.lax.stop_gradient(zero_masked(old_logp_B2T, mask_B2T))).sum(-1)
  pred_B = (log_ratio_B2[:, 0] - log_ratio_B2[:, 1]) / eta
  target_B = jax.lax.stop_gradient(rewards_B2[:, 0].astype(f32) - rewards_B2[:, 1].astype(f32))
  loss = ((pred_B - target_B) ** 2).sum() / n_pairs
  return loss, {"loss": loss, "pred_mean": pred_B.sum() / n_pairs,
                "reward_diff_abs_mean": jnp.abs(target_B).sum() / n_pairs}
