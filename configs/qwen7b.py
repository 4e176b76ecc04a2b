"""Qwen2.5-7B base with the official A*-PO settings; MATH by default.

  python experiments/main.py --config=configs/qwen7b.py --workdir=DIR
  python experiments/main.py --config=configs/qwen7b.py:gsm8k --workdir=DIR   # GSM8K
  python experiments/main.py --config=configs/qwen7b.py:lora --workdir=DIR    # a LoRA adapter: fits a v5e-8
"""
from configs import base


def get_config(arg: str = "math"):
  c = base.qwen_config("Qwen/Qwen2.5-7B", arg, micro_batch=0)
  # Prompts per forward/backward: one per batch shard (the official MICRO_BATCH_SIZE_PER_DEVICE=1): 4 on
  # v4-8/v5p-8, 8 on 8-chip slices and 8 x H200, 32 on v5e-32 (docs/tpu.md 4), where a fixed 4 cannot
  # split over 8 batch shards. A global size instead: --config.train.micro_batch=8
  # --config.train.micro_batch_per_device=0.
  c.train.micro_batch_per_device = 1
  return c
