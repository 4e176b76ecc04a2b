"""A phase of PHASES compiled for a TPU slice or GPUs on a machine without one, and read.

The real compiler (libtpu, XLA:GPU) compiles for compile-only devices (`chips.topology_devices`). The compiled
program gives per-device memory (`memory_analysis()`: an out-of-memory here is the one the chip would report)
and, read from its HLO with loop trip counts (`hlo_cost`), FLOPs, HBM bytes and collective bytes, from which a
roofline time: the largest of FLOPs / peak, HBM bytes / HBM bandwidth and collective bytes / ICI bandwidth (a
projection: it assumes perfect overlap and no fixed costs).
"""
from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh

from astarpo_jax import methods
from astarpo_jax.aot import fixed_costs, hlo_cost, phases, projection
from astarpo_jax.aot.chips import ChipSpec
from astarpo_jax.aot.memory_plan import resident_bytes
from astarpo_jax.aot.run_shape import RunShape, tree_bytes_per_device
from astarpo_jax.model import decoder, lora, paged_attention
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.sampling import decode_plan

def resident_other(phase: str, cfg: ModelConfig, run: RunShape, mesh: Mesh, method: methods.Method,
                   sample_copy: bool = False) -> int:
  """Per-device bytes of the resident state a phase does not take as an argument (it stays in HBM
  meanwhile), on the training mesh `mesh`: Stage 1 holds only the reference; Stage 2 holds the policy,
  its optimizer state, a critic and the reference (for a method that scores it) throughout.
  `sample_copy`: a sampling phase runs on the sampling mesh's copy, so the params it samples with stay
  resident beside it (the copy is its argument).

  LoRA (a `lora.model_config` cfg): the base is always resident (it is the policy's as well as π_ref's), the
  update takes it as an argument, and a rollout samples the merged compute-dtype copy (the prefill's and
  decode's argument, the reshard's input), so the adapter, its moments and the base all stay beside it; with
  a sampling mesh the merged copy on the training mesh stays too, beside the copy resharded from it."""
  resident = resident_bytes(cfg, run.ref_param_dtype, phases.optimizers_for(method, run), mesh, method)
  sampling = phase in phases.SAMPLING_PHASES
  if phase.startswith("stage1"):
    return resident["ref_params"] if sample_copy and sampling else 0
  if lora.of(cfg) is not None:
    return _lora_resident_other(phase, cfg, resident, mesh, sample_copy)
  if "reference" not in method.footprint().scored:
    resident.pop("ref_params")
  taken = {"rollout_prefill": ("params",), "rollout_decode": ("params",), "rollout_reshard": ("params",),
           "reference": ("ref_params",), "ppo_values": ("critic",)}.get(phase, ("params", "opt_state", "critic", "critic_opt_state"))
  if sample_copy and sampling:
    taken = ()
  return sum(v for k, v in resident.items() if k not in taken)


def _lora_resident_other(phase: str, cfg: ModelConfig, resident: dict, mesh: Mesh, sample_copy: bool) -> int:
  """`resident_other` of a LoRA run's Stage-2 phase (see there)."""
  if phase == "rollout_decode_adapter":  # the base and the adapter's compute-dtype cast are its arguments
    return sum(v for k, v in resident.items() if k != "ref_params")
  rollout = phase.startswith("rollout_")
  taken = () if rollout else {"reference": ("ref_params",), "ppo_values": ("critic",)}.get(
      phase, ("params", "opt_state", "critic", "critic_opt_state", "ref_params"))  # an update: the base its argument
  merged = 0
  if rollout and sample_copy and phase in phases.SAMPLING_PHASES:  # the merged copy the reshard read from
    c = dataclasses.replace(cfg, param_dtype=cfg.dtype)
    merged = tree_bytes_per_device(decoder.abstract_params(c)[1], decoder.param_shardings(c, mesh))
  return merged + sum(v for k, v in resident.items() if k not in taken)


@dataclasses.dataclass
class PhaseResult:
  """One compiled phase, per device. For decode phases `cost` is one step (cost at 1 trip - at 0)."""
  phase: str
  mesh_shape: tuple
  compile_s: float
  error: str = ""  # the compiler's refusal (e.g. out of memory), empty when it compiled
  memory: dict = dataclasses.field(default_factory=dict)  # argument, output, alias, temp, code
  resident_other: int = 0
  cost: dict = dataclasses.field(default_factory=dict)  # flops, hbm_bytes, bytes, collective_bytes
  xla: dict = dataclasses.field(default_factory=dict)  # cost_analysis(): loop bodies once
  loops: dict = dataclasses.field(default_factory=dict)  # trip count -> loops (None: data-dependent)
  useful_flops: float = 0.0  # per device: the model's FLOPs over the rows it computes (projection.useful_flops x fill)
  rows_fill: float = 1.0  # the share of the call's rows it computes (packed rows: phases.computed_fill)
  live_flops: float = 0.0  # per device, scoring and updates: the FLOPs of live tokens only (projection.live_flops)
  collectives: dict = dataclasses.field(default_factory=dict)
  custom_calls: dict = dataclasses.field(default_factory=dict)
  segments: dict = dataclasses.field(default_factory=dict)  # decode: columns attended -> per-step cost
  page_size: int = 0  # a paged decode: its segments are keyed by live tokens per slot (decode_step_at)
  top_ops: list = dataclasses.field(default_factory=list)  # [(opcode, JAX op, TFLOP, HBM GB, all-space GB)]
  hlo: dict = dataclasses.field(default_factory=dict, repr=False)  # keep_hlo: {None or cache slots: HLO text}
  # what the roofline leaves out, per call (decode: per step), on the devices' chip: fixed_costs.of_program
  fixed: dict = dataclasses.field(default_factory=dict)

  @property
  def peak(self) -> int:
    m = self.memory
    return self.resident_other + m["argument"] + m["output"] - m["alias"] + m["temp"] + m["code"] if m else 0

  def times(self, chip: ChipSpec, cost: dict | None = None) -> dict:
    """Roofline seconds: compute, HBM, ICI, and the projection (their max). A collective's latency: per ring
    step of its replica group on TPU (`collective_hops`, read from the HLO), per call on GPUs."""
    c = cost or self.cost
    count = c.get("collective_count", 0.0)
    hops = c.get("collective_hops", count * (max(int(np.prod(self.mesh_shape)) - 1, 1) if self.mesh_shape else 1))
    t = {"compute_s": c["flops"] / chip.peak_flops, "hbm_s": c["hbm_bytes"] / chip.hbm_bandwidth,
         "ici_s": c["collective_bytes"] / chip.ici_bandwidth + count * chip.collective_latency_s
         + hops * chip.hop_latency_s}
    t["projected_s"] = max(t.values())
    return t

  def mfu(self, chip: ChipSpec) -> float:
    return self.useful_flops / (self.times(chip)["projected_s"] * chip.peak_flops) if self.cost else 0.0

  def live_mfu(self, chip: ChipSpec) -> float:
    """The useful-token MFU: live tokens' FLOPs (no padding, no packing slack) over the roofline's seconds."""
    return self.live_flops / (self.times(chip)["projected_s"] * chip.peak_flops) if self.cost else 0.0


KERNEL_TARGETS = {"tpu_custom_call": "pallas", "__gpu$xla.gpu.triton": "triton"}  # custom call -> kernel


def paged_kernel_bytes(cfg: ModelConfig, slots: int, mesh_shape, page_size: int, live_len: int,
                       dtype_bytes: int = 2, kernel: str = "pallas") -> float:
  """HBM bytes per device the paged attention kernel moves in one decode step, every slot at `live_len` cached
  tokens: the pages its grid fetches (TPU: paged_attention.pallas_pages_read) or its loops read (GPU:
  gpu_tokens_read), K and V of the device's kv heads, and its query and output blocks (the GPU's query heads
  padded to 16 a kv head), over every layer. The compile counts the whole pool, the kernel's operand, instead."""
  d, f, t = mesh_shape
  local_slots = slots // (d * f)
  t_heads = t if cfg.num_kv_heads % t == 0 else 1
  kv, q = cfg.num_kv_heads // t_heads, cfg.num_heads // t_heads
  if kernel == "triton":
    tokens = paged_attention.gpu_tokens_read([live_len] * local_slots, page_size)
    q = kv * paged_attention.gpu_query_rows(q // kv)
  else:
    tokens = paged_attention.pallas_pages_read([live_len] * local_slots, page_size) * page_size
  per_layer = 2 * tokens * kv * cfg.head_dim * dtype_bytes + 2 * local_slots * q * cfg.head_dim * dtype_bytes
  return float(cfg.num_layers * per_layer)


def kernel_of(res: "PhaseResult") -> str:
  """Which paged attention kernel a compiled decode calls ("" for none)."""
  return next((k for target, k in KERNEL_TARGETS.items() if res.custom_calls.get(target)), "")


def decode_step_at(res: "PhaseResult", cfg: ModelConfig, run: RunShape, live_len: int, page_size: int) -> dict:
  """One decode step's cost with every slot at `live_len` cached tokens: the compile's count, the kernel's
  operand bytes replaced by the pages it fetches (`paged_kernel_bytes`); the dense layout's count as compiled."""
  if res.page_size and len(res.segments) == 2:  # already read: linear in the live tokens between its two ends
    (n0, c0), (n1, c1) = sorted(res.segments.items())
    w = (live_len - n0) / (n1 - n0)
    return {k: c0[k] + w * (c1[k] - c0[k]) for k in c0}
  cost = dict(res.cost)
  if cost.get("kernel_hbm_bytes"):
    slots = run.stage1_rows if res.phase.startswith("stage1") else run.sample_batch
    cost["hbm_bytes"] = (cost["hbm_bytes"] - cost["kernel_hbm_bytes"]
                         + paged_kernel_bytes(cfg, slots, res.mesh_shape, page_size, live_len, kernel=kernel_of(res)))
  return cost


def out_of_memory(message: str) -> str:
  """The compiler's out-of-memory line, shortened ('' when the error is something else)."""
  m = re.search(r"(Ran out of memory in memory space \w+[^\n]*|RESOURCE_EXHAUSTED[^\n]*)", message)
  return m.group(1)[:400] if m else ""


def _cost_dict(c: hlo_cost.Cost) -> dict:
  return {"flops": c.flops, "hbm_bytes": c.hbm_bytes, "bytes": c.bytes, "collective_bytes": c.collective_bytes,
          "transcendentals": c.transcendentals, "collective_count": c.collective_count,
          "collective_hops": c.collective_hops,
          "kernel_hbm_bytes": sum(c.custom_call_hbm.get(t, 0.0) for t in KERNEL_TARGETS)}


def _diff(a: dict, b: dict) -> dict:
  return {k: a[k] - b[k] for k in a}


def _compile(fn, args, mesh: Mesh):
  with jax.set_mesh(mesh):
    return fn.lower(*args).compile()


def _top_ops(cost: hlo_cost.Cost, n: int = 12) -> list:
  """The ops that move the most HBM bytes (trip counts included), op names shortened."""
  merged: dict = {}
  for (opcode, name), (f, b, h) in cost.by_op.items():
    key = (opcode, re.sub(r"jit\([\w]*\)/|while/body/|closed_call/|jvp\(\)/", "", name))
    merged[key] = [a + v for a, v in zip(merged.get(key, [0.0, 0.0, 0.0]), (f, h, b))]
  top = sorted(merged.items(), key=lambda kv: -kv[1][1])[:n]
  return [(op, name[-90:], f / 1e12, h / 1e9, b / 1e9) for (op, name), (f, h, b) in top]


def compile_phase(phase: str, cfg: ModelConfig, run: RunShape, mesh: Mesh, settings: Mapping | None = None,
                  keep_hlo: bool = False, sample_mesh: Mesh | None = None) -> PhaseResult:
  """Build, compile and read one phase; a compile error (the chip's OOM) is returned, not raised.
  A decode phase compiles the engine's segment at its smallest and largest attention window for the
  target's default (`decode_plan.default_window_step`: the whole cache only on TPU/GPU).

  `settings`: the config's method settings (config.algo as a dict, with train.logp_chunk); an update
  phase binds its method to them, the other phases count the resident state of `settings["name"]`'s
  method (default A*-PO). `sample_mesh`: the sampling mesh (mesh.sample_shape, over `mesh`'s devices in
  the same order; None = sample on `mesh`): the sampling phases compile on it, the reshard phases onto it."""
  if phase in phases.RESHARD_PHASES and sample_mesh is None:
    raise ValueError(f"{phase} compiles the copy onto a sampling mesh: set mesh.sample_shape")
  run, settings, method = phases.bind_phase(phase, run, settings, sample_mesh)
  on = sample_mesh if sample_mesh is not None and phase in phases.SAMPLING_PHASES else mesh
  decode = phase in phases.DECODE_PHASES
  windows = decode_plan.attention_windows(run.prompt_len, run.response_len,
                                     decode_plan.default_window_step(run.response_len, on.devices.flat[0].platform))
  # decode_len d: the segment attends over P + d - 1 columns
  segments = tuple(sorted({w - run.prompt_len + 1 for w in (windows[0], windows[-1])})) if decode else (None,)
  res = PhaseResult(phase, tuple(on.devices.shape), 0.0)
  res.resident_other = resident_other(phase, cfg, run, mesh, method, sample_copy=sample_mesh is not None)
  texts = {}
  for seg in segments:
    seg_run = dataclasses.replace(run, decode_len=seg) if seg else run
    fn, args = phases.PHASES[phase](cfg, seg_run, on, settings)
    if isinstance(fn, phases.Programs):  # the reshard: a program per leaf (sampler.copy_to)
      return _compile_programs(res, fn, args, cfg, run, on)
    compiled = _timed_compile(res, fn, args, on)
    if compiled is None:
      return res
    res.memory = _memory(compiled)
    xla = compiled.cost_analysis() or {}
    res.xla = {"flops": float(xla.get("flops", 0)), "bytes": float(xla.get("bytes accessed", 0))}
    texts[run.prompt_len + seg - 1 if seg else None] = compiled.as_text()
  read_hlo(res, texts, cfg, run, mesh.devices.size)
  res.rows_fill = phases.computed_fill(phase, run, on, settings)
  res.useful_flops *= res.rows_fill
  res.live_flops = projection.live_flops(phase, cfg, run) / mesh.devices.size
  if decode and res.cost.get("kernel_hbm_bytes"):  # paged: the kernel's bytes at each live length
    res.page_size = phases.page_layout(run, run.rollout_batch, on.devices.flat[0].platform,
                                (settings or {}).get("page_size")).page_size
    S = run.prompt_len + run.response_len - 1
    res.segments = {n: decode_step_at(res, cfg, run, n, res.page_size) for n in (run.prompt_len, S)}
    res.cost = dict(res.segments[S])  # the step at the full cache, as the dense phases report it
  device = on.devices.flat[0]
  res.fixed = fixed_costs.of_program(texts, device.device_kind, device.platform)
  res.hlo = texts if keep_hlo else {}
  return res


def _timed_compile(res: PhaseResult, fn, args, mesh: Mesh):
  """`fn` compiled for `mesh`, its time added to `res.compile_s`; None with `res.error` set when the compiler
  refuses it (its verdict is the result: out of memory, or the error's first lines)."""
  t = time.perf_counter()
  try:
    return _compile(fn, args, mesh)
  except Exception as e:  # noqa: BLE001
    res.error = out_of_memory(str(e)) or f"{type(e).__name__}: {str(e)[:600]}"
    return None
  finally:
    res.compile_s += time.perf_counter() - t


def _memory(compiled) -> dict:
  ma = compiled.memory_analysis()
  out = {k: int(getattr(ma, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
  return dict(out, code=int(ma.generated_code_size_in_bytes))


def _compile_programs(res: PhaseResult, programs: "phases.Programs", args, cfg: ModelConfig, run: RunShape,
                      mesh: Mesh) -> PhaseResult:
  """A phase the run makes as several programs, one after another (phases.Programs: the reshard), compiled one
  by one and read as the run pays them. Memory: `argument` the params as stored, `output` the copies made on the
  sampling mesh, and `temp` what is live beside them at the worst moment: the cast copy on the training mesh
  (`before`'s output, kept until the copy ends) plus the larger of `before`'s temporaries beyond the copies' bytes
  and the largest one leaf's program needs (a device runs its programs in order, each one's temporaries freed when
  it ends): so peak = resident + stored + copies + [cast copy] + the largest leaf's temporaries. Cost and fixed
  costs: each program's times the leaves it copies (one call of the whole copy)."""
  total, fixed, first = hlo_cost.Cost(), fixed_costs.StepCosts(), {}
  device = mesh.devices.flat[0]
  out = leaf_temp = code = copied_args = 0
  before = None
  first_programs = ((*programs.before, 1),) if programs.before is not None else ()
  for fn, fn_args, n in first_programs + programs.leaves:
    compiled = _timed_compile(res, fn, fn_args, mesh)
    if compiled is None:
      return res
    mem, text = _memory(compiled), compiled.as_text()
    total.add(hlo_cost.analyze(text, unknown_trips=1.0)[0], n)
    part = fixed_costs.of_program({None: text}, device.device_kind, device.platform)
    if part:
      first = first or part
      fixed.add(fixed_costs.from_dict(part), n)
    code += mem["code"]
    if programs.before is not None and before is None:
      before = mem
      continue
    out += n * mem["output"]
    copied_args += n * mem["argument"]
    leaf_temp = max(leaf_temp, mem["temp"])
  stored = args[0]
  if programs.before is not None:
    argument, temp = before["argument"], before["output"] + max(before["temp"] - out, leaf_temp)
  else:  # the leaves copy_to keeps as they are count once, as stored
    kept = tree_bytes_per_device(stored, jax.tree.map(lambda x: x.sharding, stored))
    kept -= sum(n * tree_bytes_per_device(a, jax.tree.map(lambda x: x.sharding, a)) for _, a, n in programs.leaves)
    argument, temp = copied_args + kept, leaf_temp
  res.memory = {"argument": argument, "output": out, "alias": 0, "temp": temp, "code": code,
                "largest_leaf_temp": leaf_temp}
  res.cost, res.top_ops = _cost_dict(total), _top_ops(total)
  res.collectives, res.custom_calls = dict(total.collectives), dict(total.custom_calls)
  res.useful_flops = projection.useful_flops(res.phase, cfg, run) / mesh.devices.size
  if first:  # of_program's dict, summed over the programs
    res.fixed = dict(first, **{f.name: getattr(fixed, f.name) for f in dataclasses.fields(fixed)
                               if f.name != "collectives"},
                     collectives={f"{k}@{g}": v for (k, g), v in fixed.collectives.items()})
  return res


def read_hlo(res: PhaseResult, texts: dict, cfg: ModelConfig, run: RunShape, num_devices: int) -> PhaseResult:
  """Fill `res`'s cost fields from the optimised HLO text(s): {None: text}, or {cache slots: text} for the
  decode segments (then `cost` is one step of the last segment). Also re-reads saved HLO."""
  for slots, text in texts.items():
    full, loops = hlo_cost.analyze(text, unknown_trips=1.0)
    res.loops = dict(sorted(_count(loops.values()).items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))
    res.collectives, res.custom_calls = dict(full.collectives), dict(full.custom_calls)
    res.cost, res.top_ops = _cost_dict(full), _top_ops(full)
    seg_run = dataclasses.replace(run, decode_len=slots - run.prompt_len + 1) if slots else run
    res.useful_flops = projection.useful_flops(res.phase, cfg, seg_run) / num_devices
    if slots is not None:
      res.cost = _diff(res.cost, _cost_dict(hlo_cost.analyze(text, unknown_trips=0.0)[0]))
      res.segments[slots] = dict(res.cost, useful_flops=res.useful_flops)
  return res


def _count(values) -> dict:
  out: dict = {}
  for v in values:
    out[v] = out.get(v, 0) + 1
  return out
