"""Every method's whole run projected from compiled phases: A*-PO against GRPO, RLOO, PPO and REBEL.

The paper's claim (arXiv 2505.20686) is a ratio of training times: A*-PO draws one response per prompt
(after a Stage 1 of N per prompt, once), GRPO a group of G per prompt at every step. What a group costs
depends on how the rollout is batched, so each method's rollout is projected twice:
  - at the config's decode slots (256 on the accelerators): G x 256 rows through 256 slots, a finished
    slot refilled at the next step (the engine's continuous batching);
  - with as many slots as fit (`wide`): every row of the rollout in its own slot, as a server batches them,
    up to the largest slot count whose decode compiles within the chip's memory.
Each decode step's cost is the compiled paged decode at that slot count, its kernel's bytes following the
live tokens of that step (`paged_step`); response lengths come from projection's length mix, scheduled as the
engine schedules them (`projection.simulate_continuous` at the engine's `min_free`).

Every figure is a range of two projections, neither a measurement: the roofline of the compiled programs
(perfect overlap, no fixed costs: the lower edge) and the modeled time (`Plan.modeled`): each call's fixed
costs read from its compile (`fixed_costs`: Pallas grid steps, collectives the schedule can not hide, GPU
launches), the host round trips of every sampling call, and what a whole run does besides steps: grading
every response, evaluation and checkpoint saves.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

import numpy as np

from astarpo_jax import methods
from astarpo_jax.aot import compiling, fixed_costs, memory_plan, projection
from astarpo_jax.aot.chips import ChipSpec
from astarpo_jax.aot.projection import PROMPT_TOKENS
from astarpo_jax.aot.memory_plan import RunShape
from astarpo_jax.model import paged_attention
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.sampling import decode_plan

METHODS = ("astarpo", "grpo", "rloo", "ppo", "rebel")
PAPER_RATIO_4XH100 = (0.46, 0.55)  # A*-PO / GRPO training time, the paper's table (as issue 37 quotes it)


@dataclasses.dataclass(frozen=True)
class MethodShape:
  """What one method's run adds to the phases every method shares."""
  name: str
  rows_per_prompt: int  # G responses per prompt per rollout
  reference: bool  # scores π_ref once per rollout
  critic: bool  # PPO: the critic's value forward once per rollout (its update is in the method's update)
  stage1: bool  # A*-PO: N samples per prompt from π_ref, once, before training
  # π's own fixed-score calls per rollout, each costed as π_ref's `reference` call (same model and rows): -1 every
  # call of the rollout (old log-probs from the training forward), n > 0 the first n (A*-PO's mismatch metric)
  policy_calls: int = 0


def method_shape(name: str, settings: Mapping | None = None) -> MethodShape:
  """The shape of `name`'s run under its settings (the config's algo section)."""
  m = methods.get(name, dict(settings or {}, name=name))
  fp = m.footprint()
  policy = -1 if "policy" in fp.scored else getattr(m.config, "mismatch_blocks", 0)
  return MethodShape(name, m.responses_per_prompt(), "reference" in fp.scored, fp.critic, name == "astarpo", policy)


def paged_step(res, cfg: ModelConfig, chip: ChipSpec, slots: int, page_size: int,
               modeled: bool = False) -> Callable[[int, int], float]:
  """(active slots, live tokens over them) -> seconds of one step of the compiled decode `res` at `slots` slots:
  its roofline, or with `modeled` its modeled time (`fixed_costs.modeled_step` over the compile's fixed costs).
  Paged with the attention kernel: the step as compiled with the kernel's bytes replaced by the pages that step
  reads (the live tokens, and half a block per active slot for its partial last page or block), per device.
  Otherwise (the dense layout, or XLA's gather): the step as compiled at the full cache, whatever is live."""
  fixed = fixed_costs.from_dict(res.fixed) if modeled and res.fixed else None

  def seconds(cost: dict, kernel_bytes: float, waits: float = 0.0) -> float:
    if fixed is None:
      return res.times(chip, cost)["projected_s"]
    return fixed_costs.modeled_step(cost, fixed, chip, kernel_bytes, waits)["modeled_s"]

  if not page_size:
    full = seconds(res.cost, 0.0)
    return lambda active, live_tokens: full
  d, f, t = res.mesh_shape
  tt = t if cfg.num_kv_heads % t == 0 else 1
  per_token = memory_plan.kv_bytes_per_token(cfg, cfg.num_kv_heads // tt) / (d * f)
  base = compiling.decode_step_at(res, cfg, None, 0, page_size)
  kernel = compiling.kernel_of(res)
  base_kernel = compiling.paged_kernel_bytes(cfg, slots, res.mesh_shape, page_size, 0, kernel=kernel)
  block = page_size * (paged_attention.gpu_pages_per_block(page_size) if kernel == "triton" else 1)

  cols = -(-max(res.segments or [page_size]) // page_size)  # the page table's columns (the last live length)

  def step(active: int, live_tokens: int) -> float:
    live = (live_tokens + active * block / 2) * per_token
    waits = (fixed_costs.pallas_dma_waits(cfg, active, live_tokens / max(active, 1), res.mesh_shape, page_size,
                                          cols, chip) if fixed is not None and kernel == "pallas" and active else 0.0)
    return seconds(dict(base, hbm_bytes=base["hbm_bytes"] - base_kernel + live), live, waits)
  return step


def rollout_seconds(step_s, rows: int, slots: int, cap: int, seed: int, prompt_tokens: int = PROMPT_TOKENS,
                    min_free: int = 1) -> dict:
  """One sampling call of `rows` rows through `slots` slots (continuous batching, lengths unknown to the
  scheduler, a segment returning to the host once `min_free` slots are free): seconds, steps and host trips."""
  lengths = projection.sample_lengths(cap, rows, seed=seed)
  sim = projection.simulate_continuous(lengths, slots, step_s, prompt_tokens, min_free)
  return {"seconds": sim["seconds"], "steps": sim["steps"], "trips": sim["trips"], "useful_per_s": sim["useful_per_s"]}


@dataclasses.dataclass(frozen=True)
class Plan:
  """The official MATH run (scripts/apo_math.sh of the official code) and how a projection samples it."""
  num_prompts: int = 7500
  epochs: int = 25
  n_samples: int = 8  # Stage 1's N
  stage1_chunks: int = 4  # Stage-1 calls simulated (the rest take their mean)
  rollouts: int = 3  # Stage-2 rollouts simulated per method and slot count (their mean)
  modeled: bool = False  # False: the roofline (the lower edge); True: the modeled time (fixed costs counted)
  min_free: int = 0  # the engine's min_free (0: decode_plan.default_min_free of the slots)
  multi_host: bool = False  # a pod: every host round trip syncs every host (fixed_costs.HOST_TRIP_S)
  # Grading: responses/s of the reward pool, docs/rewards.md (RewardPool, 2 workers, this project's 2-core
  # development machine, math_verify): measured there; a TPU VM's host has more cores (an upper bound on time).
  grade_per_s: float = 300.0
  eval_every: int = 50  # configs/base.py train.eval_every: MATH500 (500 prompts, greedy) at each
  eval_rows: int = 500
  checkpoint_every: int = 50  # configs/base.py train.checkpoint_every
  # A checkpoint's write (fp32 params and Adam's two moments: 12 bytes a parameter) at 1 GB/s to a bucket or
  # disk per host, not overlapped with training: an assumption, not measured.
  checkpoint_bytes_per_s: float = 1e9


def phase_seconds(results: Mapping, chip: ChipSpec, modeled: bool = False) -> dict[str, float]:
  """{phase: seconds per call} of the compiled phases that are not decode segments: the roofline, or the
  modeled time (the compile's exposed collectives and launches beside its compute and HBM time)."""
  def one(r) -> float:
    if modeled and r.fixed:
      return fixed_costs.modeled_step(r.cost, fixed_costs.from_dict(r.fixed), chip)["modeled_s"]
    return r.times(chip)["projected_s"]
  return {name: one(r) for name, r in results.items() if r.cost and not r.segments}


def sampling_call(step, rows: int, slots: int, run: RunShape, plan: Plan, seeds) -> dict:
  """Mean decode seconds and host trips of sampling calls of `rows` rows (one simulation per seed); modeled,
  the trips' time is in the seconds."""
  min_free = (plan.min_free or decode_plan.default_min_free(slots)) if plan.modeled else 1
  sims = [rollout_seconds(step, rows, min(slots, rows), run.response_len, s, min_free=min_free) for s in seeds]
  trips = float(np.mean([x["trips"] for x in sims]))
  host = fixed_costs.host_seconds(trips, plan.multi_host) if plan.modeled else 0.0
  return {"decode_s": float(np.mean([x["seconds"] for x in sims])) + host, "trips": trips, "host_s": host}


def stage1_hours(results: Mapping, cfg: ModelConfig, chip: ChipSpec, run: RunShape, plan: Plan = Plan(),
                 wide: tuple[int, object] | None = None) -> dict:
  """Stage 1: num_prompts x N rows from π_ref, `run.stage1_prompts` prompts per sampler call through
  `run.stage1_rows` slots, each call preceded by the copy onto the sampling mesh and its prompts' prefill.
  `wide`: (slots, compiled decode) to decode through instead (the rollout's decode at more slots: the same
  program on the same bf16 copy, its pool sized for a rollout's prompts)."""
  t = phase_seconds(results, chip, plan.modeled)
  slots, dec = wide or (run.stage1_rows, results["stage1_decode"])
  step = paged_step(dec, cfg, chip, slots, dec.page_size, plan.modeled)
  prompts = run.stage1_prompts or run.rollout_batch
  rows = prompts * plan.n_samples
  call = sampling_call(step, rows, slots, run, plan, range(plan.stage1_chunks))
  prefill = t["stage1_prefill"] * prompts / run.stage1_rows  # compiled for stage1_rows prompts; linear in them
  grade = rows / plan.grade_per_s if plan.modeled else 0.0
  calls = math.ceil(plan.num_prompts / prompts)
  call_s = call["decode_s"] + prefill + t.get("stage1_reshard", 0.0) + grade
  return {"stage1_call_s": call_s, "stage1_calls": calls, "stage1_trips": calls * call["trips"],
          "stage1_host_share": call["host_s"] / call_s, "stage1_h": calls * call_s / 3600}


def stage2_step(results: Mapping, cfg: ModelConfig, chip: ChipSpec, run: RunShape, m: MethodShape,
                decode: Mapping[int, object], scored_rows: int, plan: Plan = Plan()) -> dict[int, dict]:
  """One Stage-2 step of method `m` per slot count in `decode` ({slots: compiled rollout_decode at that many
  slots}): the copy onto the sampling mesh, the prompts' prefill, the decode of rollout_batch x G rows, π_ref's,
  π's own (`m.policy_calls`, old log-probs; at `reference`'s time, a lower edge for an fp32 policy's gathers) and
  the critic's scoring forwards (`reference` / `ppo_values`, compiled at `scored_rows` rows a call) and
  rollout_batch / mini_batch optimizer steps (the method's own `{name}_update`, compiled at its config's
  micro-batch)."""
  t = phase_seconds(results, chip, plan.modeled)
  rows = run.rollout_batch * m.rows_per_prompt
  scoring_calls = math.ceil(rows / scored_rows)
  fixed = {"copy_s": t.get("rollout_reshard", 0.0), "grade_s": rows / plan.grade_per_s if plan.modeled else 0.0,
           "prefill_s": t["rollout_prefill"] * run.rollout_batch / run.sample_batch,
           "reference_s": scoring_calls * t["reference"] if m.reference else 0.0,
           "values_s": scoring_calls * t["ppo_values"] if m.critic else 0.0,
           "old_logp_s": (scoring_calls if m.policy_calls < 0 else min(m.policy_calls, scoring_calls)) * t["reference"],
           "update_s": run.rollout_batch // (run.mini_batch or run.micro_batch) * t[f"{m.name}_update"]}
  out = {}
  for slots, dec in sorted(decode.items()):
    step = paged_step(dec, cfg, chip, slots, dec.page_size, plan.modeled)
    call = sampling_call(step, rows, slots, run, plan, [100 + s for s in range(plan.rollouts)])
    row = dict(fixed, slots=min(slots, rows), decode_s=call["decode_s"], trips=call["trips"], host_s=call["host_s"])
    row["rollout_s"] = row["copy_s"] + row["prefill_s"] + row["decode_s"]
    row["step_s"] = (row["rollout_s"] + row["grade_s"] + row["reference_s"] + row["old_logp_s"] + row["values_s"]
                     + row["update_s"])
    row["rollout_share"] = row["rollout_s"] / row["step_s"]
    out[slots] = row
  return out


def run_besides_steps(results: Mapping, cfg: ModelConfig, chip: ChipSpec, run: RunShape, dec, steps: int,
                      plan: Plan) -> float:
  """Hours a run spends besides its Stage-2 steps and Stage 1, the same for every method (modeled only): an
  evaluation every `eval_every` steps (MATH500's rows through the rollout's decode at the config's slots, graded
  by the two eval graders) and a checkpoint save every `checkpoint_every` steps."""
  if not plan.modeled:
    return 0.0
  slots = run.sample_batch
  step = paged_step(dec, cfg, chip, slots, dec.page_size, True)
  prefill = phase_seconds(results, chip, True)["rollout_prefill"] * plan.eval_rows / slots
  evaluation = (sampling_call(step, plan.eval_rows, slots, run, plan, [7])["decode_s"] + prefill
                + 2 * plan.eval_rows / plan.grade_per_s)
  save = 12 * cfg.num_params / plan.checkpoint_bytes_per_s
  return (steps // plan.eval_every * evaluation + steps // plan.checkpoint_every * save) / 3600


def whole_runs(results: Mapping, cfg: ModelConfig, chip: ChipSpec, runs: Mapping[str, RunShape],
               shapes: Mapping[str, MethodShape], decode: Mapping[int, object], plan: Plan = Plan()) -> list[dict]:
  """A row per (method, slot setting): "config" (the config's slots) and "wide" (the largest compiled slot
  count up to the call's rows, Stage 1's calls included), hours of Stage 1, Stage 2 and besides, and the ratio
  to GRPO's at the same setting; at the roofline or modeled (`plan.modeled`: call it once each for the range).
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
  besides = run_besides_steps(results, cfg, chip, base, decode[config_slots], steps, plan)
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
      stage2 = steps * step["step_s"] / 3600
      s1_fields = {k: s1[setting][k] if m.stage1 else 0.0 for k in ("stage1_trips", "stage1_host_share")}
      rows.append(dict(step, **s1_fields, method=name, setting=setting, rows=need, stage1_h=stage1, stage2_steps=steps,
                       stage2_h=stage2, besides_h=besides, total_h=stage1 + stage2 + besides,
                       edge="modeled" if plan.modeled else "roofline"))
  for r in rows:
    grpo = next((g for g in rows if g["method"] == "grpo" and g["setting"] == r["setting"]), None)
    r["vs_grpo"] = r["total_h"] / grpo["total_h"] if grpo else float("nan")
  return rows
