"""What a run reads before it trains: the model's config, the data sets, the reference's params (loaded, or the
demo's warm-started one), the tokenizer's stop ids and the graders.

experiment.py's `build` calls these with the config; they read only the config fields they are given (the
composition root's other half: config is read here, in experiment.py and in run_config.py only).
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

import numpy as np

from astarpo_jax.data import chains, dataset, synthetic
from astarpo_jax.infra import files, multihost
from astarpo_jax.model import decoder, hf, known_models
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.rewards import reward_pool, user_grader
from astarpo_jax.run_config import OFFLINE_TASKS, char_vocab
from astarpo_jax.sampling.rollout import Graded
from astarpo_jax.training import warmstart


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
  return dataclasses.replace(cfg, attention_block=m.attention_block,
                             train_attention=m.get("train_attention", "auto"))


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


def stop_ids(tok, extra) -> tuple[int, ...]:
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


def load_set(c, name: str, split: str) -> list[dataset.Example]:
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


def check_chars(c, texts, where: str) -> None:
  """A random model's character tokenizer for a data file reads an unlisted character as <unk>: refuse it."""
  if c.model.name_or_path != "random" or c.data.train in OFFLINE_TASKS:
    return
  missing = sorted({ch for t in texts for ch in t.replace(synthetic.BOX, "")} - set(c.model.random.chars))
  if missing:
    raise ValueError(f"config.model.random.chars: {''.join(missing)!r} occur in {where} but are not among the "
                     f"tokenizer's characters {c.model.random.chars!r}; add them")


def warmstart_pairs(c, tok) -> list[tuple[list[int], list[int]]]:
  """(prompt ids, response ids + EOS) of the supervised warm-start: an offline task's worked answers, or the
  rows of warmstart.file (data.problem_field and warmstart.response_field) under data.template."""
  task = OFFLINE_TASKS.get(c.data.train)
  if task is not None:
    unboxed = c.data[c.data.train].unboxed_fraction
    rng = np.random.default_rng(task_seed(c))
    return [task.supervised_pair(tok, ex.problem, boxed=bool(rng.random() >= unboxed))
            for ex in load_set(c, c.data.train, "warmstart")]
  rows = dataset.read_rows(c.warmstart.file)
  missing = [i for i, r in enumerate(rows) if not isinstance(r.get(c.data.problem_field), str)
             or not isinstance(r.get(c.warmstart.response_field), str)]
  if missing:
    raise ValueError(f"config.warmstart.file: rows {missing[:5]} of {c.warmstart.file} lack a string "
                     f"{c.data.problem_field!r} (data.problem_field) or {c.warmstart.response_field!r} "
                     "(warmstart.response_field)")
  texts = [dataset.format_prompt(r[c.data.problem_field].strip(), c.data.template) for r in rows]
  check_chars(c, texts + [r[c.warmstart.response_field] for r in rows], c.warmstart.file)
  prompts = tok(texts)["input_ids"]
  responses = tok([r[c.warmstart.response_field] for r in rows], add_special_tokens=False)["input_ids"]
  return [(list(p), list(r) + [tok.eos_token_id]) for p, r in zip(prompts, responses)]


def build_reference(c, cfg: ModelConfig, tok, workdir: str, mesh, log) -> tuple[Any, dict]:
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
    pairs = warmstart_pairs(c, tok)
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
