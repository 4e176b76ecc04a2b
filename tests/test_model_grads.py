"""The hand-written backwards of the SwiGLU MLP and of attention equal autodiff of the plain formulas."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from astarpo_jax import model


def _plain_mlp(h, wg, wu, wd):
  return jnp.einsum("BTF,FD->BTD", jax.nn.silu(jnp.einsum("BTD,DF->BTF", h, wg)) * jnp.einsum("BTD,DF->BTF", h, wu), wd)


def _inputs(dtype, B=2, T=5, D=16, F=24):
  k = jax.random.split(jax.random.key(0), 5)
  h = jax.random.normal(k[0], (B, T, D)) * 2
  ws = [jax.random.normal(k[i], s) / np.sqrt(s[0]) for i, s in ((1, (D, F)), (2, (D, F)), (3, (F, D)))]
  g = jax.random.normal(k[4], (B, T, D))
  return [x.astype(dtype) for x in (h, *ws)], g.astype(dtype)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_swiglu_custom_backward_equals_autodiff(dtype, tol):
  args, g = _inputs(dtype)
  out, vjp = jax.vjp(model.swiglu_mlp, *args)
  out_ref, vjp_ref = jax.vjp(_plain_mlp, *args)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_ref, np.float32), rtol=tol, atol=tol)
  for got, want in zip(vjp(g), vjp_ref(g)):
    assert got.dtype == want.dtype == dtype
    scale = float(jnp.abs(want.astype(jnp.float32)).max())
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol * scale, rtol=0)


def test_decoder_gradients_with_custom_backwards_equal_autodiff_of_the_plain_block(monkeypatch):
  cfg = model.ModelConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=4)
  _, params = model.init_params(cfg, 0)
  tokens = jax.random.randint(jax.random.key(1), (2, 7), 0, 50)
  mask = jnp.ones((2, 7), bool).at[0, :2].set(False)
  pos = model.positions_from_mask(mask)

  def loss(p):
    logits, _ = model.forward(cfg, p, tokens, pos, mask)
    return (jax.nn.log_softmax(logits)[..., 3] * mask).sum()

  g_custom = jax.grad(loss)(params)
  monkeypatch.setattr(model, "swiglu_mlp", _plain_mlp)
  monkeypatch.setattr(model, "_attention", _plain_attention)
  g_plain = jax.grad(loss)(params)
  for a, b in zip(jax.tree.leaves(g_custom), jax.tree.leaves(g_plain)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def _plain_attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS):
  B, T, N, H = q_BTNH.shape
  K = k_BSKH.shape[2]
  s = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTNH.reshape(B, T, K, N // K, H), k_BSKH).astype(jnp.float32) / math.sqrt(H)
  s = jnp.where(mask_BTS[:, None, None], s, jnp.finfo(jnp.float32).min)
  p = jax.nn.softmax(s, axis=-1).astype(v_BSKH.dtype)
  return jnp.einsum("BKGTS,BSKH->BTKGH", p, v_BSKH).reshape(B, T, N, H)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_attention_custom_backward_equals_autodiff_with_left_padding(dtype, tol):
  B, T, N, K, H = 3, 6, 4, 2, 8
  k = jax.random.split(jax.random.key(2), 4)
  q, kk, v = (jax.random.normal(k[i], s).astype(dtype) for i, s in ((0, (B, T, N, H)), (1, (B, T, K, H)), (2, (B, T, K, H))))
  g = jax.random.normal(k[3], (B, T, N, H)).astype(dtype)
  valid_BT = jnp.ones((B, T), bool).at[0, :3].set(False).at[2, :1].set(False)  # left padding: pad queries see nothing
  mask_BTS = jnp.tril(jnp.ones((T, T), bool))[None] & valid_BT[:, None, :]
  out, vjp = jax.vjp(lambda a, b, c: model._attention(a, b, c, mask_BTS), q, kk, v)
  out_ref, vjp_ref = jax.vjp(lambda a, b, c: _plain_attention(a, b, c, mask_BTS), q, kk, v)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_ref, np.float32), atol=tol, rtol=tol)
  for got, want in zip(vjp(g), vjp_ref(g)):
    assert got.dtype == want.dtype == dtype
    scale = float(jnp.abs(want.astype(jnp.float32)).max())
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol * scale, rtol=0)
  # keys at padded slots get no gradient (every score that reads them is masked)
  assert float(jnp.abs(vjp(g)[1][0, :3]).max()) == 0.0
