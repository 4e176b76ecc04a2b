"""Qwen2.5-7B base with the official A*-PO settings; MATH by default.

  python experiments/main.py --config=configs/qwen7b.py --workdir=DIR
  python experiments/main.py --config=configs/qwen7b.py:gsm8k --workdir=DIR   # GSM8K
"""
from configs import base


def get_config(arg: str = "math"):
  return base.qwen_config("Qwen/Qwen2.5-7B", arg, micro_batch=4)  # micro_batch: prompts per forward/backward
