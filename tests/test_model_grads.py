"""The hand-written backward of the SwiGLU MLP equals autodiff of the plain formula."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from astarpo_jax.model import decoder, layer_forms, layers
from astarpo_jax.model.config import ModelConfig


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
  out, vjp = jax.vjp(layers.swiglu_mlp, *args)
  out_ref, vjp_ref = jax.vjp(_plain_mlp, *args)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_ref, np.float32), rtol=tol, atol=tol)
  for got, want in zip(vjp(g), vjp_ref(g)):
    assert got.dtype == want.dtype == dtype
    scale = float(jnp.abs(want.astype(jnp.float32)).max())
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol * scale, rtol=0)


def test_decoder_gradients_with_custom_mlp_equal_autodiff_of_the_plain_block(monkeypatch):
  cfg = ModelConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=4)
  _, params = decoder.init_params(cfg, 0)
  tokens = jax.random.randint(jax.random.key(1), (2, 7), 0, 50)
  mask = jnp.ones((2, 7), bool).at[0, :2].set(False)
  pos = decoder.positions_from_mask(mask)

  def loss(p):
    logits, _ = decoder.forward(cfg, p, tokens, pos, mask)
    return (jax.nn.log_softmax(logits)[..., 3] * mask).sum()

  g_custom = jax.grad(loss)(params)
  monkeypatch.setattr(layer_forms, "swiglu_mlp", _plain_mlp)  # the layer calls it there
  g_plain = jax.grad(loss)(params)
  for a, b in zip(jax.tree.leaves(g_custom), jax.tree.leaves(g_plain)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
