"""What a roofline leaves out of a compiled step, counted from its optimised HLO: the modeled time beside it.

A roofline charges a step max(compute, HBM, interconnect) as if everything overlapped and nothing cost time but
bytes and FLOPs. Read from the compiled program instead:
  - Pallas grid steps: each `tpu_custom_call`'s grid (the Mosaic module's `iteration_bounds`, in its backend
    config) times the loops around it; a grid step costs GRID_STEP_S of pipeline bookkeeping whatever it moves,
    so a kernel takes max(its bytes / HBM bandwidth, grid steps x GRID_STEP_S). A megacore chip (v4, v5p) splits
    a leading "parallel" grid dimension over its two TensorCores.
  - Collectives the schedule can not hide: the HLO is scheduled (instruction order = execution order), so a
    synchronous collective stalls the step for all of its time, and an async one (`*-start` / `*-done`, TPU's
    async collective fusions) for what the independent work scheduled between its start and its done does not
    cover. A collective's time is its bytes over the link bandwidth plus a latency by the size of the replica
    group it runs over (`ChipSpec.collective_latency(group - 1)`), not by the slice's chip count.
  - GPU launches: every kernel a step runs (fusions, library calls, collectives) is a launch, except inside a
    command buffer (XLA:GPU's CUDA-graph `call`s), which launches once; a while loop outside one reads its
    predicate on the host once per trip. (The compile-only H100 decode of 1.5B at jax 0.10.2 shows no
    command-buffer computation in its HLO: 621 launches a step are counted; graphs XLA forms later, at the
    thunk level, would not show here, so this is an upper edge on launches.)
Host round trips (the engine's segments) and whole-run costs are per rollout, not per step: `host_trips`.

Constants are stated assumptions, each with where it comes from; every modeled time is a projection from a
compile, not a measurement.
"""
from __future__ import annotations

import base64
import collections
import dataclasses
import functools
import math
import re

from astarpo_jax.aot import chips, hlo_cost
from astarpo_jax.aot.chips import MEGACORE, ChipSpec
from astarpo_jax.aot.hlo_text import Computation, Instr

# Pallas TPU pipeline overhead per grid step (DMA issue and wait, semaphores, loop bookkeeping): ~0.35 us, as
# docs/tpu.md 0 states it; no public measurement found with this project's search tools: an assumption.
GRID_STEP_S = 0.35e-6
# A kernel launch on a GPU outside a CUDA graph: a few us of host enqueue and launch latency (order of magnitude
# of NVIDIA's CUDA graphs material; not measured here): an assumption. A graph launch costs about as much once.
GPU_LAUNCH_S = 4e-6
# A while loop's predicate read on the host each trip (XLA:GPU outside a command buffer): a device-to-host copy
# and a stream sync, ~10 us: an assumption.
GPU_SYNC_S = 10e-6
# One return to the host between decode segments: read the done flags, decide, dispatch the refill and the next
# segment (Python + PJRT dispatch + a device-to-host copy): ~0.5 ms on one host; a pod's hosts do it in lockstep,
# each decision an implicit sync of every host: ~2 ms. Assumptions, not measured.
HOST_TRIP_S = {"host": 0.5e-3, "pod": 2e-3}

_COLLECTIVE = hlo_cost._COLLECTIVES  # the collective opcodes hlo_cost counts
_NO_KERNEL = hlo_cost._FREE | {"copy-done", "send-done", "recv-done"}


def _kind(ins: Instr) -> str | None:
  return next((k for k in _COLLECTIVE if ins.opcode == k or ins.opcode == k + "-start"), None)


def _target(ins: Instr) -> str:
  m = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
  return m.group(1) if m else ""


@functools.lru_cache(maxsize=256)
def mosaic_grid(body_b64: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
  """(iteration bounds, dimension semantics) of a serialized Mosaic kernel (a tpu_custom_call's "body")."""
  from jax._src.lib import tpu
  from jaxlib.mlir import ir
  with ir.Context() as ctx:
    ctx.allow_unregistered_dialects = True
    tpu.register_dialect(ctx)
    text = str(ir.Module.parse(base64.b64decode(body_b64)))
  bounds = re.search(r"iteration_bounds = array<i64(?::\s*([0-9, ]*))?>", text)
  sem = re.search(r"dimension_semantics = \[([^\]]*)\]", text)
  grid = tuple(int(x) for x in bounds.group(1).split(",")) if bounds and bounds.group(1) else ()
  return grid, tuple(re.findall(r"<(\w+)>", sem.group(1))) if sem else ()


def kernel_grid(ins: Instr) -> tuple[tuple[int, ...], tuple[str, ...]]:
  """The grid of a Pallas TPU custom call, read from the Mosaic module in its backend config; () if none."""
  body = re.search(r'"body":"([^"]*)"', ins.attrs)
  return mosaic_grid(body.group(1)) if body else ((), ())


@dataclasses.dataclass
class StepCosts:
  """Fixed costs of one call of a program (of one decode step, for `per_step`), trip counts included."""
  grid_steps: float = 0.0  # Pallas grid steps, every kernel call
  grid_steps_parallel: float = 0.0  # of those, steps of kernels whose leading grid dimension is "parallel"
  collectives: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # (kind, group) -> n
  collective_s: float = 0.0  # time of every collective (bytes and latency)
  exposed_s: float = 0.0  # of that, what nothing independent is scheduled beside
  launches: float = 0.0  # GPU kernel launches (a command buffer counts one)
  command_buffers: float = 0.0
  host_syncs: float = 0.0  # GPU while-loop trips whose predicate goes to the host

  def add(self, other: "StepCosts", k: float = 1.0) -> None:
    for f in ("grid_steps", "grid_steps_parallel", "collective_s", "exposed_s", "launches", "command_buffers",
              "host_syncs"):
      setattr(self, f, getattr(self, f) + k * getattr(other, f))
    for key, v in other.collectives.items():
      self.collectives[key] += k * v


class _Counter:
  def __init__(self, text: str, chip: ChipSpec, unknown_trips: float, gpu: bool):
    self.prog = hlo_cost.Program(text, unknown_trips, True)
    self.chip, self.unknown, self.gpu = chip, unknown_trips, gpu
    self._cache: dict[str, StepCosts] = {}

  def op_seconds(self, ins: Instr, comp: Computation) -> float:
    """Roofline seconds of one scheduled op (its loops and calls included)."""
    c = self.prog.instr_cost(ins, comp)
    return max(c.flops / self.chip.peak_flops, c.hbm_bytes / self.chip.hbm_bandwidth)

  def collective_seconds(self, ins: Instr, comp: Computation, out: StepCosts) -> float:
    """Bytes over the link plus a latency per collective by its replica group's size; counted into `out`."""
    c = self.prog.instr_cost(ins, comp)
    inner = [ins] if _kind(ins) else []
    if ins.opcode == "fusion" and ins.called("calls"):
      inner = [i for i in self.prog.comps[ins.called("calls")[0]].instrs if _kind(i)]
    seconds = c.collective_bytes / self.chip.ici_bandwidth
    for i in inner[:max(int(round(c.collective_count)), 0)]:  # those hlo_cost counts (not a continuation)
      group = hlo_cost._group_size(i.attrs)
      out.collectives[(_kind(i), group)] += 1
      seconds += self.chip.collective_latency(max(group - 1, 1))
    return seconds

  def _is_start(self, ins: Instr) -> bool:
    if ins.opcode.endswith("-start") and _kind(ins):
      return True
    return ins.opcode == "fusion" and self._root_target(ins) == "AsyncCollectiveStart"

  def _is_done(self, ins: Instr) -> bool:
    return ins.opcode.endswith("-done") or (ins.opcode == "fusion" and self._root_target(ins) == "AsyncCollectiveDone")

  def _root_target(self, ins: Instr) -> str:
    fused = self.prog.comps.get(ins.called("calls")[0]) if ins.called("calls") else None
    return _target(fused.instrs[-1]) if fused is not None and fused.instrs else ""

  def _has_collective(self, ins: Instr) -> bool:
    if _kind(ins):
      return True
    fused = self.prog.comps.get(ins.called("calls")[0]) if ins.opcode == "fusion" and ins.called("calls") else None
    return fused is not None and any(_kind(i) for i in fused.instrs)

  def collectives_of(self, comp: Computation, out: StepCosts) -> None:
    """Exposed collective time of one computation's schedule (see the module docstring)."""
    order = comp.instrs
    for n, ins in enumerate(order):
      if self._is_start(ins):
        chained, between, seconds = {ins.name}, 0.0, self.collective_seconds(ins, comp, out)
        for later in order[n + 1:]:
          if any(o in chained for o in later.operands):
            chained.add(later.name)
            if self._is_done(later):
              break
            if self._has_collective(later):  # a continuation of the same collective
              seconds += self.collective_seconds(later, comp, out)
          elif later.opcode not in hlo_cost._FREE:
            between += self.op_seconds(later, comp)
        out.collective_s += seconds
        out.exposed_s += max(0.0, seconds - between)
      elif _kind(ins) and not ins.opcode.endswith("-start"):  # synchronous: the step waits for all of it
        seconds = self.collective_seconds(ins, comp, out)
        out.collective_s += seconds
        out.exposed_s += seconds

  def visit(self, name: str, in_graph: bool = False) -> StepCosts:
    key = f"{name}/{in_graph}"
    if key in self._cache:
      return self._cache[key]
    comp, out = self.prog.comps[name], StepCosts()
    self.collectives_of(comp, out)
    for ins in comp.instrs:
      if ins.opcode == "while":
        trips = self.prog.trip_count(ins, comp)
        k = self.unknown if trips is None else trips
        for sub in ins.called("body") + ins.called("condition"):
          out.add(self.visit(sub, in_graph), k)
        if self.gpu and not in_graph:
          out.host_syncs += k
        continue
      if ins.opcode in ("call", "conditional", "async-start"):
        subs = ins.called("to_apply") + ins.called("calls") + ins.called("branch_computations")
        graph = self.gpu and any("command_buffer" in s for s in subs)
        for sub in subs:
          out.add(self.visit(sub, in_graph or graph), 1.0 if ins.opcode != "conditional" else 1.0 / len(subs))
        if graph and not in_graph:
          out.launches += 1
          out.command_buffers += 1
        continue
      if ins.opcode == "custom-call" and _target(ins) == "tpu_custom_call":
        grid, semantics = kernel_grid(ins)
        steps = float(math.prod(grid))
        out.grid_steps += steps
        out.grid_steps_parallel += steps if semantics[:1] == ("parallel",) and grid and grid[0] > 1 else 0.0
      if self.gpu and not in_graph and ins.opcode not in _NO_KERNEL and not ins.opcode.endswith("-done"):
        out.launches += 1
    self._cache[key] = out
    return out


def count(text: str, chip: ChipSpec, unknown_trips: float = 1.0, gpu: bool = False) -> StepCosts:
  """Fixed costs of one call of a compiled program (`compiled.as_text()`), data-dependent loops at
  `unknown_trips` trips."""
  c = _Counter(text, chip, unknown_trips, gpu)
  return c.visit(c.prog.entry)


def per_step(text: str, chip: ChipSpec, gpu: bool = False) -> StepCosts:
  """One trip of a decode segment's data-dependent loop: the program at 1 trip less the program at 0."""
  one, zero = count(text, chip, 1.0, gpu), count(text, chip, 0.0, gpu)
  one.add(zero, -1.0)
  return one


def of_program(texts: dict, device_kind: str, platform: str) -> dict:
  """A compiled phase's fixed costs as a plain dict (PhaseResult.fixed): per step of its last decode segment
  ({window: text}) or per call ({None: text}), on the chip its devices are (`device_kind`); {} on a CPU."""
  kind = chips.chip_of_device(device_kind)
  if kind is None or not texts:
    return {}
  gpu, last = platform in ("gpu", "cuda"), texts[max(texts, key=lambda k: -1 if k is None else k)]
  fixed = per_step(last, chips.CHIPS[kind], gpu) if None not in texts else count(last, chips.CHIPS[kind], gpu=gpu)
  out = {f.name: getattr(fixed, f.name) for f in dataclasses.fields(fixed) if f.name != "collectives"}
  out["collectives"] = {f"{k}@{n}": v for (k, n), v in fixed.collectives.items()}
  return dict(out, chip=kind)


def from_dict(d: dict) -> StepCosts:
  """The StepCosts of `of_program`'s dict."""
  fields = {f.name for f in dataclasses.fields(StepCosts)} - {"collectives"}
  out = StepCosts(**{k: v for k, v in d.items() if k in fields})
  for key, v in d.get("collectives", {}).items():
    kind, _, n = key.partition("@")
    out.collectives[(kind, int(n))] = v
  return out


def grid_seconds(fixed: StepCosts, chip: ChipSpec, grid_step_s: float = GRID_STEP_S) -> float:
  """Seconds of pipeline overhead in the kernels' grid steps; a megacore chip runs a parallel dimension's
  steps on its two TensorCores at once."""
  split = fixed.grid_steps_parallel / 2 if chip.kind in MEGACORE else 0.0
  return (fixed.grid_steps - split) * grid_step_s


def modeled_step(cost: dict, fixed: StepCosts, chip: ChipSpec, kernel_bytes: float = 0.0, dma_wait_s: float = 0.0,
                 grid_step_s: float = GRID_STEP_S, launch_s: float = GPU_LAUNCH_S) -> dict:
  """A step's roofline (max of compute, HBM, interconnect bytes) and its modeled time: the kernels at
  max(their bytes, their grid steps' overhead) plus their DMA waits, then the collectives' exposed time and
  the GPU's launches and host-read loop predicates added, as nothing overlaps them. `cost`: the step's compiled cost (flops, hbm_bytes,
  collective_bytes); `kernel_bytes`: the HBM bytes of its Pallas kernels, within hbm_bytes; `dma_wait_s`: their
  copies' waits beyond the bytes (`pallas_dma_waits`)."""
  compute = cost["flops"] / chip.peak_flops
  kernel, hbm = kernel_bytes / chip.hbm_bandwidth, cost["hbm_bytes"] / chip.hbm_bandwidth
  grid = grid_seconds(fixed, chip, grid_step_s)
  roofline = max(compute, hbm, cost["collective_bytes"] / chip.ici_bandwidth)
  body = max(compute, hbm - kernel + max(kernel, grid) + dma_wait_s)
  launches = fixed.launches * launch_s + fixed.host_syncs * GPU_SYNC_S
  return {"roofline_s": roofline, "modeled_s": body + fixed.exposed_s + launches,
          "grid_s": max(0.0, body - max(compute, hbm)), "exposed_collective_s": fixed.exposed_s,
          "launch_s": launches}


def pallas_dma_waits(cfg, rows: int, live_len: float, mesh_shape, page: int, cols: int, chip: ChipSpec) -> float:
  """Seconds one device's TPU paged-attention kernels (every layer) wait on their copies beyond the bytes,
  `rows` slots at `live_len` tokens: model.paged_attention_tpu.fixed_cost's ring fill, Little's-law stall and
  descriptor issue (its grid steps are the compile's, counted by `grid_seconds`)."""
  from astarpo_jax.model import paged_attention_tpu
  d, f, t = mesh_shape
  kv = cfg.num_kv_heads // (t if cfg.num_kv_heads % t == 0 else 1)
  local = max(rows // (d * f), 1)
  lengths = [int(round(live_len))] * (local - local % 2 if local > 1 else 1)
  c = paged_attention_tpu.fixed_cost(lengths, cfg.num_layers, page, page * kv * cfg.head_dim * 2, chip.hbm_bandwidth,
                                     cols, cores=2 if chip.kind in MEGACORE else 1)
  return c["fill_s"] + c["stall_s"] + c["issue_s"]


# ----------------------------------------------------------------------------- host round trips


def host_trips(segment_log) -> dict:
  """Round trips to the host of one engine run, from its segment log ((slots, window, steps, seconds) per
  segment: `decode_plan.RunStats.segment_log`): each segment ends with the host reading the done flags."""
  steps = sum(int(s[2]) for s in segment_log)
  return {"trips": len(segment_log), "steps": steps, "steps_per_trip": steps / max(len(segment_log), 1)}


def engine_trips(budgets_R, slots: int, prompts: int, min_free: int | None, prompt_len: int = 8) -> dict:
  """The engine's own schedule for rows of these lengths (`budgets_R`, row r = prompt r // n, sample r % n, as
  a sampling call lays them out): `engine.generate` on this CPU with a one-layer random model and no stop
  token, so each row ends at its budget, through `slots` slots and the attention over the whole cache (the
  accelerators' default). Returns `host_trips` of its segment log."""
  import jax
  import numpy as np

  from astarpo_jax.model import decoder
  from astarpo_jax.model.config import ModelConfig
  from astarpo_jax.sampling import decode_plan, engine
  from astarpo_jax.sampling.token_choice import SamplingConfig
  cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=8)
  _, params = decoder.init_params(cfg, 0)
  budgets = np.asarray(budgets_R, np.int32)
  tokens = np.random.default_rng(0).integers(3, cfg.vocab_size, (prompts, prompt_len)).astype(np.int32)
  scfg = SamplingConfig(temperature=1.0, max_new_tokens=int(budgets.max()), stop_ids=())
  stats = decode_plan.RunStats()
  engine.generate(cfg, params, tokens, np.ones_like(tokens, bool), jax.random.key(0), scfg,
                  num_samples=len(budgets) // prompts, budget_R=budgets, slots=slots, min_free=min_free,
                  window_step=None, stats=stats)
  return host_trips(stats.segment_log)


def host_seconds(trips: float, multi_host: bool, trip_s: dict = HOST_TRIP_S) -> float:
  """Seconds the host round trips cost (HOST_TRIP_S: one host, or a pod's hosts in lockstep)."""
  return trips * trip_s["pod" if multi_host else "host"]
