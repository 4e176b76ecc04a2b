"""Generated tokens/s of `astarpo_jax.sampler` against HF `generate` (PyTorch CPU), same weights.

  python experiments/bench_sampler.py            # batch 8 and 32, 64-token prompts, 128 new tokens
  python experiments/bench_sampler.py --quick    # batch 8, 16-token prompts, 32 new tokens

Both sides sample at temperature 1 without top-k/top-p and with EOS disabled, so every row
produces exactly `--new_tokens` tokens; the timed call includes prefill. JAX compile time is
the first call's extra time over a warm call. The ceiling is FLOPs per generated token against
a measured fp32 matmul rate; the load average is printed since other processes share the CPU.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from astarpo_jax import hf as hf_lib
from astarpo_jax import model as model_lib
from astarpo_jax import sampler as sampler_lib

BENCH_MODEL = model_lib.ModelConfig(vocab_size=32768, hidden_size=512, intermediate_size=1408, num_layers=8,
                                    num_heads=8, num_kv_heads=2, head_dim=64, tie_embeddings=True)


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
  """Best-of-`repeats` fp32 rate of one [n, n] @ [n, n] jnp.dot, in GFLOP/s."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  dot = jax.jit(jnp.dot)
  dot(a, a).block_until_ready()
  best = min(_timed(lambda: dot(a, a).block_until_ready()) for _ in range(repeats))
  return 2 * n**3 / best / 1e9


def flops_per_token(cfg: model_lib.ModelConfig, context: float) -> float:
  """2 x non-embedding params + 2 x V x D (the lm head) + 4 x L x N x H x context (QK^T and PV)."""
  non_embed = cfg.num_params - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)
  attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context
  return 2 * non_embed + 2 * cfg.vocab_size * cfg.hidden_size + attn


def _cpu_seconds() -> tuple[float, float]:
  """(CPU seconds all processes have been busy, CPU seconds this process used) from /proc/stat."""
  with open("/proc/stat") as f:
    jiffies = [int(x) for x in f.readline().split()[1:]]
  busy = sum(jiffies) - jiffies[3] - jiffies[4]  # minus idle and iowait
  t = os.times()
  return busy / os.sysconf("SC_CLK_TCK"), t.user + t.system


def _timed(fn) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def bench_jax(cfg, params, prompts_BP: np.ndarray, new_tokens: int, repeats: int):
  """(compile seconds, warm seconds per call) of `sampler.sample` on these prompts."""
  scfg = sampler_lib.SamplingConfig(temperature=1.0, max_new_tokens=new_tokens, stop_ids=())
  prompts = prompts_BP.tolist()

  def run(seed):
    out = sampler_lib.sample(cfg, params, prompts, jax.random.key(seed), scfg)
    jax.block_until_ready(out)
    assert int(out.length_B.min()) == new_tokens, "EOS is disabled: every row must reach new_tokens"

  first = _timed(lambda: run(0))
  warm = [_timed(lambda: run(i + 1)) for i in range(repeats)]
  return first - min(warm), statistics.median(warm)


def bench_hf(model, prompts_BP: np.ndarray, new_tokens: int, repeats: int) -> float:
  """Warm seconds per `generate` call (sampling, temperature 1, no top-k/top-p, no EOS)."""
  import torch
  ids = torch.as_tensor(prompts_BP, dtype=torch.long)
  kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)

  def run():
    with torch.inference_mode():
      out = model.generate(ids, **kwargs)
    assert out.shape == (ids.shape[0], ids.shape[1] + new_tokens), out.shape

  run()  # warm-up
  return statistics.median(_timed(run) for _ in range(repeats))


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


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="batch 8, 16-token prompts, 32 new tokens, 1 repeat")
  ap.add_argument("--batches", default="8,32", help="comma-separated batch sizes")
  ap.add_argument("--prompt_len", type=int, default=64)
  ap.add_argument("--new_tokens", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=3, help="warm timed calls per measurement (median)")
  ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
  ap.add_argument("--skip_hf", action="store_true", help="time the JAX sampler only")
  args = ap.parse_args()
  if args.quick:
    args.batches, args.prompt_len, args.new_tokens, args.repeats = "8", 16, 32, 1
  batches = [int(b) for b in args.batches.split(",")]

  cfg = BENCH_MODEL
  _, params = model_lib.init_params(cfg, seed=0)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs, "
        f"load average at start {os.getloadavg()[0]:.2f}")
  busy0, own0, wall0 = *_cpu_seconds(), time.perf_counter()
  print(f"model: {cfg.num_params / 1e6:.1f}M params (V={cfg.vocab_size} D={cfg.hidden_size} F={cfg.intermediate_size} "
        f"L={cfg.num_layers} N={cfg.num_heads} K={cfg.num_kv_heads} H={cfg.head_dim}, tied), fp32")
  gflops = matmul_gflops()
  flops = flops_per_token(cfg, context=args.prompt_len + args.new_tokens / 2)
  ceiling = gflops * 1e9 / flops
  print(f"fp32 matmul (2048^3 jnp.dot): {gflops:.1f} GFLOP/s; {flops / 1e6:.1f} MFLOP per generated token "
        f"-> ceiling {ceiling:.0f} tokens/s")
  hf_model = None
  if not args.skip_hf:
    hf_model, diff = load_hf_model(cfg, params, args.threads)
    print(f"HF Qwen2ForCausalLM loaded from our weights (max logit difference {diff:.1e}), "
          f"torch threads {args.threads}")

  # All JAX timings first, then all HF ones, so neither runs while the other's threads wind down.
  rng = np.random.default_rng(0)
  prompts = {B: rng.integers(1, cfg.vocab_size, (B, args.prompt_len)) for B in batches}
  jax_res = {B: bench_jax(cfg, params, prompts[B], args.new_tokens, args.repeats) for B in batches}
  hf_s = {B: bench_hf(hf_model, prompts[B], args.new_tokens, args.repeats) for B in batches} if hf_model else {}
  print(f"\nprompt {args.prompt_len} tokens, {args.new_tokens} new tokens, temperature 1.0, median of {args.repeats}")
  print(f"{'batch':>5} {'jax tok/s':>10} {'hf tok/s':>9} {'speedup':>8} {'% ceiling':>9} {'jax compile s':>13}")
  for B in batches:
    compile_s, jax_s = jax_res[B]
    jax_tps = B * args.new_tokens / jax_s
    if B in hf_s:
      hf_tps = B * args.new_tokens / hf_s[B]
      hf_col, speed_col = f"{hf_tps:9.0f}", f"{jax_tps / hf_tps:7.2f}x"
    else:
      hf_col, speed_col = f"{'-':>9}", f"{'-':>8}"
    print(f"{B:5d} {jax_tps:10.0f} {hf_col} {speed_col} {100 * jax_tps / ceiling:8.0f}% {compile_s:13.1f}")
  busy1, own1 = _cpu_seconds()
  others = (busy1 - busy0 - (own1 - own0)) / ((time.perf_counter() - wall0) * os.cpu_count())
  print(f"\nother processes kept {100 * max(others, 0):.0f}% of the CPU busy during the run "
        f"(more than a few % means the timings are disturbed)")


if __name__ == "__main__":
  main()
