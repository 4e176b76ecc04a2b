"""Tiny random HF models built offline with transformers (PyTorch CPU), as parity references."""
from __future__ import annotations

import os
import shutil

import numpy as np
import torch
import transformers

from tests.data_paths import qwen_tokenizer_dir

VOCAB = 97


def tiny_hf_model(arch: str, tied: bool, seed: int = 0, vocab: int = VOCAB):
  """A random `Qwen2ForCausalLM`, `Qwen3ForCausalLM` or `LlamaForCausalLM` with GQA and non-trivial
  norms/biases; the Qwen3 one has a head dim (24) not tied to hidden size / heads (16)."""
  torch.manual_seed(seed)
  common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                tie_word_embeddings=tied, rms_norm_eps=1e-6)
  if arch == "qwen2":
    cfg = transformers.Qwen2Config(**common, rope_theta=1000.0)
    model = transformers.Qwen2ForCausalLM(cfg)
  elif arch == "qwen3":
    cfg = transformers.Qwen3Config(**common, head_dim=24, rope_theta=1000.0)
    model = transformers.Qwen3ForCausalLM(cfg)
  elif arch == "llama":
    cfg = transformers.LlamaConfig(**common, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, rope_theta=500000.0)
    model = transformers.LlamaForCausalLM(cfg)
  else:
    raise ValueError(arch)
  with torch.no_grad():  # random norms and biases, so that a mix-up of any tensor shows in the logits
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      elif name.endswith("bias"):
        p.copy_(0.1 * torch.randn_like(p))
  return model.eval()


def padded_batch(seed: int = 0):
  """Left-padded token ids [3, 12] with rows of different lengths, and their mask."""
  rng = np.random.default_rng(seed)
  lengths = [12, 7, 3]
  tokens = np.zeros((3, 12), np.int32)
  mask = np.zeros((3, 12), bool)
  for i, n in enumerate(lengths):
    tokens[i, 12 - n:] = rng.integers(1, VOCAB, n)
    mask[i, 12 - n:] = True
  return tokens, mask


def hf_logits(model, tokens, mask) -> np.ndarray:
  """HF logits with explicit positions for left padding (HF defaults to arange positions)."""
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  with torch.no_grad():
    out = model(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                position_ids=torch.tensor(positions, dtype=torch.long))
  return out.logits.float().numpy()


def tiny_qwen_checkpoint(path) -> str:
  """A local HF folder as a user's checkpoint looks: a tiny random tied `Qwen2ForCausalLM` over the real
  Qwen vocabulary, saved with the Qwen tokenizer files beside it."""
  vocab = len(transformers.AutoTokenizer.from_pretrained(qwen_tokenizer_dir()))
  torch.manual_seed(0)
  cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                 tie_word_embeddings=True)
  transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)
  for name in os.listdir(qwen_tokenizer_dir()):
    shutil.copy(os.path.join(qwen_tokenizer_dir(), name), path)
  return str(path)
