"""PPO with a critic on Qwen2.5-1.5B: A*-PO's baseline, on the data, prompts per step and model of configs/qwen1p5b.py.

  python experiments/main.py --config=configs/ppo_qwen1p5b.py --workdir=DIR
  python experiments/main.py --config=configs/ppo_qwen1p5b.py:gsm8k --workdir=DIR   # GSM8K

The paper does not publish its PPO settings; these are verl's PPO defaults (ppo_trainer.yaml): one
response per prompt, actor lr 1e-6, critic lr 1e-5 (a copy of the model with a scalar head), GAE
γ = λ = 1, ratio clip 0.2, value clip 0.5, no entropy bonus. verl keeps the KL out of PPO by default;
here the RLHF-style KL-in-reward with verl's kl_ctrl coefficient 0.001 keeps pi near pi_ref like the
other methods (set algo.kl_coef=0 for verl's exact default). Stage 1 is skipped. The micro-batch of
8 prompts runs policy and critic forward/backward, about A*-PO's 16 rows of activations.
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
  c.algo.kl_coef = 1e-3  # KL in the reward (verl's kl_ctrl.kl_coef)
  c.algo.entropy_coef = 0.0
  c.optim.lr = 1e-6
  c.algo.value_lr = 1e-5
  return c
