"""The token log-prob / entropy heads (kernels.py) against numpy and autodiff of the plain forms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

from astarpo_jax.model import kernels as K


def _np_log_softmax(z):
  z = np.asarray(z, np.float64)
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


# ---------------------------------------------------------------------------------------------
# Token log-probs and entropy.

def test_token_logprobs_and_entropy_match_numpy_in_fp32_for_bf16_logits():
  logits = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 11)) * 3
  targets = jax.random.randint(jax.random.PRNGKey(1), (2, 3), 0, 11)
  for dtype in (jnp.float32, jnp.bfloat16):
    z = logits.astype(dtype)
    ls = _np_log_softmax(np.asarray(z.astype(jnp.float32)))
    logp, ent = K.token_logprobs(z, targets), K.token_entropy(z)
    assert logp.dtype == jnp.float32 and ent.dtype == jnp.float32
    np.testing.assert_allclose(logp, np.take_along_axis(ls, np.asarray(targets)[..., None], -1)[..., 0], atol=1e-5)
    np.testing.assert_allclose(ent, -(np.exp(ls) * ls).sum(-1), atol=1e-5)


def test_token_logprobs_and_entropy_are_stable_for_huge_logits():
  # exp(1e4) overflows; the answers are those of logits [0, −1, −2e4]. fp32 spacing near 1e4 is
  # ~1e-3, the accuracy to expect of log p; the entropy works on max-shifted logits, so is exact.
  logits = jnp.array([[[1e4, 1e4 - 1.0, -1e4]]])
  np.testing.assert_allclose(K.token_logprobs(logits, jnp.array([[1]])), [[-1.0 - np.log1p(np.exp(-1.0))]], atol=2e-3)
  p = np.array([1, np.exp(-1.0)]) / (1 + np.exp(-1.0))
  np.testing.assert_allclose(K.token_entropy(logits), [[-(p * np.log(p)).sum()]], atol=1e-5)
  np.testing.assert_allclose(K.token_entropy(jnp.zeros((1, 2, 7))), np.log(7) * np.ones((1, 2)), atol=1e-6)
  masked_vocab = jnp.array([[[0.0, 0.0, -jnp.inf]]])  # a -inf logit: probability 0, no NaN
  np.testing.assert_allclose(K.token_entropy(masked_vocab), [[np.log(2)]], atol=1e-6)


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
    return K.token_logprobs(logits, targets), K.token_entropy(logits)

  def chunked(h, w):
    return K.chunked_logprobs_entropy(h, w, targets, chunk=chunk, temperature=temperature)

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

  plain = lambda h, w: (K.token_logprobs(jnp.einsum("btd,dv->btv", h, w), targets),
                        K.token_entropy(jnp.einsum("btd,dv->btv", h, w)))
  chunked = lambda h, w: K.chunked_logprobs_entropy(h, w, targets, chunk=4)
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
    logp, ent = K.chunked_logprobs_entropy(h, w, targets, chunk=4)
    return logp.sum() + ent.sum()

  largest = _largest_intermediate(jax.make_jaxpr(jax.value_and_grad(f, (0, 1)))(hidden, unembed))
  assert largest <= B * 4 * V < B * T * V, largest


def test_chunked_accumulates_bf16_matmul_in_fp32():
  hidden, unembed, targets = _hidden_unembed_targets()
  h16, w16 = hidden.astype(jnp.bfloat16), unembed.astype(jnp.bfloat16)
  logp, ent = K.chunked_logprobs_entropy(h16, w16, targets, chunk=4)
  logits = np.einsum("btd,dv->btv", np.asarray(h16, np.float64), np.asarray(w16, np.float64))
  ls = _np_log_softmax(logits)
  assert logp.dtype == jnp.float32
  np.testing.assert_allclose(logp, np.take_along_axis(ls, np.asarray(targets)[..., None], -1)[..., 0], atol=1e-4)
  np.testing.assert_allclose(ent, -(np.exp(ls) * ls).sum(-1), atol=1e-4)


@pytest.mark.parametrize("chunk,vocab_chunk", [(4, 16), (3, 50), (64, 7)])  # 16 and 7 do not divide V = 50
def test_vocab_chunked_logprobs_equal_the_log_softmax_of_the_full_logits(chunk, vocab_chunk):
  hidden, unembed, targets = _hidden_unembed_targets()
  for scale in (1.0, 300.0):  # logits of size ~1e4 too: the blocks are combined around the max
    got = K.vocab_chunked_logprobs(hidden * scale, unembed, targets, chunk=chunk, vocab_chunk=vocab_chunk)
    logits = np.einsum("btd,dv->btv", np.asarray(hidden * scale, np.float64), np.asarray(unembed, np.float64))
    want = np.take_along_axis(_np_log_softmax(logits), np.asarray(targets)[..., None], -1)[..., 0]
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=1e-4 * scale, rtol=1e-5)


def test_vocab_chunked_logprobs_never_materialise_a_whole_vocabulary_row():
  B, T, D, V = 2, 12, 8, 50
  hidden, unembed, targets = _hidden_unembed_targets(B, T, D, V)
  largest = _largest_intermediate(jax.make_jaxpr(
      lambda h, w: K.vocab_chunked_logprobs(h, w, targets, chunk=4, vocab_chunk=16))(hidden, unembed))
  assert largest < B * T * D + 1 and largest <= max(B * 4 * 16, B * T * D), largest


@pytest.mark.parametrize("kwargs", [{"chunk": 0}, {"vocab_chunk": -1}, {"vocab_chunk": 2.5}])
def test_vocab_chunked_logprobs_reject_bad_chunk_sizes(kwargs):
  hidden, unembed, targets = _hidden_unembed_targets()
  with pytest.raises(ValueError, match=next(iter(kwargs))):
    K.vocab_chunked_logprobs(hidden, unembed, targets, **kwargs)
