"""Meshes over compile-only devices, and choices made by compiling: the sampling layout, how the update's weights
travel, π_ref's scoring and the update's micro-batches, and the settings under which an overflowing phase fits.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
from jax.sharding import Mesh

from astarpo_jax.aot import fixed_costs, phases, projection
from astarpo_jax.aot.chips import ChipSpec
from astarpo_jax.aot.compiling import PhaseResult, compile_phase, decode_step_at
from astarpo_jax.aot.memory_plan import RunShape
from astarpo_jax.infra import sharding
from astarpo_jax.model import lora
from astarpo_jax.model.config import ModelConfig

def abstract_mesh_devices(devices, mesh_shape) -> Mesh:
  """A (data, fsdp, tensor) Mesh over compile-only devices."""
  shape = tuple(mesh_shape)
  if int(np.prod(shape)) != len(devices):
    raise ValueError(f"mesh shape {shape} needs {int(np.prod(shape))} devices; the slice has {len(devices)}: "
                     "set mesh.shape to match (e.g. (1, -1, 1))")
  return Mesh(np.asarray(devices).reshape(shape), sharding.MESH_AXES)


def sampling_mesh(cfg: ModelConfig, devices, mesh_shape, sample_shape=(), backend: str = "tpu") -> Mesh | None:
  """The sampling mesh of config mesh.sample_shape (() = `sharding.default_sample_shape` for `backend`)
  over the same devices in the same order as the training mesh; None when it is the training mesh."""
  shape = sharding.resolve_sample_shape(sample_shape, mesh_shape, backend, cfg.num_heads, cfg.num_kv_heads)
  shape = sharding.resolve_mesh_shape(shape, len(devices))
  return None if shape == tuple(mesh_shape) else abstract_mesh_devices(devices, shape)


def sample_layout_candidates(cfg: ModelConfig, num_devices: int) -> list[tuple[int, int, int]]:
  """Sampling meshes (data, 1, tensor): the weights replicated over `data`, tensor-parallel over `tensor`
  (a divisor of the chip count that splits the query heads): no weight is gathered inside a decode step."""
  return [(num_devices // t, 1, t) for t in range(1, num_devices + 1)
          if num_devices % t == 0 and cfg.num_heads % t == 0]


def choose_sample_layout(cfg: ModelConfig, run: RunShape, devices, mesh_shape, chip: ChipSpec, usable_bytes: int,
                         settings: Mapping | None = None, live_len: int = 390) -> tuple[list[dict], tuple | None]:
  """Each candidate sampling mesh's rollout decode step compiled, projected at `live_len` cached tokens per slot
  (plus the copy onto it once per rollout, per decode step of the rollout's mean length), and the fastest whose
  decode and copy (`rollout_reshard`, a program a leaf as sampler.copy_to makes it) both fit the chip chosen.
  Returns (rows, chosen shape or None when none fits); a row's `peak` is the larger of the two."""
  mesh = abstract_mesh_devices(devices, mesh_shape)
  rows = []
  for shape in sample_layout_candidates(cfg, len(devices)):
    sample = None if tuple(shape) == tuple(mesh_shape) else abstract_mesh_devices(devices, shape)
    dec = compile_phase("rollout_decode", cfg, run, mesh, settings, sample_mesh=sample)
    row = {"shape": shape, "error": dec.error}
    if not dec.error:
      page = phases.page_layout(run, run.rollout_batch, devices[0].platform, (settings or {}).get("page_size")).page_size
      cost = decode_step_at(dec, cfg, run, live_len, page)
      row.update(dec.times(chip, cost), peak=dec.peak, fits=dec.peak <= usable_bytes, result=dec, page_size=page,
                 mesh=sample if sample is not None else mesh,
                 hbm_bytes=cost["hbm_bytes"], collective_bytes=cost["collective_bytes"],
                 collectives=cost.get("collective_count", 0.0))
      if sample is not None:
        copy = compile_phase("rollout_reshard", cfg, run, mesh, settings, sample_mesh=sample)
        row["copy_s"] = copy.times(chip)["projected_s"] if not copy.error else float("nan")
        row["copy_peak"] = copy.peak if not copy.error else float("inf")
        row["peak"] = max(row["peak"], row["copy_peak"])
        row["fits"] = row["peak"] <= usable_bytes
      else:
        row["copy_s"] = 0.0
      steps = projection.expected_max_length(run.response_len, run.sample_batch)
      row["step_with_copy_s"] = row["projected_s"] + row["copy_s"] / max(steps, 1)
    rows.append(row)
  fitting = [r for r in rows if not r["error"] and r["fits"]]
  chosen = min(fitting, key=lambda r: r["step_with_copy_s"])["shape"] if fitting else None
  return rows, chosen


# ----------------------------------------------------------------------------- weights gathered once


def gather_settings(phase: str, mode: str) -> dict:
  """The phase settings of train.gather_weights `mode` ("per_step_local", "per_step" or "per_micro_batch"): an
  update's compute copy gathered once per optimizer step (its gradients reduced once, or per micro-batch), π_ref's
  scoring on its bf16 weights held whole over the batch axes."""
  if phase == "reference":
    return {"ref_replicated": mode != "per_micro_batch"}
  return {"gather_weights": mode} if phases.update_method(phase) else {}


def _auto_order(phase: str, cfg: ModelConfig) -> tuple[str, ...]:
  """The modes train.gather_weights "auto" tries for `phase`, fewest bytes moved first (update.resolve_gather);
  a LoRA update has its own layout (its base placed as π_ref's)."""
  if phase == "reference":
    return ("per_step", "per_micro_batch")
  if lora.of(cfg) is not None:
    return ("per_micro_batch",)
  critic = phases.method_of(phases.update_method(phase), {}).footprint().critic
  return ("per_step", "per_micro_batch") if critic else ("per_step_local", "per_step", "per_micro_batch")


def compile_gathered(phase: str, cfg: ModelConfig, run: RunShape, mesh: Mesh, settings: Mapping, usable_bytes: int,
                     **kw) -> tuple:
  """(compiled phase, how its weights travel, why): train.gather_weights "auto" compiles the once-per-step
  layouts first (gradients reduced once, then per micro-batch) and keeps the first that compiles and fits
  `usable_bytes`, else the per-micro-batch gathers."""
  mode = settings.get("gather_weights") or "per_micro_batch"
  if phase != "reference" and not phases.update_method(phase):
    return compile_phase(phase, cfg, run, mesh, settings, **kw), "", ""
  if mode != "auto":
    return compile_phase(phase, cfg, run, mesh, dict(settings, **gather_settings(phase, mode)), **kw), mode, \
        "as configured"
  refused = []
  for how in _auto_order(phase, cfg):
    res = compile_phase(phase, cfg, run, mesh, dict(settings, **gather_settings(phase, how)), **kw)
    fits = not res.error and res.peak <= usable_bytes
    if fits or how == "per_micro_batch":
      said = res.error[:80] if res.error else f"peak {res.peak / 2**30:.2f} of {usable_bytes / 2**30:.2f} GiB"
      return res, how, "; ".join(refused + [f"{how}{' fits' if fits else ''}: {said}"])
    refused.append(f"{how} does not fit ({res.error[:80] if res.error else f'{res.peak / 2**30:.2f} GiB'} of "
                   f"{usable_bytes / 2**30:.2f})")
  raise AssertionError("unreachable: per_micro_batch ends every order")


def _doubling(start: int, stop: int, max_compiles: int) -> list[int]:
  """start, 2 start, 4 start, ... while <= stop and dividing it (at most max_compiles)."""
  out = []
  while len(out) < max_compiles and start <= stop and stop % start == 0:
    out.append(start)
    start *= 2
  return out


def _until_one_does_not_fit(phase: str, cfg: ModelConfig, runs: list[tuple[int, RunShape]], mesh: Mesh,
                            settings: Mapping, usable_bytes: int, figures) -> list[dict]:
  """Compile `phase` at each (value, run) in order (train.gather_weights as set) until one is refused or does not
  fit: a row each, {value, weights, error, result} and, compiled, peak, fits and `figures(run, result)`."""
  rows = []
  for value, r in runs:
    res, how, _ = compile_gathered(phase, cfg, r, mesh, settings, usable_bytes)
    row = {"value": value, "weights": how, "error": res.error, "result": res}
    if not res.error:
      row.update(peak=res.peak, fits=res.peak <= usable_bytes, **figures(r, res))
    rows.append(row)
    if res.error or not row["fits"]:
      break
  return rows


def choose_score_batch(cfg: ModelConfig, run: RunShape, mesh: Mesh, settings: Mapping, usable_bytes: int,
                       chip: ChipSpec, max_compiles: int = 5) -> tuple[list[dict], int | None]:
  """π_ref's scoring forward compiled at growing prompts per call (the update's micro-batch x 1, 2, 4, ... up to
  the rollout), the largest that fits chosen (train.score_micro_batches): fewer, larger calls. Returns
  ([{score_micro_batches, rows, peak, fits, call_s, step_s, error}], the chosen multiple or None)."""
  ks = [k for k in (2 ** i for i in range(max_compiles)) if run.micro_batch * k <= run.rollout_batch]

  def figures(r, res):
    call = res.times(chip)["projected_s"]
    return {"call_s": call, "step_s": run.rollout_batch * run.rows_per_prompt / r.reference_rows * call}
  runs = [(k, dataclasses.replace(run, reference_batch=run.micro_batch * k)) for k in ks]
  rows = _until_one_does_not_fit("reference", cfg, runs, mesh, settings, usable_bytes, figures)
  for row, (_, r) in zip(rows, runs):
    row.update(score_micro_batches=row.pop("value"), rows=r.reference_rows)
  fitting = [r for r in rows if not r["error"] and r["fits"]]
  return rows, (fitting[-1]["score_micro_batches"] if fitting else None)


def call_seconds(res: PhaseResult, chip: ChipSpec) -> float:
  """A compiled call's modeled seconds (the roofline with the fixed costs its compile read), else its roofline."""
  if res.fixed and res.cost:
    return fixed_costs.modeled_step(res.cost, fixed_costs.from_dict(res.fixed), chip)["modeled_s"]
  return res.times(chip)["projected_s"]


def choose_update_batch(phase: str, cfg: ModelConfig, run: RunShape, mesh: Mesh, settings: Mapping,
                        usable_bytes: int, chip: ChipSpec, max_compiles: int = 4) -> tuple[list[dict], int | None]:
  """The update's micro-batch by compiling: prompts per forward/backward at the config's, x2, x4, ... up to the
  optimizer step's, each with train.gather_weights as set ("auto" tries its order), the fastest that fits chosen.
  Fewer, larger micro-batches read the weights and the gradient accumulator fewer times a step (the bound once the
  weights move once a step: HBM on v6e and GPUs); larger ones hold more activations. The arithmetic is the same up
  to the order of the accumulation. Returns ([{micro_batch, micro_batches, weights, peak, fits, step_s, mfu,
  error}], the chosen prompts per micro-batch or None)."""
  step = run.mini_batch or run.micro_batch
  runs = [(mb, dataclasses.replace(run, micro_batch=mb, micro_batch_per_device=0))
          for mb in _doubling(run.micro_batch, step, max_compiles)]
  rows = _until_one_does_not_fit(phase, cfg, runs, mesh, settings, usable_bytes,
                                 lambda r, res: {"step_s": call_seconds(res, chip), "mfu": res.mfu(chip)})
  for row in rows:
    row.update(micro_batch=row["value"], micro_batches=step // row.pop("value"))
  fitting = [r for r in rows if not r["error"] and r["fits"]]
  return rows, (min(fitting, key=lambda r: r["step_s"])["micro_batch"] if fitting else None)


# ----------------------------------------------------------------------------- what would fit


def plan_phases(method: str = "astarpo") -> dict[str, str]:
  """memory_plan's phases -> the compiled phase that is each, for `method`'s run."""
  return {"sample": "rollout_decode", "reference": "reference", "update": f"{method}_update"}


def _candidates(cfg: ModelConfig, run: RunShape, mesh_shape: tuple, phase: str, num_devices: int):
  """(setting, cfg, run, mesh shape) alternatives for an overflowing phase, most likely to help first."""
  d, f, t = mesh_shape
  out = []
  if phase in ("update", "reference"):  # micro_batch in prompts; its rows must split over the batch axes
    for k in (2, 4):
      if run.micro_batch % k == 0 and (run.micro_rows // k) % (d * f) == 0:
        out.append((f"train.micro_batch={run.micro_batch // k}", cfg, dataclasses.replace(
            run, micro_batch=run.micro_batch // k), mesh_shape))
  if phase == "update" and not cfg.remat:
    out.insert(0, ("model.remat=True", dataclasses.replace(cfg, remat=True), run, mesh_shape))
  if phase == "sample":
    for k in (2, 4):
      if run.sample_batch // k >= d * f:
        out.append((f"sampling.max_batch={run.sample_batch // k}", cfg, dataclasses.replace(
            run, sample_batch=run.sample_batch // k), mesh_shape))
  if f % 2 == 0 and cfg.num_heads % (2 * t) == 0 and run.micro_rows % (d * f // 2) == 0:
    shape = (d, f // 2, 2 * t)
    out.append((f"mesh.shape={shape}", cfg, run, shape))
  if cfg.param_dtype != "bfloat16":
    out.append(("model.param_dtype=bfloat16 (AdamW moments too)", dataclasses.replace(cfg, param_dtype="bfloat16"),
                run, mesh_shape))
  return out


def find_fitting_settings(cfg: ModelConfig, run: RunShape, mesh_shape: tuple, devices, usable_bytes: int,
                          phase: str, settings: Mapping | None = None, max_compiles: int = 6,
                          sample_shape=(), backend: str = "tpu") -> list[tuple[str, int | None, str]]:
  """Compile alternatives for a plan phase ("sample", "reference", "update") that overflows; stop at the
  first that fits. [(setting, peak bytes or None, verdict)] for each compiled, at most `max_compiles`.
  `settings` as for compile_phase (its "name" picks the method whose update is compiled); the sample
  phase compiles on the sampling mesh of `sample_shape` (`sampling_mesh`) beside each candidate mesh."""
  tried, name = [], (settings or {}).get("name", "astarpo")
  for setting, c, r, shape in _candidates(cfg, run, tuple(mesh_shape), phase, len(devices))[:max_compiles]:
    mesh = abstract_mesh_devices(devices, shape)
    sm = sampling_mesh(c, devices, shape, sample_shape, backend) if phase == "sample" else None
    res = compile_phase(plan_phases(name)[phase], c, r, mesh, settings, sample_mesh=sm)
    if res.error:
      tried.append((setting, None, f"does not compile: {res.error[:160]}"))
      continue
    fits = res.peak <= usable_bytes
    tried.append((setting, res.peak, "fits" if fits else "does not fit"))
    if fits:
      break
  return tried
