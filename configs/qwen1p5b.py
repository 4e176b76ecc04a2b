"""Qwen2.5-1.5B base with the official A*-PO settings; MATH by default.

  python experiments/main.py --config=configs/qwen1p5b.py --workdir=DIR
  python experiments/main.py --config=configs/qwen1p5b.py:gsm8k --workdir=DIR   # GSM8K
"""
from configs import base


def get_config(arg: str = "math"):
  c = base.get_config()
  c.model.name_or_path = "Qwen/Qwen2.5-1.5B"
  if arg == "gsm8k":
    c.data.train = "gsm8k_train"
    c.data.test_sets = ("gsm8k_test",)
    c.data.template = "gsm8k"
    c.reward.grader = "gsm8k_flexible"  # the official Stage 1 rule; gsm8k_strict matches its Stage 2 eval
  elif arg != "math":
    raise ValueError(f"configs/qwen1p5b.py: unknown variant {arg!r} (math | gsm8k)")
  else:
    c.data.test_sets = ("math500", "minerva")
    c.data.avg_k_sets = ("aime24", "amc23")
  return c
