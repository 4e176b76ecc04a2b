"""The decoder layer, written once, and the two layouts its forms run in (decoder.py holds the forms).

`Rows` also applies a LoRA adapter (model/lora.py) where the layer's params carry one: a weight `name` with
leaves `name + "_lora_a"` [*in, r] and `name + "_lora_b"` [r, *out] computes x W + s (x A) B, s = cfg.lora_scale,
so the frozen base is read as stored and no merged weight exists in the forward or its backward.
Axis letters as in decoder.py; r the adapter's rank.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from astarpo_jax.infra import platforms
from astarpo_jax.infra.sharding import constrain
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.model.layers import apply_rope, rms_norm, swiglu_mlp

Params = dict  # one layer's slice of the param pytree, or the whole tree
LORA_A, LORA_B = "_lora_a", "_lora_b"  # suffixes of an adapter's leaves beside the weight they adapt


# ----------------------------------------------------------------------------- the decoder layer
#
# The forms of the forward differ only in
#  - how activations and weights are laid out: `Rows` keeps activations [B, T, D] and uses the
#    params as stored (full forward, prefill, decode on accelerators); `Columns` runs one token
#    per row with activations [D, B] and the weights fused and stored [out, in] (`fused_decode_params`),
#    the orientation in which XLA:CPU's small-batch matmuls run about twice as fast;
#  - what attention reads and writes (`attend`): causal attention within the call, a cache written
#    at one slot for every row (prefill), or at each row's own slot (decode).


@dataclasses.dataclass(frozen=True)
class Rows:
  """Activations [B, T, D]; weights as stored in the params (one layer's slice), plus any LoRA adapter."""
  cfg: ModelConfig

  def _w(self, lp, name):
    return lp[name].astype(self.cfg.dtype)

  def _proj(self, spec, x, lp, name):
    """einsum(spec, x, W) + s (x A) B when `name` has an adapter: A's leading dims contract x's trailing ones."""
    y = jnp.einsum(spec, x, self._w(lp, name))
    if name + LORA_A not in lp:
      return y
    scale = getattr(self.cfg, "lora_scale", None)
    if scale is None:
      raise ValueError(f"the params carry a LoRA adapter on {name} but the model config has no lora_scale: "
                       "build it with model.lora.model_config(cfg, lora_config)")
    a, b = self._w(lp, name + LORA_A), self._w(lp, name + LORA_B)
    xa = jnp.tensordot(x, a, axes=a.ndim - 1) * jnp.asarray(scale, x.dtype)  # [B, T, r]
    return y + jnp.tensordot(xa, b, axes=1).astype(y.dtype)

  def norm(self, x_BTD, scale_D):
    return rms_norm(x_BTD, scale_D, self.cfg.rms_norm_eps)

  def qkv(self, h_BTD, lp):
    return tuple(self._proj("BTD,DXH->BTXH", h_BTD, lp, name) for name in ("wq", "wk", "wv"))

  def attn_out(self, attn_BTNH, lp):
    return self._proj("BTNH,NHD->BTD", attn_BTNH, lp, "wo")

  def mlp(self, h_BTD, lp):
    if not any(n + LORA_A in lp for n in ("w_gate", "w_up", "w_down")):
      return swiglu_mlp(h_BTD, self._w(lp, "w_gate"), self._w(lp, "w_up"), self._w(lp, "w_down"))
    # Autodiff here (not swiglu_mlp's hand-written backward, which forms every weight's gradient): the frozen
    # base weights get none, the adapters theirs from [B, T, r] products.
    pre_BTF = constrain(self._proj("BTD,DF->BTF", h_BTD, lp, "w_gate"), ("batch", "length", "mlp"))
    up_BTF = constrain(self._proj("BTD,DF->BTF", h_BTD, lp, "w_up"), ("batch", "length", "mlp"))
    return self._proj("BTF,FD->BTD", jax.nn.silu(pre_BTF) * up_BTF, lp, "w_down")

  def residual(self, x_BTD):
    return constrain(x_BTD, ("batch", "length", "act_embed"))


@dataclasses.dataclass(frozen=True)
class Columns:
  """One token per row, activations [D, B]; weights from `fused_decode_params` ([out, in], fused)."""
  cfg: ModelConfig

  def norm(self, x_DB, scale_D):
    return rms_norm(x_DB.T, scale_D, self.cfg.rms_norm_eps).T

  def qkv(self, h_DB, lp):
    N, K, H = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
    qkv_OB = lp["qkv_OD"] @ h_DB  # sliced before transposing: XLA:CPU then keeps the fast matmul form
    B = qkv_OB.shape[1]
    return (qkv_OB[:N * H].T.reshape(B, 1, N, H), qkv_OB[N * H:(N + K) * H].T.reshape(B, 1, K, H),
            qkv_OB[(N + K) * H:].T.reshape(B, 1, K, H))

  def attn_out(self, attn_BTNH, lp):
    return lp["o_DO"] @ attn_BTNH.reshape(attn_BTNH.shape[0], -1).T

  def mlp(self, h_DB, lp):
    gate_FB, up_FB = jnp.split(lp["gate_up_OD"] @ h_DB, 2, axis=0)
    return lp["down_DF"] @ (jax.nn.silu(gate_FB) * up_FB)

  def residual(self, x_DB):
    return x_DB


def decoder_layer(cfg: ModelConfig, ops, x, lp, positions_BT, inv_freq, attend):
  """One pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(x)). Returns (x, what `attend`
  returned beside its output, e.g. the updated layer cache).

  `ops` lays out activations and weights (`Rows` or `Columns`); `attend(q_BTNH, k_BTKH, v_BTKH)
  -> (out_BTNH, aux)` receives the rotated queries and keys.
  """
  dt = jnp.dtype(cfg.dtype)
  q_BTNH, k_BTKH, v_BTKH = ops.qkv(ops.norm(x, lp["attn_norm"]), lp)
  if cfg.qkv_bias:
    q_BTNH, k_BTKH, v_BTKH = (q_BTNH + lp["bq"].astype(dt), k_BTKH + lp["bk"].astype(dt),
                              v_BTKH + lp["bv"].astype(dt))
  if cfg.qk_norm:
    q_BTNH = rms_norm(q_BTNH, lp["q_norm"], cfg.rms_norm_eps)
    k_BTKH = rms_norm(k_BTKH, lp["k_norm"], cfg.rms_norm_eps)
  q_BTNH = constrain(apply_rope(q_BTNH, positions_BT, inv_freq), ("batch", "length", "heads", "head_dim"))
  k_BTKH = constrain(apply_rope(k_BTKH, positions_BT, inv_freq), ("batch", "length", "kv_heads", "head_dim"))
  attn_BTNH, aux = attend(q_BTNH, k_BTKH, v_BTKH)
  x = x + ops.attn_out(attn_BTNH, lp)
  x = x + ops.mlp(ops.norm(x, lp["mlp_norm"]), lp)
  return ops.residual(x), aux


def over_layers(body, carry, layers):
  """`lax.scan(body, carry, layers)` over stacked layers, or a Python loop over a list of per-layer trees
  (`unstack_layers`: the GPU's sampling copy). XLA:GPU copies a layer's weights out of a stacked [L, ...]
  array before its matmuls, dynamic index or static: for Qwen2.5-7B on 8 x H200 that copy was about half of a
  decode step's HBM bytes (docs/tpu.md 0)."""
  if not isinstance(layers, list):
    return jax.lax.scan(body, carry, layers)
  for lp in layers:
    carry, _ = body(carry, lp)
  return carry, None


def unstack_layers(params: Params) -> Params:
  """`params` with its stacked layers as a list of per-layer trees (`over_layers` loops over them)."""
  L = jax.tree.leaves(params["layers"])[0].shape[0]
  return dict(params, layers=[jax.tree.map(lambda w, i=i: w[i], params["layers"]) for i in range(L)])


# ----------------------------------------------------------------------------- the training forward's layer form
#
# The cache-free forward (scoring, training) runs its layers as a `lax.scan` over the stacked [L, ...] params
# ("scan", compile time flat in depth) or as a Python loop over per-layer slices taken once per call
# ("unstacked"). XLA:GPU copies a layer's weights out of the stack in every trip of the scan, forward, remat and
# backward, and writes each layer's gradient back into a stacked buffer: Qwen2.5-7B's update on 8 x H200 moved 5.74 TB
# of HBM a call with the scan, 4.80 unstacked (compile-only; docs/tpu.md, the GPU training forward). TPUs keep the
# scan: their compiles read the stacked slices without copies.
TRAIN_LAYER_FORMS = ("auto", "scan", "unstacked")


def target_platform() -> str:
  """The platform the code is being traced for: the mesh's (a compile-only GPU target traced on this CPU host
  included) inside a `jax.set_mesh` context, else the default backend."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return device.platform if device is not None else jax.default_backend()


def train_layer_form(form: str = "auto", platform: str | None = None) -> str:
  """"scan" or "unstacked" for the cache-free forward: `form` as given, or "auto": unstacked on GPUs (the
  platform traced for, `target_platform`), the scan elsewhere."""
  if form not in TRAIN_LAYER_FORMS:
    raise ValueError(f"layer_form={form!r}: use one of {TRAIN_LAYER_FORMS}")
  if form != "auto":
    return form
  return "unstacked" if platforms.is_gpu(platform or target_platform()) else "scan"


@jax.custom_vjp
def unstack_for_training(layers: Params) -> list:
  """`unstack_layers`' per-layer list of the stacked `layers`, differentiable with a backward that stacks the L
  per-layer gradients in one concatenation (autodiff of L slices would pad each layer's gradient to the whole
  stack and add L of them)."""
  L = jax.tree.leaves(layers)[0].shape[0]
  return [jax.tree.map(lambda w, i=i: w[i], layers) for i in range(L)]


def _unstack_fwd(layers):
  return unstack_for_training(layers), None


def _unstack_bwd(_, grads_L):
  return (jax.tree.map(lambda *g: jnp.stack(g), *grads_L),)


unstack_for_training.defvjp(_unstack_fwd, _unstack_bwd)


def stack_layers(params: Params) -> Params:
  """The inverse of `unstack_layers`: the per-layer list stacked back on a leading [L] axis."""
  return dict(params, layers=jax.tree.map(lambda *w: jnp.stack(w), *params["layers"]))


def unstacked_shardings(shardings: Params, num_layers: int) -> Params:
  """The NamedShardings of `unstack_layers(params)` from those of the stacked params (the layer axis dropped)."""
  drop = lambda s: jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*tuple(s.spec)[1:]))  # noqa: E731
  return dict(shardings, layers=[jax.tree.map(drop, shardings["layers"]) for _ in range(num_layers)])

