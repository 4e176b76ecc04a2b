"""Qwen2.5-1.5B base with the official A*-PO settings; MATH by default.

  python experiments/main.py --config=configs/qwen1p5b.py --workdir=DIR
  python experiments/main.py --config=configs/qwen1p5b.py:gsm8k --workdir=DIR   # GSM8K
  python experiments/main.py --config=configs/qwen1p5b.py:lora --workdir=DIR    # a LoRA adapter (base.with_lora)
  python experiments/main.py --config=configs/qwen1p5b.py:lora_v5e1 --workdir=DIR  # LoRA on one v5e chip (16 GB)
"""
from configs import base


def get_config(arg: str = "math"):
  if arg.endswith("_v5e1"):  # one v5e chip (Colab's TPU runtime): LoRA, everything on one device, smaller batches
    c = base.qwen_config("Qwen/Qwen2.5-1.5B", arg.removesuffix("_v5e1"), micro_batch=4)
    if not c.model.lora.rank:
      raise ValueError(f"configs/qwen1p5b.py:{arg}: the one-chip variant is LoRA's (lora_v5e1 or gsm8k_lora_v5e1)")
    c.mesh.shape = (1, 1, 1)
    c.sampling.max_batch = 64  # decode slots: the page pool of 256 slots x 1,280 tokens does not fit 16 GB
    return c
  return base.qwen_config("Qwen/Qwen2.5-1.5B", arg, micro_batch=16)  # micro_batch: prompts per forward/backward
