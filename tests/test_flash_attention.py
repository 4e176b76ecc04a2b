"""The flash kernels of the cache-free forward (model/flash.py), run in Pallas' interpreter on the CPU, equal the
plain softmax attention (layers.attention) under the causal, same-segment, real-key mask: outputs at every real
query and the gradients of a loss over them, for left-padded and packed rows with grouped-query heads; the
decoder's whole training forward with the kernel gives the XLA blocks' logits and gradients; "auto" runs the
kernel on GPUs only."""
import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from astarpo_jax.model import decoder, flash, kernels, layers
from astarpo_jax.model.config import ModelConfig


def _rows(T: int, packed: bool):
  """Segment ids [2, T]: row 0 left-padded (or two packed sequences and trailing padding), row 1 all real."""
  seg = np.ones((2, T), np.int32)
  if packed:
    seg[0, : T // 2], seg[0, T // 2: T - 3], seg[0, T - 3:] = 1, 2, 0
  else:
    seg[0, :5] = 0
  return jnp.asarray(seg)


def _reference(q, k, v, seg):
  T = q.shape[1]
  causal = jnp.arange(T)[None, :] <= jnp.arange(T)[:, None]
  mask = causal[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
  return layers.attention(q, k, v, mask)


@pytest.mark.parametrize("kernel,T,H", [("triton", 32, 16), ("mosaic", 128, 128)])
@pytest.mark.parametrize("packed", [False, True])
def test_flash_kernel_equals_masked_softmax_attention_and_its_gradients(kernel, T, H, packed):
  B, N, K = 2, 4, 2
  kq, kk, kv, kw = jax.random.split(jax.random.key(0), 4)
  q, k, v = (jax.random.normal(key, (B, T, n, H), jnp.float32) for key, n in ((kq, N), (kk, K), (kv, K)))
  w = jax.random.normal(kw, (B, T, N, H), jnp.float32)
  seg = _rows(T, packed)
  real = (seg > 0)[:, :, None, None].astype(jnp.float32)  # padding queries' outputs feed nothing

  def loss(fn, q, k, v):
    return (fn(q, k, v) * w * real).sum()
  ours = lambda q, k, v: flash.flash_causal_attention(q, k, v, seg, kernel, interpret=True)  # noqa: E731
  ref = lambda q, k, v: _reference(q, k, v, seg)  # noqa: E731
  out_ref, g_ref = _out_and_grads(ref, loss, q, k, v)  # outside any interpreter
  interpreted = contextlib.nullcontext()
  if kernel == "mosaic":  # the TPU kernel's interpreter, entered around its forward and backward (jitted)
    from jax.experimental.pallas import tpu as pltpu
    interpreted = pltpu.force_tpu_interpret_mode()
  with interpreted:
    out, g = _out_and_grads(ours, loss, q, k, v)
  np.testing.assert_allclose(out * real, out_ref * real, rtol=2e-5, atol=2e-5)
  for name, a, b in zip("qkv", g, g_ref):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.abs(b).max()), err_msg=name)


def _out_and_grads(fn, loss, q, k, v):
  return jax.jit(lambda q, k, v: (fn(q, k, v), jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2))(q, k, v)))(
      q, k, v)


def test_auto_runs_the_kernel_on_gpus_only_and_refuses_bad_choices():
  assert flash.train_attention("auto", "gpu") == flash.train_attention("auto", "cuda") == "flash"
  assert flash.train_attention("auto", "tpu") == flash.train_attention("auto", "cpu") == "xla"
  assert flash.train_attention("flash", "tpu") == "flash" and flash.train_attention("xla", "gpu") == "xla"
  assert flash.kernel_for("cuda") == "triton" and flash.kernel_for("tpu") == "mosaic"
  with pytest.raises(ValueError, match="GPU or TPU"):
    flash.kernel_for("cpu")
  with pytest.raises(ValueError, match="train_attention"):
    flash.train_attention("fused", "gpu")
  with pytest.raises(ValueError, match="train_attention"):
    ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                head_dim=4, train_attention="fast")
  with pytest.raises(ValueError, match="multiple of 16"):  # a length the kernel cannot block: a clear error
    flash.flash_causal_attention(*(jnp.zeros((1, 20, 2, 4)),) * 3, jnp.ones((1, 20)), "triton", interpret=True)
  assert flash.block_for(1280, (128, 64)) == 128 and flash.block_for(1288, (128, 64, 32, 16)) == 0


CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, remat=True, attention_block=8)


@pytest.mark.parametrize("packed", [False, True])
def test_training_forward_with_the_kernel_gives_the_xla_blocks_logits_and_gradients(monkeypatch, packed):
  """The decoder's cache-free forward as the update runs it (remat, the layer scan), the Triton kernel interpreted."""
  T = 32
  tokens = jax.random.randint(jax.random.key(1), (2, T), 0, CFG.vocab_size)
  seg = _rows(T, packed)
  positions = jnp.where(seg > 0, jnp.arange(T)[None] - jnp.argmax(seg > 0, axis=1)[:, None], 0)
  if packed:
    positions = positions.at[0, T // 2:].set(jnp.arange(T - T // 2))
  _, params = decoder.init_params(CFG, 0)
  w = ((seg[:, :-1] > 0) & (seg[:, 1:] > 0)).astype(jnp.float32)  # real queries (a padding one feeds nothing)

  def loss(cfg, p):
    h, _ = decoder.hidden_states(cfg, p, tokens, positions, seg > 0, segments_BT=seg if packed else None)
    logits = decoder.logits_from_hidden(cfg, p, h)[:, :-1]
    return (kernels.token_logprobs(logits, tokens[:, 1:]) * w).sum() / w.sum(), logits

  (v_xla, logits_xla), g_xla = jax.value_and_grad(functools.partial(loss, CFG), has_aux=True)(params)
  monkeypatch.setattr(flash, "kernel_for", lambda platform: "triton")
  monkeypatch.setitem(flash._KERNELS, "triton", lambda *args, interpret: flash._triton(*args, interpret=True))
  with_kernel = dataclasses.replace(CFG, train_attention="flash")
  assert flash.forward_kernel(with_kernel.train_attention, "cpu", T) == "triton"
  (v_fl, logits_fl), g_fl = jax.value_and_grad(functools.partial(loss, with_kernel), has_aux=True)(params)
  real = (seg[:, :-1] > 0)[..., None]
  np.testing.assert_allclose(logits_fl * real, logits_xla * real, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(v_fl, v_xla, rtol=1e-5)
  for path, a, b in zip(jax.tree.leaves_with_path(g_fl), jax.tree.leaves(g_fl), jax.tree.leaves(g_xla)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.abs(b).max()) + 1e-7, err_msg=str(path[0]))


def _kernel_flops(text: str) -> float:
  from astarpo_jax.aot import hlo_cost
  cost, _ = hlo_cost.analyze(text)
  return sum(f for (op, _), (f, _, _) in cost.by_op.items() if op == "custom-call")


def _compiled_grad_text(devices, kernel: str, B: int, T: int, N: int, K: int, H: int) -> str:
  """Forward and backward of the kernel compiled for one compile-only device of `devices`."""
  from jax.sharding import NamedSharding, PartitionSpec
  mesh = jax.sharding.Mesh(np.array(devices[:1]), ("x",))
  sds = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, PartitionSpec()))  # noqa: E731

  def loss(q, k, v, seg):
    return flash.flash_causal_attention(q, k, v, seg, kernel).astype(jnp.float32).sum()
  fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  return fn.lower(sds((B, T, N, H)), sds((B, T, K, H)), sds((B, T, K, H)), sds((B, T), jnp.int32)).compile().as_text()


def test_the_cost_model_counts_the_gpu_kernels_matmuls_over_the_causal_half():
  """Compile-only for an H100 (the CUDA plugin): forward 2 matmuls, the one backward kernel 5, each
  2 x B x N x T x H x T / 2 FLOPs; the preprocessing kernel none (hand-worked)."""
  from astarpo_jax.aot import chips
  from tests.test_aot import _cuda_plugin
  if not _cuda_plugin():
    pytest.skip("compile-only CUDA needs jax-cuda12-plugin/-pjrt (docs/tpu.md 0)")
  from astarpo_jax.aot import hlo_cost
  assert flash.SCOPE == hlo_cost.FLASH_SCOPE
  B, T, N, K, H = 2, 256, 4, 2, 64
  text = _compiled_grad_text(chips.topology_devices("h100x4"), "triton", B, T, N, K, H)
  assert text.count('custom_call_target="__gpu$xla.gpu.triton"') == 3  # forward, preprocess, backward
  per_matmul = 2 * B * N * T * H * T / 2
  assert _kernel_flops(text) == (2 + 5) * per_matmul


def test_the_cost_model_counts_the_tpu_kernels_matmuls_over_the_causal_half():
  """Compile-only for a v5e (libtpu): forward 2 matmuls, the dq kernel 3, the dk/dv kernel 4 (hand-worked)."""
  from astarpo_jax.aot import chips
  if not chips.libtpu_available():
    pytest.skip("libtpu not installed: pip install -e '.[test]' brings it (jax[tpu])")
  B, T, N, K, H = 1, 256, 2, 1, 128
  text = _compiled_grad_text(chips.topology_devices("v5e-8"), "mosaic", B, T, N, K, H)
  per_matmul = 2 * B * N * T * H * T / 2
  assert _kernel_flops(text) == (2 + 3 + 4) * per_matmul
