"""Defaults shared by every config: the official A*-PO recipe (arXiv 2505.20686, github ZhaolinGao/A-PO).

Each config file's `get_config(arg)` starts from `base.get_config()` and changes what it must.
Every field can be overridden on the command line: `--config.algo.beta2=1e-3`. docs/fidelity.md lists
every setting that decides results with its official value and the file of the official code that
sets it; tests/test_fidelity.py checks the paper presets against that table.
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.mode = "all"  # stage1 | train | eval | all
  c.seed = 0

  c.model = ml_collections.ConfigDict()
  c.model.name_or_path = "Qwen/Qwen2.5-1.5B"  # HF hub id or local folder; "random" builds `model.random`
  c.model.dtype = "bfloat16"  # compute dtype (use float32 on CPU)
  c.model.param_dtype = "float32"  # policy params and optimizer state
  c.model.ref_param_dtype = "bfloat16"  # frozen reference copy
  c.model.remat = True  # rematerialise each layer in the backward pass
  c.model.attention_block = 64  # query rows per block of causal attention in scoring/training; 0 = one block
  # scoring/training attention: "xla" (those blocks), "flash" (a fused kernel, model/flash.py) or "auto" (flash on
  # GPUs, xla elsewhere); the sampler's decode has its own (sampling.paged_attention)
  c.model.train_attention = "auto"
  # LoRA (model/lora.py; docs/lora.md): rank 0 = full fine-tuning (official). rank > 0 trains an adapter on the
  # frozen base, which is also pi_ref (one copy of the weights): targets "all-linear" (q,k,v,o,gate,up,down) or a
  # comma list of them; scale alpha / rank; base_dtype the base's storage dtype ("" = model.dtype, the compute
  # dtype); the adapter and its optimizer state in model.param_dtype. A deviation from the paper's full fine-tuning.
  c.model.lora = ml_collections.ConfigDict(dict(rank=0, alpha=32.0, targets="all-linear", base_dtype=""))
  # Shape of a randomly initialised model (used when name_or_path == "random").
  c.model.random = ml_collections.ConfigDict(dict(
      hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
      max_position_embeddings=128, tie_embeddings=True, chars=""))
  # model.random.chars: with data.train a data file, the characters of the random model's character tokenizer
  # (its prompts' and responses' characters; `\boxed{` is one token besides). Offline tasks bring their own.

  c.data = ml_collections.ConfigDict()
  c.data.train = "math_train"  # a preset of astarpo_jax.data.PRESETS, "synthetic", or a local file
  c.data.data_dir = ""  # folder with local copies of the presets (e.g. ../shared/data); "" = the hub
  c.data.problem_field = ""  # field mapping for a local file (train)
  c.data.answer_field = ""
  c.data.answer_format = "plain"  # plain | gsm8k | boxed | latex_list | json (as loaded: for a user reward function)
  c.data.extra_fields = ()  # other row fields passed to a user reward function as keywords: fn(response, gold, **extra)
  c.data.num_train = 0  # 0 = all
  c.data.seed = -1  # offline tasks' problems and the demo reference's warm-start; -1 = config.seed
  c.data.template = "boxed"  # boxed | gsm8k | plain, or a string with {problem}
  c.data.chat = False  # wrap prompts in the tokenizer's chat template (instruct models)
  c.data.max_prompt_tokens = 256
  # How a prompt's length is measured for that limit: "chat_template" (official: the user turn in the
  # tokenizer's chat template, though the raw prompt is what the model sees) or "raw".
  c.data.prompt_filter = "chat_template"
  c.data.test_sets = ("math500",)  # presets evaluated greedily (pass@1)
  c.data.avg_k_sets = ()  # presets evaluated with sampling, avg@k (small sets: aime24, amc23)
  c.data.avg_k = 8
  c.data.num_test = 0  # 0 = all rows of each test set
  # The synthetic task (data.train = "synthetic"): sums, and the share of warm-start targets that
  # leave the final answer unboxed (the grader then scores them 0, as a base model's bare answers).
  c.data.synthetic = ml_collections.ConfigDict(dict(min_terms=2, max_terms=2, max_digits=2, num_train=4000,
                                                    num_test=200, unboxed_fraction=0.0))

  c.sampling = ml_collections.ConfigDict()
  c.sampling.temperature = 1.0
  c.sampling.top_p = 1.0
  c.sampling.top_k = 0
  c.sampling.max_new_tokens = 1024
  c.sampling.max_batch = 0  # decode slots (continuous batching; memory); 0 = sampler.DEFAULT_SLOTS of the backend
  # The decode's KV cache (sampling/engine.py): "" = the backend's (dense on the CPU, paged on TPU/GPU), or
  # "dense" / "paged"; tokens of a page (0 = the backend's: 64 TPU, 16 GPU); a cap on the pool's pages (0 = none);
  # the paged attention ("" = the backend's kernel: pallas on TPU, triton on GPU; "xla" = a gather, the fallback).
  c.sampling.kv_layout = ""
  c.sampling.page_size = 0
  c.sampling.max_pages = 0
  c.sampling.paged_attention = ""
  c.sampling.extra_stop_tokens = ()  # besides the tokenizer's EOS (official: EOS only); e.g. ("<|im_end|>",)

  c.stage1 = ml_collections.ConfigDict()
  c.stage1.n_samples = 8
  c.stage1.beta1 = 0.5  # 0 = plain mean of the rewards
  c.stage1.chunk_prompts = 64
  c.stage1.drop_all_fail = False  # train only on prompts that pi_ref solved at least once
  c.stage1.vstar_file = ""  # reuse an existing V* file (vstar.jsonl) instead of sampling
  c.stage1.eval_columns_file = ""  # or import precomputed 0/1 columns eval_0..eval_{N-1}
  c.stage1.eval_columns_key = "extra_info.question"  # the raw problem (or "prompt.0.content": the prompt)
  c.stage1.adaptive_n_min = 0  # > 0: draw this many first, the rest only where they are not all correct
  c.stage1.keep_responses = False

  c.algo = ml_collections.ConfigDict()
  c.algo.name = "astarpo"  # astarpo | grpo | ppo | rebel (the baselines skip Stage 1)
  c.algo.beta2 = 1e-3
  c.algo.entropy_coef = 1e-3  # entropy bonus (the baselines' configs set their own)
  # A*-PO's entropy term: "seq_mean_token_mean" (official: the mean over responses of each one's token
  # mean, as verl's micro-batch of one response per GPU computes it) or "token_mean" (over all tokens).
  c.algo.entropy_agg = "seq_mean_token_mean"
  # Baselines only (verl's defaults unless said otherwise); train.*_batch count prompts for every method.
  c.algo.group_size = 0  # responses per prompt; 0 = the method's usual: GRPO 8, PPO 1, REBEL 2
  c.algo.clip_eps = 0.2  # GRPO / PPO ratio clip
  c.algo.kl_coef = 1e-3  # GRPO: k3 KL loss to pi_ref; PPO: KL-in-reward; 0 = no reference forward
  c.algo.loss_agg = "token_mean"  # GRPO: token_mean | seq_mean_token_mean | seq_mean_token_sum
  c.algo.value_lr = 1e-5  # PPO critic (its own AdamW, same weight decay / clipping as optim.*)
  c.algo.value_clip = 0.5  # PPO value-loss clip
  c.algo.gae_gamma = 1.0  # PPO GAE
  c.algo.gae_lambda = 1.0
  c.algo.rebel_eta = 1.0  # REBEL step size η (REBEL paper / code default)
  # GRPO / PPO / RLOO / REBEL: pi_old's log-probs from the training forward over each rollout ("trainer", official:
  # verl recomputes them, verl/workers/fsdp_workers.py generate_sequences; one more forward per rollout) or the
  # sampler's own ("sampler": no forward; a bf16 paged decode's numbers, not the trainer's).
  c.algo.old_logp = "trainer"
  # > 0: truncated importance sampling, GRPO / PPO per token, RLOO per response: the surrogate weighted by
  # min(pi_old / pi_sampler, tis_cap) (Yao et al. 2025 use 2; verl actor.tis_imp_ratio_cap). 0 = off (official).
  c.algo.tis_cap = 0.0
  # Every method logs the sampler-vs-trainer mismatch per step (mismatch_abs_mean / _max, mismatch_seq_kl_k3);
  # where the trainer does not score pi_old anyway (A*-PO, old_logp "sampler") it scores this many fixed-score
  # calls' rows for it, the rollout's first; 0 = no metric there.
  c.algo.mismatch_blocks = 1

  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 1e-6  # 0: the task's lr for algo.name, from optim.lr_by_algo (a task swept per method)
  c.optim.lr_by_algo = ml_collections.ConfigDict()  # algo.name -> lr; read only when optim.lr is 0
  c.optim.weight_decay = 0.01
  c.optim.grad_clip = 1.0
  c.optim.warmup_steps = 0  # constant schedule
  # Memory-saving deviations from the official fp32 AdamW (training/optimizers.py; docs/lora.md, 7B on v5e-8):
  # kind "adafactor" = a factored second moment without momentum (~0 bytes of state a param); mu_dtype "bfloat16"
  # = AdamW's first moment in bf16 (the second stays in model.param_dtype). Official: "adamw", "".
  c.optim.kind = "adamw"
  c.optim.mu_dtype = ""
  # Official: verl's constant schedule with zero warm-up gives lr 0 to the first rollout's optimizer steps
  # (AdamW's moments still update); False starts at optim.lr.
  c.optim.zero_lr_first_rollout = True

  c.train = ml_collections.ConfigDict()
  c.train.num_steps = 0  # rollout steps; 0 = train.epochs over the training prompts kept
  c.train.epochs = 25  # official: 25 epochs of floor(prompts / rollout_batch) rollouts
  c.train.official_step_count = True  # official: verl's loop stops one rollout short of its total
  c.train.rollout_batch = 256  # prompts per rollout, one response each
  c.train.mini_batch = 128  # prompts per optimizer step
  c.train.micro_batch = 8  # prompts per forward/backward (gradient accumulation)
  # Or prompts per batch shard (data x fsdp of the training mesh; train.micro_batch then 0), as the official
  # scripts' MICRO_BATCH_SIZE_PER_DEVICE (scripts/apo_math.sh), so one config compiles on any slice
  c.train.micro_batch_per_device = 0
  c.train.logp_chunk = 256  # response positions per block of logits
  # Pack each micro-batch's rows (packing.py) so the update's and the fixed-score forwards skip response padding:
  # the same losses and gradients (tests/test_packing.py, every method), fewer rows computed where a batch shard holds
  # several rows (MATH-like lengths, phases.mix_fill: 8 rows a shard pack into 6, 16 into 10, 2 stay 2; 1.33-1.70x
  # faster CPU training in the comparison's runs). verl's counterpart,
  # use_remove_padding, is off in the official A*-PO config (verl/trainer/config/apo_trainer.yaml): False pads
  # every row to the full width, as it does.
  c.train.pack_rows = True
  # The fixed-score forwards (pi_ref's log-probs, pi_old's, a critic's values) take this many update micro-batches
  # a call. Official: 1 (scripts/apo_math.sh: ref.log_prob_micro_batch_size = ppo_micro_batch_size). More calls
  # fewer times, so an FSDP mesh gathers the weights less often (docs/tpu.md 0b: ICI-bound at 1). The largest that
  # fits, by compiling: python experiments/aot.py --config=... --topology=... --choose_score_batch
  c.train.score_micro_batches = 1
  # How the update's weights travel on a mesh that splits them (training/update.py): "per_step" casts the params to
  # the compute dtype and gathers that copy once per optimizer step, each micro-batch's gradient reduce-scattered
  # into the sharded accumulator (and pi_ref's scoring on its bf16 weights whole); "per_micro_batch" gathers each
  # layer in every micro-batch's forward and backward (the official FSDP's way); "auto": per_step where the copy and
  # its gradient fit (experiments/aot.py compiles it first and falls back).
  c.train.gather_weights = "auto"
  c.train.checkpoint_every = 50
  c.train.eval_every = 50

  # Graders per use (astarpo_jax/rewards/grading.py). The official rules differ by stage: MATH Stage 1 grades the
  # response alone, Stage 2 and validation also score 0 a response that did not end with EOS. Each grader field
  # also takes a user function, "path/to/file.py:function" or "package.module:function":
  # fn(response, gold, **extra) -> float in [0, 1], run in the same workers (astarpo_jax/rewards/user_grader.py).
  c.reward = ml_collections.ConfigDict()
  c.reward.grader = "hendrycks"  # Stage 2's reward (official MATH: verl math.py compute_score)
  c.reward.eos_required = True  # Stage 2: a truncated response scores 0
  c.reward.stage1_grader = "hendrycks"  # Stage 1 (official MATH: compute_score_preprocessing)
  c.reward.stage1_eos_required = False
  c.reward.eval_graders = ("hendrycks", "math_verify")  # the first is the headline; the others beside it
  c.reward.eval_eos_required = True
  c.reward.num_workers = 4
  c.reward.timeout_s = 5.0  # per response; past it the worker is killed and the response scores 0
  # A batch (a rollout step, a Stage-1 chunk, an eval chunk) where more than this share of the responses timed
  # out or failed to grade stops the run, with the first failure's text; 1 = never stop.
  c.reward.max_error_share = 0.5
  # A response passes (counts as correct) when r >= this: Stage 1's num_correct, all_fail (drop_all_fail),
  # adaptive N and the evaluation's pass_rate. 0/1 rewards count the same under any value in (0, 1].
  c.reward.pass_threshold = 1.0

  c.warmstart = ml_collections.ConfigDict()
  c.warmstart.steps = 0  # > 0: supervised warm-start of the reference first (synthetic demo)
  c.warmstart.batch_size = 64
  c.warmstart.lr = 3e-3
  c.warmstart.file = ""  # a random model on a data file: JSONL rows of (data.problem_field, warmstart.response_field)
  c.warmstart.response_field = "response"

  c.mesh = ml_collections.ConfigDict()
  c.mesh.shape = (1, -1, 1)  # (data, fsdp, tensor); -1 takes the remaining devices
  # The sampling calls' mesh (Stage 1, rollouts, evaluation) over the same devices; the params are copied onto
  # it once per sampling call. () = the backend's default (sharding.default_sample_shape): mesh.shape, except on
  # TPU (d, f, t) -> (d, f/2, 2t) for f >= 8 (the decode's weight gathers: docs/tpu.md). mesh.shape = no copy.
  c.mesh.sample_shape = ()

  c.export_hf = True  # write the final policy as an HF folder in workdir/export
  # SIGTERM / SIGINT (preemption, maintenance, Ctrl-C): the Stage-2 step or Stage-1 chunk in flight finishes and
  # is saved, then the run exits with code 75 and the same command resumes. A step that has not finished this
  # many seconds after the notice is given up (exit 75 without saving it: the rerun resumes from the last
  # checkpoint). Below the notice the platform gives (30 s on spot TPU VMs and GKE by default); 0 = no limit.
  c.preemption_grace_s = 25.0

  # Weights & Biases (optional: pip install wandb). A rerun in the same work directory resumes the same
  # W&B run (its id is kept in workdir/wandb_run_id); only process 0 logs.
  c.wandb = ml_collections.ConfigDict()
  c.wandb.mode = "disabled"  # disabled | online | offline (offline runs upload later with `wandb sync`)
  c.wandb.project = "astarpo_jax"
  c.wandb.entity = ""  # "" = the API key's default entity
  c.wandb.name = ""  # "" = W&B picks a name
  return c


# LoRA on a Qwen model (configs/qwen7b.py:lora, qwen1p5b.py:lora): rank 64, alpha 128 on every linear layer, the
# base frozen in bfloat16 and also pi_ref. The lr is 3x the official full fine-tuning's 1e-6, the ratio the demo's
# sweep found between its LoRA lr and its full fine-tuning lr (docs/lora.md; not swept on Qwen). Both are
# deviations from the paper.
QWEN_LORA = dict(rank=64, alpha=128.0, targets="all-linear", base_dtype="bfloat16")
QWEN_LORA_LR = 3e-6


def with_lora(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`c` training a LoRA adapter (QWEN_LORA) at QWEN_LORA_LR instead of the full model."""
  c.model.lora.update(QWEN_LORA)
  c.optim.lr = QWEN_LORA_LR
  return c


def qwen_config(hub_id: str, variant: str, micro_batch: int) -> ml_collections.ConfigDict:
  """A Qwen2.5 base model with the official settings; variant "math" (default) or "gsm8k", either with a
  "_lora" suffix (or "lora" alone: MATH) for a LoRA adapter (`with_lora`)."""
  variant, lora = {"lora": ("math", True)}.get(variant, (variant.removesuffix("_lora"), variant.endswith("_lora")))
  c = qwen_config_full(hub_id, variant, micro_batch)
  return with_lora(c) if lora else c


def qwen_config_full(hub_id: str, variant: str, micro_batch: int) -> ml_collections.ConfigDict:
  c = get_config()
  c.model.name_or_path = hub_id
  c.train.micro_batch = micro_batch
  if variant == "gsm8k":
    c.data.train = "gsm8k_train"
    c.data.test_sets = ("gsm8k_test",)
    c.data.template = "gsm8k"
    # Official GSM8K (verl gsm8k.py): Stage 2 and validation 'strict', Stage 1 'flexible', no EOS rule.
    c.reward.grader = "gsm8k_strict"
    c.reward.eos_required = False
    c.reward.stage1_grader = "gsm8k_flexible"
    c.reward.eval_graders = ("gsm8k_strict", "math_verify")
    c.reward.eval_eos_required = False
  elif variant == "math":
    # The sets of the official README's evaluation figure (MATH500, Minerva, OlympiadBench, AMC23 avg@32).
    # The official in-training validation is the full MATH test split (data preset "math_test", online).
    c.data.test_sets = ("math500", "minerva", "olympiadbench")
    c.data.avg_k_sets = ("amc23",)
    c.data.avg_k = 32
  else:
    raise ValueError(f"{hub_id}: unknown config variant {variant!r} (math | gsm8k)")
  return c
