"""Held-out evaluation: greedy pass@1 and sampled avg@k on tokenized test prompts.

Both are mean rewards: with 0/1 rewards the share solved, with a user function's rewards in [0, 1] the mean
score, and `pass_rate` beside it the share of responses with r >= the pass threshold (value_table.py). The run's
own evaluation and experiments/evaluate.py go through evals/ (pass@k, maj@k, kept samples), which keys its chunks
as `evaluate` does here (`fold_in(key, first row)`), so for k dividing batch_size both give the same mean.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from astarpo_jax.data.dataset import Prompt
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.model.decoder import Params
from astarpo_jax.sampling import rollout as rollout_lib
from astarpo_jax.sampling.token_choice import SamplingConfig


def evaluate(cfg: ModelConfig, params: Params, prompts: Sequence[Prompt], tokenizer, grade, scfg: SamplingConfig,
             key: jax.Array, *, k: int = 1, max_batch: int | None = None, batch_size: int = 256,
             also: Mapping[str, Callable] | None = None, sample_mesh: jax.sharding.Mesh | None = None,
             pass_threshold: float = 1.0) -> dict:
  """Mean reward over `prompts`: pass@1 with a greedy `scfg` (temperature 0), or avg@k when sampling.

  Returns accuracy (the mean reward), pass_rate (the share with r >= pass_threshold; the same for 0/1
  rewards), mean response length and the truncation rate; with `also` (name -> grade), "also"
  holds each other grader's accuracy on the same responses. `sample_mesh`: sample there (rollout.rollout).
  """
  if not prompts:
    raise ValueError("evaluate: no prompts")
  if scfg.temperature == 0 and k != 1:
    raise ValueError("evaluate: greedy decoding gives the same answer k times; use k=1 or a temperature > 0")
  rewards, lengths, truncated = [], [], []
  also_rewards: dict[str, list] = {name: [] for name in (also or {})}
  # Chunks of batch_size rows, the k samples of a prompt from one prefill (rows as if each prompt were repeated k times).
  n = k if batch_size % k == 0 else 1
  rows = [p for p in prompts for _ in range(k // n)]
  per_chunk = batch_size // n
  for start in range(0, len(rows), per_chunk):
    chunk = rows[start:start + per_chunk]
    r = rollout_lib.rollout(cfg, params, [p.ids for p in chunk], [p.target for p in chunk],
                            jax.random.fold_in(key, start * n), scfg, tokenizer, grade, max_batch, num_samples=n,
                            sample_mesh=sample_mesh)
    rewards.append(r.rewards_B)
    lengths.append(r.length_B)
    truncated.append(r.truncated_B)
    golds = [p.target for p in chunk for _ in range(n)]
    for name, other in (also or {}).items():
      also_rewards[name].append(np.asarray(other(r.texts, golds, r.truncated_B.tolist())[0]))
  rewards_np = np.concatenate(rewards)
  out = {"accuracy": float(rewards_np.mean()), "pass_rate": float((rewards_np >= pass_threshold).mean()),
         "response_length": float(np.concatenate(lengths).mean()),
         "truncation_rate": float(np.concatenate(truncated).mean()), "num_prompts": len(prompts), "k": k}
  if also:
    out["also"] = {name: float(np.concatenate(rs).mean()) for name, rs in also_rewards.items()}
  return out


def greedy(scfg: SamplingConfig) -> SamplingConfig:
  """The same limits and stop tokens, decoded greedily."""
  return dataclasses.replace(scfg, temperature=0.0, top_p=1.0, top_k=0)
