"""LoRA adapters on the decoder's projections, the base frozen: with a LoRA policy π_ref *is* the base.

An adapter is a small pytree {"layers": {name + "_lora_a": [L, *in, r], name + "_lora_b": [L, r, *out]}} beside
the frozen base's weight `name` ([L, *in, *out]). `attach(base, adapter)` puts its leaves into the base's layer
dict (no copy of the base); the layer (layer_forms.Rows) then computes x W + s (x A) B with s = alpha / r, the
scale kept on the model config (`model_config`). The same base tree without the adapter is π_ref: scoring it is
the base's forward reading the same arrays, so a LoRA run holds one copy of the weights. Init as PEFT's: A
Kaiming-uniform (bound 1/sqrt(fan_in)), B = 0, so step 0 is the base. `merged` folds the adapter into the weights
(sampling, the merged HF export); hf.save_peft_adapter writes it as a PEFT adapter folder.

Axis letters as in decoder.py; r the rank.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from astarpo_jax.infra import sharding as sharding_lib
from astarpo_jax.model import decoder
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.model.decoder import Params
from astarpo_jax.model.layer_forms import LORA_A, LORA_B

# Config target name -> the decoder's weight (and the HF module it is, for PEFT's target_modules).
TARGETS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down"}
HF_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
              "down": "down_proj"}
ALL_LINEAR = tuple(TARGETS)  # the common "all-linear" choice (PEFT, TRL, verl)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Which projections get an adapter, its rank and alpha (scale alpha / rank), the frozen base's dtype."""
  targets: tuple[str, ...] = ALL_LINEAR
  rank: int = 16
  alpha: float = 32.0
  base_dtype: str = "bfloat16"  # the base (π_ref) is stored in this dtype; the adapter in the policy's param_dtype

  def __post_init__(self):
    bad = [t for t in self.targets if t not in TARGETS]
    if bad or not self.targets or len(set(self.targets)) != len(self.targets):
      raise ValueError(f"model.lora.targets={self.targets!r}: name each of {ALL_LINEAR} at most once (or "
                       "'all-linear')")
    if not isinstance(self.rank, int) or self.rank < 1:
      raise ValueError(f"model.lora.rank={self.rank!r}: must be an int >= 1 (0 in the config = full fine-tuning)")
    if not self.alpha > 0:
      raise ValueError(f"model.lora.alpha={self.alpha!r}: must be > 0 (the adapter's scale is alpha / rank)")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def parse_targets(value) -> tuple[str, ...]:
  """'all-linear', a comma-separated string or a sequence of target names -> a tuple in TARGETS' order."""
  if isinstance(value, str):
    value = ALL_LINEAR if value == "all-linear" else tuple(v.strip() for v in value.split(",") if v.strip())
  return tuple(value)


@dataclasses.dataclass(frozen=True)
class LoraModelConfig(ModelConfig):
  """A ModelConfig with the adapter's settings: the layer multiplies (x A) by lora_scale = alpha / r; the memory
  plan and the compiles read the adapter's shapes from it."""
  lora: LoraConfig = LoraConfig()

  @property
  def lora_scale(self) -> float:
    return self.lora.scale


def model_config(cfg: ModelConfig, lcfg: LoraConfig) -> LoraModelConfig:
  """`cfg` with the adapter's settings (static, as every field of the model config)."""
  fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ModelConfig)}
  return LoraModelConfig(**fields, lora=lcfg)


def of(cfg: ModelConfig) -> LoraConfig | None:
  """The adapter settings a model config carries (None: full fine-tuning)."""
  return getattr(cfg, "lora", None)


def _in_dims(name: str) -> int:
  return 2 if name == "wo" else 1  # wo is [N, H, D]; every other weight [in, *out]


def adapter_layout(cfg: ModelConfig, lcfg: LoraConfig, dtype: str | None = None) -> tuple[Params, Params]:
  """(logical axes, abstract shapes) of the adapter: A keeps the weight's input axes, B its output axes, so the
  adapter is sharded as its weight is (FSDP over embed, tensor over heads / mlp); the rank axis is whole."""
  axes_all, shapes_all = decoder.logical_axes(cfg)["layers"], decoder.abstract_params(cfg)[1]["layers"]
  dt = jnp.dtype(dtype or cfg.param_dtype)
  axes, shapes = {}, {}
  for t in lcfg.targets:
    name = TARGETS[t]
    w_axes, w_shape, k = axes_all[name], shapes_all[name].shape, _in_dims(name)
    axes[name + LORA_A] = (*w_axes[:1 + k], None)
    axes[name + LORA_B] = (w_axes[0], None, *w_axes[1 + k:])
    shapes[name + LORA_A] = jax.ShapeDtypeStruct((*w_shape[:1 + k], lcfg.rank), dt)
    shapes[name + LORA_B] = jax.ShapeDtypeStruct((w_shape[0], lcfg.rank, *w_shape[1 + k:]), dt)
  return {"layers": axes}, {"layers": shapes}


def adapter_shardings(cfg: ModelConfig, lcfg: LoraConfig, mesh, rules=sharding_lib.DEFAULT_RULES) -> Params:
  axes, shapes = adapter_layout(cfg, lcfg)
  return sharding_lib.tree_shardings(mesh, axes, shapes, rules)


def init_adapter(cfg: ModelConfig, lcfg: LoraConfig, seed: int = 0, dtype: str | None = None) -> Params:
  """A fresh adapter: A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (PEFT's kaiming_uniform_(a=sqrt(5))), B = 0."""
  _, shapes = adapter_layout(cfg, lcfg, dtype)
  key, out = jax.random.key(seed), {}
  for i, (leaf, s) in enumerate(sorted(shapes["layers"].items())):
    if leaf.endswith(LORA_B):
      out[leaf] = jnp.zeros(s.shape, s.dtype)
      continue
    bound = 1.0 / math.sqrt(math.prod(s.shape[1:-1]))
    out[leaf] = jax.random.uniform(jax.random.fold_in(key, i), s.shape, jnp.float32, -bound, bound).astype(s.dtype)
  return {"layers": out}


def is_adapter_leaf(name: str) -> bool:
  return name.endswith(LORA_A) or name.endswith(LORA_B)


def has_adapter(params: Params) -> bool:
  """Whether a param tree carries adapter leaves (an attached policy), its layers stacked (a dict) or unstacked (a
  list of per-layer dicts, as the GPU's sampling copy)."""
  layers = params.get("layers", {})
  names = layers if isinstance(layers, dict) else {n for layer in layers for n in layer}
  return any(is_adapter_leaf(n) for n in names)


def attach(base: Params, adapter: Params) -> Params:
  """The policy: the base's tree with the adapter's leaves in its layer dict (the base's arrays, not copies)."""
  return dict(base, layers={**base["layers"], **adapter["layers"]})


def split(params: Params) -> tuple[Params, Params]:
  """(base, adapter) of an attached tree."""
  layers = params["layers"]
  return (dict(params, layers={n: w for n, w in layers.items() if not is_adapter_leaf(n)}),
          {"layers": {n: w for n, w in layers.items() if is_adapter_leaf(n)}})


def targets_of(adapter: Params) -> tuple[str, ...]:
  """The config targets an adapter covers."""
  names = {n[:-len(LORA_A)] for n in adapter["layers"] if n.endswith(LORA_A)}
  return tuple(t for t, w in TARGETS.items() if w in names)


def delta(cfg: ModelConfig, name: str, a, b) -> jax.Array:  # noqa: ARG001 (name: the weight, for readers)
  """s A B in the weight's shape [L, *in, *out], fp32."""
  L, r = a.shape[0], a.shape[-1]
  a_LIr = a.astype(jnp.float32).reshape(L, -1, r)
  b_LrO = b.astype(jnp.float32).reshape(L, r, -1)
  return (cfg.lora_scale * jnp.einsum("LIr,LrO->LIO", a_LIr, b_LrO)).reshape(*a.shape[:-1], *b.shape[2:])


def merged(cfg: ModelConfig, params: Params, dtype: str | None = None) -> Params:
  """A plain param tree with W + s A B folded in (fp32 sum, then `dtype`, default the compute dtype); the
  other params cast to `dtype` as well. The input is an attached tree (base + adapter)."""
  base, adapter = split(params)
  dt = jnp.dtype(dtype or cfg.dtype)
  out = decoder.cast_params(base, dt.name)
  layers = dict(out["layers"])

  def merge_layer(w_a_b):  # one layer at a time (lax.map): the fp32 sum is one layer's weight, not all L
    w, a, b = w_a_b
    return (w.astype(jnp.float32) + delta(cfg, "", a[None], b[None])[0]).astype(dt)
  for t in targets_of(adapter):
    name = TARGETS[t]
    a, b = adapter["layers"][name + LORA_A], adapter["layers"][name + LORA_B]
    layers[name] = jax.lax.map(merge_layer, (base["layers"][name], a, b))
  return dict(out, layers=layers)


@functools.partial(jax.jit, static_argnums=(0, 2))
def merged_jit(cfg, params, dtype):
  """`merged`, jitted (its output placed as XLA propagates the base's shardings)."""
  return merged(cfg, params, dtype)


def sampling_params(cfg: ModelConfig, base: Params, adapter: Params) -> Params:
  """The policy the sampler runs on: the adapter merged into a copy of the base in the compute dtype, once per
  rollout (the decode then reads the same bytes per step as a full fine-tuning run's, with no adapter matmuls);
  its sharding follows the base's."""
  return merged_jit(cfg, attach(base, adapter), jnp.dtype(cfg.dtype).name)


def peft_tensors(cfg: ModelConfig, adapter: Params) -> dict[str, tuple[int, str, jax.Array, jax.Array]]:
  """Per target: (layer count, HF module name, PEFT's lora_A [L, r, in], lora_B [L, out, r]) with in / out
  flattened as HF's nn.Linear has them (q: out = N*H in head-major order, o: in = N*H)."""
  out = {}
  for t in targets_of(adapter):
    name = TARGETS[t]
    a, b = adapter["layers"][name + LORA_A], adapter["layers"][name + LORA_B]
    L, r = a.shape[0], a.shape[-1]
    out[t] = (L, HF_MODULES[t], jnp.swapaxes(a.reshape(L, -1, r), 1, 2), jnp.swapaxes(b.reshape(L, r, -1), 1, 2))
  return out
