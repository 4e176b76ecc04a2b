"""PPO with a critic on Qwen2.5-1.5B: A*-PO's baseline, on the data, prompts per step and model of configs/qwen1p5b.py.

  python experiments/main.py --config=configs/ppo_qwen1p5b.py --workdir=DIR
  python experiments/main.py --config=configs/ppo_qwen1p5b.py:gsm8k --workdir=DIR   # GSM8K

The official repository publishes no PPO script; these are the defaults of the verl copy it ships
(verl/trainer/config/ppo_trainer.yaml; docs/fidelity.md, "The baselines"): one response per prompt,
actor lr 1e-6, critic lr 1e-5 (a copy of the model with a scalar head), GAE γ = λ = 1, ratio clip 0.2,
value clip 0.5, entropy coefficient 0.001, and the KL to pi_ref in the reward with kl_ctrl's fixed
coefficient 0.001. Stage 1 is skipped. The micro-batch of 8 prompts runs policy and critic
forward/backward, about A*-PO's 16 rows of activations.
"""
from configs import base


def get_config(arg: str = "math"):
  c = base.qwen_config("Qwen/Qwen2.5-1.5B", arg, micro_batch=8)
  c.algo.name = "ppo"
  c.algo.group_size = 1
  c.algo.clip_eps = 0.2
  c.algo.value_clip = 0.5
  c.algo.gae_gamma = 1.0
  c.algo.gae_lambda = 1.0
  c.algo.kl_coef = 1e-3  # KL in the reward (ppo_trainer.yaml kl_ctrl.kl_coef)
  c.algo.entropy_coef = 1e-3  # ppo_trainer.yaml: entropy_coeff 0.001
  c.optim.lr = 1e-6
  c.algo.value_lr = 1e-5
  return c
