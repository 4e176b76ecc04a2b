"""Rollouts: prompts -> sampled responses -> text -> rewards -> the arrays a train step consumes.

Shared by Stage 1 (N samples per prompt from pi_ref), Stage 2 (one per prompt from pi) and
evaluation. Grading is passed in as a callable so that the same code runs with the worker pool,
in-process graders, or a test's fake.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from astarpo_jax import sampler as sampler_lib
from astarpo_jax.model import ModelConfig, Params

# grade(texts, golds, truncated) -> rewards float32 [B] (and optionally a dict of counts)
GradeFn = Callable[[Sequence[str], Sequence[str], Sequence[bool]], "np.ndarray | tuple[np.ndarray, dict]"]


@dataclasses.dataclass
class Rollout:
  """One response per prompt row, with everything Stage 2 needs (numpy, on the host)."""
  tokens_BS: np.ndarray  # [B, P+R] int32: left-padded prompt, then the response (pad after the stop)
  mask_BS: np.ndarray  # [B, P+R] bool: real tokens
  resp_mask_BR: np.ndarray  # [B, R] bool: response tokens up to and including the stop token
  prompt_len: int  # P
  texts: list[str]
  rewards_B: np.ndarray  # [B] float32
  truncated_B: np.ndarray  # [B] bool
  length_B: np.ndarray  # [B] int32
  sample_logp_BR: np.ndarray  # [B, R] float32, log-prob under the sampling distribution
  grade_stats: dict
  seconds: dict


def decode_responses(tokenizer, tokens_BR: np.ndarray, mask_BR: np.ndarray) -> list[str]:
  """Response texts (special tokens such as EOS dropped)."""
  rows = [row[m].tolist() for row, m in zip(tokens_BR, mask_BR)]
  return tokenizer.batch_decode(rows, skip_special_tokens=True)


def rollout(cfg: ModelConfig, params: Params, prompt_ids: Sequence[Sequence[int]], golds: Sequence[str],
            key: jax.Array, scfg: sampler_lib.SamplingConfig, tokenizer, grade: GradeFn,
            max_batch: int | None = None) -> Rollout:
  """Sample one response per prompt with `params`, decode and grade it."""
  t0 = time.perf_counter()
  P = sampler_lib.bucket_length(max(len(p) for p in prompt_ids))
  prompt_BP, pmask_BP = sampler_lib.left_pad(prompt_ids, scfg.pad_id, P)
  out = jax.device_get(sampler_lib.sample_padded(cfg, params, prompt_BP, pmask_BP, key, scfg, max_batch))
  t1 = time.perf_counter()
  texts = decode_responses(tokenizer, out.tokens_BT, out.mask_BT)
  graded = grade(texts, list(golds), out.truncated_B.tolist())
  rewards, stats = graded if isinstance(graded, tuple) else (graded, {})
  t2 = time.perf_counter()
  return Rollout(
      tokens_BS=np.concatenate([prompt_BP, np.asarray(out.tokens_BT, np.int32)], axis=1),
      mask_BS=np.concatenate([pmask_BP, np.asarray(out.mask_BT, bool)], axis=1),
      resp_mask_BR=np.asarray(out.mask_BT, bool), prompt_len=P, texts=texts,
      rewards_B=np.asarray(rewards, np.float32), truncated_B=np.asarray(out.truncated_B, bool),
      length_B=np.asarray(out.length_B, np.int32), sample_logp_BR=np.asarray(out.logp_BT, np.float32),
      grade_stats=dict(stats), seconds={"sample": t1 - t0, "grade": t2 - t1})
