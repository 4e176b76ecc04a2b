"""A*-PO loss and V̂* (losses.py) against hand-worked numbers, the paper's table and closed forms."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from astarpo_jax.model import kernels as K
from astarpo_jax.stage1.value_table import optimal_value
from astarpo_jax.training import losses as L

# ---------------------------------------------------------------------------------------------
# V*

# The paper's table for N = 8, β1 = 1/2, k correct out of 8.
VSTAR_TABLE_N8 = [0.0, 0.2935, 0.4772, 0.6113, 0.7169, 0.8040, 0.8782, 0.9428, 1.0]


def test_vstar_n8_beta_half_matches_table_and_closed_form():
  rewards_PN = np.array([[1.0] * k + [0.0] * (8 - k) for k in range(9)])
  v = np.asarray(optimal_value(jnp.asarray(rewards_PN), 0.5))
  closed = 0.5 * np.log((np.arange(9) * np.exp(2.0) + (8 - np.arange(9))) / 8)
  np.testing.assert_allclose(v, closed, atol=1e-6)
  np.testing.assert_allclose(closed, VSTAR_TABLE_N8, atol=5e-5)  # the table, to 4 decimals
  np.testing.assert_allclose(v, VSTAR_TABLE_N8, atol=5e-5)


def test_vstar_beta_zero_is_plain_mean():
  rewards_PN = jnp.array([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
  np.testing.assert_allclose(optimal_value(rewards_PN, 0.0), [0.5, 0.25], atol=1e-7)


def test_vstar_is_stable_for_tiny_beta():
  # exp(1/1e-3) overflows fp32; the log-sum-exp form gives 1 + β·log(k/N) without overflow.
  rewards_PN = jnp.array([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0], [0.0] * 4])
  v = np.asarray(optimal_value(rewards_PN, 1e-3))
  np.testing.assert_allclose(v, [1 + 1e-3 * np.log(0.25), 1 + 1e-3 * np.log(0.75), 0.0], atol=1e-6)


def test_vstar_mask_gives_each_prompt_its_own_sample_count():
  rewards_PN = jnp.array([[1.0, 0.0, 7.0, 7.0], [1.0, 1.0, 0.0, 0.0]])
  mask_PN = jnp.array([[1, 1, 0, 0], [1, 1, 1, 1]])
  v = np.asarray(optimal_value(rewards_PN, 0.5, mask_PN))
  np.testing.assert_allclose(v, [0.5 * np.log((np.exp(2) + 1) / 2), 0.5 * np.log((2 * np.exp(2) + 2) / 4)], atol=1e-6)
  np.testing.assert_allclose(optimal_value(rewards_PN, 0.0, mask_PN), [0.5, 0.5], atol=1e-7)


def test_vstar_rejects_prompt_without_samples_and_negative_beta():
  with pytest.raises(ValueError, match=r"prompts \[1\] have no sample"):
    optimal_value(jnp.ones((2, 3)), 0.5, jnp.array([[1, 0, 0], [0, 0, 0]]))
  with pytest.raises(ValueError, match="beta1"):
    optimal_value(jnp.ones((2, 3)), -1.0)
  with pytest.raises(ValueError, match="rewards_PN"):
    optimal_value(jnp.ones((6,)), 0.5)


def test_vstar_works_under_jit():
  f = jax.jit(functools.partial(optimal_value, beta1=0.5))
  np.testing.assert_allclose(f(jnp.array([[1.0, 0, 0, 0, 0, 0, 0, 0]])), [0.2935], atol=5e-5)


# ---------------------------------------------------------------------------------------------
# A*-PO loss.

def _hand_case():
  """B = 2, T = 3; row 1 has 2 response tokens and one padding slot (value 99 there)."""
  return dict(
      logp_BT=jnp.array([[-1.0, -1.0, -0.5], [-0.3, -0.7, 99.0]]),
      ref_logp_BT=jnp.array([[-1.5, -1.0, -1.0], [-0.5, -1.7, 99.0]]),
      mask_BT=jnp.array([[1, 1, 1], [1, 1, 0]]),
      rewards_B=jnp.array([1.0, 0.0]),
      vstar_B=jnp.array([0.25, 0.5]),
      entropy_BT=jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]]))


def test_astarpo_loss_hand_worked_value_and_metrics():
  # Σ log-ratio: row 0: 0.5 + 0 + 0.5 = 1.0, row 1: 0.2 + 1.0 = 1.2; β2 = 0.5 → 0.5, 0.6.
  # advantages r − V*: 0.75, −0.5; residuals: 0.5 − 0.75 = −0.25, 0.6 + 0.5 = 1.1.
  # regression: (0.0625 + 1.21)/2 = 0.63625; entropy token mean: 15/5 = 3; loss = 0.63625 − 0.01·3.
  loss, m = L.astarpo_loss(**_hand_case(), beta2=0.5, entropy_coef=0.01, entropy_agg="token_mean")
  np.testing.assert_allclose(loss, 0.60625, atol=1e-6)
  np.testing.assert_allclose(m["regression_loss"], 0.63625, atol=1e-6)
  np.testing.assert_allclose(m["entropy"], 3.0, atol=1e-6)
  np.testing.assert_allclose(m["kl"], 2.2 / 5, atol=1e-6)
  np.testing.assert_allclose(m["advantage_mean"], 0.125, atol=1e-6)
  np.testing.assert_allclose(m["beta_log_ratio_mean"], 0.55, atol=1e-6)


def test_astarpo_loss_hand_worked_gradient():
  # ∂/∂logp_bt = (2/B)·β2·residual_b on response tokens; ∂/∂H_bt = −c_H / num_tokens; none to ref.
  case = _hand_case()
  f = lambda lp, ref, ent: L.astarpo_loss(lp, ref, case["mask_BT"], case["rewards_B"], case["vstar_B"], ent,
                                          beta2=0.5, entropy_coef=0.01, entropy_agg="token_mean")[0]
  g_logp, g_ref, g_ent = jax.grad(f, (0, 1, 2))(case["logp_BT"], case["ref_logp_BT"], case["entropy_BT"])
  np.testing.assert_allclose(g_logp, [[-0.125] * 3, [0.55, 0.55, 0.0]], atol=1e-6)
  np.testing.assert_allclose(g_ref, np.zeros((2, 3)), atol=0)
  np.testing.assert_allclose(g_ent, [[-0.002] * 3, [-0.002, -0.002, 0.0]], atol=1e-7)


def test_official_entropy_term_is_the_mean_of_each_responses_token_mean():
  # The official code's micro-batch of one response per GPU: row 0's mean entropy (1 + 2 + 3)/3 = 2,
  # row 1's (4 + 5)/2 = 4.5; their mean 3.25 (the token mean would be 3). loss = 0.63625 − 0.01·3.25.
  case = _hand_case()
  loss, m = L.astarpo_loss(**case, beta2=0.5, entropy_coef=0.01)  # the default
  np.testing.assert_allclose(m["entropy"], 3.25, atol=1e-6)
  np.testing.assert_allclose(loss, 0.60375, atol=1e-6)
  # ∂/∂H_bt = −c_H / (B·|y_b|): −0.01/6 on row 0, −0.01/4 on row 1's two tokens, 0 on its padding.
  f = lambda ent: L.astarpo_loss(case["logp_BT"], case["ref_logp_BT"], case["mask_BT"], case["rewards_B"],
                                 case["vstar_B"], ent, beta2=0.5, entropy_coef=0.01)[0]
  np.testing.assert_allclose(jax.grad(f)(case["entropy_BT"]), [[-0.01 / 6] * 3, [-0.0025, -0.0025, 0.0]], atol=1e-8)
  with pytest.raises(ValueError, match="entropy_agg"):
    L.astarpo_loss(**case, beta2=0.5, entropy_coef=0.01, entropy_agg="mean")


def test_astarpo_loss_ignores_padding_and_post_eos_values_even_nan():
  case = _hand_case()
  pad = ~case["mask_BT"].astype(bool)
  f = lambda c: jax.value_and_grad(
      lambda lp, ent: L.astarpo_loss(lp, c["ref_logp_BT"], c["mask_BT"], c["rewards_B"], c["vstar_B"], ent,
                                     beta2=0.5, entropy_coef=0.01)[0], (0, 1))(c["logp_BT"], c["entropy_BT"])
  base_loss, base_grads = f(case)
  for garbage in (-1e30, 7.0, jnp.nan, jnp.inf):
    dirty = dict(case)
    for key in ("logp_BT", "ref_logp_BT", "entropy_BT"):
      dirty[key] = jnp.where(pad, garbage, case[key])
    loss, grads = f(dirty)
    np.testing.assert_array_equal(loss, base_loss)
    for a, b in zip(grads, base_grads):
      np.testing.assert_array_equal(a, b)


def test_astarpo_loss_is_zero_at_the_optimal_log_ratio():
  # β2·Σ log π/π_ref = r − V* exactly: the regression residual vanishes.
  mask_BT = jnp.array([[1, 1, 0], [1, 0, 0]])
  logp_BT = jnp.array([[-1.0, -1.0, 0.0], [-2.0, 0.0, 0.0]])
  ref_BT = jnp.array([[-1.2, -1.3, 0.0], [-1.0, 0.0, 0.0]])  # Σ log-ratio: 0.5, −1.0
  loss, _ = L.astarpo_loss(logp_BT, ref_BT, mask_BT, jnp.array([1.0, 0.0]), jnp.array([0.9, 0.2]),
                           beta2=0.2, entropy_coef=0.0)
  np.testing.assert_allclose(loss, 0.0, atol=1e-10)


def _tiny_policy_batch(B=6, T=5, D=4, V=7, seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 6)
  lengths = jnp.array([5, 1, 3, 4, 2, 5])[:B]
  return dict(
      w_DV=jax.random.normal(k[0], (D, V)),
      hidden_BTD=jax.random.normal(k[1], (B, T, D)),
      targets_BT=jax.random.randint(k[2], (B, T), 0, V),
      ref_logp_BT=-jax.random.uniform(k[3], (B, T), minval=0.5, maxval=3.0),
      mask_BT=(jnp.arange(T)[None, :] < lengths[:, None]).astype(jnp.int32),
      rewards_B=(jax.random.uniform(k[4], (B,)) > 0.5).astype(jnp.float32),
      vstar_B=jax.random.uniform(k[5], (B,)))


@pytest.mark.parametrize("entropy_agg", ["token_mean", "seq_mean_token_mean"])
def test_micro_batch_accumulation_gives_exactly_the_full_batch_gradient_and_metrics(entropy_agg):
  d = _tiny_policy_batch()
  w_DV = d.pop("w_DV")

  @functools.partial(jax.jit, static_argnums=(4,))
  @functools.partial(jax.grad, has_aux=True)
  def grad_fn(w, batch, num_seqs, num_tokens, agg=entropy_agg):
    logits_BTV = batch["hidden_BTD"] @ w
    logp, ent = K.token_logprobs(logits_BTV, batch["targets_BT"]), K.token_entropy(logits_BTV)
    return L.astarpo_loss(logp, batch["ref_logp_BT"], batch["mask_BT"], batch["rewards_B"], batch["vstar_B"], ent,
                          beta2=0.3, entropy_coef=0.5, num_seqs=num_seqs, num_tokens=num_tokens, entropy_agg=agg)

  micro = [{k: v[s:s + 2] for k, v in d.items()} for s in range(0, 6, 2)]
  full_grad, full_metrics = grad_fn(w_DV, d, 6, d["mask_BT"].sum())
  acc_grad, acc_metrics = 0.0, {}
  for mb in micro:  # the mini-batch's counts on every micro-batch
    g, m = grad_fn(w_DV, mb, 6, d["mask_BT"].sum())
    acc_grad = acc_grad + g
    acc_metrics = {k: acc_metrics.get(k, 0.0) + v for k, v in m.items()}
  np.testing.assert_allclose(acc_grad, full_grad, atol=1e-6)
  for k, v in full_metrics.items():
    np.testing.assert_allclose(acc_metrics[k], v, atol=1e-6, err_msg=k)
  # Each micro-batch averaged on its own counts (the default): a token mean then weighs the micro-batches'
  # tokens wrongly; sequence means over equal micro-batches do not care (the official code's case).
  naive = sum(grad_fn(w_DV, mb, 2, mb["mask_BT"].sum())[0] for mb in micro) / 3
  if entropy_agg == "token_mean":
    assert np.abs(naive - full_grad).max() > 1e-3
  else:
    np.testing.assert_allclose(naive, full_grad, atol=1e-6)


def test_astarpo_loss_jits_and_matches_eager():
  case = _hand_case()
  f = functools.partial(L.astarpo_loss, beta2=1e-3, entropy_coef=1e-3)
  eager, _ = f(**case)
  jitted, _ = jax.jit(f)(**case)
  np.testing.assert_allclose(jitted, eager, rtol=1e-6)


def test_astarpo_loss_rejects_bad_shapes_and_missing_entropy():
  case = _hand_case()
  with pytest.raises(ValueError, match="vstar_B"):
    L.astarpo_loss(**{**case, "vstar_B": jnp.zeros(3)}, beta2=0.1, entropy_coef=0.0)
  with pytest.raises(ValueError, match="mask_BT"):
    L.astarpo_loss(**{**case, "mask_BT": jnp.ones((2, 4))}, beta2=0.1, entropy_coef=0.0)
  with pytest.raises(ValueError, match="entropy_BT"):
    L.astarpo_loss(**{**case, "entropy_BT": None}, beta2=0.1, entropy_coef=0.01)
  with pytest.raises(ValueError, match="beta2"):
    L.astarpo_loss(**case, beta2=-1.0, entropy_coef=0.0)

