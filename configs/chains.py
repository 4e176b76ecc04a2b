"""CPU comparison task: long, variable chains of arithmetic (astarpo_jax/data/chains.py) with a small decoder.

  python experiments/main.py --config=configs/chains.py --workdir=/tmp/chains
  python experiments/main.py --config=configs/chains.py:quick --workdir=/tmp/chains_q
  python experiments/main.py --config=configs/chains.py --config.algo.name=grpo --workdir=/tmp/chains_grpo

The regime of the paper's claim, shrunk to 2 CPU cores: worked solutions of about 10 to 110 tokens
(so sampling is a large part of a step), a reference that solves some prompts and never others, and
tens of rollout steps of learning. The task keeps the demo's one-digit operands and 2-layer d-128
decoder; its spread comes from the number of operations (2..9: long chains fail more). The reference
is warm-started (supervised) on worked solutions of other problems, a quarter of them unboxed (scored 0
by the grader, as a base model's bare answers). Every method runs with --config.algo.name=astarpo|grpo|ppo|rebel|rloo (the
baselines skip Stage 1). Calibrated except the sampling share: docs/chains.md Run 5 (this config: RL prompts
the warm-start never saw, zero-pass share 0.19, held-out avg@8 at temperature 1 0.39 rising to ~0.47 over
50 A*-PO steps, greedy pass@1 0.66; sampling 21% of an A*-PO step against the 35% target).
Variants: `long` (2..14 operations: responses of tens to ~230 tokens, sampled mean ~96, zero-pass 0.27-0.30;
docs/chains.md run 8), `paper` (long's task under the paper's protocol: 128 prompts, 25 epochs, beta2 = 1e-3, an
lr per method from its sweep), `quick` (shorter chains, fewer steps, prompts and test problems: a smoke run) and
`test` (the CI-sized run of tests/test_chains.py).
"""
import ml_collections

from configs import base


def get_config(arg: str = "full"):
  c = base.get_config()
  c.model.name_or_path = "random"
  c.model.dtype = c.model.param_dtype = c.model.ref_param_dtype = "float32"
  c.model.remat = False
  # The demo's decoder (configs/base.py: 2 layers, d 128, MLP 384, 4 heads, 2 KV): positions for a 32-token
  # prompt bucket plus max_new_tokens.
  c.model.random.update(dict(hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2,
                             head_dim=32, max_position_embeddings=224, tie_embeddings=True))

  c.data.train = "chains"
  c.data.test_sets = ("chains",)
  c.data.avg_k_sets = ("chains",)  # avg@8 at the sampling temperature: compare.py's metric (RL's gains show there)
  c.data.avg_k = 8
  c.data.seed = 0  # the same problems and warm-started reference for every config.seed
  # The reference's supervised corpus: 4000 chains of 2..8 steps (warmstart_max_steps). The RL prompts and the
  # test problems run to 9 steps, and no RL prompt is in the corpus (fresh_prompts), as a base model's RL prompts
  # are not its fine-tuning data: that is what leaves a share of prompts pi_ref never solves (run 5).
  c.data.chains = ml_collections.ConfigDict(dict(min_steps=2, max_steps=9, digits=1, ops="+-", max_value=99,
                                                 num_train=4000, num_test=100, unboxed_fraction=0.25,
                                                 warmstart_max_steps=8, fresh_prompts=True,
                                                 # the lr sweeps' held-out problems: drawn after the test ones
                                                 num_val=100, heldout="test"))
  c.data.num_train = 512
  c.data.max_prompt_tokens = 32  # 9 operations of one-digit operands: at most 21 tokens with BOS
  c.data.prompt_filter = "raw"  # the character tokenizer has no chat template

  c.sampling.max_new_tokens = 128  # the longest worked solution (9 steps) is at most 111 tokens with EOS
  c.stage1.chunk_prompts = 128
  c.reward.grader = c.reward.stage1_grader = "math_verify"
  c.reward.eos_required = True  # a response cut at max_new_tokens scores 0 (the official Stage-2 rule)
  c.reward.stage1_eos_required = False
  c.reward.eval_graders = ("math_verify",)
  c.reward.eval_eos_required = True
  c.reward.num_workers = 2

  c.warmstart.steps = 1400  # 1200-1300 leave zero-pass 0.43 and no held-out learning; 1400-1500 0.01-0.04 (run 4)
  c.warmstart.batch_size = 64
  c.warmstart.lr = 3e-3

  c.optim.lr = 3e-5  # 1e-4 collapses A*-PO with two optimizer steps per rollout (docs/chains.md at 8a436ea, run 4)
  c.optim.weight_decay = 0.0
  c.optim.zero_lr_first_rollout = False
  c.algo.beta2 = 0.5
  c.algo.entropy_coef = 0.0
  c.algo.value_lr = 10 * c.optim.lr  # PPO's critic at 10x the policy's lr (verl: 1e-5 vs 1e-6)
  c.stage1.beta1 = 0.5
  c.train.num_steps = 50
  c.train.rollout_batch = 32
  c.train.mini_batch = 16  # two optimizer steps per rollout, as the official 256 / 128
  c.train.micro_batch = 16
  c.train.checkpoint_every = 50
  c.train.eval_every = 10  # the curves of compare.py: time to threshold is read at evaluations
  c.export_hf = False

  if arg == "quick":  # a smoke run of compare.py --quick: the same model, shorter chains, a short warm-start, 4 steps
    c.data.chains.update(dict(min_steps=2, max_steps=6, num_train=1000, num_test=32, warmstart_max_steps=0,
                              fresh_prompts=False))
    c.data.num_train = 64
    c.sampling.max_new_tokens = 64  # 6 steps: at most 53 tokens with EOS
    c.warmstart.steps = 300
    c.train.num_steps = 4
    c.train.rollout_batch = c.train.mini_batch = c.train.micro_batch = 16
    c.train.checkpoint_every = 4
    c.train.eval_every = 2
  elif arg == "long":  # responses of tens to ~230 tokens: 2..14 operations (docs/chains.md, run 8)
    # Gold solutions 10-229 tokens with EOS (mean ~96); the corpus stops one operation short of the prompts, as in
    # full. Positions for the 32-token prompt bucket plus 256 new tokens.
    c.model.random.max_position_embeddings = 288
    c.data.chains.update(dict(max_steps=14, warmstart_max_steps=13))
    c.sampling.max_new_tokens = 256  # the longest worked solution (14 steps) is at most 229 tokens with EOS
    c.warmstart.steps = 2000  # one build, zero-pass 0.27-0.30 by Stage-1 seed
    # lr per method (docs/comparison.md at 2f31eb1, run 8): A*-PO, PPO and REBEL swept on this variant (1e-5, the
    # low end of their grids); GRPO and RLOO not swept here (3e-5, run 7's on the full variant)
    c.optim.lr = 0.0
    c.optim.lr_by_algo = ml_collections.ConfigDict(dict(astarpo=1e-5, ppo=1e-5, rebel=1e-5, grpo=3e-5, rloo=3e-5))
    c.algo.value_lr = 10 * c.optim.lr_by_algo.ppo
  elif arg == "paper":  # the paper's protocol in small (docs/comparison.md): 25 epochs, its beta1 and beta2
    # long's lengths and reference (the same warm-start: data.seed, corpus and chains), 128 training prompts, 32 per
    # rollout in two optimizer steps of 16: 25 epochs are 100 rollout steps (verl's loop would stop at 99; all
    # methods run 100 here). A*-PO at the paper's beta1 = 1/2, beta2 = 1e-3 (scripts/apo_math.sh).
    c.model.random.max_position_embeddings = 288
    c.data.chains.update(dict(max_steps=14, warmstart_max_steps=13))
    c.sampling.max_new_tokens = 256
    c.warmstart.steps = 2000
    c.data.num_train = 128
    c.train.num_steps = 100
    c.train.checkpoint_every = 100
    c.algo.beta2 = 1e-3
    # every method's lr from its sweep on this variant (experiments/compare.py --size=paper --study=sweep: the
    # validation problems, seeds 0 and 4; docs/comparison.md run 9), each interior to its grid: A*-PO, GRPO, PPO and
    # REBEL 1e-5, RLOO 3e-5 (A*-PO collapses at 3e-5, RLOO at 9e-5)
    c.optim.lr = 0.0
    c.optim.lr_by_algo = ml_collections.ConfigDict(dict(astarpo=1e-5, ppo=1e-5, rebel=1e-5, grpo=1e-5, rloo=3e-5))
    c.algo.value_lr = 10 * c.optim.lr_by_algo.ppo
  elif arg == "test":  # the wiring only (tests/test_chains.py): a 1-layer model, short chains, a few steps
    c.model.random.update(dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                               head_dim=16))
    c.data.chains.update(dict(min_steps=1, max_steps=4, num_train=256, num_test=16, warmstart_max_steps=3,
                               num_val=16))
    c.data.num_train = 64
    c.sampling.max_new_tokens = 40  # 4 steps: at most 29 tokens with EOS
    c.warmstart.steps = 10
    c.warmstart.batch_size = 16
    c.train.num_steps = 2
    c.train.rollout_batch = c.train.mini_batch = c.train.micro_batch = 16
    c.train.eval_every = 0
  elif arg != "full":
    raise ValueError(f"configs/chains.py: unknown variant {arg!r} (full | long | paper | quick | test)")
  return c
