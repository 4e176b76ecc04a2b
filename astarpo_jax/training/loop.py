"""The on-policy training loop every method runs: rollout -> the method's arrays -> guarded updates.

Per rollout step: `rollout.rollout` samples G responses per prompt from the current policy and grades
them; the method's `prepare` adds what its loss needs (π_ref or old-policy log-probs, V̂*, advantages);
the loop then takes `rollout_batch / mini_batch` optimizer steps (`update.update_step` with the
method's loss), logs, evaluates and checkpoints. Each mini-batch's metrics are fetched only after the
next one is dispatched, so the host never idles the device between them; a non-finite step (which the
step itself leaves unapplied) still stops the run before anything is saved. Resume: the train state,
the data iterator's position and the rollout step are saved together, and everything random is a
function of (seed, step), so a killed run rerun from its latest checkpoint reaches what an
uninterrupted run reaches. A preemption notice (infra/preemption.py) lets the step in flight finish: the
loop saves that step, on every process the same one, closes the logs and raises `Preempted`, so the rerun
logs each step once.

LoRA (`RunContext.lora`): the train state holds the adapter; the policy is the adapter attached to π_ref's own
tree (`RunContext.policy`), which the update step takes as its frozen base; each rollout and evaluation samples
from the adapter merged into one compute-dtype copy (`RunContext.sampling_params`).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from astarpo_jax.data.dataset import BatchIterator, Prompt
from astarpo_jax.infra import checkpoint as ckpt_lib, multihost, preemption, sharding
from astarpo_jax.infra.metrics import MetricsWriter
from astarpo_jax.model import lora as lora_lib
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.model.decoder import Params
from astarpo_jax.sampling import rollout as rollout_lib
from astarpo_jax.sampling.token_choice import SamplingConfig
from astarpo_jax.training import packing, scoring, update


@dataclasses.dataclass(frozen=True)
class LoopSettings:
  """How many prompts, how often, in what pieces: the same for every method (all counts are prompts;
  a mini-batch of a method with G responses per prompt holds mini_batch·G rows)."""
  num_steps: int = 100  # rollout steps
  rollout_batch: int = 256  # prompts per rollout
  mini_batch: int = 128  # prompts per optimizer step (rollout_batch / mini_batch steps per rollout)
  micro_batch: int = 16  # prompts per forward/backward; gradients accumulate over a mini-batch
  sample_max_batch: int | None = None  # decode slots (memory), None = the backend default (sampler.DEFAULT_SLOTS)
  seed: int = 0
  checkpoint_every: int = 50
  eval_every: int = 0  # 0 = only at the end
  pack_rows: bool = False  # the update's micro-batches and the fixed-score forwards packed (packing.py)
  score_micro_batches: int = 1  # the fixed-score forwards (π_ref, π_old, a critic) take this many micro-batches a call
  gather_weights: str = "per_micro_batch"  # train.gather_weights: "auto" resolves at the update's compile (gather_mode)

  def __post_init__(self):
    for f in ("num_steps", "rollout_batch", "mini_batch", "micro_batch", "checkpoint_every", "score_micro_batches"):
      if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
        raise ValueError(f"LoopSettings.{f}={getattr(self, f)!r}: must be an int >= 1")
    if self.rollout_batch % self.mini_batch:
      raise ValueError(f"rollout_batch={self.rollout_batch} is not divisible by mini_batch={self.mini_batch}")
    if self.mini_batch % self.micro_batch:
      raise ValueError(f"mini_batch={self.mini_batch} is not divisible by micro_batch={self.micro_batch}")


def steps_for_epochs(num_prompts: int, rollout_batch: int, epochs: int, official_step_count: bool = True) -> int:
  """Rollout steps of `epochs` passes over `num_prompts` prompts, `rollout_batch` at a time, the tail that
  does not fill a rollout dropped each epoch (official: verl's DataLoader with drop_last, ray_trainer.py's
  total_training_steps = len(dataloader) * total_epochs). `official_step_count`: one fewer, as verl's loop
  stops once its step counter, which starts at 1, reaches that total."""
  per_epoch = num_prompts // rollout_batch
  if per_epoch < 1:
    raise ValueError(f"{num_prompts} training prompts do not fill one rollout of {rollout_batch}: lower "
                     "train.rollout_batch or train on more prompts")
  return max(1, epochs * per_epoch - (1 if official_step_count else 0))


@dataclasses.dataclass(frozen=True)
class RunContext:
  """What every rollout step needs besides the method's own settings and the train state."""
  cfg: ModelConfig  # the policy's model config (with LoRA: lora.model_config's, the adapter's scale in it)
  ref_params: Params  # frozen π_ref; with LoRA also the base the adapter is attached to
  tokenizer: Any
  grade: rollout_lib.GradeFn
  scfg: SamplingConfig
  mesh: jax.sharding.Mesh | None = None  # over all processes' devices; None = one device
  value_table: Any = None  # A*-PO's Stage-1 V̂* (stage1.Stage1Result); None for other methods
  sample_mesh: jax.sharding.Mesh | None = None  # where rollouts sample (mesh.sample_shape); None = the state's mesh
  lora: lora_lib.LoraConfig | None = None  # the policy is a LoRA adapter on ref_params (state["params"] the adapter)

  @property
  def row_sharding(self):
    return multihost.row_sharding(self.mesh)

  def policy(self, params: Params) -> Params:
    """The policy's param tree from the train state's params: with LoRA the adapter attached to π_ref's tree."""
    return lora_lib.attach(self.ref_params, params) if self.lora is not None else params

  def sampling_params(self, params: Params) -> Params:
    """What the sampler runs on: the policy's params, or with LoRA the adapter merged into a copy of the base in
    the compute dtype, once per call (lora.sampling_params)."""
    return lora_lib.sampling_params(self.cfg, self.ref_params, params) if self.lora is not None else params


@dataclasses.dataclass(frozen=True)
class RunIO:
  """Where a run writes and whom it tells: the work directory, the log, evaluations."""
  workdir: str
  log: Callable[[str], Any] = print
  is_logger: bool = True  # process 0 writes metrics and logs
  evaluate_fn: Callable[[Params, int], dict] | None = None  # (params, step) -> {name: accuracy}
  wandb: Any = None  # metrics.WandbSettings: a W&B run beside metrics.jsonl (process 0), or None
  preemption: preemption.Watch | None = None  # SIGTERM / SIGINT: finish the step, save it, raise Preempted


@dataclasses.dataclass
class RunResult:
  params: Params  # the final policy (with LoRA: the adapter attached to the base)
  last_eval: dict
  eval_seconds: float  # wall time spent in `evaluate_fn`, inside the loop's time
  eval_cpu_seconds: float  # and the CPU time (all threads of this process) it took


def _cpu_seconds() -> float:
  t = os.times()
  return t.user + t.system


def current_lr(opt_state) -> float:
  """The learning rate AdamW used last (from its schedule state when present)."""
  for leaf in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "hyperparams")):
    if hasattr(leaf, "hyperparams"):
      return float(leaf.hyperparams["learning_rate"])
  return float("nan")


def place_state(method, ctx: RunContext, optimizers: update.Optimizers, state: dict) -> tuple[dict, Any, Any]:
  """The state placed by the logical-axis rules on `ctx.mesh` (FSDP / tensor parallel), with the shardings
  the update step is compiled for (None without a mesh)."""
  if ctx.mesh is None:
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding), state), None, None  # committed, as restored ones
  axes, shapes = method.critic_layout(ctx.cfg) if "value_params" in state else (None, None)
  state_sh = update.state_shardings(ctx.cfg, optimizers, ctx.mesh, axes, shapes, lora_cfg=ctx.lora)
  return jax.device_put(state, state_sh), state_sh, ctx.mesh


def _updates(step_fn, place, state, batch: dict[str, np.ndarray], loop: LoopSettings, rows_per_prompt: int,
             prompt_len: int, shards: int) -> tuple[dict, list[dict]]:
  """Dispatches the rollout's optimizer steps, one per mini-batch; returns the state and each step's
  metrics, fetched one step late (after the next step is dispatched). `shards`: the mesh's batch shards,
  each packing its own rows (train.pack_rows)."""
  n_mini = loop.rollout_batch // loop.mini_batch
  rows = loop.mini_batch * rows_per_prompt
  fetched, pending = [], None
  for j in range(n_mini):
    mb = update.split_microbatches({k: v[j * rows:(j + 1) * rows] for k, v in batch.items()},
                                   loop.micro_batch * rows_per_prompt)
    if loop.pack_rows:
      mb = packing.pack_microbatches(mb, prompt_len, shards)
    state, m = step_fn(state, place(mb))
    if pending is not None:
      fetched.append(jax.device_get(pending))
    pending = m
  fetched.append(jax.device_get(pending))
  return state, fetched


def _check_finite(fetched: list[dict], step_before: int, rstep: int, ckpt, workdir: str) -> dict[str, float]:
  """The mini-batches' metrics averaged; stops the run at the first non-finite step (never applied)."""
  for j, m in enumerate(fetched):
    if not bool(m["finite"]):
      ckpt.wait()
      raise FloatingPointError(
          f"non-finite loss or gradient at step {step_before + j + 1} (rollout {rstep}, mini-batch {j}); the "
          f"update was not applied, the run stops, and the last good checkpoint (step {ckpt.latest_step()}) in "
          f"{workdir}/checkpoints is intact")
  return {k: sum(float(m[k]) for m in fetched) / len(fetched) for k in fetched[0] if k != "finite"}


@dataclasses.dataclass
class _Placement:
  """Where the state and each micro-batch live, and the update steps compiled for them (one per shape)."""
  state: Any  # shardings of the train state (None without a mesh)
  batch: Any  # sharding of every [M, b, ...] batch array
  steps: dict  # (prompt_len, response_len) -> jitted update step
  base: Any = None  # LoRA: shardings of the frozen base (π_ref's tree), an input of the update step
  score_ref: Callable | None = None  # π_ref's params -> the copy its scoring forwards read (`reference_copy`)

  def place(self, mb: dict) -> dict:
    """This process's rows of each micro-batch array (the host arrays themselves with one process)."""
    if self.batch is None:
      return mb
    return jax.tree.map(lambda x: multihost.from_host(x, self.batch), mb)


def _free_bytes() -> int | None:
  """What the first local device has left beside what it holds (None where it does not say, as the CPU)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats["bytes_limit"] - stats["bytes_in_use"] if "bytes_limit" in stats and "bytes_in_use" in stats else None


def _tensor_ways(mesh) -> int:
  return 1 if mesh is None else dict(zip(mesh.axis_names, mesh.devices.shape)).get("tensor", 1)


def reference_copy(mode: str, ctx: RunContext) -> Callable | None:
  """How π_ref's scoring forwards read its weights under train.gather_weights `mode`: None (as placed for training:
  each call gathers them over the batch axes) for "per_micro_batch", without a mesh and with LoRA (π_ref is the
  frozen base the update reads as placed), else a jitted `ref_params -> copy`: cast to the compute dtype (as each
  layer casts before use) and whole over the batch axes, keeping the tensor split (update.gathered_shardings),
  made once a rollout and dropped after its scoring. "auto" takes it where the copy fits beside what the device
  holds: the choice the TPU compile makes (aot.layouts.compile_gathered)."""
  if ctx.mesh is None or ctx.lora is not None or update.resolve_gather(mode, 0, None) == "per_micro_batch":
    return None
  copy_bytes = sum(x.size for x in jax.tree.leaves(ctx.ref_params)) * jnp.dtype(ctx.cfg.dtype).itemsize
  free = _free_bytes()
  if mode == "auto" and free is not None and copy_bytes // _tensor_ways(ctx.mesh) > free:
    return None
  shardings = update.gathered_shardings(jax.tree.map(lambda x: x.sharding, ctx.ref_params))
  return jax.jit(functools.partial(update.compute_copy, ctx.cfg, copy_shardings=shardings), out_shardings=shardings)


def gather_mode(mode: str, ctx: RunContext, state) -> str:
  """train.gather_weights resolved for this mesh: "auto" gathers the compute copy once per optimizer step when it
  and one micro-batch's gradient of it fit beside what the device holds, and accumulates the gradients per device
  when a whole master-dtype accumulator fits too, for full fine-tuning without a critic (update.resolve_gather; no
  limit known on the CPU). The copy and the accumulator are whole over the batch axes and keep the tensor split."""
  if mode != "auto":
    return update.resolve_gather(mode, 0, None)
  tensor = _tensor_ways(ctx.mesh)
  leaves = jax.tree.leaves(state["params"])
  copy_bytes = sum(x.size for x in leaves) * jnp.dtype(ctx.cfg.dtype).itemsize // tensor
  local = ctx.lora is None and "value_params" not in state
  acc_bytes = None
  if local:  # a tied output projection accumulates its [D, V] gradient beside the embedding's (update.py)
    tied = state["params"]["embed"] if ctx.cfg.tie_embeddings else None
    acc_bytes = sum(x.size * x.dtype.itemsize for x in leaves + ([tied] if tied is not None else [])) // tensor
  return update.resolve_gather(mode, copy_bytes, _free_bytes(), acc_bytes)


def _rollout_step(method, ctx: RunContext, loop: LoopSettings, optimizers, placed: _Placement, state, rstep: int,
                  batch_prompts: Sequence[Prompt], ckpt, workdir: str) -> tuple[dict, dict]:
  """Sample and grade G responses per prompt, the method's arrays, then the mini-batch updates."""
  G = method.responses_per_prompt()
  t0, cpu0 = time.perf_counter(), _cpu_seconds()
  ro = rollout_lib.rollout(ctx.cfg, ctx.sampling_params(state["params"]), [p.ids for p in batch_prompts], [p.target for p in batch_prompts],
                           jax.random.fold_in(jax.random.key(loop.seed), rstep), ctx.scfg, ctx.tokenizer, ctx.grade,
                           loop.sample_max_batch, ctx.mesh, num_samples=G,  # prompt-major groups, one prefill each
                           sample_mesh=ctx.sample_mesh)
  scoring_ctx = ctx if placed.score_ref is None else dataclasses.replace(
      ctx, ref_params=placed.score_ref(ctx.ref_params))  # π_ref whole over the batch axes for this rollout's scoring
  batch, prep_metrics = method.prepare(scoring_ctx, state, ro, batch_prompts, scoring.Blocks(
      loop.micro_batch * loop.score_micro_batches * G, loop.pack_rows))
  del scoring_ctx
  t1 = time.perf_counter()
  key = (ro.prompt_len, batch["resp_mask"].shape[1])
  if key not in placed.steps:
    loss = functools.partial(method.loss, ctx.cfg, key[0])
    placed.steps[key] = update.jit_update_step(ctx.cfg, loss, optimizers, placed.state, placed.batch,
                                               lora_base=ctx.lora is not None, base_shardings=placed.base,
                                               gather_weights=gather_mode(loop.gather_weights, ctx, state))
  step_before = int(state["step"])
  shards = sharding.batch_ways(ctx.mesh)
  step_fn = placed.steps[key]
  if ctx.lora is not None:  # the frozen base rides beside the donated state
    step_fn = functools.partial(lambda fn, s, b: fn(s, b, ctx.ref_params), step_fn)
  state, fetched = _updates(step_fn, placed.place, state, batch, loop, G, key[0], shards)
  sums = _check_finite(fetched, step_before, rstep, ckpt, workdir)
  t2 = time.perf_counter()
  metrics = dict(sums, **rollout_lib.rollout_metrics(ro), **prep_metrics)
  # cpu_step: this process's CPU seconds (all its threads; not the grader workers'), which load does not inflate
  metrics.update(lr=current_lr(state["opt_state"]), sec_update=t2 - t1, sec_step=t2 - t0,
                 cpu_step=_cpu_seconds() - cpu0,
                 tokens_per_sec=int(batch["resp_mask"].sum()) / max(t2 - t0, 1e-9))
  return state, metrics


class _Evaluations:
  """Runs `evaluate_fn`, logs its figures and keeps the time it took apart from training's."""

  def __init__(self, evaluate_fn, writer: MetricsWriter):
    self.fn, self.writer = evaluate_fn, writer
    self.last: dict = {}
    self.seconds = self.cpu_seconds = 0.0

  def __call__(self, params, step: int) -> None:
    logged = self.writer.logged(step, "eval/")  # e.g. the final evaluation, redone by a run resumed after it
    t, cpu = time.perf_counter(), _cpu_seconds()
    self.last = self.fn(params, step)
    self.seconds += time.perf_counter() - t
    self.cpu_seconds += _cpu_seconds() - cpu
    if not logged:
      self.writer.write(step, self.last, "eval/")


def run(method, policy_params: Params, prompts: Sequence[Prompt], ctx: RunContext, loop: LoopSettings,
        optimizers: update.Optimizers, io: RunIO) -> RunResult:
  """Trains `policy_params` with `method` (a methods.Method) from `io.workdir`'s latest checkpoint (or 0)
  to `loop.num_steps` rollout steps. With several JAX processes (ctx.mesh spans them) every process runs
  this same loop: the rollout is sampled as one program and gathered, each process places its rows."""
  # The step donates its state: own a copy, so the caller's arrays (often the reference's) survive. With LoRA
  # `policy_params` is the adapter: it is copied, the base is π_ref's own (never donated).
  state = method.init_state(ctx.cfg, ctx.policy(jax.tree.map(jnp.copy, policy_params)), optimizers, loop.seed)
  state, state_sh, mesh = place_state(method, ctx, optimizers, state)
  rows = loop.micro_batch * method.responses_per_prompt()
  base_sh = jax.tree.map(lambda x: x.sharding, ctx.ref_params) if ctx.lora is not None and mesh is not None else None
  placed = _Placement(state_sh, update.batch_sharding(mesh, rows) if mesh is not None else None, {}, base_sh,
                      reference_copy(loop.gather_weights, ctx))
  writer = MetricsWriter(io.workdir, log=io.log, enabled=io.is_logger, wandb=io.wandb)
  evals = _Evaluations(io.evaluate_fn, writer)
  it = BatchIterator(list(range(len(prompts))), loop.rollout_batch, seed=loop.seed)
  ckpt = ckpt_lib.Checkpointer(f"{io.workdir}/checkpoints", keep=3, save_every=loop.checkpoint_every)
  start = 0
  restored = ckpt_lib.restore_latest_good(ckpt, state, io.log)  # a damaged latest one is set aside
  if restored is not None:
    state, host = restored
    it.restore(host["iterator"])
    start = host["rollout_step"]
    io.log(f"resumed after rollout step {start} ({io.workdir}/checkpoints)")
  watch = io.preemption or preemption.Watch()  # one not installed never stops the loop
  watch.resume_point = f"the latest complete checkpoint in {io.workdir}/checkpoints"
  bar = tqdm(range(start, loop.num_steps), initial=start, total=loop.num_steps, desc=method.name,
             disable=not io.is_logger)
  try:
    with watch.finishing("the rollout step in flight"):
      for rstep in bar:
        batch_prompts = [prompts[i] for i in it.next_indices()]
        state, metrics = _rollout_step(method, ctx, loop, optimizers, placed, state, rstep, batch_prompts, ckpt,
                                       io.workdir)
        done = rstep + 1
        writer.write(done, metrics, "train/", text_keys=list(method.text_keys))
        bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", loss=f"{metrics['loss']:.4f}")
        if io.evaluate_fn is not None and loop.eval_every and done % loop.eval_every == 0 and done < loop.num_steps:
          evals(ctx.sampling_params(state["params"]), done)
        stop = watch.stop_requested()  # the same on every process: all save this step
        if ckpt.save(done, ckpt_lib.to_saveable(state), {"iterator": it.state(), "rollout_step": done},
                     force=(done == loop.num_steps) or stop):
          writer.flush()  # what a checkpoint holds is in every log, even after a kill -9
        if stop:
          ckpt.wait()
          watch.disarm()
          raise watch.preempted(f"rollout step {done} finished and saved in {io.workdir}/checkpoints")
    if io.evaluate_fn is not None:
      evals(ctx.sampling_params(state["params"]), loop.num_steps)
  finally:  # an exception (kill, NaN, preemption) still lets in-flight saves finish: no lost or torn checkpoints
    ckpt.wait()
    ckpt.close()
    bar.close()
    writer.close()
  return RunResult(ctx.policy(state["params"]), evals.last, evals.seconds, evals.cpu_seconds)
