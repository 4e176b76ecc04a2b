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
  c = base.qwen_config("Qwen/Qwen2.5-1.5B", arg, micro_batch=16)  # micro_batch: prompts per forward/backward
  if not c.model.lora.rank:
    # Full fine-tuning: 64 prompts a micro-batch (2 per optimizer step of 128), chosen by compiling
    # (experiments/aot.py --choose_update_batch; docs/tpu.md 3.4): with the weights moved once a step the update is
    # HBM-bound and each micro-batch reads the weights and the gradient accumulator again. Modeled s per optimizer
    # step, 16 -> 64 prompts: v6e-8 0.48 -> 0.32, 4 x H100 1.33 -> 0.59 (128: 0.49, its choice there). A*-PO's loss is
    # a mean over sequences, so the update is the same up to the order of accumulation (official: one sequence a GPU,
    # docs/fidelity_sources.md S3; this config had 16).
    c.train.micro_batch = 64
  return c
