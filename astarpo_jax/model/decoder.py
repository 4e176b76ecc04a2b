"""Decoder-only transformer covering HF `Qwen2ForCausalLM`, `Qwen3ForCausalLM` and `LlamaForCausalLM`.

Flax NNX declares the parameters (with logical axis names as metadata); the model is split once
into a graph definition and a plain nested-dict param pytree, and every computation is a pure
function of that pytree. Layers are stacked on a leading `layers` axis and run with `lax.scan`
so that compile time does not grow with depth.

Axis letters used in names and einsums:
  B batch, T query length, S key/cache length, L layers, D model dim, N query heads,
  K kv heads, G query heads per kv head (N = K*G), H head dim, F mlp hidden, V vocab.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from astarpo_jax.infra import platforms, sharding as sharding_lib
from astarpo_jax.infra.sharding import constrain
from astarpo_jax.model import flash
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.model.layer_forms import (LORA_A, Columns as _Columns, Rows as _Rows, decoder_layer,  # noqa: F401
                                           over_layers, stack_layers, target_platform, train_layer_form,
                                           unstack_for_training,
                                           unstack_layers, unstacked_shardings)  # noqa: F401
from astarpo_jax.model.layers import attention, causal_attention, rms_norm, rope_inv_freq

Params = dict[str, Any]  # nested dict of arrays (nnx.to_pure_dict of the model state)
Cache = dict[str, jax.Array]  # {"k": [L,B,S,K,H], "v": [L,B,S,K,H], "mask": [B,S] bool, "index": [] int32}

def _normal(rngs: nnx.Rngs, shape, dtype, std=0.02):
  return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Decoder(nnx.Module):
  """Parameter declarations with logical axis names; the math lives in pure functions below."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    pd = jnp.dtype(cfg.param_dtype)
    L, D, F, N, K, H, V = (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                           cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)
    P = lambda value, axes: nnx.Param(value, axes=axes)  # noqa: E731
    self.embed = P(_normal(rngs, (V, D), pd), ("vocab", "embed"))
    layers = {
        "attn_norm": P(jnp.ones((L, D), pd), ("layers", "norm")),
        "wq": P(_normal(rngs, (L, D, N, H), pd), ("layers", "embed", "heads", "head_dim")),
        "wk": P(_normal(rngs, (L, D, K, H), pd), ("layers", "embed", "kv_heads", "head_dim")),
        "wv": P(_normal(rngs, (L, D, K, H), pd), ("layers", "embed", "kv_heads", "head_dim")),
        "wo": P(_normal(rngs, (L, N, H, D), pd), ("layers", "heads", "head_dim", "embed")),
        "mlp_norm": P(jnp.ones((L, D), pd), ("layers", "norm")),
        "w_gate": P(_normal(rngs, (L, D, F), pd), ("layers", "embed", "mlp")),
        "w_up": P(_normal(rngs, (L, D, F), pd), ("layers", "embed", "mlp")),
        "w_down": P(_normal(rngs, (L, F, D), pd), ("layers", "mlp", "embed")),
    }
    if cfg.qkv_bias:
      layers["bq"] = P(jnp.zeros((L, N, H), pd), ("layers", "heads", "head_dim"))
      layers["bk"] = P(jnp.zeros((L, K, H), pd), ("layers", "kv_heads", "head_dim"))
      layers["bv"] = P(jnp.zeros((L, K, H), pd), ("layers", "kv_heads", "head_dim"))
    if cfg.qk_norm:
      layers["q_norm"] = P(jnp.ones((L, H), pd), ("layers", "norm"))
      layers["k_norm"] = P(jnp.ones((L, H), pd), ("layers", "norm"))
    self.layers = nnx.Dict(layers)
    self.final_norm = P(jnp.ones((D,), pd), ("norm",))
    if not cfg.tie_embeddings:
      self.lm_head = P(_normal(rngs, (D, V), pd), ("embed", "vocab"))


def init_params(cfg: ModelConfig, seed: int = 0) -> tuple[nnx.GraphDef, Params]:
  """Random init: returns the graph definition and the param pytree (a nested dict)."""
  graphdef, state = nnx.split(Decoder(cfg, nnx.Rngs(seed)))
  return graphdef, nnx.to_pure_dict(state)


def abstract_params(cfg: ModelConfig) -> tuple[nnx.GraphDef, Params]:
  """Shapes and dtypes of the params without allocating them (for sharding plans and imports)."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
  return graphdef, nnx.to_pure_dict(state)


def logical_axes(cfg: ModelConfig) -> Params:
  """The logical axis names of every param, in the same tree structure as the params."""
  _, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
  return jax.tree.map(lambda v: v.axes, state, is_leaf=lambda x: isinstance(x, nnx.Variable)).to_pure_dict()


def param_shardings(cfg: ModelConfig, mesh: jax.sharding.Mesh, rules=sharding_lib.DEFAULT_RULES) -> Params:
  """NamedShardings of the params of `cfg` on `mesh`, by the logical-axis rule table."""
  _, abstract = abstract_params(cfg)
  return sharding_lib.tree_shardings(mesh, logical_axes(cfg), abstract, rules)


# The decoder layer and its two layouts (`_Rows`, `_Columns`) live in layer_forms.py.


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: str | None = None) -> Cache:
  """An empty KV cache for `max_len` token slots per row."""
  shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
  dt = jnp.dtype(dtype or cfg.dtype)
  return {
      "k": jnp.zeros(shape, dt),
      "v": jnp.zeros(shape, dt),
      "mask": jnp.zeros((batch, max_len), bool),  # which slots hold a real (non-pad) token
      "index": jnp.zeros((), jnp.int32),  # next slot to write; shared by all rows (left padding)
  }


def _scan_layers(cfg: ModelConfig, layers: Params, x, positions_BT, attend_at, k_all=None, v_all=None,
                 form: str = "scan"):
  """Run the stacked layers with `lax.scan`; `attend_at(q, k, v, k_layer, v_layer)` gets this layer's
  cache slices (None without a cache). A cache rides in the scan carry (not xs/ys) so that XLA updates
  it in place, one layer at a time. `form` "unstacked" (cache-free only): a Python loop over per-layer
  slices taken once per call (`unstack_for_training`), each layer rematerialised on its own."""
  inv_freq = rope_inv_freq(cfg)
  ops = _Rows(cfg)

  def layer(x, lp, k_layer, v_layer):
    return decoder_layer(cfg, ops, x, lp, positions_BT, inv_freq,
                         lambda q, k, v: attend_at(q, k, v, k_layer, v_layer))
  if cfg.remat:
    layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)

  if k_all is None:
    def body(x, lp):
      return layer(x, lp, None, None)[0], None
    if form == "unstacked" and not isinstance(layers, list):
      layers = unstack_for_training(layers)
    return over_layers(body, x, layers)[0], None, None

  def body_cached(carry, lp):
    x, k_all, v_all, i = carry
    x, (k_layer, v_layer) = layer(x, lp, k_all[i], v_all[i])
    k_all = jax.lax.dynamic_update_index_in_dim(k_all, k_layer, i, 0)
    v_all = jax.lax.dynamic_update_index_in_dim(v_all, v_layer, i, 0)
    return (x, k_all, v_all, i + 1), None
  (x, k_all, v_all, _), _ = over_layers(body_cached, (x, k_all, v_all, jnp.zeros((), jnp.int32)), layers)
  return x, k_all, v_all


def hidden_states(cfg: ModelConfig, params: Params, tokens_BT, positions_BT, mask_BT,
                  cache: Cache | None = None, segments_BT=None, layer_form: str = "auto"
                  ) -> tuple[jax.Array, Cache | None]:
  """Final-normed hidden states [B, T, D] and the updated cache.

  `mask_BT` is True for real tokens (False for padding). Without a cache, attention is causal over
  this call's tokens; with one, the T tokens are written at slots [index, index+T) and attend to
  every earlier valid slot. Row positions are explicit, so left padding needs no special casing.
  `segments_BT` (cache-free only): several sequences packed in a row (packing.py), a token attending
  only to the earlier tokens of its own segment (ids > 0; 0 is padding). `layer_form` (cache-free only):
  layer_forms.train_layer_form's choice, "auto" = unstacked on GPUs, the layer scan elsewhere.
  """
  dt = jnp.dtype(cfg.dtype)
  T = tokens_BT.shape[1]
  x_BTD = constrain(params["embed"].astype(dt)[tokens_BT], ("batch", "length", "act_embed"))
  if cache is None:
    kernel = flash.forward_kernel(cfg.train_attention, target_platform(), T)
    if kernel:  # the mask as segment ids (model/flash.py)
      seg_BT = segments_BT if segments_BT is not None else mask_BT

      def attend_at(q, k, v, _k_layer, _v_layer):
        return flash.flash_causal_attention(q, k, v, seg_BT, kernel), None
    else:
      causal_TT = jnp.arange(T)[None, :] <= jnp.arange(T)[:, None]
      mask_BTS = causal_TT[None] & mask_BT[:, None, :]
      if segments_BT is not None:
        mask_BTS &= segments_BT[:, :, None] == segments_BT[:, None, :]

      def attend_at(q, k, v, _k_layer, _v_layer):
        return causal_attention(q, k, v, mask_BTS, cfg.attention_block), None
    x_BTD, _, _ = _scan_layers(cfg, params["layers"], x_BTD, positions_BT, attend_at,
                               form=train_layer_form(layer_form))
    return rms_norm(x_BTD, params["final_norm"], cfg.rms_norm_eps), None

  if segments_BT is not None:
    raise ValueError("segments_BT: packed rows are for cache-free forwards (scoring, training), not a cache")
  write_at = cache["index"]
  kv_mask_BS = jax.lax.dynamic_update_slice(cache["mask"], mask_BT, (0, write_at))
  S = cache["mask"].shape[1]
  causal_TS = jnp.arange(S)[None, :] <= (write_at + jnp.arange(T))[:, None]
  mask_BTS = causal_TS[None] & kv_mask_BS[:, None, :]

  def attend_cached(q, k, v, k_BSKH, v_BSKH):
    k_BSKH = jax.lax.dynamic_update_slice(k_BSKH, k.astype(k_BSKH.dtype), (0, write_at, 0, 0))
    v_BSKH = jax.lax.dynamic_update_slice(v_BSKH, v.astype(v_BSKH.dtype), (0, write_at, 0, 0))
    return attention(q, k_BSKH.astype(dt), v_BSKH.astype(dt), mask_BTS), (k_BSKH, v_BSKH)
  x_BTD, k_all, v_all = _scan_layers(cfg, params["layers"], x_BTD, positions_BT, attend_cached,
                                     cache["k"], cache["v"])
  h_BTD = rms_norm(x_BTD, params["final_norm"], cfg.rms_norm_eps)
  return h_BTD, {"k": k_all, "v": v_all, "mask": kv_mask_BS, "index": write_at + T}


def unembed_matrix(cfg: ModelConfig, params: Params) -> jax.Array:
  """[D, V] output projection (the transposed embedding when tied)."""
  if cfg.tie_embeddings:
    return params["embed"].T
  return params["lm_head"]


def gathered_unembed(cfg: ModelConfig, params: Params) -> jax.Array:
  """`unembed_matrix` whole over the batch axes (data, fsdp; a tensor split of the vocabulary kept), for a head
  that forms the logits in chunks inside a loop: constrained once per call, outside the loop, so that no chunk
  all-gathers the [D, V] matrix again (the gradient-free scoring did, once per 32-position chunk)."""
  return constrain(unembed_matrix(cfg, params), (None, "vocab"))


def logits_from_hidden(cfg: ModelConfig, params: Params, h_BTD) -> jax.Array:
  """Logits [B, T, V] in fp32 from hidden states."""
  dt = jnp.dtype(cfg.dtype)
  logits_BTV = jnp.einsum("BTD,DV->BTV", h_BTD.astype(dt), unembed_matrix(cfg, params).astype(dt))
  return constrain(logits_BTV.astype(jnp.float32), ("batch", "length", "vocab"))


def _decode_logits(cfg: ModelConfig, params: Params, x_B1D) -> jax.Array:
  """The decode's logits [V, B] from its last hidden states, vocab-major as the token choice reads them and in
  the compute dtype: the token choice casts inside its own fusions. On TPU a [B, V] result transposed, or an
  fp32 cast, was another copy of the logits written and read each step (docs/tpu.md 0)."""
  dt = jnp.dtype(cfg.dtype)
  h_BD = rms_norm(x_B1D, params["final_norm"], cfg.rms_norm_eps)[:, 0]
  logits_VB = jnp.einsum("DV,BD->VB", unembed_matrix(cfg, params).astype(dt), h_BD.astype(dt))
  return constrain(logits_VB, ("vocab", "batch"))


def forward(cfg: ModelConfig, params: Params, tokens_BT, positions_BT, mask_BT,
            cache: Cache | None = None, layer_form: str = "auto") -> tuple[jax.Array, Cache | None]:
  """Logits [B, T, V] (fp32) and the updated cache (None when called without one)."""
  h_BTD, cache = hidden_states(cfg, params, tokens_BT, positions_BT, mask_BT, cache, layer_form=layer_form)
  return logits_from_hidden(cfg, params, h_BTD), cache


# ----------------------------------------------------------------------------- one token per row
#
# Decoding feeds one token per row and writes its key/value at each row's own cache column, so
# rows at different lengths share a batch (continuous batching). Two layouts of the same layer:
# on the CPU, `fused_decode_params` (a second copy of the layer weights, `_Columns`) with the layers
# unrolled over per-layer cache buffers: with stacked weights and cache in a scan, XLA:CPU copies each
# layer's weight slice (and, in variants profiled, the stacked cache) on every step. Elsewhere the
# params as stored and the stacked cache in a scan, written in place, with no second copy of the weights.

DecodeCache = dict[str, Any]  # {"k", "v"}: per-layer tuples ([B,K,H,S], [B,K,S,H]) or stacked [L,B,S,K,H]
# (built, moved and sharded by astarpo_jax/decode_cache.py)


def fused_decode_params(cfg: ModelConfig, params: Params) -> Params:
  """The `_Columns` layout, in the compute dtype: per layer q|k|v and gate|up fused, every matrix
  [out, in], the other per-layer params as they are; the embedding (not copied) and the [V, D]
  unembedding (the embedding itself when tied and already in the compute dtype)."""
  if any(name.endswith(LORA_A) for name in params["layers"]):  # `_Columns` has no adapter path: merge it first
    raise ValueError("fused_decode_params: the params carry a LoRA adapter; sample from lora.merged(...) instead")
  dt = jnp.dtype(cfg.dtype)
  D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  fused = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
  layers = []
  for i in range(cfg.num_layers):
    lp = {name: w[i].astype(dt) for name, w in params["layers"].items()}
    out = {name: w for name, w in lp.items() if name not in fused}
    out["qkv_OD"] = jnp.concatenate([lp["wq"].reshape(D, N * H), lp["wk"].reshape(D, K * H),
                                     lp["wv"].reshape(D, K * H)], axis=1).T
    out["o_DO"] = lp["wo"].reshape(N * H, D).T
    out["gate_up_OD"] = jnp.concatenate([lp["w_gate"], lp["w_up"]], axis=1).T
    out["down_DF"] = lp["w_down"].T
    layers.append(out)
  tied_as_is = cfg.tie_embeddings and params["embed"].dtype == dt
  return {"layers": tuple(layers), "embed": params["embed"], "final_norm": params["final_norm"],
          "unembed_VD": params["embed"] if tied_as_is else unembed_matrix(cfg, params).T.astype(dt)}


def decode_params(cfg: ModelConfig, params: Params, backend: str | None = None) -> Params:
  """What `decode_step` runs on: on the CPU the fused copy (small-batch matmuls about 2x faster);
  on TPU/GPU the params in the compute dtype: the params themselves when stored in it (a bf16 π_ref),
  else cast once per call (an fp32 policy: half its bytes), so no decode step re-reads and re-casts
  fp32 weights (the TPU compile showed that cast inside every step: docs/tpu.md). The values are those
  every layer computes with anyway (each weight is cast to cfg.dtype before use). On GPU the layers are
  also unstacked (`unstack_layers`), a copy once per call, so that no step copies them out of the stack."""
  backend = backend or jax.default_backend()
  if backend == "cpu":
    return _fused_decode_params_jit(cfg, params)
  if platforms.is_gpu(backend):
    return params if is_unstacked(params) else _unstacked_compute_jit(params, cfg.dtype)
  return compute_dtype_params(cfg, params)


def makes_decode_copy(cfg: ModelConfig, backend: str) -> bool:
  """Whether `decode_params` copies the weights on `backend` for params stored in cfg.param_dtype: the CPU's fused
  layout and the GPU's unstacked layers always, a TPU's cast when the params are stored wider than they compute.
  An unknown backend ("") counts the cast only. The memory plan counts the copy."""
  if backend == "cpu" or platforms.is_gpu(backend):
    return True
  return jnp.dtype(cfg.param_dtype) != jnp.dtype(cfg.dtype)


def is_unstacked(params: Params) -> bool:
  """Whether `params` holds its layers as a list of per-layer trees (`unstack_layers`)."""
  return isinstance(params["layers"], list)


def compute_dtype_params(cfg: ModelConfig, params: Params) -> Params:
  """The params in the compute dtype: themselves when stored in it, else cast once (not in every step)."""
  dt = jnp.dtype(cfg.dtype)
  if all(x.dtype == dt for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)):
    return params
  return _cast_params_jit(params, cfg.dtype)


_fused_decode_params_jit = jax.jit(fused_decode_params, static_argnums=0)
_cast_params_jit = jax.jit(lambda params, dtype: cast_params(params, dtype), static_argnums=1)
_unstacked_compute_jit = jax.jit(lambda params, dtype: unstack_layers(cast_params(params, dtype)), static_argnums=1)


def is_fused(dparams: Params) -> bool:
  """Whether `dparams` (from `decode_params`) is the fused CPU layout."""
  return isinstance(dparams["layers"], tuple)


def _write_rows(c, x, col_B, axis: int):
  """c with x[b] written at index col_B[b] of `axis`, per row b (row axis 0 of c and x)."""
  return jax.vmap(lambda c1, x1, i: jax.lax.dynamic_update_index_in_dim(c1, x1.astype(c1.dtype), i, axis - 1))(
      c, x, col_B)


def _attend_columns(cfg, q_B1NH, k_B1KH, v_B1KH, k_BKHS, v_BKSH, col_B, live_BS):
  """Write this step's key/value at each row's column, then attend over the live columns; keys are
  stored [B, K, H, S] so that QK^T is a plain batched matmul."""
  dt = jnp.dtype(cfg.dtype)
  B, _, N, H = q_B1NH.shape
  K = k_B1KH.shape[2]
  k_BKHS = _write_rows(k_BKHS, k_B1KH[:, 0, :, :, None], col_B, 3)
  v_BKSH = _write_rows(v_BKSH, v_B1KH[:, 0, :, None, :], col_B, 2)
  W = live_BS.shape[1]  # the window: only the first W columns are read
  q_BKGH = q_B1NH[:, 0].reshape(B, K, N // K, H)
  scores_BKGW = jnp.einsum("BKGH,BKHW->BKGW", q_BKGH, k_BKHS[..., :W].astype(dt)).astype(jnp.float32) / math.sqrt(H)
  scores_BKGW = jnp.where(live_BS[:, None, None], scores_BKGW, jnp.finfo(jnp.float32).min)
  probs_BKGW = jax.nn.softmax(scores_BKGW, axis=-1).astype(dt)
  attn_BKGH = jnp.einsum("BKGW,BKWH->BKGH", probs_BKGW, v_BKSH[:, :, :W].astype(dt))
  return attn_BKGH.reshape(B, 1, N, H), (k_BKHS, v_BKSH)


def decode_step(cfg: ModelConfig, dparams: Params, cache: DecodeCache, tok_B, pos_B, col_B, live_BS
                ) -> tuple[jax.Array, DecodeCache]:
  """Logits [V, B] (vocab-major; fp32 on the CPU's fused path, else the compute dtype) of the token after
  `tok_B`, fed at positions `pos_B`.

  Each row's key/value is written at its cache column `col_B`; attention reads the columns marked in
  `live_BS` [B, W] (this one included) among the cache's first W <= S columns: a decode over short rows
  passes a window W below the cache's length and reads (and pays for) only those columns. `dparams` from `decode_params`, `cache` from `decode_cache.init` in the same layout.
  """
  dt = jnp.dtype(cfg.dtype)
  inv_freq = rope_inv_freq(cfg)
  if is_fused(dparams):
    ops = _Columns(cfg)
    x_DB = dparams["embed"][tok_B].astype(dt).T
    ks, vs = [], []
    for lp, k_BKHS, v_BKSH in zip(dparams["layers"], cache["k"], cache["v"]):
      attend = functools.partial(_attend_columns, cfg, k_BKHS=k_BKHS, v_BKSH=v_BKSH, col_B=col_B, live_BS=live_BS)
      x_DB, (k_BKHS, v_BKSH) = decoder_layer(cfg, ops, x_DB, lp, pos_B[:, None], inv_freq, attend)
      ks.append(k_BKHS)
      vs.append(v_BKSH)
    logits_VB = dparams["unembed_VD"] @ ops.norm(x_DB, dparams["final_norm"])
    return logits_VB.astype(jnp.float32), {"k": tuple(ks), "v": tuple(vs)}

  # The stacked cache rides in the layer scan's carry; each layer scatters its rows' new key/value
  # into it in place (B x K x H elements) and reads its window back. The TPU and GPU compilers keep
  # this scatter in place; a per-row dynamic update of the layer's slice, a one-hot select and the
  # layer write-back each copied the layer (or the whole) cache once per step or per row (docs/tpu.md 4.5).
  ops, W, rows_B = _Rows(cfg), live_BS.shape[1], jnp.arange(tok_B.shape[0])

  def layer(carry, lp):
    x_B1D, k_all, v_all, i = carry

    def attend(q, k, v):
      nonlocal k_all, v_all
      k_all, v_all = (c.at[i, rows_B, col_B].set(new[:, 0].astype(c.dtype), unique_indices=True,
                                                  mode="promise_in_bounds") for c, new in ((k_all, k), (v_all, v)))
      k_BWKH, v_BWKH = (jax.lax.dynamic_slice_in_dim(c[i], 0, W, axis=1).astype(dt) for c in (k_all, v_all))
      return attention(q, k_BWKH, v_BWKH, live_BS[:, None, :]), None
    x_B1D, _ = decoder_layer(cfg, ops, x_B1D, lp, pos_B[:, None], inv_freq, attend)
    return (x_B1D, k_all, v_all, i + 1), None
  x_B1D = constrain(dparams["embed"].astype(dt)[tok_B[:, None]], ("batch", "length", "act_embed"))
  (x_B1D, k_all, v_all, _), _ = over_layers(layer, (x_B1D, cache["k"], cache["v"], jnp.zeros((), jnp.int32)),
                                            dparams["layers"])
  return _decode_logits(cfg, dparams, x_B1D), {"k": k_all, "v": v_all}


def decode_step_paged(cfg: ModelConfig, params: Params, pages: dict, tok_B, pos_B, write_B, table_BM, attend_pages
                      ) -> tuple[jax.Array, dict]:
  """`decode_step` over a paged cache (model/paged_attention.py): logits [V, B] (compute dtype) of the token after
  `tok_B`, fed at positions `pos_B`, and the pool with its key/value written at position pos_B of each row's pages.

  `pages` {"k", "v"}: [L, num_pages, page_size, K * H]. A row's token at position t sits at page
  table_BM[b, t // page_size], offset t % page_size; rows with `write_B` False (finished slots) write into the
  pool's last page, which no row owns, and attend over one token. `attend_pages` is one of
  paged_attention.IMPLEMENTATIONS (the Pallas kernel on TPU)."""
  dt = jnp.dtype(cfg.dtype)
  inv_freq = rope_inv_freq(cfg)
  ops = _Rows(cfg)
  page, trash = pages["k"].shape[2], pages["k"].shape[1] - 1
  page_B = jnp.where(write_B, jnp.take_along_axis(table_BM, (pos_B // page)[:, None], axis=1)[:, 0], trash)
  off_B = jnp.where(write_B, pos_B % page, 0)
  lengths_B = jnp.where(write_B, pos_B + 1, 1).astype(jnp.int32)
  table_BM = jnp.where(write_B[:, None], table_BM, trash)

  def layer(carry, lp):
    x_B1D, k_all, v_all, i = carry

    def attend(q, k, v):
      nonlocal k_all, v_all
      k_all, v_all = (c.at[i, page_B, off_B].set(new[:, 0].reshape(new.shape[0], -1).astype(c.dtype),
                                                  mode="promise_in_bounds")
                      for c, new in ((k_all, k), (v_all, v)))
      return attend_pages(q[:, 0], k_all, v_all, i, lengths_B, table_BM)[:, None], None
    x_B1D, _ = decoder_layer(cfg, ops, x_B1D, lp, pos_B[:, None], inv_freq, attend)
    return (x_B1D, k_all, v_all, i + 1), None
  x_B1D = constrain(params["embed"].astype(dt)[tok_B[:, None]], ("batch", "length", "act_embed"))
  (x_B1D, k_all, v_all, _), _ = over_layers(layer, (x_B1D, pages["k"], pages["v"], jnp.zeros((), jnp.int32)),
                                            params["layers"])
  return _decode_logits(cfg, params, x_B1D), {"k": k_all, "v": v_all}


def positions_from_mask(mask_BT) -> jax.Array:
  """Positions for left-padded rows: 0 at the first real token, counting real tokens only."""
  return jnp.maximum(jnp.cumsum(mask_BT.astype(jnp.int32), axis=-1) - 1, 0)


def cast_params(params: Params, dtype: str) -> Params:
  """All floating params cast to `dtype` (e.g. a bf16 frozen reference copy of an fp32 policy)."""
  dt = jnp.dtype(dtype)
  return jax.tree.map(lambda p: p.astype(dt) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)
