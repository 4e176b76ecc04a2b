"""Projected wall time of a run from its compiled phases (`aot.PhaseResult`): projections, not measurements;
and the analytic FLOPs a phase needs (`useful_flops`, the numerator of MFU; benches use `forward_flops`).

Each phase's time is its roofline time on the chip (see `aot.PhaseResult.times`). Decode runs
until the longest row of a batch stops (or the cap); each step reads the engine's attention window
(`decode_plan.attention_windows` / `decode_plan.pick_window`: the columns the furthest row needs; on TPU/GPU the
default is the whole cache, `decode_plan.default_window_step`), and a step's cost is interpolated linearly in
the window between the compiled segments (its smallest and its largest window: the KV read grows linearly with it, the weights
do not). Response lengths follow the issue's stated rollout mix: lognormal with median 0.3 x cap and
sigma 0.8, clipped to [8, cap].

A Stage-2 step (one rollout) = sampling the rollout (with a sampling mesh, after copying the params onto
it) + the reference forward in micro-batches + the optimizer steps; Stage 1 = prompts x N samples in
chunks; a full run = Stage 1 + epochs x (prompts // rollout) Stage-2 steps (the official trainer drops the
last incomplete batch).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from astarpo_jax.aot.chips import ChipSpec
from astarpo_jax.aot.memory_plan import RunShape
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.sampling import decode_plan

MEDIAN_FRACTION, SIGMA, MIN_LEN = 0.3, 0.8, 8

# The paper's A*-PO training time on 4 x H100 (arXiv 2505.20686), hours.
PAPER_HOURS_4XH100 = {"Qwen/Qwen2.5-1.5B": 6.92, "Qwen/Qwen2.5-3B": 8.78, "Qwen/Qwen2.5-7B": 11.01}


# ----------------------------------------------------------------------------- useful FLOPs (analytic)


def layer_matmul_params(cfg: ModelConfig) -> int:
  """Weights of the layers' matmuls (q, k, v, o, gate, up, down), all layers."""
  D, F, N, K, H = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  return cfg.num_layers * (D * (N + 2 * K) * H + N * H * D + 3 * D * F)


def forward_flops(cfg: ModelConfig, tokens: int, attended_pairs: float, head_positions: int) -> float:
  """Matmul FLOPs of one forward: 2 per weight per token, 4*N*H per attended (query, key) pair per
  layer (QK^T and PV), 2*D*V per position whose logits are formed. Norms, rotary and softmax excluded."""
  attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * attended_pairs
  return 2 * layer_matmul_params(cfg) * tokens + attn + 2 * cfg.hidden_size * cfg.vocab_size * head_positions


def causal_pairs(n: int) -> float:
  """(query, key) pairs of causal attention over n positions."""
  return n * (n + 1) / 2


def useful_flops(phase: str, cfg: ModelConfig, run: RunShape) -> float:
  """FLOPs of a phase's call that the method needs (no recompute, no masked blocks), whole slice;
  for decode phases, of one step over the segment's window. Training = 3x forward (backward = 2x)."""
  P, R, S = run.prompt_len, run.response_len, run.seq_len
  if phase.endswith("reshard"):
    return 0.0
  if phase.endswith("prefill"):
    rows = run.stage1_rows if phase.startswith("stage1") else run.sample_batch
    return rows * forward_flops(cfg, P, causal_pairs(P), 1)
  if phase.endswith("decode") or phase == "rollout_decode_adapter":  # the adapter's dots: not the model's FLOPs
    rows = run.stage1_rows if phase.startswith("stage1") else run.sample_batch
    return rows * forward_flops(cfg, 1, P + (run.decode_len or R) - 1, 1)
  if phase == "reference":
    return run.reference_rows * forward_flops(cfg, S, causal_pairs(S), R)
  per_row = 3 * forward_flops(cfg, S, causal_pairs(S), R)
  if phase == "ppo_update":  # the critic: the same body, a [D] -> 1 head
    per_row += 3 * (forward_flops(cfg, S, causal_pairs(S), 0) + 2 * cfg.hidden_size * R)
  return run.mini_rows * per_row


# A prompt's tokens in the chat template (MATH, Qwen2.5): the bucket is 256, the live prompt ~200.
PROMPT_TOKENS = 200


def live_flops(phase: str, cfg: ModelConfig, run: RunShape) -> float:
  """The useful-token FLOPs of a scoring or update call, whole slice: `useful_flops` counted over live tokens only,
  each row a prompt of PROMPT_TOKENS and a response of the length mix's mean (`mean_length`), no padding and no
  packing slack. 0 for other phases (their live tokens are the decode's own)."""
  if phase != "reference" and not phase.endswith("_update"):
    return 0.0
  R = mean_length(run.response_len)
  T = min(PROMPT_TOKENS, run.prompt_len) + R
  rows = run.reference_rows if phase == "reference" else run.mini_rows
  per_row = forward_flops(cfg, T, causal_pairs(T), R)
  if phase == "reference":
    return rows * per_row
  critic = forward_flops(cfg, T, causal_pairs(T), 0) + 2 * cfg.hidden_size * R if phase == "ppo_update" else 0.0
  return rows * 3 * (per_row + critic)


def length_cdf(t: float, cap: int) -> float:
  """P(length <= t) of the clipped lognormal mix."""
  if t < MIN_LEN:
    return 0.0
  if t >= cap:
    return 1.0
  z = (math.log(t) - math.log(MEDIAN_FRACTION * cap)) / SIGMA
  return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def mean_length(cap: int) -> float:
  return sum(1 - length_cdf(t, cap) for t in range(cap))


def expected_max_length(cap: int, rows: int) -> float:
  """E[longest of `rows` independent lengths]: the steps a batch decodes without continuous batching."""
  return sum(1 - length_cdf(t, cap) ** rows for t in range(cap))


def _interp(segments: dict, slots: float) -> dict:
  (s0, c0), (s1, c1) = sorted(segments.items())[0], sorted(segments.items())[-1]
  w = 0.0 if s1 == s0 else (slots - s0) / (s1 - s0)
  return {k: c0[k] + w * (c1[k] - c0[k]) for k in c0}


def step_seconds(segments: dict, chip: ChipSpec, slots: float) -> float:
  c = _interp(segments, slots)
  return max(c["flops"] / chip.peak_flops, c["hbm_bytes"] / chip.hbm_bandwidth,
             c["collective_bytes"] / chip.ici_bandwidth)


def decode_seconds(segments: dict, chip: ChipSpec, prompt_len: int, cap: int, steps: float,
                   window_step: int | None = None) -> float:
  """Seconds for `steps` decode steps of rows that start together, each step over the window the
  engine holds then: picked for the furthest row, kept until that row's next column leaves it
  (`window_step` None, the TPU/GPU default: the whole cache at every step)."""
  windows = decode_plan.attention_windows(prompt_len, cap, window_step)
  headroom, total, window = decode_plan.window_headroom(windows), 0.0, 0
  for s in range(1, math.ceil(steps) + 1):  # with s tokens drawn (the prefill drew the first), a step
    if prompt_len + s - 1 >= window:  # writes its key at column P + s - 1 and draws token s
      window = decode_plan.pick_window(windows, prompt_len, s, headroom)
    total += min(1.0, steps - (s - 1)) * step_seconds(segments, chip, window)
  return total


@dataclasses.dataclass(frozen=True)
class RunPlan:
  """The official MATH run (scripts/apo_math.sh of the official code): 7,500 prompts, 25 epochs, 256 per rollout."""
  num_prompts: int = 7500
  epochs: int = 25
  n_samples: int = 8


def project(results: dict, chip: ChipSpec, run, plan: RunPlan = RunPlan()) -> dict:
  """Seconds per phase call, per Stage-2 step, Stage-1 and full-run hours, from compiled phases.

  `results`: {phase name: PhaseResult}; `run`: the RunShape they were compiled for.
  """
  out: dict = {}
  t = {name: r.times(chip)["projected_s"] for name, r in results.items() if r.cost and not r.segments}
  cap, P = run.response_len, run.prompt_len

  def sampling(prefix: str, rows: int) -> float | None:
    pre, dec = results.get(prefix + "_prefill"), results.get(prefix + "_decode")
    if pre is None or dec is None or not pre.cost or not dec.segments:
      return None
    steps = expected_max_length(cap, rows) - 1
    out[prefix + "_decode_steps"] = steps
    paged = getattr(dec, "page_size", 0) or None  # paged: the step's cost follows the live tokens
    return t[prefix + "_prefill"] + decode_seconds(dec.segments, chip, P, cap, steps, window_step=paged)

  # With a sampling mesh, each sampling call (a Stage-1 chunk, a rollout) first copies the params onto it.
  stage1_copy, rollout_copy = t.get("stage1_reshard", 0.0), t.get("rollout_reshard", 0.0)

  stage1_call = sampling("stage1", run.stage1_rows)
  rollout_call = sampling("rollout", run.sample_batch)
  out["mean_length"] = mean_length(cap)
  if stage1_call is not None:
    calls = math.ceil(plan.num_prompts * plan.n_samples / run.stage1_rows)
    out["stage1_call_s"], out["stage1_h"] = stage1_call, calls * (stage1_call + stage1_copy) / 3600
  if rollout_call is not None and "reference" in t and "astarpo_update" in t:
    # batches in prompts (x rows_per_prompt for rows), as memory_plan.RunShape
    step = (rollout_copy + math.ceil(run.rollout_batch * run.rows_per_prompt / run.sample_batch) * rollout_call
            + math.ceil(run.rollout_batch / (run.reference_batch or run.micro_batch)) * t["reference"]
            + (run.rollout_batch // (run.mini_batch or run.micro_batch)) * t["astarpo_update"])
    steps = plan.epochs * (plan.num_prompts // run.rollout_batch)
    out.update(rollout_s=rollout_call, step_s=step, stage2_steps=steps, stage2_h=steps * step / 3600)
    if "stage1_h" in out:
      out["total_h"] = out["stage1_h"] + out["stage2_h"]
  return out


def sample_lengths(cap: int, n: int, seed: int = 0) -> np.ndarray:
  """`n` response lengths drawn from the clipped lognormal mix (`length_cdf`), by inverting its cdf."""
  u = np.random.default_rng(seed).uniform(size=n)
  table = np.array([length_cdf(t, cap) for t in range(cap + 1)])
  return np.clip(np.searchsorted(table, u), 1, cap).astype(np.int64)


def simulate_continuous(lengths: np.ndarray, slots: int, step_seconds, prompt_len: int = 0, min_free: int = 1,
                        min_slots: int = 8) -> dict:
  """A decode of rows of `lengths` through `slots` slots, admitted in the given order (the scheduler does not
  know a row's length), as the engine schedules them: a segment decodes until `min_free` slots are done (or
  every slot, with no row pending), the host then refills every free slot; with no row pending it returns when
  the rows left fit in half the slots (the ladder's step down, to `min_slots`). Time from
  `step_seconds(active, live_tokens)` per step. Returns the time, the useful tokens, the host round trips
  (segments) and the fixed-length rate (every slot decoding rows of the mean length back to back, no tail)."""
  pending, live = list(lengths[::-1]), []  # live: [tokens generated so far, length]
  total_s, steps, trips, tokens, B = 0.0, 0, 0, int(lengths.sum()), slots
  while pending or live:
    while pending and len(live) < B:
      live.append([0, int(pending.pop())])
    while not pending and B > min_slots and len(live) <= B // 2:
      B //= 2
    exit_free = min(min_free, len(pending)) if pending else (B + 1 if B <= min_slots else B - B // 2)
    trips += 1
    while live:  # one segment: steps until exit_free of the B slots are done
      total_s += step_seconds(len(live), sum(prompt_len + g for g, _ in live))
      steps += 1
      for row in live:
        row[0] += 1
      live = [r for r in live if r[0] < r[1]]
      if B - len(live) >= exit_free:
        break
  mean = float(lengths.mean())
  fixed_rate = slots / step_seconds(slots, slots * (prompt_len + mean / 2))
  return {"seconds": total_s, "steps": steps, "trips": trips, "tokens": tokens, "useful_per_s": tokens / total_s,
          "fixed_length_per_s": fixed_rate, "share_of_fixed": tokens / total_s / fixed_rate}
