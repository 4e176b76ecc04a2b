"""A compiled decode step against what it must move: the bytes a chip holds and the slice's memory roofline.

A decode step has to read, at least, every bf16 weight byte a chip holds and the live keys and values of its
slots. `live_bytes_rows` sets the compiled step's HBM bytes per chip (the paged kernel's counted from its
grid or loops at each live length: compiling.decode_step_at) beside that floor at several live lengths; the
slice's roofline reads every weight byte once and every live KV byte once across all its chips (the bound a
perfect layout with no copies of the weights would reach). Projections from compiles, not measurements.
"""
from __future__ import annotations

import dataclasses

import jax

from astarpo_jax.aot import compiling, fixed_costs, memory_plan
from astarpo_jax.aot.chips import ChipSpec
from astarpo_jax.aot.memory_plan import RunShape
from astarpo_jax.model import decoder
from astarpo_jax.model.config import ModelConfig


def weights_bytes(cfg: ModelConfig) -> int:
  """Every weight of the model in the compute dtype (the sampling copy)."""
  _, shapes = decoder.abstract_params(dataclasses.replace(cfg, param_dtype=cfg.dtype))
  return sum(int(s.size) * s.dtype.itemsize for s in jax.tree.leaves(shapes))


def slice_roofline_s(cfg: ModelConfig, chip: ChipSpec, num_chips: int, slots: int, live_len: int) -> float:
  """Seconds to read every weight byte and every live KV byte once, spread over the slice's chips."""
  kv = slots * live_len * memory_plan.kv_bytes_per_token(cfg)
  return (weights_bytes(cfg) + kv) / (num_chips * chip.hbm_bandwidth)


def held_bytes(cfg: ModelConfig, sample_mesh, slots: int, live_len: int) -> tuple[int, int]:
  """(bf16 weights one chip holds on `sample_mesh`, the live KV bytes of its slots) at `live_len` tokens."""
  _, shapes = decoder.abstract_params(dataclasses.replace(cfg, param_dtype=cfg.dtype))
  weights = memory_plan.tree_bytes_per_device(shapes, decoder.param_shardings(cfg, sample_mesh))
  d, f, t = (sample_mesh.shape[a] for a in ("data", "fsdp", "tensor"))
  kv_heads = cfg.num_kv_heads // t if cfg.num_kv_heads % t == 0 else cfg.num_kv_heads
  return weights, slots // (d * f) * live_len * memory_plan.kv_bytes_per_token(cfg, kv_heads)


def live_bytes_rows(res: "compiling.PhaseResult", cfg: ModelConfig, run: RunShape, chip: ChipSpec, sample_mesh,
                    page_size: int, lengths=(128, 390, 1024)) -> list[dict]:
  """Per live length: the compiled step's HBM bytes per chip, the floor (weights held + live KV), their ratio,
  the step's projected seconds (its roofline) and modeled seconds (fixed_costs.modeled_step: the compile's
  fixed costs counted; the roofline where none were read), the slice's roofline and the step's ratio to it."""
  rows = []
  kernel = compiling.kernel_of(res)
  cols = -(-(run.prompt_len + run.response_len - 1) // page_size) if page_size else 0
  for n in lengths:
    cost = compiling.decode_step_at(res, cfg, run, n, page_size)
    weights, kv = held_bytes(cfg, sample_mesh, run.sample_batch, n)
    step = res.times(chip, cost)["projected_s"]
    modeled = step
    if res.fixed:
      kb = compiling.paged_kernel_bytes(cfg, run.sample_batch, res.mesh_shape, page_size, n, kernel=kernel) \
          if page_size and kernel else 0.0
      waits = (fixed_costs.pallas_dma_waits(cfg, run.sample_batch, n, res.mesh_shape, page_size, cols, chip)
               if kernel == "pallas" and page_size else 0.0)
      modeled = fixed_costs.modeled_step(cost, fixed_costs.from_dict(res.fixed), chip, kb, waits)["modeled_s"]
    roof = slice_roofline_s(cfg, chip, sample_mesh.size, run.sample_batch, n)
    rows.append(dict(live_len=n, hbm_bytes=cost["hbm_bytes"], weights=weights, kv=kv,
                     bytes_ratio=cost["hbm_bytes"] / (weights + kv), step_s=step, modeled_s=modeled, roofline_s=roof,
                     roofline_ratio=step / roof))
  return rows
