"""Rollouts: prompts -> sampled responses -> text -> rewards -> the arrays a train step consumes.

Shared by Stage 1 (N samples per prompt from pi_ref), Stage 2 (one per prompt from pi) and
evaluation. Grading is passed in as a callable so that the same code runs with the worker pool,
in-process graders, or a test's fake.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np

from astarpo_jax.infra import multihost, sharding
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.model.decoder import Params
from astarpo_jax.sampling import sampler as sampler_lib
from astarpo_jax.sampling.token_choice import SampleOutput, SamplingConfig


class Graded(NamedTuple):
  """What a grader returns: one reward per response, and counts of what went wrong (timeouts, errors)."""
  rewards_B: np.ndarray  # [B] float32
  counts: dict[str, float]


# (texts, golds, truncated) -> Graded; a gold is whatever the caller passes per prompt (Prompt.target: the gold,
# or a user_grader.Target with the row's extra fields), forwarded as is
GradeFn = Callable[[Sequence[str], Sequence, Sequence[bool]], Graded]


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


def rollout(cfg: ModelConfig, params: Params, prompt_ids: Sequence[Sequence[int]], golds: Sequence,
            key: jax.Array, scfg: SamplingConfig, tokenizer, grade: GradeFn,
            max_batch: int | None = None, mesh: jax.sharding.Mesh | None = None, num_samples: int = 1,
            sample_mesh: jax.sharding.Mesh | None = None) -> Rollout:
  """Sample `num_samples` responses per prompt with `params` (rows prompt-major: row p*n+j is the j-th
  of prompt p, each prompt prefilled once), decode and grade them.

  With several JAX processes (`mesh` over all their devices; by default the params' mesh) the sampler runs as one program on
  the global prompt array; each process decodes and grades only the rows it holds, and the
  results are gathered so that every process returns the same full Rollout. `sample_mesh` (config
  `mesh.sample_shape`, over the same devices): sample there instead, the params copied onto it once
  per call (`sampler.sample_padded`); None samples on the params' own mesh.
  """
  t0 = time.perf_counter()
  P = sampler_lib.bucket_length(max(len(p) for p in prompt_ids))
  prompt_BP, pmask_BP = sampler_lib.left_pad(prompt_ids, scfg.pad_id, P)
  out, rows = sample_shares(cfg, params, prompt_BP, pmask_BP, key, scfg, max_batch, mesh, num_samples, sample_mesh)
  t1 = time.perf_counter()
  texts = decode_responses(tokenizer, out.tokens_BT, out.mask_BT)
  rewards, stats = grade(texts, [golds[r // num_samples] for r in rows], out.truncated_B.tolist())
  rewards = np.asarray(rewards, np.float32)
  if rewards.shape != (len(rows),):  # a non-finite reward is the update's to catch: it stops the run
    raise ValueError(f"grade returned rewards of shape {rewards.shape} for {len(rows)} responses: it must "
                     "return one reward per response")
  if num_samples > 1:  # a row per sample: its prompt repeated
    prompt_BP, pmask_BP = np.repeat(prompt_BP, num_samples, axis=0), np.repeat(pmask_BP, num_samples, axis=0)
  if jax.process_count() > 1:  # every process gets every row: a few small arrays and the texts
    B = len(prompt_BP)
    out = jax.tree.map(lambda x: multihost.gather_rows(x, rows, B), out)
    rewards = multihost.gather_rows(np.asarray(rewards, np.float32), rows, B)
    texts = multihost.gather_texts(texts, rows, B)
    names = sorted(stats)  # the same grader on every process: the same count names
    stats = dict(zip(names, (float(v) for v in multihost.process_sum([float(stats[k]) for k in names])))) \
        if names else {}
  t2 = time.perf_counter()
  return Rollout(
      tokens_BS=np.concatenate([prompt_BP, np.asarray(out.tokens_BT, np.int32)], axis=1),
      mask_BS=np.concatenate([pmask_BP, np.asarray(out.mask_BT, bool)], axis=1),
      resp_mask_BR=np.asarray(out.mask_BT, bool), prompt_len=P, texts=texts,
      rewards_B=np.asarray(rewards, np.float32), truncated_B=np.asarray(out.truncated_B, bool),
      length_B=np.asarray(out.length_B, np.int32), sample_logp_BR=np.asarray(out.logp_BT, np.float32),
      grade_stats=dict(stats), seconds={"sample": t1 - t0, "grade": t2 - t1})


def sample_shares(cfg: ModelConfig, params: Params, prompt_BP: np.ndarray, pmask_BP: np.ndarray, key: jax.Array,
                  scfg: SamplingConfig, max_batch: int | None, mesh: jax.sharding.Mesh | None,
                  num_samples: int = 1, sample_mesh: jax.sharding.Mesh | None = None
                  ) -> tuple[SampleOutput, np.ndarray]:
  """Sample on the global prompt array; returns this process's rows of the output (numpy) and their indices
  (B * num_samples rows, prompt-major).

  Every process passes the same host prompts; rows are padded to a multiple of the mesh's batch
  shards (repeats of the last row, never returned) and split over them. A row owned by several
  processes (the batch not split over every device) is returned by the lowest-numbered one only.
  With `sample_mesh` the rows are split over its batch axes and the params copied onto it.
  """
  B, n = len(prompt_BP), num_samples
  if jax.process_count() == 1:
    return jax.device_get(sampler_lib.sample_padded(cfg, params, prompt_BP, pmask_BP, key, scfg, max_batch,
                                                    num_samples=n, mesh=sample_mesh)), np.arange(B * n)
  mesh = sample_mesh or multihost.resolve_mesh(mesh, params)
  row_sh = multihost.row_sharding(mesh)
  Bp = -(-B // sharding.batch_ways(mesh)) * sharding.batch_ways(mesh)
  fill = np.minimum(np.arange(Bp), B - 1)
  tokens_BP = multihost.global_rows(prompt_BP[fill], np.arange(Bp), Bp, row_sh)  # each process places its shards
  out = sampler_lib.sample_padded(cfg, params, tokens_BP, pmask_BP[fill], key, scfg, max_batch, num_samples=n,
                                  mesh=sample_mesh)
  held = multihost.process_rows(Bp * n, row_sh)  # the fill prompts' samples are the rows past B * n
  rows = held[multihost.owned_rows(Bp * n, row_sh) & (held < B * n)]
  return jax.tree.map(lambda x: multihost.local_rows(multihost.to_rows(x, row_sh), rows), out), rows


def trim_response(ro: Rollout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(tokens_BS, mask_BS, resp_mask_BR) without the response columns past the longest response
  (rounded up to a length bucket, so the update steps compile for few shapes)."""
  R_full = ro.resp_mask_BR.shape[1]
  R = min(R_full, sampler_lib.bucket_length(int(ro.length_B.max()) if len(ro.length_B) else 1))
  cut = ro.prompt_len + R
  return ro.tokens_BS[:, :cut], ro.mask_BS[:, :cut], ro.resp_mask_BR[:, :R]


def rollout_metrics(ro: Rollout) -> dict[str, float]:
  """The log's per-rollout numbers every method shares."""
  return {"reward_mean": float(ro.rewards_B.mean()), "response_length": float(ro.length_B.mean()),
          "truncation_rate": float(ro.truncated_B.mean()), "sec_sample": ro.seconds["sample"],
          "sec_grade": ro.seconds["grade"], "grade_timeouts": float(ro.grade_stats.get("num_timeouts", 0)),
          "grade_errors": float(ro.grade_stats.get("num_errors", 0))}
