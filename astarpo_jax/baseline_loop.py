"""The on-policy loop of the baselines: rollout of G responses per prompt -> targets -> GRPO/PPO/REBEL updates.

The same pieces as the A*-PO loop (stage2.py): `rollout`, `reference_logprobs`, the shared driver
`loop.run_loop` (updates, logs, evaluation, checkpoints), and the same loop settings (`stage2.Stage2Config`), in which
rollout_batch, mini_batch and micro_batch count *prompts*: a mini-batch holds mini_batch·G
responses and a micro-batch micro_batch·G, so every method takes the same number of optimizer
steps on the same prompts. Resumable like stage2: everything random is a function of (seed, step).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from astarpo_jax import baseline_losses as BL
from astarpo_jax import baselines
from astarpo_jax import loop as loop_lib
from astarpo_jax import multihost
from astarpo_jax import rollout as rollout_lib
from astarpo_jax import sampler as sampler_lib
from astarpo_jax import stage2, train
from astarpo_jax.data import Prompt
from astarpo_jax.model import ModelConfig, Params


def samples_policy_logprobs(scfg: sampler_lib.SamplingConfig) -> bool:
  """Whether the sampler's log-probs are the policy's own (temperature 1, no top-k/top-p filter)."""
  return scfg.temperature == 1.0 and scfg.top_p == 1.0 and scfg.top_k == 0


def _in_chunks(fn, rows: int, *arrays_BX, row_sharding=None) -> np.ndarray:
  """fn over consecutive blocks of `rows` rows, concatenated: a forward over a whole rollout at once
  would be a run's memory peak (GRPO's rollouts are G times A*-PO's). Across several processes each
  places only its rows of a block (`row_sharding`) and the result is gathered back."""
  n = len(arrays_BX[0])
  place = (lambda a: multihost.from_host(a, row_sharding)) if jax.process_count() > 1 else jnp.asarray
  return np.concatenate([multihost.to_host(fn(*(place(a[i:i + rows]) for a in arrays_BX))) for i in range(0, n, rows)])


def rollout_targets(cfg: ModelConfig, bcfg: baselines.BaselineConfig, state: dict, ref_params: Params,
                    ro: rollout_lib.Rollout, policy_logprobs: bool, chunk_rows: int,
                    row_sharding=None) -> tuple[dict[str, np.ndarray], dict[str, float]]:
  """Everything the update step needs from a rollout of prompt-major groups, plus phase times.

  old_logp: the sampler's log-probs when they are the policy's (`policy_logprobs`), else a fresh
  forward. GRPO: group-normalised advantages. PPO: the critic's values, GAE advantages, returns.
  Forwards run `chunk_rows` rows at a time (the micro-batch), as the A*-PO loop's reference forward.
  """
  tokens_BS, mask_BS, resp_mask_BR = stage2.trim_response(ro)
  R, P = resp_mask_BR.shape[1], ro.prompt_len
  secs: dict[str, float] = {}
  t = time.perf_counter()
  if policy_logprobs:
    old_logp_BR = np.where(resp_mask_BR, ro.sample_logp_BR[:, :R], 0.0).astype(np.float32)
  else:  # the sampled-from distribution is not the policy's (temperature / top-p): recompute
    old_logp_BR = _in_chunks(lambda tok, m: train.reference_logprobs(cfg, state["params"], tok, m, prompt_len=P),
                             chunk_rows, tokens_BS, mask_BS, row_sharding=row_sharding)
    secs["sec_old_logp"] = time.perf_counter() - t
  out = {"tokens": tokens_BS, "mask": mask_BS, "resp_mask": resp_mask_BR, "old_logp": old_logp_BR,
         "rewards": ro.rewards_B}
  t = time.perf_counter()
  if bcfg.needs_reference:
    out["ref_logp"] = _in_chunks(lambda tok, m: train.reference_logprobs(cfg, ref_params, tok, m, prompt_len=P),
                                 chunk_rows, tokens_BS, mask_BS, row_sharding=row_sharding)
  secs["sec_ref"] = time.perf_counter() - t
  t = time.perf_counter()
  if bcfg.algo == "grpo":
    out["adv"] = np.asarray(BL.grpo_advantages(ro.rewards_B.reshape(-1, bcfg.group_size))).reshape(-1)
  elif bcfg.algo == "ppo":
    values_BR = _in_chunks(lambda tok, m: baselines.critic_values(cfg, state["value_params"], tok, m, prompt_len=P),
                           chunk_rows, tokens_BS, mask_BS, row_sharding=row_sharding)
    values_BR = np.where(resp_mask_BR, values_BR, 0.0).astype(np.float32)
    adv, returns = jax.device_get(baselines.ppo_targets(bcfg, values_BR, resp_mask_BR, ro.rewards_B, old_logp_BR,
                                                        out.get("ref_logp")))
    out.update(old_values=values_BR, adv=adv, returns=returns)
    secs["sec_values"] = time.perf_counter() - t
  return out, secs


def _host_metrics(bcfg: baselines.BaselineConfig, full: dict[str, np.ndarray]) -> dict[str, float]:
  """Per-rollout numbers that need no model: group statistics, KL of the sampling policy to pi_ref."""
  m: dict[str, float] = {}
  mask = full["resp_mask"]
  if "ref_logp" in full:  # k1 estimate, token mean, as A*-PO's `kl`
    m["kl_old_ref"] = float(np.where(mask, full["old_logp"] - full["ref_logp"], 0.0).sum() / max(mask.sum(), 1))
  if bcfg.group_size > 1:
    r_PG = full["rewards"].reshape(-1, bcfg.group_size)
    m["no_signal_frac"] = float((r_PG.max(-1) == r_PG.min(-1)).mean())  # groups whose rewards are all equal
  if bcfg.algo == "ppo":
    m["value_mean"] = float(np.where(mask, full["old_values"], 0.0).sum() / max(mask.sum(), 1))
  return m


def run_baseline(cfg: ModelConfig, policy_params: Params, ref_params: Params, *, prompts: Sequence[Prompt],
                 tokenizer, grade, scfg: sampler_lib.SamplingConfig, bcfg: baselines.BaselineConfig, optimizer,
                 loop: stage2.Stage2Config, workdir: str, value_optimizer=None, value_seed: int = 0,
                 evaluate_fn: Callable[[Params, int], dict] | None = None, log=print,
                 is_logger: bool = True, mesh: jax.sharding.Mesh | None = None) -> tuple[Params, dict]:
  """Trains `policy_params` with GRPO, PPO or REBEL (`bcfg.algo`); resumes from `workdir` if it can.

  PPO's critic starts as a copy of the policy with a fresh scalar head (`baselines.init_value_params`).
  With a `mesh` (the one active around this call), the state is replicated over it: the baselines do
  not shard; the placement only matches what the jitted steps return, so nothing compiles twice.
  With several JAX processes every process runs this loop, as `stage2.run_stage2`: the rollout is
  sampled as one program and gathered, and each process places only its rows of the forwards'
  inputs and of every micro-batch.
  """
  G = bcfg.group_size
  own = jax.tree.map(jnp.copy, policy_params)  # the step donates its state; the caller's arrays survive
  if bcfg.algo == "ppo":
    if value_optimizer is None:
      raise ValueError("run_baseline: PPO needs a `value_optimizer` for its critic")
    state = baselines.init_state(own, optimizer, baselines.init_value_params(cfg, policy_params, value_seed),
                                 value_optimizer)
  else:
    state = baselines.init_state(own, optimizer)
  mesh = multihost.resolve_mesh(mesh)
  if mesh is not None:
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = (jax.tree.map(lambda x: multihost.from_host(multihost.to_host(x), replicated), state)
             if jax.process_count() > 1 else jax.device_put(state, replicated))
  row_sh = multihost.row_sharding(mesh)
  base_key = jax.random.key(loop.seed)
  policy_logprobs = samples_policy_logprobs(scfg)

  def prepare(state, rstep: int, indices) -> loop_lib.Prepared:
    rows = [prompts[i] for i in indices for _ in range(G)]  # prompt-major groups
    ro = rollout_lib.rollout(cfg, state["params"], [p.ids for p in rows], [p.gold for p in rows],
                             jax.random.fold_in(base_key, rstep), scfg, tokenizer, grade, loop.sample_max_batch, mesh)
    full, secs = rollout_targets(cfg, bcfg, state, ref_params, ro, policy_logprobs, loop.micro_batch * G, row_sh)
    metrics = dict(loop_lib.rollout_metrics(ro), **_host_metrics(bcfg, full), **secs)
    return loop_lib.Prepared(full, (ro.prompt_len, full["resp_mask"].shape[1]), metrics)

  def place(mb):  # across processes: this process's rows of each micro-batch
    if jax.process_count() == 1:
      return mb
    return jax.tree.map(lambda x: multihost.from_host(x, train.batch_sharding(mesh, loop.micro_batch * G)), mb)

  spec = loop_lib.LoopSpec(
      desc=bcfg.algo, prepare=prepare, place=place, rows_per_prompt=G,
      make_step=lambda key: baselines.jit_train_step(cfg, bcfg, optimizer, key[0], value_optimizer))
  state, last_eval = loop_lib.run_loop(spec, state, num_prompts=len(prompts), loop=loop, workdir=workdir,
                                       evaluate_fn=evaluate_fn, log=log, is_logger=is_logger)
  return state["params"], last_eval
