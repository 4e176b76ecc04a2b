"""The A*-PO loss (arXiv 2505.20686), Stage 2's regression; pure JAX, fp32. Stage 1's V̂* is
stage1/value_table.py's `optimal_value`.

  Stage 2  one response y ~ π per prompt; regress β2·Σ_t log π(y_t)/π_ref(y_t) onto r − V̂*(x):
           loss = mean_b (β2·Σ_t [log π − log π_ref] − (r_b − V̂*_b))² − entropy_coef·H̄. No critic, no clipping.

The baselines' losses are in baseline_losses.py; the token log-probs and entropies they all take are
computed by model/kernels.py. Axis letters: B batch, T response length.

Micro-batching: the loss takes optional `num_seqs` / `num_tokens`, the counts of the whole mini-batch.
Passed on each micro-batch, the micro-batch losses (and gradients, and metrics) sum to the full-batch
ones exactly. Left as None, they default to the counts of the arrays given.
"""
from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from astarpo_jax.infra.masks import check_nonneg, check_shapes, f32, masked_sum, zero_masked

ENTROPY_AGGS = ("seq_mean_token_mean", "token_mean")


def astarpo_loss(logp_BT: jax.Array, ref_logp_BT: jax.Array, mask_BT: jax.Array, rewards_B: jax.Array,
                 vstar_B: jax.Array, entropy_BT: jax.Array | None = None, *, beta2: float,
                 entropy_coef: float, num_seqs=None, num_tokens=None, entropy_agg: str = "seq_mean_token_mean"
                 ) -> tuple[jax.Array, Mapping[str, jax.Array]]:
  """A*-PO loss Σ_b (β2·Σ_t m·(logp − ref_logp) − (r_b − V̂*_b))² / num_seqs − c_H·H̄.

  H̄ is the entropy term: "seq_mean_token_mean" Σ_b (Σ_t m·H / |y_b|) / num_seqs, as the official code
  computes it (verl's micro-batch of one response per GPU: each response's token mean, averaged), or
  "token_mean" Σ m·H / num_tokens. Gradients flow only through `logp_BT` and `entropy_BT`. With the
  paper's β2 = 1e-3 and entropy_coef = 1e-3. `num_seqs`/`num_tokens` default to this batch's B and mask
  count; pass the mini-batch's totals on each micro-batch to make the summed gradients equal the
  full-batch one. Metrics are normalised the same way, so they too sum over micro-batches.
  """
  check_shapes("astarpo_loss", logp_BT=(logp_BT, ("B", "T")), ref_logp_BT=(ref_logp_BT, ("B", "T")),
               mask_BT=(mask_BT, ("B", "T")), rewards_B=(rewards_B, ("B",)), vstar_B=(vstar_B, ("B",)),
               entropy_BT=(entropy_BT, ("B", "T")))
  check_nonneg("astarpo_loss", beta2=beta2, entropy_coef=entropy_coef)
  if entropy_agg not in ENTROPY_AGGS:
    raise ValueError(f"astarpo_loss: entropy_agg={entropy_agg!r}; choose one of {ENTROPY_AGGS}")
  n_seq = jnp.maximum(jnp.asarray(logp_BT.shape[0] if num_seqs is None else num_seqs, f32), 1.0)
  n_tok = jnp.maximum(jnp.asarray(mask_BT.astype(f32).sum() if num_tokens is None else num_tokens, f32), 1.0)

  log_ratio_BT = zero_masked(logp_BT, mask_BT) - jax.lax.stop_gradient(zero_masked(ref_logp_BT, mask_BT))
  log_ratio_B = log_ratio_BT.sum(-1)
  adv_B = jax.lax.stop_gradient(rewards_B.astype(f32) - vstar_B.astype(f32))
  residual_B = beta2 * log_ratio_B - adv_B
  regression = (residual_B ** 2).sum() / n_seq
  metrics = {
      "regression_loss": regression,
      "kl": log_ratio_BT.sum() / n_tok,
      "advantage_mean": adv_B.sum() / n_seq,
      "beta_log_ratio_mean": (beta2 * log_ratio_B).sum() / n_seq,
  }
  loss = regression
  if entropy_BT is not None:
    if entropy_agg == "token_mean":
      entropy = masked_sum(entropy_BT, mask_BT) / n_tok
    else:
      len_B = jnp.maximum(mask_BT.astype(f32).sum(-1), 1.0)
      entropy = (zero_masked(entropy_BT, mask_BT).sum(-1) / len_B).sum() / n_seq
    metrics["entropy"] = entropy
    loss = loss - entropy_coef * entropy
  elif not isinstance(entropy_coef, (int, float)) or entropy_coef != 0:
    raise ValueError("astarpo_loss: `entropy_BT` is None but `entropy_coef` is not 0; pass token entropies")
  metrics["loss"] = loss
  return loss, metrics


# ---------------------------------------------------------------------------------------------
# Stage 1: the optimal value of π_ref's samples.

