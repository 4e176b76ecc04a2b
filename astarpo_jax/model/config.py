"""The decoder's shape and numerics: one frozen dataclass every layer of the package takes (its own
module so that the layers and the decoder both import it and neither imports the other)."""
from __future__ import annotations

import dataclasses

ARCHITECTURES = ("qwen2", "llama", "qwen3")
TRAIN_ATTENTION = ("auto", "xla", "flash")  # the cache-free forward's attention (model/flash.py)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of the decoder; built from an HF config.json by `hf.config_from_hf`."""
  vocab_size: int
  hidden_size: int  # D
  intermediate_size: int  # F
  num_layers: int  # L
  num_heads: int  # N
  num_kv_heads: int  # K
  head_dim: int  # H
  arch: str = "qwen2"
  qkv_bias: bool = True  # Qwen2: q/k/v biases; Llama, Qwen3: none
  qk_norm: bool = False  # Qwen3: RMSNorm over each head's queries and keys before RoPE
  rope_theta: float = 10000.0
  # Llama 3 rope scaling as (factor, low_freq_factor, high_freq_factor, original_max_position).
  rope_llama3_scaling: tuple[float, float, float, int] | None = None
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = True
  max_position_embeddings: int = 32768
  dtype: str = "float32"  # compute dtype (bfloat16 on TPU/GPU)
  param_dtype: str = "float32"  # storage dtype of the params
  remat: bool = False  # rematerialise each layer in the backward pass
  # Query rows per block of cache-free (scoring, training) attention; a block attends only to the
  # keys up to its last row. 0 = the whole sequence as one block.
  attention_block: int = 64
  # The cache-free forward's attention: "xla" (the blocks above), "flash" (a fused kernel: model/flash.py) or
  # "auto" (flash on GPUs, xla elsewhere).
  train_attention: str = "auto"

  def __post_init__(self):
    if self.arch not in ARCHITECTURES:
      raise ValueError(f"arch={self.arch!r}: supported architectures are {ARCHITECTURES}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
    if not isinstance(self.attention_block, int) or self.attention_block < 0:
      raise ValueError(f"attention_block={self.attention_block!r} must be an int >= 0 (0 = one block)")
    if self.train_attention not in TRAIN_ATTENTION:
      raise ValueError(f"train_attention={self.train_attention!r}: use one of {TRAIN_ATTENTION}")

  @property
  def num_params(self) -> int:
    """Total parameter count (embeddings included once when tied)."""
    d, f, n, k, h = self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim
    attn = d * n * h * 2 + d * k * h * 2 + (n * h + 2 * k * h if self.qkv_bias else 0) + (2 * h if self.qk_norm else 0)
    layer = attn + 3 * d * f + 2 * d
    emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return self.num_layers * layer + emb + d
