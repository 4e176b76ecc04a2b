"""Qwen3-1.7B base with the official A*-PO settings; MATH by default.

  python experiments/main.py --config=configs/qwen3_1p7b.py --workdir=DIR
  python experiments/main.py --config=configs/qwen3_1p7b.py:gsm8k --workdir=DIR   # GSM8K

Qwen3 differs from Qwen2.5 only inside the attention block (per-head RMSNorm on q and k, no q/k/v
biases, head dim 128 set on its own); its base model is prompted raw like Qwen2.5's, with the same
stop rule (the tokenizer's EOS only, as the official recipe; sampling.extra_stop_tokens adds others).
"""
from configs import base


def get_config(arg: str = "math"):
  # micro_batch: prompts per forward/backward. Per token and layer the activations are about those of
  # Qwen2.5-1.5B (D + F = 8192 vs 10496 values), so the same 16.
  return base.qwen_config("Qwen/Qwen3-1.7B-Base", arg, micro_batch=16)
