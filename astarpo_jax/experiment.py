"""Wires a run config into library calls: the composition root used by `experiments/main.py`.

The config is read here and in run_config.py only (its checks and the method it names): `build`
unpacks it once into a `Setup` of plain values and frozen settings, and everything after (Stage 1,
training, evaluation, export) takes the Setup.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any, Callable

import jax
import numpy as np

from astarpo_jax import methods
from astarpo_jax.data import chains, dataset, synthetic
from astarpo_jax.evals import run as evals_run, samples as evals_samples, summary as evals_summary
from astarpo_jax.infra import files, multihost, preemption, sharding
from astarpo_jax.model import decoder, hf, known_models, lora
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.rewards import reward_pool, user_grader
from astarpo_jax.run_config import (OFFLINE_TASKS, build_method, char_vocab, lora_settings, policy_lr, ref_param_dtype,
                                    wandb_settings)
from astarpo_jax.sampling.rollout import Graded
from astarpo_jax.sampling.token_choice import SamplingConfig
from astarpo_jax.stage1 import estimate, official_data, value_table as vt
from astarpo_jax.training import loop, update, warmstart


def model_config(c) -> ModelConfig:
  """The run's model config (policy dtypes): the random demo model, a local folder's config.json, a model of
  known_models (no hub access needed: memory plans, AOT compiles), or a hub id's config.json."""
  m = c.model
  kw = dict(dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat)
  if m.name_or_path == "random":
    r = m.random
    cfg = ModelConfig(vocab_size=len(char_vocab(c)), hidden_size=r.hidden_size,
                      intermediate_size=r.intermediate_size, num_layers=r.num_layers, num_heads=r.num_heads,
                      num_kv_heads=r.num_kv_heads, head_dim=r.head_dim,
                      max_position_embeddings=r.max_position_embeddings, tie_embeddings=r.tie_embeddings, **kw)
  elif not os.path.isdir(m.name_or_path) and m.name_or_path in known_models.HF_CONFIGS:
    cfg = hf.config_from_hf(known_models.HF_CONFIGS[m.name_or_path], **kw)
  else:
    cfg = hf.load_hf_config(hf.resolve_checkpoint_dir(m.name_or_path), **kw)
  return dataclasses.replace(cfg, attention_block=m.attention_block)


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
class Grader:
  """One use's grader as a `grade(texts, golds, truncated) -> Graded` callable over the run's worker pool.

  `name`: a built-in grader or a user function's import path (user_grader.py). `eos_required`: a response
  that did not end with a stop token scores 0 (the official MATH Stage-2 and validation rule); otherwise the
  truncation flags are not passed and every response is graded. A batch with failures (timeouts, errors,
  crashes: each scored 0) logs a line with their counts, and the first failure of the run in full; when more
  than `max_error_share` of a batch (over all processes) failed, the run stops with that failure's text, so
  a function that always fails cannot train on zeros.
  """
  pool: reward_pool.RewardPool
  name: str
  eos_required: bool
  max_error_share: float = 1.0
  log: Callable[[str], Any] = print
  _shown: list = dataclasses.field(default_factory=list, repr=False, compare=False)  # the first failure, once

  def __call__(self, texts, golds, truncated) -> Graded:
    if not user_grader.is_spec(self.name):  # a built-in grader reads the gold alone
      golds = [g.gold if isinstance(g, user_grader.Target) else g for g in golds]
    res = self.pool.grade(texts, golds, grader=self.name, truncated=truncated if self.eos_required else None)
    failed = res.num_timeouts + res.num_errors
    if failed:
      self.log(f"reward {self.name}: {failed} of {len(texts)} responses scored 0 by failures ({res.num_timeouts} "
               f"past the time limit, {res.num_errors} errors or crashes; {res.num_killed} workers replaced)")
      if res.first_error and not self._shown:
        self._shown.append(res.first_error)
        self.log(f"reward {self.name}: the first failure, in full (later ones are counted only):\n{res.first_error}")
    failed_all, total_all = multihost.process_sum([failed, len(texts)])  # every process decides the same
    if failed_all > self.max_error_share * total_all:
      raise RuntimeError(
          f"reward {self.name}: {failed_all:.0f} of {total_all:.0f} responses failed to grade, more than "
          f"reward.max_error_share={self.max_error_share:g}; stopping rather than training on zeros. "
          f"The first failure:\n{res.first_error or '(on another process)'}")
    return Graded(res.rewards, {"num_timeouts": res.num_timeouts, "num_errors": res.num_errors,
                                "num_truncated": getattr(res, "num_truncated", 0)})


@dataclasses.dataclass(frozen=True)
class Graders:
  """The grader of each use: Stage 1's V̂* samples, the training reward, and evaluation (name -> grade,
  the first the headline metric, the others reported beside it)."""
  stage1: Any
  train: Any
  eval: tuple[tuple[str, Any], ...]


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


def _stop_ids(tok, extra) -> tuple[int, ...]:
  ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
  vocab = tok.get_vocab()
  ids |= {vocab[t] for t in extra if t in vocab}
  if not ids:
    raise ValueError("the tokenizer has no EOS token and none of sampling.extra_stop_tokens: responses would never stop")
  return tuple(sorted(ids))


def task_seed(c) -> int:
  """The seed of an offline task's problems and of the demo reference's warm-start (config.data.seed, or
  config.seed when it is -1): fixed, it keeps the data and the reference while config.seed varies the run."""
  return c.seed if c.data.seed < 0 else c.data.seed


def _load_set(c, name: str, split: str) -> list[dataset.Example]:
  if name == "synthetic":
    s = c.data.synthetic
    syn = synthetic.SyntheticConfig(min_terms=s.min_terms, max_terms=s.max_terms, max_digits=s.max_digits)
    n = s.num_train if split != "test" else s.num_test
    return synthetic.load_synthetic(n, task_seed(c), syn, "test" if split == "test" else "train")[0]
  if name == "chains":  # the warm-start corpus may stop at fewer steps than the prompts, and exclude them
    s = c.data.chains
    cfg = chains.ChainsConfig(min_steps=s.min_steps, max_steps=s.max_steps, digits=s.digits, ops=s.ops,
                              max_value=s.max_value)
    corpus_cfg = dataclasses.replace(cfg, max_steps=s.warmstart_max_steps or s.max_steps)
    if split == "test" and s.get("heldout", "test") == "val":  # an lr sweep's runs: the validation problems
      split = "val"
    rows = chains.task_rows(split, task_seed(c), cfg, s.num_train if split in ("train", "warmstart") else
                            s.num_val if split == "val" else s.num_test, corpus_cfg=corpus_cfg, fresh=s.fresh_prompts,
                            num_test=s.num_test)
    return dataset.examples_from_rows(rows, chains.FIELDS, f"chains_{split}")[0]
  if name in dataset.PRESETS:
    examples, _ = dataset.load_preset(name, data_dir=c.data.data_dir or None)
  else:
    fields = dataset.Fields(c.data.problem_field, c.data.answer_field, c.data.answer_format,
                            extra=tuple(c.data.extra_fields))
    examples, _ = dataset.load_examples(name, fields)
  return examples


def _check_chars(c, texts, where: str) -> None:
  """A random model's character tokenizer for a data file reads an unlisted character as <unk>: refuse it."""
  if c.model.name_or_path != "random" or c.data.train in OFFLINE_TASKS:
    return
  missing = sorted({ch for t in texts for ch in t.replace(synthetic.BOX, "")} - set(c.model.random.chars))
  if missing:
    raise ValueError(f"config.model.random.chars: {''.join(missing)!r} occur in {where} but are not among the "
                     f"tokenizer's characters {c.model.random.chars!r}; add them")


def _warmstart_pairs(c, tok) -> list[tuple[list[int], list[int]]]:
  """(prompt ids, response ids + EOS) of the supervised warm-start: an offline task's worked answers, or the
  rows of warmstart.file (data.problem_field and warmstart.response_field) under data.template."""
  task = OFFLINE_TASKS.get(c.data.train)
  if task is not None:
    unboxed = c.data[c.data.train].unboxed_fraction
    rng = np.random.default_rng(task_seed(c))
    return [task.supervised_pair(tok, ex.problem, boxed=bool(rng.random() >= unboxed))
            for ex in _load_set(c, c.data.train, "warmstart")]
  rows = dataset.read_rows(c.warmstart.file)
  missing = [i for i, r in enumerate(rows) if not isinstance(r.get(c.data.problem_field), str)
             or not isinstance(r.get(c.warmstart.response_field), str)]
  if missing:
    raise ValueError(f"config.warmstart.file: rows {missing[:5]} of {c.warmstart.file} lack a string "
                     f"{c.data.problem_field!r} (data.problem_field) or {c.warmstart.response_field!r} "
                     "(warmstart.response_field)")
  texts = [dataset.format_prompt(r[c.data.problem_field].strip(), c.data.template) for r in rows]
  _check_chars(c, texts + [r[c.warmstart.response_field] for r in rows], c.warmstart.file)
  prompts = tok(texts)["input_ids"]
  responses = tok([r[c.warmstart.response_field] for r in rows], add_special_tokens=False)["input_ids"]
  return [(list(p), list(r) + [tok.eos_token_id]) for p, r in zip(prompts, responses)]


def _build_reference(c, cfg: ModelConfig, tok, workdir: str, mesh, log) -> tuple[Any, dict]:
  """Loads the reference policy's params, or builds (and caches in workdir) the demo's warm-started one."""
  times: dict[str, float] = {}
  ref_dtype = cfg.param_dtype  # model.ref_param_dtype, or with LoRA the frozen base's (run_config.ref_param_dtype)
  if c.model.name_or_path != "random":
    ckpt_dir = hf.resolve_checkpoint_dir(c.model.name_or_path)
    shardings = decoder.param_shardings(cfg, mesh)  # each device reads only its shard
    _, params = hf.load_hf(ckpt_dir, dtype=cfg.dtype, param_dtype=ref_dtype, remat=cfg.remat, shardings=shardings)
    return params, times
  ref_dir = os.path.join(local_dir(workdir), "reference")
  if os.path.exists(os.path.join(ref_dir, "config.json")):
    log(f"reusing the warm-started reference in {ref_dir}")
    _, params = hf.load_hf(ref_dir, dtype=cfg.dtype, param_dtype=ref_dtype, remat=cfg.remat)
    return params, times
  cfg = dataclasses.replace(cfg, param_dtype="float32")
  _, params = decoder.init_params(cfg, task_seed(c))
  if c.warmstart.steps > 0:
    t = time.perf_counter()
    pairs = _warmstart_pairs(c, tok)
    params, _ = warmstart.warm_start(cfg, params, pairs, pad_id=tok.pad_token_id, steps=c.warmstart.steps,
                                     batch_size=c.warmstart.batch_size, lr=c.warmstart.lr, seed=task_seed(c), log=log)
    times["warmstart"] = time.perf_counter() - t
  hf.save_hf(cfg, params, ref_dir, tokenizer=tok)
  return decoder.cast_params(params, ref_dtype), times


def local_dir(workdir: str) -> str:
  """Where the demo's tokenizer and warm-started reference are cached: the work directory, or for a
  bucket work directory a local folder (HF's save_pretrained writes local files only)."""
  if not files.is_remote(workdir):
    return workdir
  name = workdir.split("://", 1)[1].strip("/").replace("/", "_")
  return os.path.join(os.path.expanduser("~"), ".cache", "astarpo_jax", name)


def settings(c, method: methods.Method) -> tuple[loop.LoopSettings, update.Optimizers, Stage1Settings]:
  t, o, s1 = c.train, c.optim, c.stage1
  loop_settings = loop.LoopSettings(  # num_steps 0: set from train.epochs once the prompts are known
      num_steps=t.num_steps or 1, rollout_batch=t.rollout_batch, mini_batch=t.mini_batch, micro_batch=t.micro_batch,
      sample_max_batch=c.sampling.max_batch or None, seed=c.seed, checkpoint_every=t.checkpoint_every,
      eval_every=t.eval_every, pack_rows=bool(t.pack_rows), score_micro_batches=t.score_micro_batches)
  zero_lr = t.rollout_batch // t.mini_batch if o.zero_lr_first_rollout else 0  # the first rollout's steps
  optim = lambda lr: update.make_optimizer(lr, o.weight_decay, o.grad_clip, warmup_steps=o.warmup_steps,  # noqa: E731
                                           zero_lr_steps=zero_lr)
  optimizers = update.Optimizers(optim(policy_lr(c)), optim(c.algo.value_lr) if method.footprint().critic else None)
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
  ref_params, times = _build_reference(c, cfg, tok, workdir, mesh, log)
  template = task.PROMPT_TEMPLATE if task is not None else c.data.template

  def prompts_of(name: str, split: str, limit: int) -> list[dataset.Prompt]:
    examples = _load_set(c, name, split)
    if limit:
      examples = examples[:limit]
    _check_chars(c, [dataset.format_prompt(ex.problem, template) for ex in examples], f"the prompts of {name}")
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
                        max_new_tokens=s.max_new_tokens, stop_ids=_stop_ids(tok, s.extra_stop_tokens),
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
