"""The on-policy training loop shared by A*-PO (stage2.py) and the baselines (baseline_loop.py).

Per rollout step: the method's `prepare` (sample, grade, the forwards it needs) turns a batch of
prompt indices into host arrays, one row per response; the loop then takes `rollout_batch /
mini_batch` optimizer steps on them (each a jitted step over micro-batches), stops on a non-finite
update, logs, evaluates and checkpoints. Resume: the train state, the data iterator's position and
the rollout step are saved together, and everything random is a function of (seed, step), so a
killed run rerun from its latest checkpoint reaches what an uninterrupted run reaches.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from astarpo_jax import checkpoint as ckpt_lib
from astarpo_jax import train
from astarpo_jax.data import BatchIterator
from astarpo_jax.metrics import MetricsWriter


@dataclasses.dataclass
class Prepared:
  """What one rollout step hands to the updates."""
  batch: dict[str, np.ndarray]  # [rows, ...] host arrays, the update step's inputs
  shape_key: tuple  # the static shapes the update step is compiled for (one compile per key)
  metrics: dict[str, float]  # host-side numbers for the log (rewards, lengths, phase seconds)


@dataclasses.dataclass(frozen=True)
class LoopSpec:
  """How a method plugs into the loop."""
  desc: str  # progress-bar label
  # (state, rollout step, prompt indices) -> Prepared
  prepare: Callable[[dict, int, Sequence[int]], Prepared]
  make_step: Callable[[tuple], Callable]  # shape_key -> jitted (state, [M, b, ...] batch) -> (state, metrics)
  place: Callable[[dict], dict]  # [M, b, ...] host micro-batches -> what the step takes (per-process rows)
  rows_per_prompt: int = 1  # responses per prompt (G for GRPO's groups)
  text_keys: tuple[str, ...] = ("loss", "reward_mean", "kl", "entropy", "response_length", "grad_norm", "sec_step")


def current_lr(opt_state) -> float:
  """The learning rate AdamW used last (from its schedule state when present)."""
  for leaf in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "hyperparams")):
    if hasattr(leaf, "hyperparams"):
      return float(leaf.hyperparams["learning_rate"])
  return float("nan")


def _updates(spec: LoopSpec, step_fn, state, batch: dict[str, np.ndarray], loop, ckpt, workdir: str,
             rstep: int) -> tuple[dict, dict[str, float]]:
  """The rollout's optimizer steps, one per mini-batch; metrics averaged over them."""
  n_mini = loop.rollout_batch // loop.mini_batch
  rows = loop.mini_batch * spec.rows_per_prompt
  sums: dict[str, float] = {}
  for j in range(n_mini):
    mb = train.split_microbatches({k: v[j * rows:(j + 1) * rows] for k, v in batch.items()},
                                  loop.micro_batch * spec.rows_per_prompt)
    state, m = step_fn(state, spec.place(mb))
    m = jax.device_get(m)
    if not bool(m["finite"]):
      ckpt.wait()
      raise FloatingPointError(
          f"non-finite loss or gradient at step {int(state['step']) + 1} (rollout {rstep}); the update was not "
          f"applied and the last good checkpoint (step {ckpt.latest_step()}) in {workdir}/checkpoints is intact")
    for k, v in m.items():
      if k != "finite":
        sums[k] = sums.get(k, 0.0) + float(v) / n_mini
  return state, sums


def run_loop(spec: LoopSpec, state: dict, *, num_prompts: int, loop, workdir: str,
             evaluate_fn: Callable | None = None, log=print, is_logger: bool = True) -> tuple[dict, dict]:
  """Runs rollout steps from the latest checkpoint in `workdir` (or 0) to `loop.num_steps`.

  `state` is the freshly initialised train state, placed as the step expects (its shardings are
  also where a checkpoint is restored to). Returns the final state and the last evaluation.
  """
  writer = MetricsWriter(workdir, log=log, enabled=is_logger, wandb=loop.wandb)
  it = BatchIterator(list(range(num_prompts)), loop.rollout_batch, seed=loop.seed)
  ckpt = ckpt_lib.Checkpointer(f"{workdir}/checkpoints", keep=3, save_every=loop.checkpoint_every)
  start = 0
  if ckpt.latest_step() is not None:
    saved = ckpt_lib.to_saveable(state)
    restored, host = ckpt.restore(ckpt_lib.abstract_state(jax.eval_shape(lambda: saved),
                                                          jax.tree.map(lambda x: x.sharding, saved)))
    state = ckpt_lib.from_saveable(restored, state)
    it.restore(host["iterator"])
    start = host["rollout_step"]
    log(f"resumed after rollout step {start} ({workdir}/checkpoints)")
  step_fns: dict[tuple, Callable] = {}
  last_eval: dict = {}
  bar = tqdm(range(start, loop.num_steps), initial=start, total=loop.num_steps, desc=spec.desc, disable=not is_logger)
  try:
    for rstep in bar:
      t0 = time.perf_counter()
      prep = spec.prepare(state, rstep, it.next_indices())
      t1 = time.perf_counter()
      if prep.shape_key not in step_fns:
        step_fns[prep.shape_key] = spec.make_step(prep.shape_key)
      state, sums = _updates(spec, step_fns[prep.shape_key], state, prep.batch, loop, ckpt, workdir, rstep)
      t2 = time.perf_counter()
      metrics = dict(sums, **prep.metrics)
      metrics.update(lr=current_lr(state["opt_state"]), sec_update=t2 - t1, sec_step=t2 - t0,
                     tokens_per_sec=int(prep.batch["resp_mask"].sum()) / max(t2 - t0, 1e-9))
      done = rstep + 1
      writer.write(done, metrics, "train/", text_keys=list(spec.text_keys))
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
  return state, last_eval


def rollout_metrics(ro) -> dict[str, float]:
  """The log's per-rollout numbers every method shares."""
  return {"reward_mean": float(ro.rewards_B.mean()), "response_length": float(ro.length_B.mean()),
          "truncation_rate": float(ro.truncated_B.mean()), "sec_sample": ro.seconds["sample"],
          "sec_grade": ro.seconds["grade"], "grade_timeouts": float(ro.grade_stats.get("num_timeouts", 0)),
          "grade_errors": float(ro.grade_stats.get("num_errors", 0))}
