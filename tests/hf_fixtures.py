"""Tiny random HF models built offline with transformers (PyTorch CPU), as parity references.

A machine without PyTorch (the H200 image that experiments/device_check.py runs on) uses the same models
recorded on one with it: `python -m tests.hf_fixtures DIR` saves each model of PARITY_CASES with its logits on
`padded_batch(seed)` for RECORDED_SEEDS (experiments/device_wheels.sh writes .whl/hf_golden), and with
ASTARPO_HF_GOLDEN=DIR `tiny_hf_model` returns the recorded model and `hf_logits` its recorded logits.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import types

import numpy as np
import pytest
import transformers

try:
  import torch
except ImportError:  # the recorded models stand in (ASTARPO_HF_GOLDEN)
  torch = None

from tests.data_paths import qwen_tokenizer_dir

VOCAB = 97
PARITY_CASES = [("qwen2", True), ("qwen2", False), ("llama", True), ("llama", False), ("qwen3", True),
                ("qwen3", False)]  # (arch, tied) of tests/test_model_parity.py
RECORDED_SEEDS = range(5)
GOLDEN_ENV = "ASTARPO_HF_GOLDEN"


class Recorded:
  """A model `record` saved: its HF folder (config.json, safetensors) and its HF logits per padded_batch seed."""

  def __init__(self, path: str):
    self.path = path
    with open(os.path.join(path, "config.json")) as f:
      self.config = types.SimpleNamespace(**json.load(f))
    with np.load(os.path.join(path, "logits.npz")) as z:
      self.logits_by_seed = {int(k): z[k] for k in z.files}

  def save_pretrained(self, dest: str) -> None:
    shutil.copytree(self.path, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("logits.npz"))

  def logits(self, tokens, mask) -> np.ndarray:
    for seed, logits in self.logits_by_seed.items():
      t, m = padded_batch(seed)
      if np.array_equal(t, tokens) and np.array_equal(m, mask):
        return logits
    raise KeyError(f"no recorded logits for this batch in {self.path} (seeds {sorted(self.logits_by_seed)})")


def _recorded_name(arch: str, tied: bool) -> str:
  return f"{arch}-{'tied' if tied else 'untied'}"


def tiny_hf_model(arch: str, tied: bool, seed: int = 0, vocab: int = VOCAB):
  """A random `Qwen2ForCausalLM`, `Qwen3ForCausalLM` or `LlamaForCausalLM` with GQA and non-trivial
  norms/biases; the Qwen3 one has a head dim (24) not tied to hidden size / heads (16). Without PyTorch:
  the model recorded in $ASTARPO_HF_GOLDEN (a skip where it is absent)."""
  if torch is None:
    path = os.path.join(os.environ.get(GOLDEN_ENV, ""), _recorded_name(arch, tied))
    if (seed, vocab) != (0, VOCAB) or not os.path.isfile(os.path.join(path, "logits.npz")):
      pytest.skip(f"no PyTorch here and no recorded {_recorded_name(arch, tied)} (seed {seed}, vocab {vocab}) under "
                  f"${GOLDEN_ENV}: record one with `python -m tests.hf_fixtures DIR` where PyTorch is")
    return Recorded(path)
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
  if isinstance(model, Recorded):
    return model.logits(tokens, mask)
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


def record(dest: str) -> None:
  """Save every model of PARITY_CASES under `dest` with its HF logits on padded_batch(seed), RECORDED_SEEDS."""
  for arch, tied in PARITY_CASES:
    model, path = tiny_hf_model(arch, tied), os.path.join(dest, _recorded_name(arch, tied))
    model.save_pretrained(path)
    np.savez(os.path.join(path, "logits.npz"), **{str(s): hf_logits(model, *padded_batch(s)) for s in RECORDED_SEEDS})


if __name__ == "__main__":
  record(sys.argv[1])
