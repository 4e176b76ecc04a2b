"""The run config's checks and what it names: refused values, the method, the W&B sink, the micro-batch, the
run's shapes for plans and compiles.

Called at the top of every entry point (experiments/main.py, aot.py, memory_plan.py, compare.py) before
anything is built, so a wrong value stops with the field's name and the fix, not deep in a compile.
"""
from __future__ import annotations

from astarpo_jax import methods
from astarpo_jax.aot import memory_plan
from astarpo_jax.data import chains, dataset, synthetic
from astarpo_jax.infra import metrics, sharding
from astarpo_jax.model import lora
from astarpo_jax.model.config import TRAIN_ATTENTION
from astarpo_jax.rewards import grading, user_grader
from astarpo_jax.sampling import sampler
from astarpo_jax.training import optimizers, scoring, update

MODES = ("stage1", "train", "eval", "all")
# Offline tasks (data.train names) with their own character tokenizer, for model.name_or_path = "random".
OFFLINE_TASKS = {"synthetic": synthetic, "chains": chains}
DTYPES = ("float32", "bfloat16", "float16")
TIS_METHODS = ("grpo", "ppo", "rloo")  # the methods with a truncated importance-sampling option (algo.tis_cap)


def char_vocab(c) -> tuple[str, ...]:
  """The tokens of a random model's character tokenizer: the offline task's, or for a data file the special
  tokens, the characters of model.random.chars, and `\\boxed{` (synthetic.build_tokenizer)."""
  task = OFFLINE_TASKS.get(c.data.train)
  if task is not None:
    return task.VOCAB
  return synthetic.SPECIALS + tuple(dict.fromkeys(c.model.random.chars)) + (synthetic.BOX,)


def _grader_problem(grader) -> str | None:
  """Why `grader` (a config value) names no grader: neither built-in nor a user function found statically."""
  if not isinstance(grader, str):
    return f"{grader!r} is not a string"
  if not user_grader.is_spec(grader):
    return None if grader in grading.GRADERS else (f"{grader!r} is neither one of {grading.GRADERS} nor a user "
                                                   "function 'path/to/file.py:function' or 'package.module:function'")
  try:
    user_grader.check(grader)
  except ValueError as e:
    return str(e)
  return None


def build_method(c) -> methods.Method:
  """The method named by config.algo.name, with its hyper-parameters from config.algo (and the update's
  logits chunk, config.train.logp_chunk)."""
  return methods.get(c.algo.name, dict(c.algo.to_dict(), logp_chunk=c.train.logp_chunk))


def policy_lr(c) -> float:
  """The policy's learning rate: optim.lr, or where it is 0 the task's lr for algo.name (optim.lr_by_algo:
  a task whose lrs were swept per method gives every method its own, so a plain run of any method gets it)."""
  return float(c.optim.lr) if c.optim.lr else float(c.optim.lr_by_algo[c.algo.name])


def lora_settings(c) -> lora.LoraConfig | None:
  """model.lora as a LoraConfig (rank > 0), or None (rank 0: full fine-tuning). The frozen base's dtype is
  model.lora.base_dtype, "" = the compute dtype (model.dtype)."""
  m = c.model.get("lora")
  if m is None or not m.rank:
    return None
  try:
    return lora.LoraConfig(targets=lora.parse_targets(m.targets), rank=m.rank, alpha=float(m.alpha),
                           base_dtype=m.base_dtype or c.model.dtype)
  except ValueError as e:
    raise ValueError(f"config.{e}") from None


def ref_param_dtype(c) -> str:
  """π_ref's storage dtype: model.ref_param_dtype, or with LoRA the frozen base's (π_ref is the base)."""
  lcfg = lora_settings(c)
  return lcfg.base_dtype if lcfg is not None else c.model.ref_param_dtype


def validate_config(c) -> None:
  """Refuses values the run cannot use, naming the field and the fix, before anything is built."""
  def need(ok: bool, field: str, why: str):
    if not ok:
      raise ValueError(f"config.{field}: {why}")
  need(c.mode in MODES, "mode", f"{c.mode!r} is not one of {MODES}")
  need(c.algo.name in methods.names(), "algo.name", f"{c.algo.name!r} is not one of {methods.names()}")
  try:
    method = build_method(c)
  except ValueError as e:
    raise ValueError("config.algo." + str(e).split(".Config.", 1)[-1]) from None
  if method.footprint().critic:
    need(c.algo.value_lr > 0, "algo.value_lr", "must be > 0 (the critic's learning rate; verl uses 1e-5)")
  need(c.algo.get("old_logp", "trainer") in scoring.OLD_LOGP_SOURCES, "algo.old_logp",
       f"{c.algo.get('old_logp')!r} is not one of {scoring.OLD_LOGP_SOURCES} (the training forward, verl's way; or "
       "the sampler's own log-probs)")
  tis = c.algo.get("tis_cap", 0.0)
  need(not tis or c.algo.name in TIS_METHODS, "algo.tis_cap",
       f"{tis!r}: truncated importance sampling weighs a clipped ratio's loss ({', '.join(TIS_METHODS)}); "
       f"{c.algo.name} has none: set algo.tis_cap=0")
  need(not tis or (c.sampling.temperature == 1.0 and c.sampling.top_p == 1.0 and c.sampling.top_k == 0),
       "algo.tis_cap", f"{tis!r} weighs by pi_old / pi_sampler of the policy's own samples: sample at temperature 1 "
       "without top-k / top-p (sampling.*), or set algo.tis_cap=0")
  need(c.stage1.beta1 >= 0, "stage1.beta1", "must be >= 0 (0 = the plain mean)")
  need(c.stage1.n_samples >= 1, "stage1.n_samples", "must be >= 1")
  need(0 <= c.stage1.adaptive_n_min < c.stage1.n_samples or c.stage1.adaptive_n_min == 0, "stage1.adaptive_n_min",
       "must be 0 (off) or below stage1.n_samples")
  t = c.train
  for f in ("rollout_batch", "mini_batch"):
    need(t[f] >= 1, f"train.{f}", "must be >= 1")
  need(t.micro_batch_per_device >= 0, "train.micro_batch_per_device",
       "must be >= 0 (0 = train.micro_batch as given; > 0: prompts per batch shard)")
  need((t.micro_batch >= 1) != (t.micro_batch_per_device >= 1), "train.micro_batch",
       f"{t.micro_batch} with train.micro_batch_per_device={t.micro_batch_per_device}: set exactly one of them "
       "(the other 0): a global micro-batch in prompts, or prompts per batch shard")
  need(isinstance(t.score_micro_batches, int) and t.score_micro_batches >= 1, "train.score_micro_batches",
       "must be an int >= 1 (update micro-batches per fixed-score forward; 1 = official)")
  need(t.get("gather_weights", "auto") in update.GATHER_MODES, "train.gather_weights",
       "must be 'auto', 'per_step_local' (the compute copy gathered and the gradient reduce-scattered once per "
       "optimizer step), 'per_step' (the copy gathered once) or 'per_micro_batch'")
  need(t.num_steps >= 0, "train.num_steps", "must be >= 0 (0 = derived from train.epochs)")
  need(t.num_steps > 0 or t.epochs >= 1, "train.epochs", "must be >= 1 when train.num_steps is 0")
  need(t.rollout_batch % t.mini_batch == 0, "train.mini_batch",
       f"rollout_batch={t.rollout_batch} is not divisible by mini_batch={t.mini_batch}")
  need(t.micro_batch_per_device or t.mini_batch % t.micro_batch == 0, "train.micro_batch",
       f"mini_batch={t.mini_batch} is not divisible by micro_batch={t.micro_batch}")
  need(c.optim.lr > 0 or (c.optim.lr == 0 and c.algo.name in c.optim.get("lr_by_algo", {})), "optim.lr",
       f"must be > 0, or 0 with optim.lr_by_algo.{c.algo.name} set (it names {sorted(c.optim.get('lr_by_algo', {}))})")
  kind, mu_dtype = c.optim.get("kind", "adamw"), c.optim.get("mu_dtype", "")
  need(kind in optimizers.KINDS, "optim.kind", f"{kind!r}: use one of {optimizers.KINDS} ('adamw' is the official "
       "recipe; 'adafactor', a factored second moment without momentum, a deviation)")
  need(mu_dtype in optimizers.MU_DTYPES, "optim.mu_dtype", f"{mu_dtype!r}: use one of {optimizers.MU_DTYPES} "
       "('' = the param dtype, official; 'bfloat16' AdamW's first moment in bf16, a deviation)")
  need(not (kind == "adafactor" and mu_dtype), "optim.mu_dtype",
       f"{mu_dtype!r} with optim.kind='adafactor': Adafactor keeps no first moment; leave optim.mu_dtype ''")
  need(c.sampling.temperature >= 0, "sampling.temperature", "must be >= 0")
  need(0 < c.sampling.top_p <= 1, "sampling.top_p", "must be in (0, 1]")
  need(c.sampling.max_new_tokens >= 1, "sampling.max_new_tokens", "must be >= 1")
  for f in ("grader", "stage1_grader"):
    problem = _grader_problem(c.reward[f])
    need(problem is None, f"reward.{f}", str(problem))
  need(len(c.reward.eval_graders) >= 1, "reward.eval_graders", "need one or more graders (the first is the headline)")
  for g in c.reward.eval_graders:
    problem = _grader_problem(g)
    need(problem is None, "reward.eval_graders", str(problem))
  need(0 < c.reward.pass_threshold <= 1, "reward.pass_threshold",
       f"{c.reward.pass_threshold!r} must be in (0, 1] (a response passes when r >= it; 1 = full credit)")
  need(0 <= c.reward.max_error_share <= 1, "reward.max_error_share",
       f"{c.reward.max_error_share!r} must be in [0, 1] (1 = never stop on grading failures)")
  need(c.data.answer_format in dataset.ANSWER_FORMATS, "data.answer_format",
       f"{c.data.answer_format!r} is not one of {dataset.ANSWER_FORMATS}")
  bad = [f for f in c.data.extra_fields if not isinstance(f, str) or f in ("response", "gold")]
  need(not bad, "data.extra_fields", f"{bad}: field names, other than 'response' and 'gold' (the function's own)")
  need(c.data.prompt_filter in dataset.PROMPT_FILTERS, "data.prompt_filter",
       f"{c.data.prompt_filter!r} is not one of {dataset.PROMPT_FILTERS}")
  for dt in ("dtype", "param_dtype", "ref_param_dtype"):
    need(c.model[dt] in DTYPES, f"model.{dt}", f"must be one of {DTYPES}")
  if "lora" in c.model:
    need(isinstance(c.model.lora.rank, int) and c.model.lora.rank >= 0, "model.lora.rank",
         "must be an int >= 0 (0 = full fine-tuning, > 0 = a LoRA adapter of that rank on the frozen base)")
    need(c.model.lora.base_dtype in DTYPES + ("",), "model.lora.base_dtype",
         f"must be one of {DTYPES} or '' (the compute dtype, model.dtype)")
    lora_settings(c)  # targets, alpha: refused naming the field
  need(isinstance(c.model.attention_block, int) and c.model.attention_block >= 0, "model.attention_block",
       "must be an int >= 0 (0 = attend over the whole sequence in one block)")
  need(c.model.get("train_attention", "auto") in TRAIN_ATTENTION, "model.train_attention",
       "must be 'auto' (a flash kernel on GPUs, XLA's blocks elsewhere), 'xla' or 'flash'")
  ss = tuple(c.mesh.sample_shape)
  need(not ss or (len(ss) == 3 and all(isinstance(x, int) and (x >= 1 or x == -1) for x in ss)
                  and ss.count(-1) <= 1), "mesh.sample_shape",
       f"{ss!r}: give () (sample on the training mesh) or 3 ints (data, fsdp, tensor), at most one -1")
  need(c.model.name_or_path != "random" or c.data.train in OFFLINE_TASKS or c.model.random.chars, "model.name_or_path",
       f"'random' builds a model with a character tokenizer: set data.train to one of {tuple(OFFLINE_TASKS)}, or "
       "model.random.chars to the characters of a data file's prompts and responses")
  if c.model.name_or_path == "random" and c.data.train not in OFFLINE_TASKS and c.warmstart.steps > 0:
    need(bool(c.warmstart.file), "warmstart.file", "a random model on a data file warm-starts on this file's "
         "(data.problem_field, warmstart.response_field) rows: name it, or set warmstart.steps=0")
  if "chains" in c.data:
    ch = c.data.chains
    need(ch.get("heldout", "test") in ("test", "val"), "data.chains.heldout",
         "'test' (the tables' problems) or 'val' (the lr sweeps' validation problems, drawn after them)")
    need(ch.get("heldout", "test") == "test" or ch.get("num_val", 0) >= 1, "data.chains.num_val",
         "must be >= 1 when data.chains.heldout is 'val'")
  need(c.preemption_grace_s >= 0, "preemption_grace_s", "must be >= 0 seconds (0 = no limit after a notice)")
  try:
    wandb_settings(c)
  except (ValueError, ImportError) as e:
    raise ValueError(f"config.wandb.mode: {e}") from None


def resolve_micro_batch(c, num_devices: int) -> None:
  """With train.micro_batch_per_device > 0 (and train.micro_batch 0), set train.micro_batch to that many
  prompts per batch shard (data x fsdp of the training mesh on `num_devices`), as the official scripts
  size theirs per GPU, so one config compiles on any slice. Called at the top (main.py, aot.py,
  memory_plan.py), before anything reads train.micro_batch."""
  t = c.train
  if not t.micro_batch_per_device:
    return
  d, f, _ = sharding.resolve_mesh_shape(tuple(c.mesh.shape), num_devices)
  micro = t.micro_batch_per_device * d * f
  if t.mini_batch % micro:
    raise ValueError(f"config.train.micro_batch_per_device: {t.micro_batch_per_device} x {d * f} batch shards = "
                     f"{micro} prompts per micro-batch does not divide train.mini_batch={t.mini_batch}")
  t.micro_batch = micro


def micro_batch_override(setting: str, per_device: int, mesh_shape) -> str:
  """A fit-search setting ("train.micro_batch=N", global) as a config that sets train.micro_batch_per_device
  takes it: N per batch shard (data x fsdp), or the pair of overrides back to a global size when N does
  not split evenly. Other settings, and configs with a global micro-batch, pass through."""
  prefix = "train.micro_batch="
  if not per_device or not setting.startswith(prefix) or not setting[len(prefix):].isdigit():
    return setting
  micro, shards = int(setting[len(prefix):]), mesh_shape[0] * mesh_shape[1]
  if micro % shards == 0:
    return f"train.micro_batch_per_device={micro // shards}"
  return f"train.micro_batch_per_device=0 train.micro_batch={micro}"


def wandb_settings(c) -> metrics.WandbSettings:
  """The W&B sink of `c.wandb` (mode 'disabled' unless set), with the whole config as the run's config."""
  w = c.wandb
  return metrics.WandbSettings(mode=w.mode, project=w.project, entity=w.entity or None, name=w.name or None,
                               run_config=c.to_json_best_effort())


def run_shape(c, reference_batch: int | None = None, backend: str | None = "tpu"):
  """The aot.memory_plan.RunShape of a config (memory plans and ahead-of-time compiles): batches in prompts,
  rows per prompt the config's method's; decode slots as the sampler gives them on `backend` (the
  accelerators' by default; None: this process's backend)."""
  t, G = c.train, build_method(c).responses_per_prompt()
  return memory_plan.RunShape(
      prompt_len=sampler.bucket_length(c.data.max_prompt_tokens), response_len=c.sampling.max_new_tokens,
      rollout_batch=t.rollout_batch, micro_batch=t.micro_batch, mini_batch=t.mini_batch,
      micro_batch_per_device=t.micro_batch_per_device,
      sample_batch=sampler.decode_slots(c.sampling.max_batch, t.rollout_batch * G, backend), logp_chunk=t.logp_chunk,
      reference_batch=reference_batch or (t.micro_batch * t.score_micro_batches if t.score_micro_batches > 1 else None),
      rows_per_prompt=G,
      stage1_batch=sampler.decode_slots(c.sampling.max_batch, c.stage1.chunk_prompts * c.stage1.n_samples, backend),
      stage1_prompts=c.stage1.chunk_prompts,
      ref_param_dtype=ref_param_dtype(c), lora=lora_settings(c), optimizer=c.optim.get("kind", "adamw"),
      mu_dtype=c.optim.get("mu_dtype", ""))
