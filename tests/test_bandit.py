"""A*-PO's fixed point on a tabular bandit, and the baselines improving the same bandit.

Bandit: P prompts, single-token responses from A actions, a tabular policy (one logit row per
prompt), a random π_ref and 0/1 rewards (fractional ones in [0, 1] in one test). The KL-regularised optimum is known in closed form,
π*(a|x) = π_ref(a|x)·exp(r(x,a)/β) / Z(x), with V*(x) = β·log Z(x).

Why the fixed point is π* even with an estimated V̂*: with one sampled action and a softmax table,
the expected A*-PO gradient vanishes iff the residual β·log π/π_ref − (r − V̂*) is the same for all
actions, i.e. π ∝ π_ref·exp(r/β); the normalisation absorbs V̂*'s error. With the exact V* the
residual itself goes to 0, so the iterates stop moving and converge exactly.
"""
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from astarpo_jax.model import kernels
from astarpo_jax.stage1.value_table import optimal_value
from astarpo_jax.training import baseline_losses as BL, losses as L

P, A, BETA = 4, 6, 0.5


@pytest.fixture(scope="module")
def bandit():
  rng = np.random.default_rng(0)
  ref_logits_PA = rng.normal(0.0, 1.0, (P, A))
  ref_logits_PA -= np.log(np.exp(ref_logits_PA).sum(1, keepdims=True))  # normalised: log π_ref
  rewards_PA = np.zeros((P, A))
  for p in range(P):  # one or two correct actions per prompt
    rewards_PA[p, rng.choice(A, size=rng.integers(1, 3), replace=False)] = 1.0
  pi_ref = np.exp(ref_logits_PA)
  z_P = (pi_ref * np.exp(rewards_PA / BETA)).sum(1)
  return dict(ref_logits=jnp.asarray(ref_logits_PA, jnp.float32), rewards=jnp.asarray(rewards_PA, jnp.float32),
              pi_ref=pi_ref, r=rewards_PA, pi_star=pi_ref * np.exp(rewards_PA / BETA) / z_P[:, None],
              vstar_exact=BETA * np.log(z_P))


def _expected_reward(pi_PA, r_PA):
  return float((pi_PA * r_PA).sum(1).mean())


def _tv(p_PA, q_PA):
  return 0.5 * np.abs(p_PA - q_PA).sum(1)


def _logp(logits_PA, actions_PK):
  """Log-probs of K single-token responses per prompt, through the library helper: [P*K, 1]."""
  K = actions_PK.shape[1]
  logits_BTV = jnp.repeat(logits_PA, K, axis=0)[:, None, :]
  return kernels.token_logprobs(logits_BTV, actions_PK.reshape(-1, 1))


def _train_astarpo(bandit, vstar_P, steps=2000, lr=0.05, seed=0):
  ref, rew = bandit["ref_logits"], bandit["rewards"]
  opt = optax.adam(optax.cosine_decay_schedule(lr, steps))
  mask_B1 = jnp.ones((P, 1))

  def step(carry, key):
    theta, opt_state = carry
    a_P1 = jax.random.categorical(key, theta)[:, None]  # ONE action per prompt, from the current π

    def loss_fn(th):
      return L.astarpo_loss(_logp(th, a_P1), _logp(ref, a_P1), mask_B1, rew[jnp.arange(P), a_P1[:, 0]],
                            vstar_P, beta2=BETA, entropy_coef=0.0)[0]

    updates, opt_state = opt.update(jax.grad(loss_fn)(theta), opt_state, theta)
    return (optax.apply_updates(theta, updates), opt_state), None

  theta = ref
  run = jax.jit(lambda th, st, k: jax.lax.scan(step, (th, st), jax.random.split(k, steps))[0])
  theta, _ = run(theta, opt.init(theta), jax.random.PRNGKey(seed))
  return np.asarray(jax.nn.softmax(theta), np.float64)


def test_bandit_is_not_trivial(bandit):
  assert _tv(bandit["pi_ref"], bandit["pi_star"]).min() > 0.1
  assert _expected_reward(bandit["pi_star"], bandit["r"]) > _expected_reward(bandit["pi_ref"], bandit["r"]) + 0.2


def test_astarpo_converges_to_pi_star_with_exact_vstar(bandit):
  start = time.time()
  pi = _train_astarpo(bandit, jnp.asarray(bandit["vstar_exact"], jnp.float32))
  tv = _tv(pi, bandit["pi_star"])
  assert tv.max() < 0.01, tv
  # With the exact V* the regression residual β·log π/π_ref − (r − V*) is 0 on every action.
  residual = BETA * np.log(pi / bandit["pi_ref"]) - (bandit["r"] - bandit["vstar_exact"][:, None])
  assert np.abs(residual).max() < 0.02, residual
  assert time.time() - start < 30


def test_astarpo_converges_to_pi_star_with_vstar_from_64_reference_samples(bandit):
  """Stage 1 as in the method: V̂* from N = 64 samples of π_ref per prompt, then Stage 2."""
  actions_PN = jax.random.categorical(jax.random.PRNGKey(1), bandit["ref_logits"][:, None, :], shape=(P, 64))
  vhat_P = optimal_value(bandit["rewards"][jnp.arange(P)[:, None], actions_PN], BETA)
  assert np.abs(np.asarray(vhat_P) - bandit["vstar_exact"]).max() > 1e-3  # really an estimate
  pi = _train_astarpo(bandit, vhat_P)
  tv = _tv(pi, bandit["pi_star"])
  assert tv.max() < 0.05, tv
  assert abs(_expected_reward(pi, bandit["r"]) - _expected_reward(bandit["pi_star"], bandit["r"])) < 0.02


def test_astarpo_converges_to_pi_star_with_fractional_rewards():
  """Rewards anywhere in [0, 1] (a user's reward function): the same fixed point π* ∝ π_ref·exp(r/β), with V̂*
  from N = 64 reference samples of fractional rewards through `optimal_value`."""
  rng = np.random.default_rng(1)
  ref_logits_PA = rng.normal(0.0, 1.0, (P, A))
  ref_logits_PA -= np.log(np.exp(ref_logits_PA).sum(1, keepdims=True))
  r_PA = np.round(rng.uniform(0.0, 1.0, (P, A)), 2)  # e.g. partial credit: 0.37, 0.8, ...
  pi_ref = np.exp(ref_logits_PA)
  z_P = (pi_ref * np.exp(r_PA / BETA)).sum(1)
  frac = dict(ref_logits=jnp.asarray(ref_logits_PA, jnp.float32), rewards=jnp.asarray(r_PA, jnp.float32))
  pi_star = pi_ref * np.exp(r_PA / BETA) / z_P[:, None]
  assert _tv(pi_ref, pi_star).min() > 0.05  # not trivial
  actions_PN = jax.random.categorical(jax.random.PRNGKey(2), frac["ref_logits"][:, None, :], shape=(P, 64))
  vhat_P = optimal_value(frac["rewards"][jnp.arange(P)[:, None], actions_PN], BETA)
  np.testing.assert_allclose(np.asarray(vhat_P), BETA * np.log(z_P), atol=0.1)  # an estimate of the exact V*
  pi = _train_astarpo(frac, vhat_P)
  assert _tv(pi, pi_star).max() < 0.05, _tv(pi, pi_star)
  assert abs(_expected_reward(pi, r_PA) - _expected_reward(pi_star, r_PA)) < 0.02


# ---------------------------------------------------------------------------------------------
# Baselines on the same bandit: each must raise the expected reward well above π_ref's.

def _run_steps(step, carry, steps, seed):
  run = jax.jit(lambda c, k: jax.lax.scan(step, c, jax.random.split(k, steps))[0])
  return run(carry, jax.random.PRNGKey(seed))


def _train_grpo(bandit, steps=300, group=4, epochs=2, lr=0.05, seed=0):
  ref, rew = bandit["ref_logits"], bandit["rewards"]
  opt = optax.adam(lr)
  mask_B1 = jnp.ones((P * group, 1))

  def step(carry, key):
    theta, opt_state = carry
    a_PG = jax.random.categorical(key, theta[:, None, :], shape=(P, group))
    adv_B = BL.grpo_advantages(rew[jnp.arange(P)[:, None], a_PG]).reshape(-1)
    old_logp_B1, ref_logp_B1 = _logp(theta, a_PG), _logp(ref, a_PG)

    def epoch(c, _):  # several updates per batch, so the clipping is exercised
      th, st = c
      grad = jax.grad(lambda t: BL.grpo_loss(_logp(t, a_PG), old_logp_B1, ref_logp_B1, mask_B1, adv_B,
                                             clip_eps=0.2, kl_coef=0.04, loss_agg="seq_mean_token_mean")[0])(th)
      updates, st = opt.update(grad, st, th)
      return (optax.apply_updates(th, updates), st), None

    return jax.lax.scan(epoch, (theta, opt_state), None, length=epochs)[0], None

  theta, _ = _run_steps(step, (ref, opt.init(ref)), steps, seed)
  return np.asarray(jax.nn.softmax(theta), np.float64)


def _train_ppo(bandit, steps=300, per_prompt=4, epochs=2, lr=0.05, seed=0):
  """PPO with a tabular critic: one value per prompt (the single-token response's state)."""
  ref, rew = bandit["ref_logits"], bandit["rewards"]
  opt = optax.adam(lr)
  B = P * per_prompt
  mask_B1 = jnp.ones((B, 1))
  prompt_B = jnp.repeat(jnp.arange(P), per_prompt)

  def step(carry, key):
    params, opt_state = carry
    a_PK = jax.random.categorical(key, params["theta"][:, None, :], shape=(P, per_prompt))
    old_logp_B1 = _logp(params["theta"], a_PK)
    old_values_B1 = params["value"][prompt_B][:, None]
    token_rewards_B1 = BL.outcome_token_rewards(rew[jnp.arange(P)[:, None], a_PK].reshape(-1), mask_B1)
    adv_B1, returns_B1 = BL.gae_advantages(token_rewards_B1, old_values_B1, mask_B1, gamma=1.0, lam=1.0)

    def loss_fn(pr):
      pg, _ = BL.ppo_policy_loss(_logp(pr["theta"], a_PK), old_logp_B1, mask_B1, adv_B1, clip_eps=0.2)
      vf, _ = BL.ppo_value_loss(pr["value"][prompt_B][:, None], old_values_B1, returns_B1, mask_B1, value_clip=0.5)
      return pg + vf  # disjoint parameters: the sum trains actor and critic separately

    def epoch(c, _):
      pr, st = c
      updates, st = opt.update(jax.grad(loss_fn)(pr), st, pr)
      return (optax.apply_updates(pr, updates), st), None

    return jax.lax.scan(epoch, (params, opt_state), None, length=epochs)[0], None

  params = {"theta": ref, "value": jnp.zeros(P)}
  params, _ = _run_steps(step, (params, opt.init(params)), steps, seed)
  return np.asarray(jax.nn.softmax(params["theta"]), np.float64), np.asarray(params["value"])


def _train_rebel(bandit, steps=300, epochs=2, eta=1.0, lr=0.05, seed=0):
  rew = bandit["rewards"]
  opt = optax.adam(lr)
  mask_B21 = jnp.ones((P, 2, 1))

  def step(carry, key):
    theta, opt_state = carry
    a_P2 = jax.random.categorical(key, theta[:, None, :], shape=(P, 2))
    old_logp_B21 = _logp(theta, a_P2).reshape(P, 2, 1)
    rewards_B2 = rew[jnp.arange(P)[:, None], a_P2]

    def epoch(c, _):
      th, st = c
      grad = jax.grad(lambda t: BL.rebel_loss(_logp(t, a_P2).reshape(P, 2, 1), old_logp_B21, mask_B21,
                                              rewards_B2, eta=eta)[0])(th)
      updates, st = opt.update(grad, st, th)
      return (optax.apply_updates(th, updates), st), None

    return jax.lax.scan(epoch, (theta, opt_state), None, length=epochs)[0], None

  theta, _ = _run_steps(step, (bandit["ref_logits"], opt.init(bandit["ref_logits"])), steps, seed)
  return np.asarray(jax.nn.softmax(theta), np.float64)


def test_grpo_improves_expected_reward(bandit):
  before = _expected_reward(bandit["pi_ref"], bandit["r"])
  after = _expected_reward(_train_grpo(bandit), bandit["r"])
  assert after > before + 0.3, (before, after)


def test_ppo_improves_expected_reward_and_learns_the_value(bandit):
  before = _expected_reward(bandit["pi_ref"], bandit["r"])
  pi, value_P = _train_ppo(bandit)
  after = _expected_reward(pi, bandit["r"])
  assert after > before + 0.3, (before, after)
  # The tabular critic tracks the policy's value E_π[r | x] (it lags the policy a little).
  np.testing.assert_allclose(value_P, (pi * bandit["r"]).sum(1), atol=0.15)


def test_rebel_improves_expected_reward(bandit):
  before = _expected_reward(bandit["pi_ref"], bandit["r"])
  after = _expected_reward(_train_rebel(bandit), bandit["r"])
  assert after > before + 0.3, (before, after)
