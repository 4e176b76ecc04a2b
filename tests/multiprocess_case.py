"""The model, batches and optimizer shared by tests/test_multiprocess.py and its worker processes."""
import numpy as np

from astarpo_jax.model.config import ModelConfig
from astarpo_jax.training import update
from tests import method_steps as MS

# kv heads 2 and mlp/vocab divisible by tensor=2; the model dim by fsdp = number of processes (2).
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)
PROMPT_LEN, RESPONSE_LEN, BATCH, MICRO = 6, 5, 8, 4


def optimizer():
  # eps 1e-4: Adam's first steps g/(|g|+eps) stay smooth in g, so reduction-order noise stays small.
  return update.make_optimizer(lr=1e-2, eps=1e-4)


def method():
  return MS.method("astarpo", beta2=0.05, entropy_coef=0.01, logp_chunk=4)


def batch(i: int) -> dict[str, np.ndarray]:
  """The i-th global mini-batch [B, ...] (the same in every process)."""
  rng = np.random.default_rng(100 + i)
  B, P, R = BATCH, PROMPT_LEN, RESPONSE_LEN
  prompt_len = rng.integers(1, P + 1, B)
  resp_len = rng.integers(1, R + 1, B)
  mask = np.zeros((B, P + R), bool)
  resp_mask = np.zeros((B, R), bool)
  for j in range(B):
    mask[j, P - prompt_len[j]:P + resp_len[j]] = True
    resp_mask[j, :resp_len[j]] = True
  return {"tokens": rng.integers(1, CFG.vocab_size, (B, P + R)).astype(np.int32), "mask": mask,
          "resp_mask": resp_mask, "ref_logp": rng.normal(-3.0, 0.5, (B, R)).astype(np.float32),
          "rewards": rng.integers(0, 2, B).astype(np.float32), "vstar": rng.uniform(0, 1, B).astype(np.float32)}
