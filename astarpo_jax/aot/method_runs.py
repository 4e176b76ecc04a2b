"""Every method's whole run projected from compiled phases: A*-PO against GRPO, RLOO, PPO and REBEL.

The paper's claim (arXiv 2505.20686) is a ratio of training times: A*-PO draws one response per prompt
(after a Stage 1 of N per prompt, once), GRPO a group of G per prompt at every step. What a group costs
depends on how the rollout is batched, so each method's rollout is projected twice:
  - at the config's decode slots (256 on the accelerators): G x 256 rows through 256 slots, a finished
    slot refilled at the next step (the engine's continuous batching);
  - with as many slots as fit (`wide`): every row of the rollout in its own slot, as a server batches them,
    up to the largest slot count whose decode compiles within the chip's memory.
Each decode step's cost is the compiled paged decode at that slot count, its kernel's bytes following the
live tokens of that step (`paged_step`); response lengths come from projection's length mix. Every figure
is a projection (roofline of the compiled programs, perfect overlap), not a measurement.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

import numpy as np

from astarpo_jax import methods
from astarpo_jax.aot import compiling, memory_plan, projection
from astarpo_jax.aot.chips import ChipSpec
from astarpo_jax.aot.memory_plan import RunShape
from astarpo_jax.model import paged_attention
from astarpo_jax.model.config import ModelConfig

METHODS = ("astarpo", "grpo", "rloo", "ppo", "rebel")
# A prompt's tokens in the chat template (MATH, Qwen2.5): the bucket is 256, the live prompt ~200.
PROMPT_TOKENS = 200
PAPER_RATIO_4XH100 = (0.46, 0.55)  # A*-PO / GRPO training time, the paper's table (as issue 37 quotes it)


@dataclasses.dataclass(frozen=True)
class MethodShape:
  """What one method's run adds to the phases every method shares."""
  name: str
  rows_per_prompt: int  # G responses per prompt per rollout
  reference: bool  # scores π_ref once per rollout
  critic: bool  # PPO: the critic's value forward once per rollout (its update is in the method's update)
  stage1: bool  # A*-PO: N samples per prompt from π_ref, once, before training


def method_shape(name: str, settings: Mapping | None = None) -> MethodShape:
  """The shape of `name`'s run under its settings (the config's algo section)."""
  m = methods.get(name, dict(settings or {}, name=name))
  fp = m.footprint()
  return MethodShape(name, m.responses_per_prompt(), "reference" in fp.scored, fp.critic, name == "astarpo")


def paged_step(res, cfg: ModelConfig, chip: ChipSpec, slots: int, page_size: int) -> Callable[[int, int], float]:
  """(active slots, live tokens over them) -> seconds of one step of the compiled decode `res` at `slots` slots.
  Paged with the attention kernel: the step as compiled with the kernel's bytes replaced by the pages that step
  reads (the live tokens, and half a block per active slot for its partial last page or block), per device.
  Otherwise (the dense layout, or XLA's gather): the step as compiled at the full cache, whatever is live."""
  if not page_size:
    full = res.times(chip)["projected_s"]
    return lambda active, live_tokens: full
  d, f, t = res.mesh_shape
  tt = t if cfg.num_kv_heads % t == 0 else 1
  per_token = memory_plan.kv_bytes_per_token(cfg, cfg.num_kv_heads // tt) / (d * f)
  base = compiling.decode_step_at(res, cfg, None, 0, page_size)
  kernel = compiling.kernel_of(res)
  base_kernel = compiling.paged_kernel_bytes(cfg, slots, res.mesh_shape, page_size, 0, kernel=kernel)
  block = page_size * (paged_attention.gpu_pages_per_block(page_size) if kernel == "triton" else 1)

  def step(active: int, live_tokens: int) -> float:
    cost = dict(base, hbm_bytes=base["hbm_bytes"] - base_kernel + (live_tokens + active * block / 2) * per_token)
    return res.times(chip, cost)["projected_s"]
  return step


def floored(step_s, floor_s: float):
  """`step_s` with no step faster than `floor_s` (Plan.step_floor_s)."""
  return step_s if floor_s <= 0 else (lambda active, live_tokens: max(floor_s, step_s(active, live_tokens)))


def rollout_seconds(step_s, rows: int, slots: int, cap: int, seed: int, prompt_tokens: int = PROMPT_TOKENS) -> dict:
  """One sampling call of `rows` rows through `slots` slots (continuous batching, lengths unknown to the
  scheduler): seconds of its decode and the share spent after its first row ended (the tail)."""
  lengths = projection.sample_lengths(cap, rows, seed=seed)
  sim = projection.simulate_continuous(lengths, slots, step_s, prompt_tokens)
  return {"seconds": sim["seconds"], "steps": sim["steps"], "useful_per_s": sim["useful_per_s"]}


@dataclasses.dataclass(frozen=True)
class Plan:
  """The official MATH run (scripts/apo_math.sh of the official code) and how a projection samples it."""
  num_prompts: int = 7500
  epochs: int = 25
  n_samples: int = 8  # Stage 1's N
  stage1_chunks: int = 4  # Stage-1 calls simulated (the rest take their mean)
  rollouts: int = 3  # Stage-2 rollouts simulated per method and slot count (their mean)
  # A floor under every decode step's time (s): the launch, sampling and host time a real engine pays per step
  # whatever its batch, which a roofline leaves out. 0 = the roofline alone.
  step_floor_s: float = 0.0


def phase_seconds(results: Mapping, chip: ChipSpec) -> dict[str, float]:
  """{phase: projected seconds per call} of the compiled phases that are not decode segments."""
  return {name: r.times(chip)["projected_s"] for name, r in results.items() if r.cost and not r.segments}


def stage1_hours(results: Mapping, cfg: ModelConfig, chip: ChipSpec, run: RunShape, plan: Plan = Plan(),
                 wide: tuple[int, object] | None = None) -> dict:
  """Stage 1: num_prompts x N rows from π_ref, `run.stage1_prompts` prompts per sampler call through
  `run.stage1_rows` slots, each call preceded by the copy onto the sampling mesh and its prompts' prefill.
  `wide`: (slots, compiled decode) to decode through instead (the rollout's decode at more slots: the same
  program on the same bf16 copy, its pool sized for a rollout's prompts)."""
  t = phase_seconds(results, chip)
  slots, dec = wide or (run.stage1_rows, results["stage1_decode"])
  step = floored(paged_step(dec, cfg, chip, slots, dec.page_size), plan.step_floor_s)
  prompts = run.stage1_prompts or run.rollout_batch
  rows = prompts * plan.n_samples
  decode = np.mean([rollout_seconds(step, rows, min(slots, rows), run.response_len, seed)["seconds"]
                    for seed in range(plan.stage1_chunks)])
  prefill = t["stage1_prefill"] * prompts / run.stage1_rows  # compiled for stage1_rows prompts; linear in them
  calls = math.ceil(plan.num_prompts / prompts)
  return {"stage1_call_s": decode + prefill + t.get("stage1_reshard", 0.0), "stage1_calls": calls,
          "stage1_h": calls * (decode + prefill + t.get("stage1_reshard", 0.0)) / 3600}


def stage2_step(results: Mapping, cfg: ModelConfig, chip: ChipSpec, run: RunShape, m: MethodShape,
                decode: Mapping[int, object], scored_rows: int, plan: Plan = Plan()) -> dict[int, dict]:
  """One Stage-2 step of method `m` per slot count in `decode` ({slots: compiled rollout_decode at that many
  slots}): the copy onto the sampling mesh, the prompts' prefill, the decode of rollout_batch x G rows, π_ref's
  and the critic's scoring forwards (`reference` / `ppo_values`, compiled at `scored_rows` rows a call) and
  rollout_batch / mini_batch optimizer steps (the method's own `{name}_update`, compiled at its config's
  micro-batch)."""
  t = phase_seconds(results, chip)
  rows = run.rollout_batch * m.rows_per_prompt
  scoring_calls = math.ceil(rows / scored_rows)
  fixed = {"copy_s": t.get("rollout_reshard", 0.0),
           "prefill_s": t["rollout_prefill"] * run.rollout_batch / run.sample_batch,
           "reference_s": scoring_calls * t["reference"] if m.reference else 0.0,
           "values_s": scoring_calls * t["ppo_values"] if m.critic else 0.0,
           "update_s": run.rollout_batch // (run.mini_batch or run.micro_batch) * t[f"{m.name}_update"]}
  out = {}
  for slots, dec in sorted(decode.items()):
    step = floored(paged_step(dec, cfg, chip, slots, dec.page_size), plan.step_floor_s)
    sims = [rollout_seconds(step, rows, min(slots, rows), run.response_len, 100 + s) for s in range(plan.rollouts)]
    row = dict(fixed, slots=min(slots, rows), decode_s=float(np.mean([s["seconds"] for s in sims])))
    row["rollout_s"] = row["copy_s"] + row["prefill_s"] + row["decode_s"]
    row["step_s"] = row["rollout_s"] + row["reference_s"] + row["values_s"] + row["update_s"]
    row["rollout_share"] = row["rollout_s"] / row["step_s"]
    out[slots] = row
  return out


def whole_runs(results: Mapping, cfg: ModelConfig, chip: ChipSpec, runs: Mapping[str, RunShape],
               shapes: Mapping[str, MethodShape], decode: Mapping[int, object], plan: Plan = Plan()) -> list[dict]:
  """A row per (method, slot setting): "config" (the config's slots) and "wide" (the largest compiled slot
  count up to the call's rows, Stage 1's calls included), hours of Stage 1 and Stage 2, and the ratio to GRPO's
  at the same setting.
  `runs`: each method's RunShape (its update's micro-batch), "astarpo"'s the one the shared phases were compiled
  at (the scoring forwards' rows); `decode`: {slots: compiled rollout_decode}."""
  base = runs["astarpo"]
  steps = plan.epochs * (plan.num_prompts // base.rollout_batch)
  s1_rows = (base.stage1_prompts or base.rollout_batch) * plan.n_samples
  s1_wide = max([s for s in decode if s <= s1_rows] or [0])
  s1 = {"config": stage1_hours(results, cfg, chip, base, plan),
        "wide": stage1_hours(results, cfg, chip, base, plan, (s1_wide, decode[s1_wide]))
        if s1_wide > base.stage1_rows else None}
  s1["wide"] = s1["wide"] or s1["config"]
  config_slots = base.sample_batch
  rows = []
  for name, m in shapes.items():
    run = runs[name]
    need = run.rollout_batch * m.rows_per_prompt
    fitting = [s for s in decode if s <= need] or [min(decode)]
    chosen = {"config": config_slots, "wide": max(fitting)}
    per_slots = stage2_step(results, cfg, chip, run, m, {s: decode[s] for s in set(chosen.values())},
                            runs["astarpo"].reference_rows, plan)
    for setting, slots in chosen.items():
      step = per_slots[slots]
      stage1 = s1[setting]["stage1_h"] if m.stage1 else 0.0
      rows.append(dict(step, method=name, setting=setting, rows=need, stage1_h=stage1, stage2_steps=steps,
                       stage2_h=steps * step["step_s"] / 3600, total_h=stage1 + steps * step["step_s"] / 3600))
  for r in rows:
    grpo = next((g for g in rows if g["method"] == "grpo" and g["setting"] == r["setting"]), None)
    r["vs_grpo"] = r["total_h"] / grpo["total_h"] if grpo else float("nan")
  return rows
