"""Stage 2 of A*-PO: rollout -> reference log-probs -> A*-PO updates.

This module prepares each rollout step (one response per prompt, graded, with pi_ref's log-probs
and V*) and places the train state; `loop.run_loop` runs the steps, logs, evaluates and
checkpoints, as for the baselines. Everything random is a pure function of (seed, step) and the
data iterator's saved position, so a killed run rerun from its latest checkpoint reaches the
same parameters as one that never stopped.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from astarpo_jax import loop as loop_lib
from astarpo_jax import metrics
from astarpo_jax import multihost
from astarpo_jax import rollout as rollout_lib
from astarpo_jax import sampler as sampler_lib
from astarpo_jax import train
from astarpo_jax.data import Prompt
from astarpo_jax.model import ModelConfig, Params


@dataclasses.dataclass(frozen=True)
class Stage2Config:
  """Loop settings (the defaults are the paper's)."""
  num_steps: int = 100
  rollout_batch: int = 256  # prompts per rollout, one response each
  mini_batch: int = 128  # prompts per optimizer step (rollout_batch / mini_batch steps per rollout)
  micro_batch: int = 16  # prompts per forward/backward; gradients accumulate over a mini-batch
  sample_max_batch: int | None = None  # sampler chunk (memory), None = whole rollout at once
  seed: int = 0
  checkpoint_every: int = 50
  eval_every: int = 0  # 0 = only at the end
  wandb: metrics.WandbSettings | None = None  # a W&B run beside TensorBoard and metrics.jsonl

  def __post_init__(self):
    if self.rollout_batch % self.mini_batch:
      raise ValueError(f"rollout_batch={self.rollout_batch} is not divisible by mini_batch={self.mini_batch}")
    if self.mini_batch % self.micro_batch:
      raise ValueError(f"mini_batch={self.mini_batch} is not divisible by micro_batch={self.micro_batch}")


def trim_response(ro: rollout_lib.Rollout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Drop response columns past the longest response (rounded up to a bucket, for few compiles)."""
  R_full = ro.resp_mask_BR.shape[1]
  R = min(R_full, sampler_lib.bucket_length(int(ro.length_B.max()) if len(ro.length_B) else 1))
  cut = ro.prompt_len + R
  return ro.tokens_BS[:, :cut], ro.mask_BS[:, :cut], ro.resp_mask_BR[:, :R]


def run_stage2(cfg: ModelConfig, policy_params: Params, ref_params: Params, *, prompts: Sequence[Prompt],
               vstar_of: Callable[[Sequence[Prompt]], np.ndarray], tokenizer, grade, scfg: sampler_lib.SamplingConfig,
               loss_cfg: train.LossConfig, optimizer, loop: Stage2Config, workdir: str,
               evaluate_fn: Callable[[Params, int], dict] | None = None, log=print,
               is_logger: bool = True, mesh: jax.sharding.Mesh | None = None) -> tuple[Params, dict]:
  """Trains `policy_params` with A*-PO; resumes from `workdir`'s latest checkpoint if there is one.

  With a `mesh`, the train state is placed by the logical-axis rules (FSDP / tensor parallel) and the
  update step is compiled with explicit in/out shardings, the batch split over (data, fsdp). With
  several JAX processes (the mesh spans them) every process runs this same loop: the rollout is
  sampled as one program, each process decodes and grades its rows and all get the gathered
  rollout (see `rollout.rollout`); each places only its shards of the reference and train batches.
  Only `is_logger` (process 0) writes logs.
  """
  mesh = multihost.resolve_mesh(mesh)
  # The step donates its state: own a copy, so the caller's arrays (often the reference's) survive.
  state = train.init_train_state(jax.tree.map(jnp.copy, policy_params), optimizer)
  state_sh = batch_sh = None
  if mesh is not None:
    state_sh = train.state_shardings(cfg, optimizer, mesh)
    batch_sh = train.batch_sharding(mesh, loop.micro_batch)
    state = jax.device_put(state, state_sh)
  base_key = jax.random.key(loop.seed)
  row_sh = multihost.row_sharding(mesh)
  place = (lambda x: multihost.from_host(x, row_sh)) if jax.process_count() > 1 else jnp.asarray

  def prepare(state, rstep: int, indices) -> loop_lib.Prepared:
    batch_prompts = [prompts[i] for i in indices]
    ro = rollout_lib.rollout(cfg, state["params"], [p.ids for p in batch_prompts], [p.gold for p in batch_prompts],
                             jax.random.fold_in(base_key, rstep), scfg, tokenizer, grade, loop.sample_max_batch, mesh)
    tokens_BS, mask_BS, resp_mask_BR = trim_response(ro)
    t1 = time.perf_counter()
    # pi_ref forward in micro-batches: the whole rollout at once would be the run's memory peak.
    # Across processes each places its rows of a micro-batch and the result is gathered back.
    ref_logp_BR = np.concatenate([multihost.to_host(train.reference_logprobs(
        cfg, ref_params, place(tokens_BS[i:i + loop.micro_batch]), place(mask_BS[i:i + loop.micro_batch]),
        prompt_len=ro.prompt_len)) for i in range(0, len(tokens_BS), loop.micro_batch)])
    t2 = time.perf_counter()
    vstar_B = np.asarray(vstar_of(batch_prompts), np.float32)
    batch = {"tokens": tokens_BS, "mask": mask_BS, "resp_mask": resp_mask_BR, "ref_logp": ref_logp_BR,
             "rewards": ro.rewards_B, "vstar": vstar_B}
    metrics = dict(loop_lib.rollout_metrics(ro), vstar_mean=float(vstar_B.mean()), sec_ref=t2 - t1)
    return loop_lib.Prepared(batch, (ro.prompt_len, resp_mask_BR.shape[1]), metrics)

  spec = loop_lib.LoopSpec(
      desc="stage2", prepare=prepare,
      make_step=lambda key: train.jit_train_step(cfg, loss_cfg, optimizer, key[0], state_sh, batch_sh),
      place=lambda mb: jax.tree.map(lambda x: multihost.from_host(x, batch_sh), mb))  # this process's rows
  state, last_eval = loop_lib.run_loop(spec, state, num_prompts=len(prompts), loop=loop, workdir=workdir,
                                       evaluate_fn=evaluate_fn, log=log, is_logger=is_logger)
  return state["params"], last_eval

