"""The token choice over a vocabulary split across devices (token_choice.choose_tokens_split) against the
inverse CDF in float64 over the whole vocabulary, and the greedy argmax. The collectives run under `vmap`
with an axis name, as they would over the tensor axis of a mesh."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from astarpo_jax.sampling import token_choice
from astarpo_jax.sampling.token_choice import SamplingConfig


def _split(logits_VB, u_B, scfg, t):
  V, B = logits_VB.shape
  draw = jax.vmap(lambda x, u: token_choice.choose_tokens_split(x, u, scfg, "tensor"), in_axes=(0, None),
                  axis_name="tensor")
  tok_tB, logp_tB = draw(logits_VB.reshape(t, V // t, B), u_B)
  assert np.all(tok_tB == tok_tB[:1]) and np.allclose(logp_tB, logp_tB[:1])  # the same on every device
  return np.asarray(tok_tB[0]), np.asarray(logp_tB[0])


def _inverse_cdf(logits_VB, u_B, temperature):
  """Float64: the smallest token whose cumulative probability exceeds u, its log-prob, and how far u is from
  the nearest CDF boundary (a draw that close may round either way)."""
  x = np.asarray(logits_VB, np.float64) / temperature
  p = np.exp(x - x.max(0))
  p /= p.sum(0)
  cdf = np.cumsum(p, 0)
  tok = np.array([np.searchsorted(cdf[:, b], u, side="right") for b, u in enumerate(u_B)])
  margin = np.min(np.abs(cdf - np.asarray(u_B)[None]), axis=0)
  return tok, np.log(p[tok, np.arange(len(u_B))]), margin


@pytest.mark.parametrize("V,t,temperature", [(1000, 4, 1.0), (9500, 2, 0.7), (152064 // 16, 8, 1.0)])
def test_split_draw_is_the_inverse_cdf_of_the_whole_vocabulary(V, t, temperature):
  """Shards whose length is not a multiple of the block (1000 / 4 = 250 tokens), peaked and flat rows."""
  rng = np.random.default_rng(V)
  B = 64
  logits = rng.normal(size=(V, B)).astype(np.float32) * np.linspace(0.5, 8.0, B, dtype=np.float32)
  u = rng.uniform(size=B).astype(np.float32)
  tok, logp = _split(jnp.asarray(logits), jnp.asarray(u), SamplingConfig(temperature=temperature), t)
  ref_tok, ref_logp, margin = _inverse_cdf(logits, u, temperature)
  clear = margin > 2e-6  # fp32 sums over 10^4 terms round at ~1e-7
  assert clear.sum() >= B - 3
  np.testing.assert_array_equal(tok[clear], ref_tok[clear])
  np.testing.assert_allclose(logp[clear], ref_logp[clear], rtol=1e-4, atol=1e-5)


def test_split_draw_follows_the_softmax_frequencies():
  """Many uniforms on one small row: the draw's frequencies are softmax(logits) (a chi-square bound)."""
  V, t, n = 48, 4, 20000
  logits = np.random.default_rng(0).normal(size=V).astype(np.float32) * 2
  u = np.random.default_rng(1).uniform(size=n).astype(np.float32)
  tok, _ = _split(jnp.broadcast_to(jnp.asarray(logits)[:, None], (V, n)), jnp.asarray(u), SamplingConfig(), t)
  p = np.exp(logits - logits.max())
  p /= p.sum()
  counts = np.bincount(tok, minlength=V)
  assert counts.sum() == n and counts.shape == (V,)
  chi2 = np.sum((counts - n * p) ** 2 / (n * p))
  assert chi2 < 100  # 47 degrees of freedom: p < 1e-5 above 90


def test_split_greedy_takes_the_first_maximum_and_its_unfiltered_logprob():
  V, t, B = 400, 4, 5
  logits = np.random.default_rng(2).normal(size=(V, B)).astype(np.float32)
  logits[150, 0] = logits[250, 0] = 9.0  # a tie across shards: the lower id wins
  logits[[10, 11], 1] = 9.0  # a tie within a shard
  tok, logp = _split(jnp.asarray(logits), jnp.zeros(B, jnp.float32), SamplingConfig(temperature=0.0), t)
  ref = np.argmax(logits, axis=0)  # numpy: first index on ties
  assert ref[0] == 150 and ref[1] == 10
  np.testing.assert_array_equal(tok, ref)
  lse = np.log(np.sum(np.exp(logits.astype(np.float64)), axis=0))
  np.testing.assert_allclose(logp, logits[ref, np.arange(B)] - lse, rtol=1e-5)


def test_top_k_and_top_p_are_refused_by_the_split_draw():
  assert token_choice.splits_vocab(SamplingConfig()) and token_choice.splits_vocab(SamplingConfig(temperature=0))
  for scfg in (SamplingConfig(top_k=5), SamplingConfig(top_p=0.9)):
    assert not token_choice.splits_vocab(scfg)
    with pytest.raises(ValueError, match="whole vocabulary"):
      _split(jnp.zeros((8, 2)), jnp.zeros(2), scfg, 2)
