"""Hugging Face checkpoints (Qwen2, Qwen3, Llama): config.json <-> ModelConfig, safetensors import and export.

Import reads tensors lazily from memory-mapped safetensors files and builds each param directly in
its target sharding and dtype (`jax.make_array_from_callback`), one param at a time, so the host
never holds a second full fp32 copy of the model. Export writes safetensors shards (plus the index),
config.json and the tokenizer files, which `transformers` and vLLM load.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from astarpo_jax.model import decoder as model_lib
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.model.decoder import Params

SUPPORTED_ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}

_ST_DTYPES = {
    "F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


class CheckpointError(ValueError):
  """A checkpoint folder or config that cannot be loaded; the message names the problem."""


# ----------------------------------------------------------------------------- config


def config_from_hf(hf: dict[str, Any], *, dtype: str = "float32", param_dtype: str = "float32",
                   remat: bool = False) -> ModelConfig:
  """ModelConfig from a parsed HF config.json (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
  archs = hf.get("architectures") or []
  arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
  if arch is None:
    arch = {"qwen2": "qwen2", "llama": "llama", "qwen3": "qwen3"}.get(hf.get("model_type", ""))
  if arch is None:
    raise CheckpointError(
        f"unsupported architecture {archs or hf.get('model_type')!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
  if hf.get("hidden_act", "silu") != "silu":
    raise CheckpointError(f"hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
  if hf.get("mlp_bias") or (arch in ("llama", "qwen3") and hf.get("attention_bias")):
    raise CheckpointError(f"{arch} configs with attention_bias or mlp_bias are not supported")
  if arch in ("qwen2", "qwen3") and hf.get("use_sliding_window") and hf.get("sliding_window") and \
      hf["sliding_window"] < hf.get("max_position_embeddings", 0):
    raise CheckpointError("use_sliding_window=true cannot be represented (full attention only)")
  rope = dict(hf.get("rope_parameters") or {})
  rope.update(hf.get("rope_scaling") or {})
  theta = float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  llama3 = None
  if rope_type == "llama3":
    llama3 = (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
              int(rope["original_max_position_embeddings"]))
  elif rope_type not in (None, "default"):
    raise CheckpointError(f"rope type {rope_type!r} is not supported (supported: default, llama3)")
  heads = int(hf["num_attention_heads"])
  try:
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        arch=arch,
        qkv_bias=(arch == "qwen2"),
        qk_norm=(arch == "qwen3"),
        rope_theta=theta,
        rope_llama3_scaling=llama3,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        dtype=dtype, param_dtype=param_dtype, remat=remat)
  except KeyError as e:
    raise CheckpointError(f"config.json lacks the field {e.args[0]!r}") from None
  except ValueError as e:
    raise CheckpointError(f"config.json cannot be represented: {e}") from None


def config_to_hf(cfg: ModelConfig, torch_dtype: str = "float32") -> dict[str, Any]:
  """An HF config.json dict for `cfg` (readable by transformers 4.x and 5.x)."""
  rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  if cfg.rope_llama3_scaling:
    f, lo, hi, old = cfg.rope_llama3_scaling
    rope = {"rope_type": "llama3", "factor": f, "low_freq_factor": lo, "high_freq_factor": hi,
            "original_max_position_embeddings": old, "rope_theta": cfg.rope_theta}
  arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[cfg.arch]
  out = {
      "architectures": [arch], "model_type": cfg.arch, "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
      "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
      "max_position_embeddings": cfg.max_position_embeddings, "rope_theta": cfg.rope_theta,
      "rope_parameters": rope, "torch_dtype": torch_dtype, "dtype": torch_dtype,
  }
  if cfg.rope_llama3_scaling:
    out["rope_scaling"] = rope
  if cfg.arch == "llama":
    out.update(attention_bias=False, mlp_bias=False)
  else:
    out.update(use_sliding_window=False, sliding_window=None)
  if cfg.arch == "qwen3":
    out.update(attention_bias=False)
  return out


# ----------------------------------------------------------------------------- safetensors


def _read_header(path: str) -> tuple[dict[str, Any], int]:
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) < 8:
      raise CheckpointError(f"{path}: not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", raw)
    if n > 100_000_000:
      raise CheckpointError(f"{path}: not a safetensors file (header length {n})")
    header = json.loads(f.read(n))
  header.pop("__metadata__", None)
  return header, 8 + n


class SafetensorsIndex:
  """Name -> lazily memory-mapped numpy view, over one or several safetensors files."""

  def __init__(self, files: list[str]):
    self._where: dict[str, tuple[str, dict[str, Any], int]] = {}
    for path in files:
      header, offset = _read_header(path)
      for name, info in header.items():
        self._where[name] = (path, info, offset)
    self._maps: dict[str, np.memmap] = {}

  def __contains__(self, name: str) -> bool:
    return name in self._where

  def names(self) -> list[str]:
    return sorted(self._where)

  def get(self, name: str, expected_shape: tuple[int, ...] | None = None) -> np.ndarray:
    if name not in self._where:
      raise CheckpointError(f"tensor {name!r} is missing from the checkpoint")
    path, info, offset = self._where[name]
    if info["dtype"] not in _ST_DTYPES:
      raise CheckpointError(f"tensor {name!r} has unsupported dtype {info['dtype']}")
    shape = tuple(info["shape"])
    if expected_shape is not None and shape != tuple(expected_shape):
      raise CheckpointError(f"tensor {name!r} has shape {shape}, expected {tuple(expected_shape)}")
    if path not in self._maps:
      self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
    start, end = info["data_offsets"]
    buf = self._maps[path][offset + start: offset + end]
    return buf.view(_ST_DTYPES[info["dtype"]]).reshape(shape)


def _write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
  header, offset = {}, 0
  for name, arr in tensors.items():
    header[name] = {"dtype": _ST_NAMES[arr.dtype], "shape": list(arr.shape),
                    "data_offsets": [offset, offset + arr.nbytes]}
    offset += arr.nbytes
  header["__metadata__"] = {"format": "pt"}
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for arr in tensors.values():
      f.write(np.ascontiguousarray(arr).tobytes())
  os.replace(tmp, path)


# ----------------------------------------------------------------------------- param layout


def _hf_layout(cfg: ModelConfig) -> dict[tuple[str, ...], tuple[str, Callable, Callable]]:
  """Our param path -> (HF name pattern, HF->ours transform per layer, ours->HF transform)."""
  D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  ident = lambda x: x  # noqa: E731
  proj_in = lambda n: (lambda w: w.T.reshape(D, n, H), lambda w: w.reshape(D, n * H).T)  # noqa: E731
  bias = lambda n: (lambda b: b.reshape(n, H), lambda b: b.reshape(n * H))  # noqa: E731
  t = (lambda w: w.T, lambda w: w.T)
  pre = "model.layers.{}."
  layout = {
      ("embed",): ("model.embed_tokens.weight", ident, ident),
      ("final_norm",): ("model.norm.weight", ident, ident),
      ("layers", "attn_norm"): (pre + "input_layernorm.weight", ident, ident),
      ("layers", "mlp_norm"): (pre + "post_attention_layernorm.weight", ident, ident),
      ("layers", "wq"): (pre + "self_attn.q_proj.weight", *proj_in(N)),
      ("layers", "wk"): (pre + "self_attn.k_proj.weight", *proj_in(K)),
      ("layers", "wv"): (pre + "self_attn.v_proj.weight", *proj_in(K)),
      ("layers", "wo"): (pre + "self_attn.o_proj.weight", lambda w: w.reshape(D, N, H).transpose(1, 2, 0),
                         lambda w: w.transpose(2, 0, 1).reshape(D, N * H)),
      ("layers", "w_gate"): (pre + "mlp.gate_proj.weight", *t),
      ("layers", "w_up"): (pre + "mlp.up_proj.weight", *t),
      ("layers", "w_down"): (pre + "mlp.down_proj.weight", *t),
  }
  if cfg.qkv_bias:
    layout[("layers", "bq")] = (pre + "self_attn.q_proj.bias", *bias(N))
    layout[("layers", "bk")] = (pre + "self_attn.k_proj.bias", *bias(K))
    layout[("layers", "bv")] = (pre + "self_attn.v_proj.bias", *bias(K))
  if cfg.qk_norm:
    layout[("layers", "q_norm")] = (pre + "self_attn.q_norm.weight", ident, ident)
    layout[("layers", "k_norm")] = (pre + "self_attn.k_norm.weight", ident, ident)
  if not cfg.tie_embeddings:
    layout[("lm_head",)] = ("lm_head.weight", *t)
  return layout


def _flatten(tree: Params, prefix=()) -> Iterator[tuple[tuple[str, ...], Any]]:
  for k, v in tree.items():
    if isinstance(v, dict):
      yield from _flatten(v, prefix + (k,))
    else:
      yield prefix + (k,), v


def _set(tree: Params, path: tuple[str, ...], value) -> None:
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


# ----------------------------------------------------------------------------- import / export


def resolve_checkpoint_dir(path_or_id: str) -> str:
  """A local folder as is; otherwise a hub id downloaded (weights, config, tokenizer) to the HF cache."""
  if os.path.isdir(path_or_id):
    return path_or_id
  if os.path.sep in path_or_id.strip("/").split("/", 1)[-1] or path_or_id.startswith((".", "/")):
    raise CheckpointError(f"checkpoint folder {path_or_id!r} does not exist")
  from huggingface_hub import snapshot_download  # only needed for hub ids
  try:
    return snapshot_download(path_or_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])
  except Exception as e:  # noqa: BLE001 - network and auth errors all end here
    raise CheckpointError(f"could not fetch {path_or_id!r} from the Hugging Face hub "
                          f"(no local folder by that name either): {type(e).__name__}: {e}") from None


def load_hf_config(ckpt_dir: str, **kwargs) -> ModelConfig:
  path = os.path.join(ckpt_dir, "config.json")
  if not os.path.exists(path):
    raise CheckpointError(f"{ckpt_dir}: no config.json")
  with open(path) as f:
    return config_from_hf(json.load(f), **kwargs)


def _weight_files(ckpt_dir: str) -> list[str]:
  index = os.path.join(ckpt_dir, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
    missing = [p for p in files if not os.path.exists(os.path.join(ckpt_dir, p))]
    if missing:
      raise CheckpointError(f"{ckpt_dir}: shards listed in model.safetensors.index.json are missing: {missing}")
    return [os.path.join(ckpt_dir, p) for p in files]
  files = sorted(p for p in os.listdir(ckpt_dir) if p.endswith(".safetensors"))
  if not files:
    hint = " (found PyTorch .bin weights: convert them to safetensors)" if any(
        p.endswith(".bin") for p in os.listdir(ckpt_dir)) else ""
    raise CheckpointError(f"{ckpt_dir}: no safetensors weights{hint}")
  return [os.path.join(ckpt_dir, p) for p in files]


def load_hf(path_or_id: str, *, dtype: str = "float32", param_dtype: str = "float32", remat: bool = False,
            shardings: Params | None = None) -> tuple[ModelConfig, Params]:
  """Config and params from an HF checkpoint folder or hub id.

  `shardings` (same tree as the params, e.g. from `sharding.param_shardings`) places each param
  directly in its sharding; each device's shard is read from the memory-mapped files.
  """
  ckpt_dir = resolve_checkpoint_dir(path_or_id)
  cfg = load_hf_config(ckpt_dir, dtype=dtype, param_dtype=param_dtype, remat=remat)
  st = SafetensorsIndex(_weight_files(ckpt_dir))
  _, abstract = model_lib.abstract_params(cfg)
  target_dt = np.dtype(jnp.dtype(param_dtype))
  params: Params = {}
  for path, (pattern, to_ours, to_hf) in _hf_layout(cfg).items():
    spec = _get(abstract, path)
    stacked = path[0] == "layers"
    per_layer_shape = spec.shape[1:] if stacked else spec.shape

    hf_shape = jax.eval_shape(to_hf, jax.ShapeDtypeStruct(per_layer_shape, jnp.float32)).shape

    def read(i, pattern=pattern, to_ours=to_ours, hf_shape=hf_shape):
      return to_ours(st.get(pattern.format(i), expected_shape=hf_shape))

    def build(index, read=read, stacked=stacked, num=spec.shape[0]):
      if not stacked:
        return np.asarray(read(None)[index], dtype=target_dt)
      layer_ids = range(num)[index[0]]
      return np.stack([np.asarray(read(i)[index[1:]], dtype=target_dt) for i in layer_ids])

    sharding = _get(shardings, path) if shardings is not None else jax.sharding.SingleDeviceSharding(jax.devices()[0])
    _set(params, path, jax.make_array_from_callback(spec.shape, sharding, build))
  return cfg, params


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def save_hf(cfg: ModelConfig, params: Params, out_dir: str, *, tokenizer=None, dtype: str | None = None,
            max_shard_bytes: int = 4 << 30) -> None:
  """Write params as an HF folder: config.json, safetensors (sharded with an index if large), tokenizer."""
  os.makedirs(out_dir, exist_ok=True)
  np_dt = np.dtype(jnp.dtype(dtype or cfg.param_dtype))
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for path, (pattern, _, to_hf) in _hf_layout(cfg).items():
    arr = _get(params, path)
    layers = range(cfg.num_layers) if path[0] == "layers" else [None]
    for i in layers:
      host = np.asarray(jax.device_get(arr[i] if i is not None else arr)).astype(np_dt)
      t = np.ascontiguousarray(to_hf(host))
      if size + t.nbytes > max_shard_bytes and shards[-1]:
        shards.append({})
        size = 0
      shards[-1][pattern.format(i)] = t
      size += t.nbytes
  if len(shards) == 1:
    _write_safetensors(os.path.join(out_dir, "model.safetensors"), shards[0])
  else:
    weight_map, total = {}, 0
    for j, shard in enumerate(shards):
      fname = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
      _write_safetensors(os.path.join(out_dir, fname), shard)
      weight_map.update({k: fname for k in shard})
      total += sum(t.nbytes for t in shard.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  hf_cfg = config_to_hf(cfg, torch_dtype={"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[np_dt.name])
  if tokenizer is not None:
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
      if getattr(tokenizer, key, None) is not None:
        hf_cfg[key] = getattr(tokenizer, key)
    tokenizer.save_pretrained(out_dir)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_cfg, f, indent=2)


def load_tokenizer(path_or_id: str):
  """The HF tokenizer of a checkpoint folder or hub id (left padding, a pad token set)."""
  from transformers import AutoTokenizer
  tok = AutoTokenizer.from_pretrained(resolve_checkpoint_dir(path_or_id))
  tok.padding_side = "left"
  if tok.pad_token is None:
    tok.pad_token = tok.eos_token
  return tok


def save_peft_adapter(tensors: dict, out_dir: str, *, rank: int, alpha: float, base_model: str,
                      dtype: str = "float32") -> None:
  """A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) that `PeftModel.from_pretrained` loads
  onto the HF base model. `tensors`: lora.peft_tensors' (layers, HF module, lora_A [L, r, in], lora_B [L, out, r])
  per target; PEFT scales by lora_alpha / r, as the adapter's forward does."""
  os.makedirs(out_dir, exist_ok=True)
  np_dt = np.dtype(jnp.dtype(dtype))
  out, modules = {}, []
  for _, (num_layers, module, a_LrI, b_LOr) in tensors.items():
    part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    modules.append(module)
    a_host, b_host = (np.asarray(jax.device_get(x)).astype(np_dt) for x in (a_LrI, b_LOr))
    for i in range(num_layers):
      pre = f"base_model.model.model.layers.{i}.{part}.{module}."
      out[pre + "lora_A.weight"] = np.ascontiguousarray(a_host[i])
      out[pre + "lora_B.weight"] = np.ascontiguousarray(b_host[i])
  _write_safetensors(os.path.join(out_dir, "adapter_model.safetensors"), out)
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
            "target_modules": modules, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
            "base_model_name_or_path": base_model}
  with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
    json.dump(config, f, indent=2)
