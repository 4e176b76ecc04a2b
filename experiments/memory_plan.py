"""Per-device memory plan of a config on a device, from shapes only (no weights, no hub access).

  python experiments/memory_plan.py --config=configs/qwen1p5b.py --device=v4-8
  python experiments/memory_plan.py --config=configs/qwen7b.py --device=h200 --nocompile
  python experiments/memory_plan.py --config=configs/qwen3b.py --device=local   # this machine's devices
  python experiments/memory_plan.py --config=configs/qwen7b.py --device=v5e-8 --aot  # the TPU compiler's count

For a named device the reference forward and the update step are compiled on this machine's CPU
with as many faked devices as the target has (XLA_FLAGS is set before JAX starts); --nocompile uses
the analytic estimates instead. --aot compiles the sample (decode), reference and update phases
for the TPU slice itself (compile-only devices from libtpu, `astarpo_jax.aot`), so the figures are
the chip's; when the run does not fit it compiles up to 6 alternatives (micro-batch, remat, mesh
shape, sampler batch, param dtype) and names those that fit. Exits with status 1 and the settings
to change when it does not fit, 2 when the settings cannot run on the mesh at all (e.g. a
micro-batch the mesh cannot split).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # configs/ and the package

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from astarpo_jax.aot import chips  # noqa: E402
from astarpo_jax.run_config import run_shape  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py[:variant]).", lock_config=True)
_DEVICE = flags.DEFINE_string("device", "v4-8", "v4-8, v5e-8, v5p-8, v6e-8, h200, h100x8, a100-80x4, ... or local")
_COMPILE = flags.DEFINE_bool("compile", True, "compile the reference forward and update step (else: formulas)")
_GPU_FRACTION = flags.DEFINE_float("gpu_mem_fraction", chips.GPU_MEM_FRACTION,
                                   "XLA_PYTHON_CLIENT_MEM_FRACTION assumed for GPUs (JAX's default unless the run sets it)")
_REF_BATCH = flags.DEFINE_integer("reference_batch", 0, "plan the reference forward on this many rows at a time "
                                  "(0: train.micro_batch, as the loop runs it)")
_JSON = flags.DEFINE_bool("json", False, "print the plan as one JSON line instead of a table")
_AOT = flags.DEFINE_bool("aot", False, "compile the phases for the TPU slice itself (needs libtpu); when it does "
                         "not fit, compile up to 6 alternatives and name those that fit")
flags.mark_flags_as_required(["config"])

def _page_size(c, backend: str) -> int:
  """The decode's page size on `backend` (0: the dense layout), as engine.generate picks it."""
  from astarpo_jax.sampling import decode_plan, paged_cache
  layout = c.sampling.kv_layout or decode_plan.default_layout(backend)
  return 0 if layout == "dense" else c.sampling.page_size or paged_cache.DEFAULT_PAGE_SIZE.get(backend, 16)


def _aot_phases(plan, cfg, run, device, settings):
  """The plan's sample / reference / update phases compiled for the TPU slice `device` itself."""
  from astarpo_jax.aot import compiling, layouts, memory_plan as mp
  devices = chips.topology_devices(device)
  mesh = layouts.abstract_mesh_devices(devices, plan.mesh_shape)
  sample = layouts.sampling_mesh(cfg, devices, plan.mesh_shape, tuple(_CONFIG.value.mesh.sample_shape))
  compiled = {}
  for k, p in layouts.plan_phases(settings["name"]).items():
    result = compiling.compile_phase(p, cfg, run, mesh, settings, sample_mesh=sample if k == "sample" else None)
    compiled[k] = mp.from_aot(result, plan.resident_total)
  return dataclasses.replace(plan, phases=compiled)


def _what_fits(plan, cfg, run, device, settings):
  """Compile alternatives for each overflowing phase (at most 6 per config) and say which fit."""
  from astarpo_jax import run_config
  from astarpo_jax.aot import chips, layouts
  lines, budget = [], 6
  for name in (p for p in ("update", "reference", "sample") if plan.resident_total + plan.phases[p].total
               > plan.usable_bytes):
    tried = layouts.find_fitting_settings(cfg, run, plan.mesh_shape, chips.topology_devices(device), plan.usable_bytes,
                                      name, settings, max_compiles=budget,
                                      sample_shape=tuple(_CONFIG.value.mesh.sample_shape))
    budget -= len(tried)
    for setting, peak, verdict in tried:
      setting = run_config.micro_batch_override(setting, _CONFIG.value.train.micro_batch_per_device, plan.mesh_shape)
      lines.append(f"  {name}: {setting}: " + (verdict if peak is None else f"peak {peak / 2**30:.2f} GiB, {verdict}"))
    if budget <= 0:
      break
  return "compiled alternatives (TPU compiler):\n" + ("\n".join(lines) or "  none to try")


def _print_plan(plan, c, cfg, run, method):
  if _JSON.value:
    phases = {k: dataclasses.asdict(v) for k, v in plan.phases.items()}
    print(json.dumps({"device": plan.device, "usable_bytes": plan.usable_bytes, "mesh_shape": plan.mesh_shape,
                      "num_params": cfg.num_params, "resident": plan.resident, "phases": phases,
                      "peak": plan.peak, "peak_phase": plan.peak_phase}))
  else:
    print(f"{c.model.name_or_path} ({cfg.num_params / 1e6:,.1f}M params), {method.name}, on {plan.device}, "
          f"mesh (data, fsdp, tensor) = {plan.mesh_shape}; P={run.prompt_len} R={run.response_len} "
          f"rollout={run.rollout_batch} micro={run.micro_batch} sample_batch={run.sample_batch} "
          f"reference_rows={run.reference_rows} remat={cfg.remat}\n")
    print(plan.table())


def main(argv):
  del argv
  c = _CONFIG.value
  device = _DEVICE.value
  if device != "local":
    os.environ["JAX_PLATFORMS"] = "cpu"  # read when JAX is imported
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # --aot: libtpu on a machine without a TPU
    try:
      spec = chips.device_spec(device, _GPU_FRACTION.value)
    except ValueError as e:
      raise SystemExit(f"--device={device}: {e}") from None
    if not _AOT.value:  # read when the first backend starts, which has not happened yet
      os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                 f" --xla_force_host_platform_device_count={spec.num_devices}")
  import jax

  from astarpo_jax import experiment, run_config
  from astarpo_jax.aot import memory_plan as mp
  if device == "local":
    usable, num_devices, name = chips.device_memory_bytes(), jax.device_count(), f"local {jax.devices()[0].device_kind}"
  else:
    usable, num_devices, name = spec.usable_bytes, spec.num_devices, f"{device} ({spec.note})"
  try:
    run_config.resolve_micro_batch(c, num_devices)
  except ValueError as e:
    raise SystemExit(str(e)) from None
  cfg = experiment.model_config(c)
  if run_config.lora_settings(c) is not None:  # model.lora: the update compiles on the adapter, the base beside it
    from astarpo_jax.model import lora
    cfg = lora.model_config(cfg, run_config.lora_settings(c))
  method = run_config.build_method(c)
  settings = dict(c.algo.to_dict(), logp_chunk=c.train.logp_chunk)
  run = run_shape(c, _REF_BATCH.value or None)
  from astarpo_jax.aot import phases
  optimizers = phases.optimizers_for(method, run)  # optim.kind / optim.mu_dtype (the schedule: no bytes)
  from astarpo_jax.infra import sharding
  backend = jax.default_backend() if device == "local" else "tpu" if device.lower().startswith("v") else "gpu"
  try:
    sample_shape = sharding.resolve_sample_shape(tuple(c.mesh.sample_shape), sharding.resolve_mesh_shape(
        tuple(c.mesh.shape), num_devices), backend, cfg.num_heads, cfg.num_kv_heads)
    plan = mp.plan_memory(cfg, run, tuple(c.mesh.shape), num_devices=num_devices,
                          ref_param_dtype=run.ref_param_dtype, optimizers=optimizers, method=method,
                          mini_batch=c.train.mini_batch, usable_bytes=usable, device=name,
                          compile=_COMPILE.value and not _AOT.value, sample_shape=sample_shape,
                          page_size=_page_size(c, backend), backend=backend)
    if _AOT.value:
      plan = _aot_phases(plan, cfg, run, device, settings)
  except (ValueError, RuntimeError) as e:  # settings the mesh cannot run, or no libtpu for --aot
    print(f"cannot plan {c.model.name_or_path} on {name}: {e}")
    sys.exit(2)
  _print_plan(plan, c, cfg, run, method)
  if usable is None:
    print("\nno memory limit known for this device (CPU): nothing to check against")
    return
  try:
    mp.check_fits(plan)
  except mp.MemoryPlanError as e:
    print(f"\n{e}")
    if _AOT.value:
      print(_what_fits(plan, cfg, run, device, settings))
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
