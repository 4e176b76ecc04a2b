"""The decoder's math, shared by every form of the forward (decoder.py): RMSNorm, RoPE (with Llama 3's
scaling), grouped-query attention (whole, or causal in query blocks), and the SwiGLU MLP with its
hand-written backward. Pure functions of arrays; axis letters as in decoder.py.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from astarpo_jax.infra.sharding import constrain
from astarpo_jax.model.config import ModelConfig


def rms_norm(x_BTD, scale_D, eps):
  """RMSNorm in fp32, cast back, then scaled (the HF Qwen2/Llama order of operations)."""
  x = x_BTD.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return scale_D.astype(x_BTD.dtype) * x.astype(x_BTD.dtype)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
  """Inverse frequencies [H/2], with Llama 3's wavelength-dependent scaling when configured."""
  H = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
  if cfg.rope_llama3_scaling is None:
    return inv
  factor, low_ff, high_ff, old_len = cfg.rope_llama3_scaling
  wavelen = 2 * math.pi / inv
  low_wavelen, high_wavelen = old_len / low_ff, old_len / high_ff
  smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
  mid = (1 - smooth) * inv / factor + smooth * inv
  out = jnp.where(wavelen > low_wavelen, inv / factor, inv)
  is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
  return jnp.where(is_mid, mid, out)


def apply_rope(x_BTNH, positions_BT, inv_freq):
  """Rotary embedding, HF `rotate_half` convention (first and second halves of the head dim)."""
  angles_BTh = positions_BT[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
  cos = jnp.cos(angles_BTh)[:, :, None, :]
  sin = jnp.sin(angles_BTh)[:, :, None, :]
  x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTNH.dtype)


def attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS):
  """Grouped-query attention; masked scores get the dtype's most negative value, softmax in fp32."""
  B, T, N, H = q_BTNH.shape
  K = k_BSKH.shape[2]
  q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
  scores_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH).astype(jnp.float32) / math.sqrt(H)
  scores_BKGTS = jnp.where(mask_BTS[:, None, None], scores_BKGTS, jnp.finfo(jnp.float32).min)
  probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(v_BSKH.dtype)
  out_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", probs_BKGTS, v_BSKH)
  return out_BTKGH.reshape(B, T, N, H)


def causal_attention(q_BTNH, k_BTKH, v_BTKH, mask_BTS, block: int):
  """Cache-free causal attention, `block` query rows at a time.

  Rows [a, b) attend to keys [0, b) only: every later key is causally masked for them, so each row
  with any unmasked key gets the same softmax (up to summation order). About half the score and
  softmax work of the full T x T square; on the CPU, forward + backward at T=192 take half the time.
  (A row whose keys are all masked, a left-padding position, gets a different meaningless output;
  padding rows feed nothing, as no real row attends to their keys.)
  """
  T = q_BTNH.shape[1]
  if block <= 0 or block >= T:
    return attention(q_BTNH, k_BTKH, v_BTKH, mask_BTS)
  outs = []
  for a in range(0, T, block):
    b = min(a + block, T)
    outs.append(attention(q_BTNH[:, a:b], k_BTKH[:, :b], v_BTKH[:, :b], mask_BTS[:, a:b, :b]))
  return jnp.concatenate(outs, axis=1)


def _swiglu_forward(h_BTD, w_gate_DF, w_up_DF, w_down_FD):
  pre_BTF = constrain(jnp.einsum("BTD,DF->BTF", h_BTD, w_gate_DF), ("batch", "length", "mlp"))
  up_BTF = constrain(jnp.einsum("BTD,DF->BTF", h_BTD, w_up_DF), ("batch", "length", "mlp"))
  out_BTD = jnp.einsum("BTF,FD->BTD", jax.nn.silu(pre_BTF) * up_BTF, w_down_FD)
  return out_BTD, (pre_BTF, up_BTF)


@jax.custom_vjp
def swiglu_mlp(h_BTD, w_gate_DF, w_up_DF, w_down_FD):
  """down(silu(h @ gate) * (h @ up)), the Qwen2/Llama MLP, with a hand-written backward.

  Autodiff of this block makes XLA:CPU fuse the silu derivative into a transposing copy that
  costs as much as a matmul; written out, the backward is six matmuls and one elementwise pass
  (about 20% faster per layer on the CPU), with the same residuals (h, h @ gate, h @ up).
  """
  return _swiglu_forward(h_BTD, w_gate_DF, w_up_DF, w_down_FD)[0]


def _swiglu_fwd(h_BTD, w_gate_DF, w_up_DF, w_down_FD):
  out_BTD, (pre_BTF, up_BTF) = _swiglu_forward(h_BTD, w_gate_DF, w_up_DF, w_down_FD)
  return out_BTD, (h_BTD, pre_BTF, up_BTF, w_gate_DF, w_up_DF, w_down_FD)


def _swiglu_bwd(residuals, g_out_BTD):
  h_BTD, pre_BTF, up_BTF, w_gate_DF, w_up_DF, w_down_FD = residuals
  dt = pre_BTF.dtype
  pre = pre_BTF.astype(jnp.float32)
  sig = jax.nn.sigmoid(pre)
  act_BTF = (pre * sig).astype(dt)  # silu, as the forward rounded it
  g_act_BTF = jnp.einsum("BTD,FD->BTF", g_out_BTD.astype(dt), w_down_FD)
  g_up_BTF = g_act_BTF * act_BTF
  # silu'(a) = σ(a)·(1 + a·(1 − σ(a)))
  g_pre_BTF = (g_act_BTF.astype(jnp.float32) * up_BTF.astype(jnp.float32) * sig * (1 + pre * (1 - sig))).astype(dt)
  # Written as (g_out^T act)^T: XLA:CPU then transposes the [B*T, D] operand, not the [B*T, F] one.
  g_w_down_FD = jnp.einsum("BTD,BTF->DF", g_out_BTD.astype(dt), act_BTF * up_BTF).T
  g_w_up_DF = jnp.einsum("BTD,BTF->DF", h_BTD, g_up_BTF)
  g_w_gate_DF = jnp.einsum("BTD,BTF->DF", h_BTD, g_pre_BTF)
  g_h_BTD = jnp.einsum("BTF,DF->BTD", g_up_BTF, w_up_DF) + jnp.einsum("BTF,DF->BTD", g_pre_BTF, w_gate_DF)
  return (g_h_BTD.astype(h_BTD.dtype), g_w_gate_DF.astype(w_gate_DF.dtype), g_w_up_DF.astype(w_up_DF.dtype),
          g_w_down_FD.astype(w_down_FD.dtype))


swiglu_mlp.defvjp(_swiglu_fwd, _swiglu_bwd)
