"""REBEL on Qwen2.5-1.5B: A*-PO's baseline, on the data, prompts per step and model of configs/qwen1p5b.py.

  python experiments/main.py --config=configs/rebel_qwen1p5b.py --workdir=DIR
  python experiments/main.py --config=configs/rebel_qwen1p5b.py:gsm8k --workdir=DIR   # GSM8K

Two responses per prompt; the difference of their (1/η)·log π/π_old regressed onto their reward
difference. η = 1, the REBEL paper's and code's default (ZhaolinGao/REBEL, REBELHParams.eta); REBEL
needs no reference model and no critic. The paper does not publish its REBEL learning rate: lr 1e-6 as
A*-PO's. Stage 1 is skipped. The micro-batch of 8 prompts is 16 responses, as A*-PO's 16.
"""
from configs import base


def get_config(arg: str = "math"):
  c = base.qwen_config("Qwen/Qwen2.5-1.5B", arg, micro_batch=8)
  c.algo.name = "rebel"
  c.algo.group_size = 2
  c.algo.rebel_eta = 1.0
  c.algo.kl_coef = 0.0  # unused by REBEL
  c.algo.entropy_coef = 1e-3  # the baselines' shared setting (the official verl copy's entropy_coeff)
  c.optim.lr = 1e-6
  return c
