"""The host side of a sampling run: which decode programs it steps through (slot counts, attention windows),
which KV cache layout each backend gets, and what the run did (RunStats).

Host-only arithmetic (no device arrays), shared by the engine that runs the schedule and by the AOT projections
that cost it (aot/projection.py, aot/compiling.py)."""
from __future__ import annotations

import dataclasses

import jax


def attention_windows(P: int, T: int, step: int | None) -> list[int]:
  """The cache column counts a decode segment may attend over: P + step, P + 2 step, ... and the whole
  cache P + T - 1 (one segment program per window; step None or >= T: the whole cache only)."""
  S = P + T - 1
  if step is None or step >= T:
    return [S]
  if step < 1:
    raise ValueError(f"window_step={step}: must be >= 1 (or None for the whole cache)")
  return list(range(P + step, S, step)) + [S]


def pick_window(windows: list[int], P: int, max_step: int, headroom: int) -> int:
  """The smallest window that lets the furthest slot (`max_step` tokens generated) run `headroom` more
  steps (its next column is P + max_step - 1), else the whole cache."""
  need = P + max_step - 1 + headroom
  return next((w for w in windows if w >= need), windows[-1])


def window_headroom(windows: list[int]) -> int:
  """Steps a newly picked window must leave the furthest slot: half the window step, 1..64."""
  return max(1, min(64, (windows[1] - windows[0]) // 2)) if len(windows) > 1 else 1


def default_window_step(T: int, backend: str | None = None) -> int | None:
  """Window granularity: eighths of the response cap, rounded up to 64 columns (at most 8 windows, so
  at most 8 segment programs per slot count), on the CPU, where it is measured faster (docs/sampler.md).
  None (the whole cache) on TPU/GPU: compiled there, the sliced read costs more HBM traffic on TPU, not
  less (Qwen2.5-7B v5p-8: 56.4 GB per step at 384 columns vs 47.3 GB whole), and saves 6-12% on the GPU
  where the step is bound by the interconnect anyway (compiled before the paged decode: docs/tpu.md's history)."""
  if (backend or jax.default_backend()) != "cpu":
    return None
  return max(64, -(-T // 8 // 64) * 64)


def slot_ladder(slots: int, min_slots: int = 8, ways: int = 1) -> list[int]:
  """The slot counts a run steps down through: `slots`, then halves while they stay >= `min_slots`
  and multiples of `ways` (the mesh's batch shards)."""
  ladder = [slots]
  while ladder[-1] // 2 >= min_slots and (ladder[-1] // 2) % ways == 0 and ladder[-1] % 2 == 0:
    ladder.append(ladder[-1] // 2)
  return ladder


@dataclasses.dataclass
class RunStats:
  """What a run did: host round trips and compactions (for benchmarks and tests)."""
  prefill_calls: int = 0
  prefill_rows: int = 0  # prompts run through prefill (chunk padding included)
  prefill_seconds: float = 0.0
  segments: int = 0
  compactions: list = dataclasses.field(default_factory=list)  # slot counts stepped down to
  windows: dict = dataclasses.field(default_factory=dict)  # attention window -> segments run with it
  # per segment (slots, window, decode steps, seconds from its refill's dispatch to its flags on the host):
  # the host waits for the flags anyway, so this costs no extra synchronisation
  segment_log: list = dataclasses.field(default_factory=list)
  pages_returned: int = -1  # paged: free pages on the stack after the call (all of the slots' pages)


def default_layout(backend: str | None = None) -> str:
  """The KV cache layout per backend: dense on the CPU (fused weights, attention windows: measured faster
  there, docs/sampler.md), paged on TPU and GPU (each row's live pages only: docs/tpu.md)."""
  return "dense" if (backend or jax.default_backend()) == "cpu" else "paged"


# On the CPU a decode of at most this many new tokens keeps one slot count (`default_min_slots`): each rung below is
# a segment, refill and compaction program to compile (the demo's 2-layer decode: ~1 CPU s each, three rungs per
# sampling mode) for a tail of under T steps that it runs on fewer slots (milliseconds on the CPU).
CPU_ONE_RUNG_MAX_NEW_TOKENS = 64


def default_min_slots(slots: int, max_new_tokens: int, backend: str | None = None) -> int:
  """The ladder's smallest rung when the caller names none: 8 slots, or on the CPU with a short decode (at most
  CPU_ONE_RUNG_MAX_NEW_TOKENS) `slots` itself, one rung. Accelerators always keep the ladder."""
  if (backend or jax.default_backend()) == "cpu" and max_new_tokens <= CPU_ONE_RUNG_MAX_NEW_TOKENS:
    return slots
  return 8


def default_min_free(slots: int) -> int:
  """Free slots a segment waits for before returning to the host while rows are pending: 1/32 of the slots.
  A return is a host round trip (on a pod, every host's); waiting for k free slots idles k/2 on average. For S
  slots, c rows ending a step, steps of t_s and trips of t_h the sum t_h c / (k t_s) + k / (2 S) is least at
  k = sqrt(2 S c t_h / t_s): ~6-8 at 256 slots of Stage 1's mix (experiments/simulate_decode.py)."""
  return max(1, slots // 32)
