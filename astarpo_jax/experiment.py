"""Wires a run config into library calls: the composition root used by `experiments/main.py`.

What a run reads (model config, data, the reference, graders) is run_inputs.py's; this module builds the Setup
and runs its phases.

The config is read here, in run_inputs.py and in run_config.py only (its checks and the method it names): `build`
unpacks it once into a `Setup` of plain values and frozen settings, and everything after (Stage 1,
training, evaluation, export) takes the Setup.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Callable

import jax

from astarpo_jax import methods
from astarpo_jax.data import dataset, synthetic
from astarpo_jax.evals import run as evals_run, samples as evals_samples, summary as evals_summary
from astarpo_jax.infra import files, multihost, preemption, sharding
from astarpo_jax.model import decoder, hf, lora
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.rewards import reward_pool, user_grader
from astarpo_jax.run_config import (OFFLINE_TASKS, build_method, char_vocab, lora_settings, policy_lr, ref_param_dtype,
                                    wandb_settings)
from astarpo_jax.run_inputs import (Grader, Graders, build_reference, check_chars, load_set, local_dir, model_config,
                                    stop_ids)
from astarpo_jax.sampling.token_choice import SamplingConfig
from astarpo_jax.stage1 import estimate, official_data, value_table as vt
from astarpo_jax.training import loop, update


def maybe_initialize_distributed() -> None:
  """Joins a multi-process run; call before anything touches a JAX backend (jax.devices(), arrays).

  GPU clusters: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID; a multi-host TPU
  slice needs none (JAX reads the TPU environment).
  """
  addr = os.environ.get("JAX_COORDINATOR_ADDRESS")
  if addr:
    missing = [k for k in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if k not in os.environ]
    if missing:
      raise ValueError(f"JAX_COORDINATOR_ADDRESS={addr} is set but {missing} are not: set all three")
    jax.distributed.initialize(addr, int(os.environ["JAX_NUM_PROCESSES"]), int(os.environ["JAX_PROCESS_ID"]))
  elif len([h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
    jax.distributed.initialize()


def printer() -> Callable[[str], None]:
  """A print that only process 0 uses, flushed (logs of a multi-host run come from one place)."""
  def say(msg: str) -> None:
    if jax.process_index() == 0:
      print(msg, flush=True)
  return say


@dataclasses.dataclass(frozen=True)
class Stage1Settings:
  n_samples: int
  beta1: float
  chunk_prompts: int
  drop_all_fail: bool
  keep_responses: bool
  adaptive: estimate.AdaptiveConfig | None
  pass_threshold: float  # a response passes (counts as correct) when r >= this
  reward_id: str  # a user reward function's name and source hash, kept with the V̂* run ("" for a built-in one)
  vstar_file: str  # reuse a V̂* file instead of sampling
  eval_columns_file: str  # or import official eval_0..eval_{N-1} columns
  eval_columns_key: str


@dataclasses.dataclass(kw_only=True)
class Setup:
  """Everything a run needs, the config unpacked once."""
  cfg: ModelConfig  # the reference's (params in ref_param_dtype)
  tokenizer: Any
  ref_params: Any
  train_prompts: list
  test_sets: dict  # name -> prompts, evaluated greedily (pass@1)
  avg_k_sets: dict  # name -> prompts, evaluated with sampling (avg@k)
  avg_k: int
  graders: Graders
  pass_threshold: float
  scfg: SamplingConfig
  mesh: Any  # jax.sharding.Mesh over all devices: (data, fsdp, tensor)
  method: methods.Method
  loop: loop.LoopSettings
  optimizers: update.Optimizers
  stage1: Stage1Settings
  policy_param_dtype: str
  seed: int
  times: dict
  epochs: int = 0  # > 0: loop.num_steps is set from this many epochs over the training prompts kept
  official_step_count: bool = True  # with epochs: one rollout fewer, as verl's loop runs
  pool: Any = None  # the graders' worker pool, closed when the Setup's `with` block ends
  wandb: Any = None  # metrics.WandbSettings of the run's W&B sink (None: none)
  sample_mesh: Any = None  # the sampling calls' mesh (mesh.sample_shape) over the same devices; None = `mesh`
  lora: Any = None  # model.lora's LoraConfig: the policy is an adapter on ref_params (the frozen base); None = full FT
  base_path: str = ""  # the base model's folder or hub id (a PEFT adapter's base_model_name_or_path)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    if self.pool is not None:
      self.pool.close()


def settings(c, method: methods.Method) -> tuple[loop.LoopSettings, update.Optimizers, Stage1Settings]:
  t, o, s1 = c.train, c.optim, c.stage1
  loop_settings = loop.LoopSettings(  # num_steps 0: set from train.epochs once the prompts are known
      num_steps=t.num_steps or 1, rollout_batch=t.rollout_batch, mini_batch=t.mini_batch, micro_batch=t.micro_batch,
      sample_max_batch=c.sampling.max_batch or None, seed=c.seed, checkpoint_every=t.checkpoint_every,
      eval_every=t.eval_every, pack_rows=bool(t.pack_rows), score_micro_batches=t.score_micro_batches,
      gather_weights=t.gather_weights)
  zero_lr = t.rollout_batch // t.mini_batch if o.zero_lr_first_rollout else 0  # the first rollout's steps
  optim = lambda lr, **kw: update.make_optimizer(lr, o.weight_decay, o.grad_clip, warmup_steps=o.warmup_steps,  # noqa: E731
                                                 zero_lr_steps=zero_lr, **kw)
  # optim.kind / optim.mu_dtype name the policy's optimizer (AdamW, official, or a deviation); a critic keeps AdamW.
  policy = optim(policy_lr(c), kind=o.get("kind", "adamw"), mu_dtype=o.get("mu_dtype", ""))
  optimizers = update.Optimizers(policy, optim(c.algo.value_lr) if method.footprint().critic else None)
  adaptive = estimate.AdaptiveConfig(s1.adaptive_n_min, s1.n_samples) if s1.adaptive_n_min else None
  grader = c.reward.stage1_grader
  reward_id = (f"{user_grader.parse(grader).function} sha256:{user_grader.source_sha256(grader)}"
               if user_grader.is_spec(grader) else "")
  stage1_settings = Stage1Settings(
      n_samples=s1.n_samples, beta1=s1.beta1, chunk_prompts=s1.chunk_prompts, drop_all_fail=s1.drop_all_fail,
      keep_responses=s1.keep_responses, adaptive=adaptive, pass_threshold=c.reward.pass_threshold,
      reward_id=reward_id, vstar_file=s1.vstar_file,
      eval_columns_file=s1.eval_columns_file, eval_columns_key=s1.eval_columns_key)
  return loop_settings, optimizers, stage1_settings


def build(c, workdir: str, log=print) -> Setup:
  """Tokenizer, reference model, prompts, grader, sampling config and every setting of a run."""
  task = OFFLINE_TASKS.get(c.data.train)
  if c.model.name_or_path == "random":  # an offline task's character tokenizer, or one of model.random.chars
    tok = hf.load_tokenizer(synthetic.save_tokenizer(os.path.join(local_dir(workdir), "tokenizer"), char_vocab(c)))
  else:
    tok = hf.load_tokenizer(c.model.name_or_path)
  mesh = sharding.make_mesh(tuple(c.mesh.shape))
  cfg = dataclasses.replace(model_config(c), param_dtype=ref_param_dtype(c))
  sample_mesh = sharding.sample_mesh(tuple(c.mesh.sample_shape), mesh, num_heads=cfg.num_heads,
                                     num_kv_heads=cfg.num_kv_heads)
  ref_params, times = build_reference(c, cfg, tok, workdir, mesh, log)
  template = task.PROMPT_TEMPLATE if task is not None else c.data.template

  def prompts_of(name: str, split: str, limit: int) -> list[dataset.Prompt]:
    examples = load_set(c, name, split)
    if limit:
      examples = examples[:limit]
    check_chars(c, [dataset.format_prompt(ex.problem, template) for ex in examples], f"the prompts of {name}")
    prompts, stats = dataset.build_prompts(examples, tok, template, chat=c.data.chat,
                                        max_prompt_tokens=c.data.max_prompt_tokens,
                                        prompt_filter=c.data.prompt_filter)
    log(f"data {name}/{split}: {stats.kept} prompts ({stats.too_long} longer than {c.data.max_prompt_tokens} dropped)")
    return prompts

  train_prompts = prompts_of(c.data.train, "train", c.data.num_train)
  test_sets = {n: prompts_of(n, "test", c.data.num_test) for n in c.data.test_sets}
  avg_k_sets = {n: prompts_of(n, "test", c.data.num_test) for n in c.data.avg_k_sets}
  s = c.sampling
  scfg = SamplingConfig(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                        max_new_tokens=s.max_new_tokens, stop_ids=stop_ids(tok, s.extra_stop_tokens),
                        pad_id=tok.pad_token_id, kv_layout=s.kv_layout, page_size=s.page_size, max_pages=s.max_pages,
                        paged_attention=s.paged_attention)
  r = c.reward
  names = (r.stage1_grader, r.grader, *r.eval_graders)
  pool = reward_pool.RewardPool(num_workers=r.num_workers, timeout_s=r.timeout_s,
                                preload=tuple(dict.fromkeys(g for g in names if user_grader.is_spec(g))),
                                warm_up="math_verify" in names)
  grader = functools.partial(Grader, pool, max_error_share=r.max_error_share, log=log)
  graders = Graders(stage1=grader(r.stage1_grader, r.stage1_eos_required), train=grader(r.grader, r.eos_required),
                    eval=tuple((g, grader(g, r.eval_eos_required)) for g in r.eval_graders))
  method = build_method(c)
  loop_settings, optimizers, stage1_settings = settings(c, method)
  return Setup(cfg=cfg, tokenizer=tok, ref_params=ref_params, train_prompts=train_prompts, test_sets=test_sets,
               avg_k_sets=avg_k_sets, avg_k=c.data.avg_k, graders=graders, pass_threshold=r.pass_threshold, scfg=scfg,
               mesh=mesh, method=method,
               loop=loop_settings, optimizers=optimizers, stage1=stage1_settings,
               policy_param_dtype=c.model.param_dtype, seed=c.seed, times=times,
               epochs=0 if c.train.num_steps else c.train.epochs, official_step_count=c.train.official_step_count,
               pool=pool, wandb=wandb_settings(c), sample_mesh=sample_mesh, lora=lora_settings(c),
               base_path=(os.path.join(local_dir(workdir), "reference") if c.model.name_or_path == "random"
                          else c.model.name_or_path))


def run_stage1(setup: Setup, workdir: str, log=print, watch: preemption.Watch | None = None) -> vt.ValueTable:
  """The V̂* table of the training prompts: sampled from π_ref, or read from a V̂* file or eval_i columns.

  A method without V̂* (the baselines) samples nothing and trains on every training prompt. `watch`: a
  preemption notice finishes and writes the chunk in flight, then raises `preemption.Preempted`.
  """
  s1, prompts = setup.stage1, setup.train_prompts
  if not setup.method.needs_value_table:
    log(f"stage1: skipped ({setup.method.name} needs no V*)")
    return vt.ValueTable({}, list(prompts), "", {"skipped": f"{setup.method.name} needs no V*"})
  if s1.vstar_file or s1.eval_columns_file:
    return _read_table(setup, workdir, log)
  draw = estimate.rollout_draw(setup.cfg, setup.ref_params, setup.scfg, setup.tokenizer, setup.graders.stage1,
                               setup.loop.sample_max_batch, setup.mesh, setup.sample_mesh)
  return estimate.run_stage1(prompts, draw, out_dir=workdir, n_samples=None if s1.adaptive else s1.n_samples,
                             beta1=s1.beta1, chunk_prompts=s1.chunk_prompts, seed=setup.seed,
                             keep_responses=s1.keep_responses, drop_all_fail=s1.drop_all_fail, adaptive=s1.adaptive,
                             pass_threshold=s1.pass_threshold, reward_id=s1.reward_id, log=log, watch=watch)


def _read_table(setup: Setup, workdir: str, log) -> vt.ValueTable:
  """The V̂* table from a V̂* file, or imported from official eval_i columns (and written to workdir/stage1)."""
  s1, prompts = setup.stage1, setup.train_prompts
  if s1.vstar_file:
    records = vt.load_table(s1.vstar_file)
  else:
    # A row names its prompt by the raw problem (extra_info.question) or the prompt text (prompt.0.content).
    uid_of = {**{p.text: p.uid for p in prompts}, **{p.problem: p.uid for p in prompts if p.problem}}
    out_path = os.path.join(workdir, "stage1", "vstar.jsonl") if jax.process_index() == 0 else None
    records, _ = official_data.import_eval_columns(s1.eval_columns_file, key=s1.eval_columns_key, uid_of=uid_of,
                                                   beta1=s1.beta1, num_columns=s1.n_samples, out_path=out_path,
                                                   log=log)
  missing = [p.uid for p in prompts if p.uid not in records]
  if missing:
    log(f"stage1: {len(missing)} training prompts have no V* in the given file and are left out")
  kept = [p for p in prompts if p.uid in records and not (s1.drop_all_fail and records[p.uid]["num_correct"] == 0)]
  summary = vt.summarize([records[p.uid] for p in prompts if p.uid in records])
  log(vt.format_summary(summary))
  return vt.ValueTable(records, kept, s1.vstar_file or s1.eval_columns_file, summary)


def run_training(setup: Setup, table: vt.ValueTable, workdir: str, log=print,
                 watch: preemption.Watch | None = None) -> loop.RunResult:
  """Stage 2 (A*-PO) or the baseline's training from the reference; returns the final policy params, their
  full evaluation (run by the loop after the last step) and the time spent evaluating during training.
  `watch`: a preemption notice finishes the step in flight, saves it and raises `preemption.Preempted`."""
  policy_cfg = dataclasses.replace(setup.cfg, param_dtype=setup.policy_param_dtype)
  if setup.lora is not None:  # a fresh adapter (B = 0: step 0 is the base); the base is ref_params itself
    policy = lora.init_adapter(policy_cfg, setup.lora, setup.seed)
    policy_cfg = lora.model_config(policy_cfg, setup.lora)
  else:
    policy = decoder.cast_params(setup.ref_params, setup.policy_param_dtype)
  last: dict = {}

  def eval_fn(params, step):
    last.clear()
    last.update(evaluate_all(setup, params, label=f"step {step}", log=log))
    return {k: v["accuracy"] for k, v in last.items()}

  ctx = loop.RunContext(policy_cfg, setup.ref_params, setup.tokenizer, setup.graders.train, setup.scfg, setup.mesh,
                        table, setup.sample_mesh, setup.lora)
  io = loop.RunIO(workdir, log, jax.process_index() == 0, eval_fn, setup.wandb, watch)
  settings_ = setup.loop
  if len(table.prompts) < settings_.rollout_batch:  # before the loop compiles: its batch iterator would say less
    filtered = setup.stage1.drop_all_fail and setup.method.needs_value_table
    why = (f"stage1.drop_all_fail removed the {len(setup.train_prompts) - len(table.prompts)} prompts no Stage-1 "
           f"sample solved (the V* table is kept: {table.path or 'not written'}); train on every prompt "
           "(drop_all_fail=False), a smaller train.rollout_batch, or a stronger reference"
           if filtered else "add prompts or lower train.rollout_batch")
    raise ValueError(f"train: {len(table.prompts)} prompts to train on, fewer than one rollout batch "
                     f"(train.rollout_batch={settings_.rollout_batch}): {why}")
  if setup.epochs:
    num_steps = loop.steps_for_epochs(len(table.prompts), settings_.rollout_batch, setup.epochs,
                                      setup.official_step_count)
    log(f"train: {setup.epochs} epochs of {len(table.prompts)} prompts, {settings_.rollout_batch} per rollout: "
        f"{num_steps} rollout steps")
    settings_ = dataclasses.replace(settings_, num_steps=num_steps)
  result = loop.run(setup.method, policy, table.prompts, ctx, settings_, setup.optimizers, io)
  return dataclasses.replace(result, last_eval=dict(last))


def eval_engine(setup: Setup) -> evals_samples.Engine:
  """How the run's evaluations sample and grade (evals/samples.py): its sampling, evaluation graders, mesh."""
  return evals_samples.Engine(setup.cfg, setup.tokenizer, setup.scfg, setup.graders.eval, setup.loop.sample_max_batch,
                              setup.sample_mesh)


def evaluate_all(setup: Setup, params, label: str, log=print) -> dict:
  """Greedy pass@1 on the test sets and avg@k (with pass@k, maj@k) on the sampled sets through evals.run, the code
  of experiments/evaluate.py; rows `<set>/pass@1`, `<set>/avg@k` and `.../<grader>` (summary.run_report_rows)."""
  runs = evals_run.runs_of(setup.test_sets, setup.avg_k_sets, setup.avg_k)
  ev = evals_run.evaluate(eval_engine(setup), params, runs, setup.seed, pass_threshold=setup.pass_threshold, log=log)
  out = evals_summary.run_report_rows(ev.results, [g for g, _ in setup.graders.eval])
  log(f"eval ({label}): " + ", ".join(f"{k} {v['accuracy']:.3f}" for k, v in out.items()))
  return out


def export(setup: Setup, params, out_dir: str, log=print) -> None:
  """The final policy as an HF folder (transformers / vLLM). With LoRA also its adapter as a PEFT folder
  (`out_dir`_peft), which PEFT loads onto the base model; the HF folder holds the adapter merged in."""
  cfg = dataclasses.replace(setup.cfg, param_dtype=setup.policy_param_dtype)
  adapter = None
  if setup.lora is not None:
    lcfg_cfg = lora.model_config(cfg, setup.lora)
    adapter = jax.tree.map(multihost.to_host, lora.split(params)[1])
    params = lora.merged_jit(lcfg_cfg, params, cfg.param_dtype)
  host = jax.tree.map(multihost.to_host, params)  # every process joins the gather of sharded params
  if jax.process_index() == 0:
    hf.save_hf(cfg, host, out_dir, tokenizer=setup.tokenizer)
    log(f"exported the final policy to {out_dir}")
    if adapter is not None:
      peft_dir = out_dir.rstrip("/") + "_peft"
      hf.save_peft_adapter(lora.peft_tensors(cfg, adapter), peft_dir, rank=setup.lora.rank, alpha=setup.lora.alpha,
                           base_model=setup.base_path, dtype=cfg.param_dtype)
      log(f"exported the LoRA adapter (PEFT) to {peft_dir}")


def write_report(workdir: str, report: dict, log=print) -> None:
  """report.json with evals and phase times, and a short summary on stdout."""
  if jax.process_index() != 0:
    return
  files.write_text_atomic(os.path.join(workdir, "report.json"), json.dumps(report, indent=2, default=str))
  times = report.get("times_s", {})
  log("phase times: " + ", ".join(f"{k} {v:.0f}s" for k, v in times.items()) + f" (total {sum(times.values()):.0f}s)")
  for which in ("reference_eval", "final_eval"):
    if which in report:
      log(f"{which}: " + ", ".join(f"{k} {v['accuracy']:.3f}" for k, v in report[which].items()))
  log(f"report: {os.path.join(workdir, 'report.json')}")
