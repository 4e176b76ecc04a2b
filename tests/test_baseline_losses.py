"""GRPO, PPO (GAE, clipped policy and value losses) and REBEL, against hand-worked cases."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from astarpo_jax.training import baseline_losses as BL

E_HALF = np.exp(0.5)  # ratio of a token whose log-prob rose by 0.5
E_MHALF = np.exp(-0.5)


# ---------------------------------------------------------------------------------------------
# GRPO

def test_grpo_advantages_hand_worked():
  # Group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4·0.25/3) = 0.57735 → ±0.866025.
  # A group with one reward for all gets 0 (no signal), not NaN.
  adv = BL.grpo_advantages(jnp.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]), eps=1e-6)
  np.testing.assert_allclose(adv, [[0.866025, -0.866025, -0.866025, 0.866025], [0, 0, 0, 0]], atol=1e-5)


def test_grpo_advantages_reject_single_response_groups():
  with pytest.raises(ValueError, match="G >= 2"):
    BL.grpo_advantages(jnp.ones((3, 1)))


def _clip_cases():
  """Four one-token responses: log-prob up or down by 0.5, advantage +1 or −1."""
  return dict(logp_BT=jnp.array([[-0.5], [-0.5], [-1.5], [-1.5]]), old_logp_BT=-jnp.ones((4, 1)),
              mask_BT=jnp.ones((4, 1)), adv=jnp.array([1.0, -1.0, 1.0, -1.0]))


def test_grpo_clipped_surrogate_hand_worked_value_and_gradient():
  # ε = 0.2. Token losses −min(ρA, clip(ρ)A) and their ∂/∂logp:
  #   ρ = e^.5, A = +1: −1.2 (clipped, grad 0)      ρ = e^.5, A = −1: +e^.5 (grad e^.5)
  #   ρ = e^-.5, A = +1: −e^-.5 (grad −e^-.5)       ρ = e^-.5, A = −1: +0.8 (clipped, grad 0)
  c = _clip_cases()
  f = lambda lp: BL.grpo_loss(lp, c["old_logp_BT"], None, c["mask_BT"], c["adv"], clip_eps=0.2)
  (loss, m), grad = jax.value_and_grad(f, has_aux=True)(c["logp_BT"])
  np.testing.assert_allclose(loss, (-1.2 + E_HALF - E_MHALF + 0.8) / 4, atol=1e-6)
  np.testing.assert_allclose(grad[:, 0], [0.0, E_HALF / 4, -E_MHALF / 4, 0.0], atol=1e-6)
  np.testing.assert_allclose(m["clipfrac"], 0.5, atol=1e-7)


def test_grpo_k3_kl_penalty_hand_worked_and_clamped():
  # ref − logp = 0.5: k3 = e^.5 − 0.5 − 1, ∂/∂logp = 1 − e^.5. ref − logp = 5: k3 clamps at 10, grad 0.
  logp_BT = jnp.array([[-1.0], [-6.0]])
  ref_BT = jnp.array([[-0.5], [-1.0]])
  f = lambda lp: BL.grpo_loss(lp, lp, ref_BT, jnp.ones((2, 1)), jnp.zeros(2), kl_coef=0.1)
  (loss, m), grad = jax.value_and_grad(f, has_aux=True)(logp_BT)
  k3 = E_HALF - 1.5
  np.testing.assert_allclose(m["kl"], (k3 + 10.0) / 2, atol=1e-6)
  np.testing.assert_allclose(loss, 0.1 * (k3 + 10.0) / 2, atol=1e-6)
  np.testing.assert_allclose(grad[:, 0], [0.1 * (1 - E_HALF) / 2, 0.0], atol=1e-6)


@pytest.mark.parametrize("mode,value,grad_row0,grad_row1", [
    ("token_mean", -0.25, -1 / 4, 2 / 4),
    ("seq_mean_token_mean", 0.5, -1 / 6, 1.0),
    ("seq_mean_token_sum", -0.5, -1 / 2, 1.0),
])
def test_grpo_loss_aggregation_modes_hand_worked(mode, value, grad_row0, grad_row1):
  # ρ = 1, so each token's loss is −A: row 0 has 3 tokens with A = 1, row 1 one token with A = −2.
  mask_BT = jnp.array([[1, 1, 1], [1, 0, 0]])
  logp_BT = jnp.full((2, 3), -1.0)
  f = lambda lp: BL.grpo_loss(lp, logp_BT, None, mask_BT, jnp.array([1.0, -2.0]), loss_agg=mode)[0]
  loss, grad = jax.value_and_grad(f)(logp_BT)
  np.testing.assert_allclose(loss, value, atol=1e-6)
  np.testing.assert_allclose(grad, [[grad_row0] * 3, [grad_row1, 0, 0]], atol=1e-6)


def _random_batch(B=6, T=5, seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 6)
  lengths = jnp.array([5, 1, 3, 4, 2, 5])[:B]
  return dict(
      logp_BT=-jax.random.uniform(k[0], (B, T), minval=0.1, maxval=2.0),
      old_logp_BT=-jax.random.uniform(k[1], (B, T), minval=0.1, maxval=2.0),
      ref_logp_BT=-jax.random.uniform(k[2], (B, T), minval=0.1, maxval=2.0),
      entropy_BT=jax.random.uniform(k[3], (B, T)),
      mask_BT=(jnp.arange(T)[None, :] < lengths[:, None]).astype(jnp.int32),
      adv_B=jax.random.normal(k[4], (B,)),
      values_BT=jax.random.normal(k[5], (B, T)))


def _grpo(b, **kw):
  return BL.grpo_loss(b["logp_BT"], b["old_logp_BT"], b["ref_logp_BT"], b["mask_BT"], b["adv_B"], b["entropy_BT"],
                      clip_eps=0.2, kl_coef=0.04, entropy_coef=0.01, **kw)


@pytest.mark.parametrize("mode", BL.LOSS_AGG_MODES)
def test_grpo_micro_batches_sum_to_full_batch_loss_and_gradient(mode):
  b = _random_batch()
  grad_fn = jax.jit(jax.value_and_grad(lambda lp, bb, ns, nt: _grpo({**bb, "logp_BT": lp}, loss_agg=mode,
                                                                     num_seqs=ns, num_tokens=nt)[0]))
  n_tok = b["mask_BT"].sum()
  full_loss, full_grad = grad_fn(b["logp_BT"], b, 6, n_tok)
  parts = [grad_fn(b["logp_BT"][s:s + 2], {k: v[s:s + 2] for k, v in b.items()}, 6, n_tok) for s in range(0, 6, 2)]
  np.testing.assert_allclose(sum(p[0] for p in parts), full_loss, atol=1e-6)
  np.testing.assert_allclose(jnp.concatenate([p[1] for p in parts]), full_grad, atol=1e-6)


def _dirty(b, keys, garbage):
  pad = ~b["mask_BT"].astype(bool)
  return {k: (jnp.where(pad, garbage, v) if k in keys else v) for k, v in b.items()}


def test_grpo_loss_ignores_padding_even_nan_and_inf():
  b = _random_batch()
  f = jax.value_and_grad(lambda lp, bb: _grpo({**bb, "logp_BT": lp}, loss_agg="seq_mean_token_mean")[0])
  base = f(b["logp_BT"], b)
  for garbage in (jnp.nan, jnp.inf, -1e30, 3.0):
    d = _dirty(b, ("logp_BT", "old_logp_BT", "ref_logp_BT", "entropy_BT"), garbage)
    loss, grad = f(d["logp_BT"], d)
    np.testing.assert_array_equal(loss, base[0])
    np.testing.assert_array_equal(grad, base[1])
  assert np.all(np.asarray(base[1])[~np.asarray(b["mask_BT"], bool)] == 0)


def test_grpo_loss_rejects_bad_options():
  b = _random_batch()
  with pytest.raises(ValueError, match="loss_agg"):
    _grpo(b, loss_agg="sum")
  with pytest.raises(ValueError, match="ref_logp_BT"):
    BL.grpo_loss(b["logp_BT"], b["old_logp_BT"], None, b["mask_BT"], b["adv_B"], kl_coef=0.1)
  with pytest.raises(ValueError, match="adv_B"):
    BL.grpo_loss(b["logp_BT"], b["old_logp_BT"], None, b["mask_BT"], jnp.zeros(5))
  with pytest.raises(ValueError, match="clip_eps"):
    BL.grpo_loss(b["logp_BT"], b["old_logp_BT"], None, b["mask_BT"], b["adv_B"], clip_eps=0.0)


# ---------------------------------------------------------------------------------------------
# PPO

def test_outcome_token_rewards_put_the_reward_on_the_last_response_token():
  mask_BT = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
  r = BL.outcome_token_rewards(jnp.array([1.0, 2.0, 3.0]), mask_BT)
  np.testing.assert_array_equal(r, [[0, 0, 1, 0], [2, 0, 0, 0], [0, 0, 0, 3]])
  kl_BT = jnp.full((3, 4), 0.5)
  r_kl = BL.outcome_token_rewards(jnp.array([1.0, 2.0, 3.0]), mask_BT, kl_BT, kl_coef=0.1)
  np.testing.assert_allclose(r_kl, np.asarray(r) - 0.05 * np.asarray(mask_BT), atol=1e-7)


def test_gae_hand_worked_two_token_case():
  # γ = λ = 1, r = [0, 1], V = [0.5, 0.2]: δ1 = 1 − 0.2 = 0.8, A1 = 0.8; δ0 = 0.2 − 0.5 = −0.3,
  # A0 = −0.3 + 0.8 = 0.5. Returns A + V = [1, 1]: the Monte-Carlo return. Third slot is padding.
  adv, ret = BL.gae_advantages(jnp.array([[0.0, 1.0, 5.0]]), jnp.array([[0.5, 0.2, 9.0]]), jnp.array([[1, 1, 0]]),
                               gamma=1.0, lam=1.0, whiten=False)
  np.testing.assert_allclose(adv, [[0.5, 0.8, 0.0]], atol=1e-6)
  np.testing.assert_allclose(ret, [[1.0, 1.0, 0.0]], atol=1e-6)


def _gae_reference(r_BT, v_BT, mask_BT, gamma, lam):
  """Plain loops over each row's response tokens; the episode ends at the row's last token."""
  r_BT, v_BT, mask_BT = (np.asarray(x, np.float64) for x in (r_BT, v_BT, mask_BT))
  adv = np.zeros_like(r_BT)
  for b in range(r_BT.shape[0]):
    n = int(mask_BT[b].sum())
    running = 0.0
    for t in reversed(range(n)):
      next_v = v_BT[b, t + 1] if t + 1 < n else 0.0
      running = r_BT[b, t] + gamma * next_v - v_BT[b, t] + gamma * lam * running
      adv[b, t] = running
  return adv, (adv + v_BT) * mask_BT


def test_gae_matches_loop_reference_and_ignores_post_eos_values():
  b = _random_batch()
  r_BT = jax.random.normal(jax.random.PRNGKey(9), b["mask_BT"].shape)
  adv, ret = BL.gae_advantages(r_BT, b["values_BT"], b["mask_BT"], gamma=0.9, lam=0.8, whiten=False)
  ref_adv, ref_ret = _gae_reference(r_BT, b["values_BT"], b["mask_BT"], 0.9, 0.8)
  np.testing.assert_allclose(adv, ref_adv, atol=1e-5)
  np.testing.assert_allclose(ret, ref_ret, atol=1e-5)
  pad = ~b["mask_BT"].astype(bool)
  adv2, ret2 = BL.gae_advantages(jnp.where(pad, 100.0, r_BT), jnp.where(pad, jnp.nan, b["values_BT"]), b["mask_BT"],
                                 gamma=0.9, lam=0.8, whiten=False)
  np.testing.assert_array_equal(adv2, adv)
  np.testing.assert_array_equal(ret2, ret)


def test_whitened_advantages_have_zero_mean_unit_unbiased_std_on_the_mask():
  b = _random_batch()
  adv, _ = BL.gae_advantages(b["values_BT"] * 3 + 1, jnp.zeros_like(b["values_BT"]), b["mask_BT"], gamma=0.95, lam=0.9)
  on = np.asarray(b["mask_BT"], bool)
  a = np.asarray(adv)
  np.testing.assert_allclose(a[on].mean(), 0.0, atol=1e-5)
  np.testing.assert_allclose(a[on].std(ddof=1), 1.0, atol=1e-4)
  assert np.all(a[~on] == 0)


def test_ppo_policy_loss_hand_worked_clipping():
  # Same four cases as GRPO, with the advantage given per token.
  c = _clip_cases()
  f = lambda lp: BL.ppo_policy_loss(lp, c["old_logp_BT"], c["mask_BT"], c["adv"][:, None], clip_eps=0.2)
  (loss, m), grad = jax.value_and_grad(f, has_aux=True)(c["logp_BT"])
  np.testing.assert_allclose(loss, (-1.2 + E_HALF - E_MHALF + 0.8) / 4, atol=1e-6)
  np.testing.assert_allclose(grad[:, 0], [0.0, E_HALF / 4, -E_MHALF / 4, 0.0], atol=1e-6)
  np.testing.assert_allclose(m["clipfrac"], 0.5, atol=1e-7)


def test_ppo_value_loss_hand_worked_clipping():
  # c = 0.5. Token 1: V = 1, V_old = 0, R = 2: clipped V 0.5, (0.5 − 2)² = 2.25 > (1 − 2)² = 1, so
  # the clipped term is used and its gradient is 0. Token 2: V = −1, V_old = 0, R = 0: clipped
  # −0.5 gives 0.25 < 1, unclipped used, ∂/∂V = ½·2·(V − R)/2 = −0.5. Loss ½·(2.25 + 1)/2.
  f = lambda v: BL.ppo_value_loss(v, jnp.zeros((2, 1)), jnp.array([[2.0], [0.0]]), jnp.ones((2, 1)), value_clip=0.5)
  (loss, m), grad = jax.value_and_grad(f, has_aux=True)(jnp.array([[1.0], [-1.0]]))
  np.testing.assert_allclose(loss, 0.8125, atol=1e-6)
  np.testing.assert_allclose(grad[:, 0], [0.0, -0.5], atol=1e-6)
  np.testing.assert_allclose(m["value_clipfrac"], 0.5, atol=1e-7)


def test_ppo_losses_ignore_padding_even_nan():
  b = _random_batch()
  adv_BT = jnp.broadcast_to(b["adv_B"][:, None], b["mask_BT"].shape)

  def both(bb):
    pol = jax.value_and_grad(lambda lp: BL.ppo_policy_loss(lp, bb["old_logp_BT"], bb["mask_BT"], bb["adv_BT"],
                                                           bb["entropy_BT"], entropy_coef=0.01)[0])(bb["logp_BT"])
    val = jax.value_and_grad(lambda v: BL.ppo_value_loss(v, bb["old_values_BT"], bb["returns_BT"],
                                                         bb["mask_BT"])[0])(bb["values_BT"])
    return pol, val

  b = {**b, "adv_BT": adv_BT, "old_values_BT": b["values_BT"] * 0.5, "returns_BT": b["values_BT"] + 1.0}
  base = both(b)
  d = _dirty(b, ("logp_BT", "old_logp_BT", "adv_BT", "entropy_BT", "values_BT", "old_values_BT", "returns_BT"),
             jnp.nan)
  for (l1, g1), (l2, g2) in zip(both(d), base):
    np.testing.assert_array_equal(l1, l2)
    np.testing.assert_array_equal(g1, g2)


# ---------------------------------------------------------------------------------------------
# REBEL

def test_rebel_loss_hand_worked_value_and_gradient():
  # Σ log π/π_old: y1 0.2 + 0.2 = 0.4, y2 −0.1 − 0.1 = −0.2 (third slot padding). η = 0.5:
  # prediction 0.6/0.5 = 1.2, target r1 − r2 = 1, loss 0.04, ∂/∂logp(y1) = 2·0.2/0.5 = 0.8, y2 −0.8.
  logp = jnp.array([[[-1.0, -0.5, 7.0], [-2.0, -1.0, 7.0]]])
  old = jnp.array([[[-1.2, -0.7, 3.0], [-1.9, -0.9, 3.0]]])
  mask = jnp.array([[[1, 1, 0], [1, 1, 0]]])
  f = lambda lp: BL.rebel_loss(lp, old, mask, jnp.array([[1.0, 0.0]]), eta=0.5)
  (loss, m), grad = jax.value_and_grad(f, has_aux=True)(logp)
  np.testing.assert_allclose(loss, 0.04, atol=1e-6)
  np.testing.assert_allclose(m["pred_mean"], 1.2, atol=1e-6)
  np.testing.assert_allclose(grad, [[[0.8, 0.8, 0.0], [-0.8, -0.8, 0.0]]], atol=1e-5)


def test_rebel_minimiser_is_mirror_descent_step():
  """Regressing over all ordered action pairs of one prompt recovers π ∝ π_old·exp(η·r)."""
  A, eta = 5, 0.7
  old_logits = jnp.asarray(np.random.default_rng(0).normal(size=A), jnp.float32)
  old_logits = jax.nn.log_softmax(old_logits)
  r = jnp.array([1.0, 0.0, 0.0, 1.0, 0.0])
  a1, a2 = (x.reshape(-1) for x in jnp.meshgrid(jnp.arange(A), jnp.arange(A), indexing="ij"))
  pairs_B2 = jnp.stack([a1, a2], -1)
  mask = jnp.ones((A * A, 2, 1))
  opt = optax.adam(0.05)

  def loss_fn(theta):
    logp_B2T = jax.nn.log_softmax(theta)[pairs_B2][..., None]
    return BL.rebel_loss(logp_B2T, old_logits[pairs_B2][..., None], mask, r[pairs_B2], eta=eta)[0]

  def step(carry, _):
    theta, st = carry
    updates, st = opt.update(jax.grad(loss_fn)(theta), st, theta)
    return (optax.apply_updates(theta, updates), st), None

  (theta, _), _ = jax.jit(lambda c: jax.lax.scan(step, c, None, length=1500))((old_logits, opt.init(old_logits)))
  target = np.exp(np.asarray(old_logits) + eta * np.asarray(r))
  np.testing.assert_allclose(jax.nn.softmax(theta), target / target.sum(), atol=1e-3)


def test_rebel_micro_batches_sum_to_full_batch_and_ignore_padding():
  b = _random_batch(B=6)
  logp_B2T, old_B2T = b["logp_BT"].reshape(3, 2, 5), b["old_logp_BT"].reshape(3, 2, 5)
  mask_B2T = b["mask_BT"].reshape(3, 2, 5)
  rewards_B2 = jnp.array([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]])
  f = jax.jit(jax.value_and_grad(lambda lp, old, m, r, n: BL.rebel_loss(lp, old, m, r, eta=2.0, num_seqs=n)[0]))
  full = f(logp_B2T, old_B2T, mask_B2T, rewards_B2, 3)
  parts = [f(logp_B2T[i:i + 1], old_B2T[i:i + 1], mask_B2T[i:i + 1], rewards_B2[i:i + 1], 3) for i in range(3)]
  np.testing.assert_allclose(sum(p[0] for p in parts), full[0], atol=1e-6)
  np.testing.assert_allclose(jnp.concatenate([p[1] for p in parts]), full[1], atol=1e-6)
  pad = ~mask_B2T.astype(bool)
  dirty = f(jnp.where(pad, jnp.nan, logp_B2T), jnp.where(pad, jnp.inf, old_B2T), mask_B2T, rewards_B2, 3)
  np.testing.assert_array_equal(dirty[0], full[0])
  np.testing.assert_array_equal(dirty[1], full[1])


def test_rebel_loss_rejects_unpaired_input():
  with pytest.raises(ValueError, match="logp_B2T"):
    BL.rebel_loss(jnp.zeros((2, 3, 4)), jnp.zeros((2, 3, 4)), jnp.ones((2, 3, 4)), jnp.zeros((2, 3)), eta=1.0)
  with pytest.raises(ValueError, match="eta"):
    BL.rebel_loss(jnp.zeros((2, 2, 4)), jnp.zeros((2, 2, 4)), jnp.ones((2, 2, 4)), jnp.zeros((2, 2)), eta=0.0)
