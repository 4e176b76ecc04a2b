"""RLOO on Qwen2.5-1.5B: a fifth baseline of A*-PO, on the data, prompts per step and model of configs/qwen1p5b.py.

  python experiments/main.py --config=configs/rloo_qwen1p5b.py --workdir=DIR
  python experiments/main.py --config=configs/rloo_qwen1p5b.py:gsm8k --workdir=DIR   # GSM8K

REINFORCE Leave-One-Out (Ahmadian et al. 2024): k = 4 responses per prompt (the paper's larger k), each
response's baseline the others' mean reward, the sequence KL to pi_ref in the reward with TRL's
RLOOConfig coefficient 0.05, the sequence ratio clipped at 0.2 (TRL), entropy coefficient 0.001 (the other baselines'), lr 1e-6 as the
other methods. Stage 1 is skipped. The micro-batch of 4 prompts is 16 responses, A*-PO's 16 rows.
"""
from configs import base


def get_config(arg: str = "math"):
  c = base.qwen_config("Qwen/Qwen2.5-1.5B", arg, micro_batch=4)  # prompts per micro-batch (× group_size rows)
  c.algo.name = "rloo"
  c.algo.group_size = 4
  c.algo.clip_eps = 0.2
  c.algo.kl_coef = 0.05
  c.algo.entropy_coef = 1e-3  # the baselines' shared setting (the official verl copy's entropy_coeff)
  c.optim.lr = 1e-6
  return c
