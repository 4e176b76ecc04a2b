"""GRPO on Qwen2.5-1.5B: A*-PO's baseline, on the data, prompts per step and model of configs/qwen1p5b.py.

  python experiments/main.py --config=configs/grpo_qwen1p5b.py --workdir=DIR
  python experiments/main.py --config=configs/grpo_qwen1p5b.py:gsm8k --workdir=DIR   # GSM8K

The official repository publishes no GRPO script; these are the defaults of the verl copy it ships
(verl/trainer/config/ppo_trainer.yaml; docs/fidelity.md, "The baselines"): ratio clip 0.2, k3
("low_var_kl") KL loss to pi_ref with weight 0.001 (a penalty here: that copy subtracts it, the verl sign
bug), entropy coefficient 0.001, token-mean loss, lr 1e-6. G = 8 responses per prompt, the number of
Stage-1 samples A*-PO draws per prompt (that copy defaults to rollout.n = 1, "> 1 for grpo"). Stage 1 is
skipped. A rollout is 256 prompts × 8 = 2048 responses; the micro-batch of 2 prompts is 16 responses, as
A*-PO's 16 per forward/backward.
"""
from configs import base


def get_config(arg: str = "math"):
  c = base.qwen_config("Qwen/Qwen2.5-1.5B", arg, micro_batch=2)  # prompts per micro-batch (× group_size rows)
  c.algo.name = "grpo"
  c.algo.group_size = 8
  c.algo.clip_eps = 0.2
  c.algo.kl_coef = 1e-3  # ppo_trainer.yaml: kl_loss_coef 0.001, kl_loss_type low_var_kl
  c.algo.loss_agg = "token_mean"  # token mean (that copy: per micro-batch, whose size the paper does not give)
  c.algo.entropy_coef = 1e-3  # ppo_trainer.yaml: entropy_coeff 0.001
  c.optim.lr = 1e-6
  return c
