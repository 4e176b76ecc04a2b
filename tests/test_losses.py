"""A*-PO loss, V*, and the token log-prob / entropy helpers, against hand-worked numbers and numpy."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

from astarpo_jax import losses as L


def _np_log_softmax(z):
  z = np.asarray(z, np.float64)
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


# ---------------------------------------------------------------------------------------------
# V*

# The paper's table for N = 8, β1 = 1/2, k correct out of 8.
VSTAR_TABLE_N8 = [0.0, 0.2935, 0.4772, 0.6113, 0.7169, 0.8040, 0.8782, 0.9428, 1.0]


def test_vstar_n8_beta_half_matches_table_and_closed_form():
  rewards_PN = np.array([[1.0] * k + [0.0] * (8 - k) for k in range(9)])
  v = np.asarray(L.vstar(jnp.asarray(rewards_PN), 0.5))
  closed = 0.5 * np.log((np.arange(9) * np.exp(2.0) + (8 - np.arange(9))) / 8)
  np.testing.assert_allclose(v, closed, atol=1e-6)
  np.testing.assert_allclose(closed, VSTAR_TABLE_N8, atol=5e-5)  # the table, to 4 decimals
  np.testing.assert_allclose(v, VSTAR_TABLE_N8, atol=5e-5)


def test_vstar_beta_zero_is_plain_mean():
  rewards_PN = jnp.array([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
  np.testing.assert_allclose(L.vstar(rewards_PN, 0.0), [0.5, 0.25], atol=1e-7)


def test_vstar_is_stable_for_tiny_beta():
  # exp(1/1e-3) overflows fp32; the log-sum-exp form gives 1 + β·log(k/N) without overflow.
  rewards_PN = jnp.array([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0], [0.0] * 4])
  v = np.asarray(L.vstar(rewards_PN, 1e-3))
  np.testing.assert_allclose(v, [1 + 1e-3 * np.log(0.25), 1 + 1e-3 * np.log(0.75), 0.0], atol=1e-6)


def test_vstar_mask_gives_each_prompt_its_own_sample_count():
  rewards_PN = jnp.array([[1.0, 0.0, 7.0, 7.0], [1.0, 1.0, 0.0, 0.0]])
  mask_PN = jnp.array([[1, 1, 0, 0], [1, 1, 1, 1]])
  v = np.asarray(L.vstar(rewards_PN, 0.5, mask_PN))
  np.testing.assert_allclose(v, [0.5 * np.log((np.exp(2) + 1) / 2), 0.5 * np.log((2 * np.exp(2) + 2) / 4)], atol=1e-6)
  np.testing.assert_allclose(L.vstar(rewards_PN, 0.0, mask_PN), [0.5, 0.5], atol=1e-7)


def test_vstar_rejects_prompt_without_samples_and_negative_beta():
  with pytest.raises(ValueError, match=r"prompts \[1\] have no sample"):
    L.vstar(jnp.ones((2, 3)), 0.5, jnp.array([[1, 0, 0], [0, 0, 0]]))
  with pytest.raises(ValueError, match="beta1"):
    L.vstar(jnp.ones((2, 3)), -1.0)
  with pytest.raises(ValueError, match="rewards_PN"):
    L.vstar(jnp.ones((6,)), 0.5)


def test_vstar_works_under_jit():
  f = jax.jit(functools.partial(L.vstar, beta1=0.5))
  np.testing.assert_allclose(f(jnp.array([[1.0, 0, 0, 0, 0, 0, 0, 0]])), [0.2935], atol=5e-5)


# ---------------------------------------------------------------------------------------------
# Token log-probs and entropy.

def test_token_logprobs_and_entropy_match_numpy_in_fp32_for_bf16_logits():
  logits = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 11)) * 3
  targets = jax.random.randint(jax.random.PRNGKey(1), (2, 3), 0, 11)
  for dtype in (jnp.float32, jnp.bfloat16):
    z = logits.astype(dtype)
    ls = _np_log_softmax(np.asarray(z.astype(jnp.float32)))
    logp, ent = L.token_logprobs(z, targets), L.token_entropy(z)
    assert logp.dtype == jnp.float32 and ent.dtype == jnp.float32
    np.testing.assert_allclose(logp, np.take_along_axis(ls, np.asarray(targets)[..., None], -1)[..., 0], atol=1e-5)
    np.testing.assert_allclose(ent, -(np.exp(ls) * ls).sum(-1), atol=1e-5)


def test_token_logprobs_and_entropy_are_stable_for_huge_logits():
  # exp(1e4) overflows; the answers are those of logits [0, −1, −2e4]. fp32 spacing near 1e4 is
  # ~1e-3, the accuracy to expect of log p; the entropy works on max-shifted logits, so is exact.
  logits = jnp.array([[[1e4, 1e4 - 1.0, -1e4]]])
  np.testing.assert_allclose(L.token_logprobs(logits, jnp.array([[1]])), [[-1.0 - np.log1p(np.exp(-1.0))]], atol=2e-3)
  p = np.array([1, np.exp(-1.0)]) / (1 + np.exp(-1.0))
  np.testing.assert_allclose(L.token_entropy(logits), [[-(p * np.log(p)).sum()]], atol=1e-5)
  np.testing.assert_allclose(L.token_entropy(jnp.zeros((1, 2, 7))), np.log(7) * np.ones((1, 2)), atol=1e-6)
  masked_vocab = jnp.array([[[0.0, 0.0, -jnp.inf]]])  # a -inf logit: probability 0, no NaN
  np.testing.assert_allclose(L.token_entropy(masked_vocab), [[np.log(2)]], atol=1e-6)


def _hidden_unembed_targets(B=2, T=10, D=8, V=50, seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (jax.random.normal(k[0], (B, T, D)), jax.random.normal(k[1], (D, V)) / 2,
          jax.random.randint(k[2], (B, T), 0, V))


@pytest.mark.parametrize("chunk", [1, 4, 64])  # chunk 4 does not divide T = 10; 64 exceeds it
def test_chunked_logprobs_entropy_equal_plain_version_with_gradients(chunk):
  hidden, unembed, targets = _hidden_unembed_targets()
  temperature = 0.7

  def plain(h, w):
    logits = jnp.einsum("btd,dv->btv", h, w) / temperature
    return L.token_logprobs(logits, targets), L.token_entropy(logits)

  def chunked(h, w):
    return L.chunked_logprobs_entropy(h, w, targets, chunk=chunk, temperature=temperature)

  def value_and_grads(f):  # outputs and gradients of a weighted sum of them, in one compile
    def scalar(h, w):
      logp, ent = f(h, w)
      return (logp * jnp.arange(10.0)).sum() + 0.3 * ent.sum(), (logp, ent)
    return jax.jit(jax.value_and_grad(scalar, (0, 1), has_aux=True))(hidden, unembed)

  (_, out_chunked), g_chunked = value_and_grads(chunked)
  (_, out_plain), g_plain = value_and_grads(plain)
  for a, b in zip(out_chunked, out_plain):
    np.testing.assert_allclose(a, b, atol=1e-5)
  for a, b in zip(g_chunked, g_plain):
    np.testing.assert_allclose(a, b, atol=1e-4)


def test_chunked_gradients_stay_exact_for_huge_logits_and_keep_input_dtypes():
  # Logits of size ~1e3-1e4: the hand-written backward must neither overflow nor lose the entropy's
  # gradient to rounding; bf16 inputs get bf16 gradients (the mixed-precision contract).
  hidden, unembed, targets = _hidden_unembed_targets()
  hidden = hidden * 300.0

  def grads(f, h, w):
    def scalar(h, w):
      logp, ent = f(h, w)
      return logp.sum() + 0.3 * ent.sum()
    return jax.jit(jax.grad(scalar, (0, 1)))(h, w)

  plain = lambda h, w: (L.token_logprobs(jnp.einsum("btd,dv->btv", h, w), targets),
                        L.token_entropy(jnp.einsum("btd,dv->btv", h, w)))
  chunked = lambda h, w: L.chunked_logprobs_entropy(h, w, targets, chunk=4)
  for a, b in zip(grads(chunked, hidden, unembed), grads(plain, hidden, unembed)):
    assert np.isfinite(np.asarray(a)).all()
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3)
  g16 = grads(chunked, hidden.astype(jnp.bfloat16), unembed.astype(jnp.bfloat16))
  assert [g.dtype for g in g16] == [jnp.bfloat16, jnp.bfloat16]


def _largest_intermediate(closed_jaxpr):
  sizes = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      sizes.extend(int(np.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape"))
      for sub in jex_core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(closed_jaxpr.jaxpr)
  return max(sizes)


def test_chunked_never_materialises_full_logits_forward_or_backward():
  B, T, D, V = 2, 12, 8, 50
  hidden, unembed, targets = _hidden_unembed_targets(B, T, D, V)

  def f(h, w):
    logp, ent = L.chunked_logprobs_entropy(h, w, targets, chunk=4)
    return logp.sum() + ent.sum()

  largest = _largest_intermediate(jax.make_jaxpr(jax.value_and_grad(f, (0, 1)))(hidden, unembed))
  assert largest <= B * 4 * V < B * T * V, largest


def test_chunked_accumulates_bf16_matmul_in_fp32():
  hidden, unembed, targets = _hidden_unembed_targets()
  h16, w16 = hidden.astype(jnp.bfloat16), unembed.astype(jnp.bfloat16)
  logp, ent = L.chunked_logprobs_entropy(h16, w16, targets, chunk=4)
  logits = np.einsum("btd,dv->btv", np.asarray(h16, np.float64), np.asarray(w16, np.float64))
  ls = _np_log_softmax(logits)
  assert logp.dtype == jnp.float32
  np.testing.assert_allclose(logp, np.take_along_axis(ls, np.asarray(targets)[..., None], -1)[..., 0], atol=1e-4)
  np.testing.assert_allclose(ent, -(np.exp(ls) * ls).sum(-1), atol=1e-4)


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
  loss, m = L.astarpo_loss(**_hand_case(), beta2=0.5, entropy_coef=0.01)
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
                                          beta2=0.5, entropy_coef=0.01)[0]
  g_logp, g_ref, g_ent = jax.grad(f, (0, 1, 2))(case["logp_BT"], case["ref_logp_BT"], case["entropy_BT"])
  np.testing.assert_allclose(g_logp, [[-0.125] * 3, [0.55, 0.55, 0.0]], atol=1e-6)
  np.testing.assert_allclose(g_ref, np.zeros((2, 3)), atol=0)
  np.testing.assert_allclose(g_ent, [[-0.002] * 3, [-0.002, -0.002, 0.0]], atol=1e-7)


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


def test_micro_batch_accumulation_gives_exactly_the_full_batch_gradient_and_metrics():
  d = _tiny_policy_batch()
  w_DV = d.pop("w_DV")

  @jax.jit
  @functools.partial(jax.grad, has_aux=True)
  def grad_fn(w, batch, num_seqs, num_tokens):
    logits_BTV = batch["hidden_BTD"] @ w
    logp, ent = L.token_logprobs(logits_BTV, batch["targets_BT"]), L.token_entropy(logits_BTV)
    return L.astarpo_loss(logp, batch["ref_logp_BT"], batch["mask_BT"], batch["rewards_B"], batch["vstar_B"], ent,
                          beta2=0.3, entropy_coef=0.5, num_seqs=num_seqs, num_tokens=num_tokens)

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
  # Each micro-batch averaged on its own counts (the default) gives a different, wrong gradient.
  naive = sum(grad_fn(w_DV, mb, 2, mb["mask_BT"].sum())[0] for mb in micro) / 3
  assert np.abs(naive - full_grad).max() > 1e-3


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


@pytest.mark.parametrize("chunk,vocab_chunk", [(4, 16), (3, 50), (64, 7)])  # 16 and 7 do not divide V = 50
def test_vocab_chunked_logprobs_equal_the_log_softmax_of_the_full_logits(chunk, vocab_chunk):
  hidden, unembed, targets = _hidden_unembed_targets()
  for scale in (1.0, 300.0):  # logits of size ~1e4 too: the blocks are combined around the max
    got = L.vocab_chunked_logprobs(hidden * scale, unembed, targets, chunk=chunk, vocab_chunk=vocab_chunk)
    logits = np.einsum("btd,dv->btv", np.asarray(hidden * scale, np.float64), np.asarray(unembed, np.float64))
    want = np.take_along_axis(_np_log_softmax(logits), np.asarray(targets)[..., None], -1)[..., 0]
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=1e-4 * scale, rtol=1e-5)


def test_vocab_chunked_logprobs_never_materialise_a_whole_vocabulary_row():
  B, T, D, V = 2, 12, 8, 50
  hidden, unembed, targets = _hidden_unembed_targets(B, T, D, V)
  largest = _largest_intermediate(jax.make_jaxpr(
      lambda h, w: L.vocab_chunked_logprobs(h, w, targets, chunk=4, vocab_chunk=16))(hidden, unembed))
  assert largest < B * T * D + 1 and largest <= max(B * 4 * 16, B * T * D), largest


@pytest.mark.parametrize("kwargs", [{"chunk": 0}, {"vocab_chunk": -1}, {"vocab_chunk": 2.5}])
def test_vocab_chunked_logprobs_reject_bad_chunk_sizes(kwargs):
  hidden, unembed, targets = _hidden_unembed_targets()
  with pytest.raises(ValueError, match=next(iter(kwargs))):
    L.vocab_chunked_logprobs(hidden, unembed, targets, **kwargs)
