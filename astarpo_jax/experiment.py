"""Wires a run config into library calls: the composition root used by `experiments/main.py`.

This is the one place below the entry point that reads the ml_collections config; everything it
calls takes plain arguments.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable

import jax
import numpy as np

from astarpo_jax import data, evaluate, grading, hf, model, reward_pool, sampler, sharding, stage2, synthetic, train
from astarpo_jax import metrics, multihost, rollout, vstar
from astarpo_jax import warmstart
from astarpo_jax import baseline_loop, baselines

MODES = ("stage1", "train", "eval", "all")
ALGOS = ("astarpo",) + baselines.ALGOS  # the baselines skip Stage 1 and train with baseline_loop


def validate_config(c) -> None:
  """Refuses values the run cannot use, naming the field and the fix, before anything is built."""
  def need(ok: bool, field: str, why: str):
    if not ok:
      raise ValueError(f"config.{field}: {why}")
  need(c.mode in MODES, "mode", f"{c.mode!r} is not one of {MODES}")
  need(c.algo.name in ALGOS, "algo.name", f"{c.algo.name!r} is not one of {ALGOS}")
  need(c.algo.beta2 > 0, "algo.beta2", f"must be > 0 (got {c.algo.beta2}); the paper uses 1e-3")
  need(c.algo.entropy_coef >= 0, "algo.entropy_coef", "must be >= 0")
  if c.algo.name != "astarpo":
    need(c.algo.value_lr > 0, "algo.value_lr", "must be > 0 (PPO's critic learning rate; verl uses 1e-5)")
    try:
      baseline_config(c)
    except ValueError as e:
      raise ValueError(str(e).replace("BaselineConfig.", "config.algo.")) from None
  need(c.stage1.beta1 >= 0, "stage1.beta1", "must be >= 0 (0 = the plain mean)")
  need(c.stage1.n_samples >= 1, "stage1.n_samples", "must be >= 1")
  need(0 <= c.stage1.adaptive_n_min < c.stage1.n_samples or c.stage1.adaptive_n_min == 0, "stage1.adaptive_n_min",
       "must be 0 (off) or below stage1.n_samples")
  t = c.train
  for f in ("num_steps", "rollout_batch", "mini_batch", "micro_batch"):
    need(t[f] >= 1, f"train.{f}", "must be >= 1")
  need(t.rollout_batch % t.mini_batch == 0, "train.mini_batch",
       f"rollout_batch={t.rollout_batch} is not divisible by mini_batch={t.mini_batch}")
  need(t.mini_batch % t.micro_batch == 0, "train.micro_batch",
       f"mini_batch={t.mini_batch} is not divisible by micro_batch={t.micro_batch}")
  need(c.optim.lr > 0, "optim.lr", "must be > 0")
  need(c.sampling.temperature >= 0, "sampling.temperature", "must be >= 0")
  need(0 < c.sampling.top_p <= 1, "sampling.top_p", "must be in (0, 1]")
  need(c.sampling.max_new_tokens >= 1, "sampling.max_new_tokens", "must be >= 1")
  need(c.reward.grader in grading.GRADERS, "reward.grader", f"{c.reward.grader!r} is not one of {grading.GRADERS}")
  for dt in ("dtype", "param_dtype", "ref_param_dtype"):
    need(c.model[dt] in ("float32", "bfloat16", "float16"), f"model.{dt}", "must be float32, bfloat16 or float16")
  need(isinstance(c.model.attention_block, int) and c.model.attention_block >= 0, "model.attention_block",
       "must be an int >= 0 (0 = attend over the whole sequence in one block)")
  need(c.model.name_or_path != "random" or c.data.train == "synthetic", "model.name_or_path",
       "'random' builds a model for the synthetic task's tokenizer only: set data.train='synthetic'")
  try:
    wandb_settings(c)
  except (ValueError, ImportError) as e:
    raise ValueError(f"config.wandb.mode: {e}") from None


def wandb_settings(c) -> metrics.WandbSettings:
  """The W&B sink of `c.wandb` (mode 'disabled' unless set), with the whole config as the run's config."""
  w = c.wandb
  return metrics.WandbSettings(mode=w.mode, project=w.project, entity=w.entity or None, name=w.name or None,
                               run_config=c.to_json_best_effort())


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


class Grader:
  """The reward pool as a `grade(texts, golds, truncated) -> (rewards, counts)` callable."""

  def __init__(self, name: str, num_workers: int, timeout_s: float):
    self.name = name
    self.pool = reward_pool.RewardPool(num_workers=num_workers, timeout_s=timeout_s)

  def __call__(self, texts, golds, truncated):
    res = self.pool.grade(texts, golds, grader=self.name, truncated=truncated)
    return res.rewards, {"num_timeouts": res.num_timeouts, "num_errors": res.num_errors}

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.pool.close()


@dataclasses.dataclass
class Setup:
  cfg: model.ModelConfig
  tokenizer: Any
  ref_params: Any
  train_prompts: list
  test_sets: dict  # name -> prompts, evaluated greedily
  avg_k_sets: dict  # name -> prompts, evaluated with sampling
  grader: Grader
  scfg: sampler.SamplingConfig
  mesh: Any  # jax.sharding.Mesh over all devices: (data, fsdp, tensor)
  times: dict


def _stop_ids(tok, extra) -> tuple[int, ...]:
  ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
  vocab = tok.get_vocab()
  ids |= {vocab[t] for t in extra if t in vocab}
  if not ids:
    raise ValueError("the tokenizer has no EOS token and none of sampling.extra_stop_tokens: responses would never stop")
  return tuple(sorted(ids))


def _load_set(c, name: str, split: str) -> list[data.Example]:
  if name == "synthetic":
    s = c.data.synthetic
    syn = synthetic.SyntheticConfig(min_terms=s.min_terms, max_terms=s.max_terms, max_digits=s.max_digits)
    n = s.num_train if split == "train" else s.num_test
    return synthetic.load_synthetic(n, c.seed, syn, split)[0]
  if name in data.PRESETS:
    examples, _ = data.load_preset(name, data_dir=c.data.data_dir or None)
  else:
    fields = data.Fields(c.data.problem_field, c.data.answer_field, c.data.answer_format)
    examples, _ = data.load_examples(name, fields)
  return examples


def _build_reference(c, tok, workdir: str, mesh, log) -> tuple[model.ModelConfig, Any, dict]:
  """Loads the reference policy, or builds (and caches in workdir) the demo's warm-started one."""
  times: dict[str, float] = {}
  if c.model.name_or_path != "random":
    ckpt_dir = hf.resolve_checkpoint_dir(c.model.name_or_path)
    shardings = sharding.param_shardings(hf.load_hf_config(ckpt_dir), mesh)  # each device reads only its shard
    cfg, params = hf.load_hf(ckpt_dir, dtype=c.model.dtype, param_dtype=c.model.ref_param_dtype,
                             remat=c.model.remat, shardings=shardings)
    return cfg, params, times
  ref_dir = os.path.join(local_dir(workdir), "reference")
  if os.path.exists(os.path.join(ref_dir, "config.json")):
    log(f"reusing the warm-started reference in {ref_dir}")
    cfg, params = hf.load_hf(ref_dir, dtype=c.model.dtype, param_dtype=c.model.ref_param_dtype, remat=c.model.remat)
    return cfg, params, times
  r = c.model.random
  cfg = model.ModelConfig(vocab_size=len(tok), hidden_size=r.hidden_size, intermediate_size=r.intermediate_size,
                          num_layers=r.num_layers, num_heads=r.num_heads, num_kv_heads=r.num_kv_heads,
                          head_dim=r.head_dim, max_position_embeddings=r.max_position_embeddings,
                          tie_embeddings=r.tie_embeddings, dtype=c.model.dtype, param_dtype="float32",
                          remat=c.model.remat, attention_block=c.model.attention_block)
  _, params = model.init_params(cfg, c.seed)
  if c.warmstart.steps > 0:
    t = time.perf_counter()
    s = c.data.synthetic
    rng = np.random.default_rng(c.seed)
    pairs = [synthetic.supervised_pair(tok, ex.problem, boxed=bool(rng.random() >= s.unboxed_fraction))
             for ex in _load_set(c, "synthetic", "train")]
    params, _ = warmstart.warm_start(cfg, params, pairs, pad_id=tok.pad_token_id, steps=c.warmstart.steps,
                                     batch_size=c.warmstart.batch_size, lr=c.warmstart.lr, seed=c.seed, log=log)
    times["warmstart"] = time.perf_counter() - t
  hf.save_hf(cfg, params, ref_dir, tokenizer=tok)
  cfg = dataclasses.replace(cfg, param_dtype=c.model.ref_param_dtype)
  return cfg, model.cast_params(params, c.model.ref_param_dtype), times


def local_dir(workdir: str) -> str:
  """Where the demo's tokenizer and warm-started reference are cached: the work directory, or for a
  bucket work directory a local folder (HF's save_pretrained writes local files only)."""
  if not multihost.is_remote(workdir):
    return workdir
  name = workdir.split("://", 1)[1].strip("/").replace("/", "_")
  return os.path.join(os.path.expanduser("~"), ".cache", "astarpo_jax", name)


def build(c, workdir: str, log=print) -> Setup:
  """Tokenizer, reference model, prompts, grader and sampling config for a run."""
  if c.data.train == "synthetic":
    tok = hf.load_tokenizer(synthetic.save_tokenizer(os.path.join(local_dir(workdir), "tokenizer")))
  else:
    tok = hf.load_tokenizer(c.model.name_or_path)
  mesh = sharding.make_mesh(tuple(c.mesh.shape))
  cfg, ref_params, times = _build_reference(c, tok, workdir, mesh, log)
  cfg = dataclasses.replace(cfg, attention_block=c.model.attention_block)
  template = synthetic.PROMPT_TEMPLATE if c.data.train == "synthetic" else c.data.template

  def prompts_of(name: str, split: str, limit: int) -> list[data.Prompt]:
    examples = _load_set(c, name, split)
    if limit:
      examples = examples[:limit]
    prompts, stats = data.build_prompts(examples, tok, template, chat=c.data.chat,
                                        max_prompt_tokens=c.data.max_prompt_tokens)
    log(f"data {name}/{split}: {stats.kept} prompts ({stats.too_long} longer than {c.data.max_prompt_tokens} dropped)")
    return prompts

  train_prompts = prompts_of(c.data.train, "train", c.data.num_train)
  test_sets = {n: prompts_of(n, "test", c.data.num_test) for n in c.data.test_sets}
  avg_k_sets = {n: prompts_of(n, "test", c.data.num_test) for n in c.data.avg_k_sets}
  s = c.sampling
  scfg = sampler.SamplingConfig(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                max_new_tokens=s.max_new_tokens, stop_ids=_stop_ids(tok, s.extra_stop_tokens),
                                pad_id=tok.pad_token_id)
  grader = Grader(c.reward.grader, c.reward.num_workers, c.reward.timeout_s)
  return Setup(cfg, tok, ref_params, train_prompts, test_sets, avg_k_sets, grader, scfg, mesh, times)


def run_stage1(c, setup: Setup, workdir: str, log=print) -> vstar.Stage1Result:
  """V* for the training prompts: sampled from pi_ref, or read from a V* file or eval_i columns.

  The baselines need no V*: for them this samples nothing and returns all training prompts.
  """
  s1 = c.stage1
  prompts = setup.train_prompts
  if c.algo.name != "astarpo":
    log(f"stage1: skipped ({c.algo.name} needs no V*)")
    return vstar.Stage1Result({}, list(prompts), "", {"skipped": f"{c.algo.name} needs no V*"})
  if s1.vstar_file or s1.eval_columns_file:
    if s1.vstar_file:
      records = vstar.load_vstar(s1.vstar_file)
    else:
      records, stats = vstar.import_eval_columns(s1.eval_columns_file, key=s1.eval_columns_key,
                                                 uid_of={p.text: p.uid for p in prompts}, beta1=s1.beta1, log=log)
    missing = [p.uid for p in prompts if p.uid not in records]
    if missing:
      log(f"stage1: {len(missing)} training prompts have no V* in the given file and are left out")
    kept = [p for p in prompts if p.uid in records and not (s1.drop_all_fail and records[p.uid]["num_correct"] == 0)]
    return vstar.Stage1Result(records, kept, s1.vstar_file or s1.eval_columns_file,
                              vstar.summarize([records[p.uid] for p in prompts if p.uid in records]))
  scfg = setup.scfg
  max_batch = c.sampling.max_batch or None

  def generate(ids, key):  # this process's rows only (all of them with one process)
    prompt_BP, pmask_BP = sampler.left_pad(ids, scfg.pad_id, sampler.bucket_length(max(len(p) for p in ids)))
    out, rows = rollout.sample_shares(setup.cfg, setup.ref_params, prompt_BP, pmask_BP, key, scfg, max_batch,
                                      setup.mesh)
    return rollout.decode_responses(setup.tokenizer, out.tokens_BT, out.mask_BT), out.truncated_B.tolist(), rows

  def grade(texts, golds, truncated):
    return setup.grader(texts, golds, truncated)[0]

  adaptive = vstar.AdaptiveConfig(s1.adaptive_n_min, s1.n_samples) if s1.adaptive_n_min else None
  return vstar.run_stage1(prompts, generate, grade, out_dir=workdir, n_samples=None if adaptive else s1.n_samples,
                          beta1=s1.beta1, chunk_prompts=s1.chunk_prompts, seed=c.seed,
                          keep_responses=s1.keep_responses, drop_all_fail=s1.drop_all_fail, adaptive=adaptive, log=log)


def baseline_config(c) -> baselines.BaselineConfig:
  """The baseline hyper-parameters of `c.algo` (GRPO / PPO / REBEL)."""
  a = c.algo
  return baselines.BaselineConfig(algo=a.name, group_size=a.group_size, clip_eps=a.clip_eps, kl_coef=a.kl_coef,
                                  entropy_coef=a.entropy_coef, loss_agg=a.loss_agg, value_clip=a.value_clip,
                                  gae_gamma=a.gae_gamma, gae_lambda=a.gae_lambda, rebel_eta=a.rebel_eta,
                                  logp_chunk=c.train.logp_chunk)


def run_stage2(c, setup: Setup, stage1: vstar.Stage1Result, workdir: str, log=print):
  """Stage-2 training from the reference (A*-PO, or the baseline named by c.algo.name); returns the
  final policy params and their evaluation."""
  cfg = setup.cfg
  policy_cfg = dataclasses.replace(cfg, param_dtype=c.model.param_dtype)
  policy = model.cast_params(setup.ref_params, c.model.param_dtype)
  t = c.train
  loop = stage2.Stage2Config(num_steps=t.num_steps, rollout_batch=t.rollout_batch, mini_batch=t.mini_batch,
                             micro_batch=t.micro_batch, sample_max_batch=c.sampling.max_batch or None, seed=c.seed,
                             checkpoint_every=t.checkpoint_every, eval_every=t.eval_every, wandb=wandb_settings(c))
  optimizer = train.make_optimizer(c.optim.lr, c.optim.weight_decay, c.optim.grad_clip,
                                   warmup_steps=c.optim.warmup_steps)
  loss_cfg = train.LossConfig(beta2=c.algo.beta2, entropy_coef=c.algo.entropy_coef, logp_chunk=t.logp_chunk)

  last: dict = {}

  def eval_fn(params, step):
    last.clear()
    last.update(evaluate_all(c, setup, params, label=f"step {step}", log=log))
    return {k: v["accuracy"] for k, v in last.items()}

  if c.algo.name != "astarpo":
    if setup.mesh.size > 1:
      log(f"{c.algo.name}: the baseline loop runs on one device; the mesh's other {setup.mesh.size - 1} stay idle")
    value_optimizer = None if c.algo.name != "ppo" else train.make_optimizer(
        c.algo.value_lr, c.optim.weight_decay, c.optim.grad_clip, warmup_steps=c.optim.warmup_steps)
    params, _ = baseline_loop.run_baseline(
        policy_cfg, policy, setup.ref_params, prompts=stage1.prompts, tokenizer=setup.tokenizer, grade=setup.grader,
        scfg=setup.scfg, bcfg=baseline_config(c), optimizer=optimizer, value_optimizer=value_optimizer,
        value_seed=c.seed, loop=loop, workdir=workdir, evaluate_fn=eval_fn, log=log,
        is_logger=jax.process_index() == 0, mesh=setup.mesh)
    return params, dict(last)
  params, _ = stage2.run_stage2(policy_cfg, policy, setup.ref_params, prompts=stage1.prompts,
                                vstar_of=stage1.vstar_for, tokenizer=setup.tokenizer, grade=setup.grader,
                                scfg=setup.scfg, loss_cfg=loss_cfg, optimizer=optimizer, loop=loop, workdir=workdir,
                                evaluate_fn=eval_fn, log=log, is_logger=jax.process_index() == 0, mesh=setup.mesh)
  return params, dict(last)  # the final policy and its evaluation (run by the loop after the last step)


def evaluate_all(c, setup: Setup, params, label: str, log=print) -> dict:
  """Greedy pass@1 on the test sets and avg@k with sampling on the small sets."""
  out = {}
  key = jax.random.key(c.seed + 1)
  max_batch = c.sampling.max_batch or None
  for name, prompts in setup.test_sets.items():
    out[f"{name}/pass@1"] = evaluate.evaluate(setup.cfg, params, prompts, setup.tokenizer, setup.grader,
                                              evaluate.greedy(setup.scfg), key, max_batch=max_batch)
  for name, prompts in setup.avg_k_sets.items():
    out[f"{name}/avg@{c.data.avg_k}"] = evaluate.evaluate(setup.cfg, params, prompts, setup.tokenizer, setup.grader,
                                                          setup.scfg, key, k=c.data.avg_k, max_batch=max_batch)
  log(f"eval ({label}): " + ", ".join(f"{k} {v['accuracy']:.3f}" for k, v in out.items()))
  return out


def export(c, setup: Setup, params, out_dir: str, log=print) -> None:
  """The final policy as an HF folder (transformers / vLLM)."""
  cfg = dataclasses.replace(setup.cfg, param_dtype=c.model.param_dtype)
  host = jax.tree.map(multihost.to_host, params)  # every process joins the gather of sharded params
  if jax.process_index() == 0:
    hf.save_hf(cfg, host, out_dir, tokenizer=setup.tokenizer)
    log(f"exported the final policy to {out_dir}")


def write_report(workdir: str, report: dict, log=print) -> None:
  """report.json with evals and phase times, and a short summary on stdout."""
  if jax.process_index() != 0:
    return
  multihost.path(os.path.join(workdir, "report.json")).write_text(json.dumps(report, indent=2, default=str))
  times = report.get("times_s", {})
  log("phase times: " + ", ".join(f"{k} {v:.0f}s" for k, v in times.items()) + f" (total {sum(times.values()):.0f}s)")
  for which in ("reference_eval", "final_eval"):
    if which in report:
      log(f"{which}: " + ", ".join(f"{k} {v['accuracy']:.3f}" for k, v in report[which].items()))
  log(f"report: {os.path.join(workdir, 'report.json')}")
