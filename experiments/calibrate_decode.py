"""The projection against a decode someone else measured: Llama-3-8B on a TPU v5e-8 in bf16 at 128 slots.

  python experiments/calibrate_decode.py            # compile-only, a few minutes: the table below

The measurement: JetStream-PyTorch's benchmark table (AI-Hypercomputer/jetstream-pytorch, benchmarks/summary.md,
https://github.com/AI-Hypercomputer/jetstream-pytorch/blob/main/benchmarks/summary.md), row 2024-04-24: Llama 3 8B,
TPU v5e-8, bfloat16, batch size 128, cache length 2048, max input 1024, max output 1024: 8,249 tokens/s, served
(benchmark_serving.py over 2,000 ShareGPT requests: prefills interleaved with the decode). At 128 rows a step
that is 128 / 8,249 = 15.5 ms per step if every slot were decoding.

This project's decode compiled for the same shape (Llama-3-8B's public config.json, 128 slots, a 1,024-token
prompt bucket and 1,024 new tokens, the model split over the 8 chips: sampling mesh (1, 1, 8) as JetStream's
model parallel), its step read at a ShareGPT-like live context (~400 tokens a row) and at the whole 2,048-token
cache (what a dense cache reads every step), as roofline and modeled (aot/fixed_costs.py). Projections, not
measurements; where they differ from the published figure by more than 1.5x the output says what the model
leaves out.
"""
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from astarpo_jax.aot import chips, compiling, fixed_costs, layouts  # noqa: E402
from astarpo_jax.aot.run_shape import RunShape  # noqa: E402
from astarpo_jax.model import hf  # noqa: E402

# meta-llama/Meta-Llama-3-8B config.json (public): the fields this project's ModelConfig reads.
LLAMA3_8B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 128256, "rope_theta": 500000.0, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
             "tie_word_embeddings": False, "hidden_act": "silu"}
PUBLISHED = dict(tokens_per_s=8249.0, slots=128, source="https://github.com/AI-Hypercomputer/jetstream-pytorch/blob/"
                 "main/benchmarks/summary.md (2024-04-24, Llama 3 8B, TPU v5e-8, bf16, batch 128, cache 2048)")
LIVE = (400, 2048)  # a ShareGPT-like context a row; the whole cache


def main() -> None:
  cfg = hf.config_from_hf(LLAMA3_8B, dtype="bfloat16", param_dtype="bfloat16")
  spec, devices = chips.slice_spec("v5e-8"), chips.topology_devices("v5e-8")
  mesh = layouts.abstract_mesh_devices(devices, (1, 8, 1))
  sample = layouts.abstract_mesh_devices(devices, (1, 1, 8))
  run = RunShape(prompt_len=1024, response_len=1024, rollout_batch=128, micro_batch=8, sample_batch=128)
  settings = {"name": "astarpo", "logp_chunk": 256}
  res = compiling.compile_phase("rollout_decode", cfg, run, mesh, settings, sample_mesh=sample)
  if res.error:
    raise SystemExit(f"did not compile: {res.error}")
  fixed = fixed_costs.from_dict(res.fixed)
  kernel = compiling.kernel_of(res)
  cols = -(-(run.prompt_len + run.response_len - 1) // res.page_size) if res.page_size else 0
  published_ms = 1e3 * PUBLISHED["slots"] / PUBLISHED["tokens_per_s"]
  print(f"Llama-3-8B ({cfg.num_params / 1e9:.2f}B) on v5e-8, sampling mesh (1, 1, 8), 128 slots, compiled in "
        f"{res.compile_s:.0f} s, peak {res.peak / 2**30:.1f} GiB a chip; collectives a step {res.fixed['collectives']}")
  print(f"published: {PUBLISHED['tokens_per_s']:.0f} tokens/s = {published_ms:.1f} ms a 128-row step "
        f"({PUBLISHED['source']})\n")
  print("| live tokens a row | roofline ms | modeled ms | exposed collectives ms | kernel waits ms | tokens/s "
        "(roofline / modeled) | published / modeled |")
  print("|---:|---:|---:|---:|---:|---:|---:|")
  for n in LIVE:
    cost = compiling.decode_step_at(res, cfg, run, n, res.page_size) if res.page_size else res.cost
    kb = compiling.paged_kernel_bytes(cfg, run.sample_batch, res.mesh_shape, res.page_size, n, kernel=kernel) \
        if res.page_size else 0.0
    waits = fixed_costs.pallas_dma_waits(cfg, run.sample_batch, n, res.mesh_shape, res.page_size, cols, spec.chip) \
        if kernel == "pallas" else 0.0
    m = fixed_costs.modeled_step(cost, fixed, spec.chip, kb, waits)
    roof = res.times(spec.chip, cost)["projected_s"]
    print(f"| {n} | {roof * 1e3:.2f} | {m['modeled_s'] * 1e3:.2f} | {m['exposed_collective_s'] * 1e3:.2f} | "
          f"{waits * 1e3:.2f} | {128 / roof:.0f} / {128 / m['modeled_s']:.0f} | "
          f"{published_ms / (m['modeled_s'] * 1e3):.2f}x |")
  print("\nA served figure includes what a decode step does not: each request's prefill (up to 1,024 prompt tokens, "
        "interleaved with the decode), slots idle between requests, detokenization and the server's host loop; "
        "JetStream-PyTorch (torch_xla, 2024) read its dense 2,048-column cache every step.")


if __name__ == "__main__":
  main()
