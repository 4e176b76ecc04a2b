"""The Stage-2 loop: rollout -> reference log-probs -> A*-PO updates, with logs, eval and checkpoints.

Everything random is a pure function of (seed, step) and the data iterator's saved position, so a
run that is killed and rerun from its latest checkpoint reaches the same parameters as one that
never stopped.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from astarpo_jax import checkpoint as ckpt_lib
from astarpo_jax import multihost
from astarpo_jax import rollout as rollout_lib
from astarpo_jax import sampler as sampler_lib
from astarpo_jax import train
from astarpo_jax.data import BatchIterator, Prompt
from astarpo_jax.metrics import MetricsWriter
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
  writer = MetricsWriter(workdir, log=log, enabled=is_logger)
  it = BatchIterator(list(range(len(prompts))), loop.rollout_batch, seed=loop.seed)
  # The step donates its state: own a copy, so the caller's arrays (often the reference's) survive.
  state = train.init_train_state(jax.tree.map(jnp.copy, policy_params), optimizer)
  state_sh = batch_sh = None
  if mesh is not None:
    state_sh = train.state_shardings(cfg, optimizer, mesh)
    batch_sh = train.batch_sharding(mesh, loop.micro_batch)
    state = jax.device_put(state, state_sh)
  ckpt = ckpt_lib.Checkpointer(f"{workdir}/checkpoints", keep=3, save_every=loop.checkpoint_every)
  host: dict = {}
  if ckpt.latest_step() is not None:
    saved = ckpt_lib.to_saveable(state)
    restored, host = ckpt.restore(ckpt_lib.abstract_state(jax.eval_shape(lambda: saved),
                                                          jax.tree.map(lambda x: x.sharding, saved)))
    state = ckpt_lib.from_saveable(restored, state)
    it.restore(host["iterator"])
    log(f"resumed after rollout step {host['rollout_step']} ({workdir}/checkpoints)")
  base_key = jax.random.key(loop.seed)
  row_sh = multihost.row_sharding(mesh)
  place = (lambda x: multihost.from_host(x, row_sh)) if jax.process_count() > 1 else jnp.asarray
  steps_fns: dict[tuple[int, int], Callable] = {}
  last_eval: dict = {}
  start = host["rollout_step"] if ckpt.latest_step() is not None else 0
  bar = tqdm(range(start, loop.num_steps), initial=start, total=loop.num_steps, desc="stage2", disable=not is_logger)
  try:
    for rstep in bar:
      t0 = time.perf_counter()
      batch_prompts = [prompts[i] for i in it.next_indices()]
      ro = rollout_lib.rollout(cfg, state["params"], [p.ids for p in batch_prompts], [p.gold for p in batch_prompts],
                               jax.random.fold_in(base_key, rstep), scfg, tokenizer, grade, loop.sample_max_batch,
                               mesh)
      tokens_BS, mask_BS, resp_mask_BR = trim_response(ro)
      t1 = time.perf_counter()
      # pi_ref forward in micro-batches: the whole rollout at once would be the run's memory peak.
      # Across processes each places its rows of a micro-batch and the result is gathered back.
      ref_logp_BR = np.concatenate([multihost.to_host(train.reference_logprobs(
          cfg, ref_params, place(tokens_BS[i:i + loop.micro_batch]), place(mask_BS[i:i + loop.micro_batch]),
          prompt_len=ro.prompt_len, chunk=loss_cfg.logp_chunk)) for i in range(0, len(tokens_BS), loop.micro_batch)])
      t2 = time.perf_counter()
      vstar_B = np.asarray(vstar_of(batch_prompts), np.float32)
      full = {"tokens": tokens_BS, "mask": mask_BS, "resp_mask": resp_mask_BR, "ref_logp": ref_logp_BR,
              "rewards": ro.rewards_B, "vstar": vstar_B}
      shape_key = (ro.prompt_len, resp_mask_BR.shape[1])
      if shape_key not in steps_fns:
        steps_fns[shape_key] = train.jit_train_step(cfg, loss_cfg, optimizer, ro.prompt_len, state_sh, batch_sh)
      sums: dict[str, float] = {}
      n_mini = loop.rollout_batch // loop.mini_batch
      for j in range(n_mini):
        sl = slice(j * loop.mini_batch, (j + 1) * loop.mini_batch)
        mb = train.split_microbatches({k: v[sl] for k, v in full.items()}, loop.micro_batch)
        mb = jax.tree.map(lambda x: multihost.from_host(x, batch_sh), mb)  # this process's rows of each micro-batch
        state, m = steps_fns[shape_key](state, mb)
        m = jax.device_get(m)
        if not bool(m["finite"]):
          ckpt.wait()
          raise FloatingPointError(
              f"non-finite loss or gradient at step {int(state['step']) + 1} (rollout {rstep}); the update was not "
              f"applied and the last good checkpoint (step {ckpt.latest_step()}) in {workdir}/checkpoints is intact")
        for k, v in m.items():
          sums[k] = sums.get(k, 0.0) + float(v) / n_mini
      t3 = time.perf_counter()
      n_tokens = int(resp_mask_BR.sum())
      metrics = {
          "loss": sums["loss"], "regression_loss": sums["regression_loss"], "entropy": sums.get("entropy", 0.0),
          "kl": sums["kl"], "advantage_mean": sums["advantage_mean"], "grad_norm": sums["grad_norm"],
          "reward_mean": float(ro.rewards_B.mean()), "vstar_mean": float(vstar_B.mean()),
          "response_length": float(ro.length_B.mean()), "truncation_rate": float(ro.truncated_B.mean()),
          "lr": float(current_lr(state["opt_state"])),
          "sec_sample": ro.seconds["sample"], "sec_grade": ro.seconds["grade"], "sec_ref": t2 - t1,
          "sec_update": t3 - t2, "sec_step": t3 - t0, "tokens_per_sec": n_tokens / max(t3 - t0, 1e-9),
          "grade_timeouts": float(ro.grade_stats.get("num_timeouts", 0)),
          "grade_errors": float(ro.grade_stats.get("num_errors", 0)),
      }
      done = rstep + 1
      writer.write(done, metrics, "train/", text_keys=["loss", "reward_mean", "kl", "entropy", "response_length",
                                                        "grad_norm", "sec_step"])
      bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", loss=f"{metrics['loss']:.4f}")
      if evaluate_fn is not None and loop.eval_every and done % loop.eval_every == 0 and done < loop.num_steps:
        last_eval = evaluate_fn(state["params"], done)
        writer.write(done, last_eval, "eval/")
      ckpt.save(done, ckpt_lib.to_saveable(state), {"iterator": it.state(), "rollout_step": done},
                force=(done == loop.num_steps))
  finally:  # an exception (kill, NaN) still lets in-flight saves finish: no lost or torn checkpoints
    ckpt.wait()
    ckpt.close()
    bar.close()
    if evaluate_fn is None:
      writer.close()
  if evaluate_fn is not None:
    last_eval = evaluate_fn(state["params"], loop.num_steps)
    writer.write(loop.num_steps, last_eval, "eval/")
    writer.close()
  return state["params"], last_eval


def current_lr(opt_state) -> float:
  """The learning rate AdamW used last (from its schedule state when present)."""
  for leaf in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "hyperparams")):
    if hasattr(leaf, "hyperparams"):
      return float(leaf.hyperparams["learning_rate"])
  return float("nan")

