"""A compiled phase timed on this process's devices beside the roofline compiling.py projects for it.

The check a lent accelerator allows (experiments/measure_step.py): the program is the one phases.PHASES builds
for the tables of docs/tpu.md, compiled here, its roofline read from its HLO as compiling.read_hlo reads it, then
run on random inputs placed with the program's own shardings. A decode phase is one segment of the engine's
`while_loop` whose trip count depends on the rows: it runs from a slot state in which every slot decodes
exactly `decode_steps` more tokens, and the figures are per step (the roofline is one trip's cost, as
compiling.compile_phase reads a decode).
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from astarpo_jax.aot import compiling, phases, projection
from astarpo_jax.aot.chips import ChipSpec
from astarpo_jax.aot.memory_plan import RunShape
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.sampling import paged_cache


def input_maker(args):
  """seed -> concrete arrays for a pytree of ShapeDtypeStructs, placed with their shardings: floats ~ N(0, 0.02),
  booleans True (every token real), integers 0, PRNG keys from the seed. One program makes every leaf (compiled
  once, whatever the seed), not one per leaf."""
  leaves, tree = jax.tree.flatten(args)
  todo = [(i, a) for i, a in enumerate(leaves) if isinstance(a, jax.ShapeDtypeStruct)]

  def make(seed):
    out = []
    for i, a in todo:
      if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        key = jax.random.key(seed + i)
        out.append(jax.random.split(key, a.shape) if a.shape else key)
      elif jnp.issubdtype(a.dtype, jnp.floating):
        out.append((0.02 * jax.random.normal(jax.random.key(seed + i), a.shape)).astype(a.dtype))
      else:
        out.append(jnp.full(a.shape, a.dtype == jnp.bool_, a.dtype))
    return out

  shardings = [a.sharding for _, a in todo]
  made = jax.jit(make, out_shardings=shardings) if all(s is not None for s in shardings) else jax.jit(make)

  def inputs(seed: int):
    new = dict(zip((i for i, _ in todo), made(seed)))
    return jax.tree.unflatten(tree, [new.get(i, a) for i, a in enumerate(leaves)])

  return inputs


def random_inputs(args, seed: int):
  """`input_maker(args)(seed)`: one set of random inputs."""
  return input_maker(args)(seed)


def random_params(cfg: ModelConfig, mesh, dtype: str | None = None, seed: int = 0):
  """Params of `cfg` in `dtype` (default cfg.param_dtype), ~ N(0, 0.02), placed on `mesh` by the rule table:
  a model of any size on the device without a checkpoint or a host copy."""
  return random_inputs(phases._params(cfg, mesh, dtype), seed)


def decoding_slots(slots, steps: int, seed: int):
  """`slots` (an engine.Slots of random arrays) made to decode: every slot holds a row after a full prompt
  (step 1, position P), with a budget of 1 + `steps` tokens and uniforms in [0, 1), so a segment that runs
  until every slot is done takes `steps` trips (fewer only if every slot drew a stop token)."""
  B, P = slots.live_BP.shape
  T = slots.tokens_BT.shape[1]
  if not 1 <= steps < T:
    raise ValueError(f"decode_steps={steps}: must be in [1, {T - 1}] (the cache holds max_new_tokens={T})")
  put = lambda like, value: jax.device_put(np.asarray(value, like.dtype), like.sharding)  # noqa: E731
  u_BT = np.random.default_rng(seed).uniform(size=(B, T))
  if isinstance(slots.cache, paged_cache.Pages):  # paged: each slot reads a prompt's full pages, the stack is full
    pages, page = slots.cache, slots.cache.k.shape[2]
    F, per_prompt = pages.free_F.shape[0], P // page
    shared = pages.k.shape[1] - F - 1
    table = np.zeros(slots.table_BM.shape, np.int32)
    table[:, :per_prompt] = (np.arange(B) % max(shared // per_prompt, 1))[:, None] * per_prompt + np.arange(per_prompt)
    slots = dataclasses.replace(
        slots, table_BM=put(slots.table_BM, table), shared_B=put(slots.shared_B, np.full(B, per_prompt)),
        cache=dataclasses.replace(pages, free_F=put(pages.free_F, np.arange(shared, shared + F)[::-1]),
                                  top=put(pages.top, F), exhausted=put(pages.exhausted, False)))
  return dataclasses.replace(slots, row_B=put(slots.row_B, np.arange(B)), step_B=put(slots.step_B, np.ones(B)),
                             pos_B=put(slots.pos_B, np.full(B, P)), budget_B=put(slots.budget_B, np.full(B, 1 + steps)),
                             done_B=put(slots.done_B, np.zeros(B, bool)),
                             stopped_B=put(slots.stopped_B, np.zeros(B, bool)),
                             u_BT=put(slots.u_BT, u_BT), live_BP=put(slots.live_BP, np.ones((B, P), bool)))


def tokens_per_call(phase: str, run: RunShape) -> int:
  """Tokens one call processes: prompts x P for a prefill, one per slot for a decode step, rows x (P + R)
  for the reference forward and the update (the update's rows as `phases.bind_phase` binds its method)."""
  if phase.endswith("prefill"):
    return (run.stage1_rows if phase.startswith("stage1") else run.sample_batch) * run.prompt_len
  if phase in phases.DECODE_PHASES:
    return run.stage1_rows if phase.startswith("stage1") else run.sample_batch
  if phase == "reference":
    return run.reference_rows * run.seq_len
  return run.mini_rows * run.seq_len


def floors(phase: str, cfg: ModelConfig, run: RunShape, settings: dict, chip: ChipSpec) -> dict:
  """What a phase must cost on one `chip`, without compiling: its useful FLOPs at peak (`ideal_s`, the time
  at 100% MFU) and, for a decode step, the bytes every step reads (the weights in the compute dtype and the
  whole cache, which the accelerators' decode attends over) at the HBM bandwidth (`hbm_floor_s`). The device
  run reads its roofline from the compiled program instead (`measure`)."""
  run, _, _ = phases.bind_phase(phase, run, settings)
  useful = projection.useful_flops(phase, cfg, run)
  out = dict(phase=phase, tokens=tokens_per_call(phase, run), useful_flops=useful, ideal_s=useful / chip.peak_flops)
  if phase in phases.DECODE_PHASES:
    rows = tokens_per_call(phase, run)
    columns = run.prompt_len + run.response_len - 1
    cache = 2 * cfg.num_layers * rows * columns * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
    weights = cfg.num_params * jnp.dtype(cfg.dtype).itemsize
    out.update(slots=rows, hbm_floor_s=(weights + cache) / chip.hbm_bandwidth, cache_bytes=cache)
  return out


def measure(phase: str, cfg, run, mesh, settings: dict, chip, reps: int, decode_steps: int = 32) -> dict:
  """Roofline seconds (compute, HBM, ICI, their max) of `phase`'s compiled program and its measured median,
  with the measured MFU (useful FLOPs / (measured s x peak)) and tokens/s; a decode phase per step."""
  run, settings, _ = phases.bind_phase(phase, run, settings)
  fn, args = phases.PHASES[phase](cfg, run, mesh, settings)
  decode = phase in phases.DECODE_PHASES
  t = time.perf_counter()
  compiled = compiling._compile(fn, args, mesh)
  compile_s = time.perf_counter() - t
  key = run.prompt_len + run.response_len - 1 if decode else None  # the decode's cache columns: one step's cost
  res = compiling.read_hlo(compiling.PhaseResult(phase, tuple(mesh.devices.shape), compile_s), {key: compiled.as_text()},
                        cfg, run, mesh.devices.size)
  bounds = {k: v for k, v in res.times(chip).items() if k != "projected_s"}  # compute_s, hbm_s, ici_s
  times, trips = [], []
  make_inputs = input_maker(args)
  with jax.set_mesh(mesh):
    for rep in range(reps + 1):
      inputs = make_inputs(rep)
      if decode:
        inputs = (inputs[0], decoding_slots(inputs[1], decode_steps, seed=rep))
      jax.block_until_ready(inputs)
      t = time.perf_counter()
      out = jax.block_until_ready(compiled(*inputs))
      seconds = time.perf_counter() - t
      steps = int(np.max(np.asarray(out[0].step_B))) - 1 if decode else 1
      if rep:  # the first call is the warm-up
        times.append(seconds / max(steps, 1))
        trips.append(steps)
  measured = float(np.median(times))
  tokens = tokens_per_call(phase, run)
  out = dict(phase=phase, compile_s=compile_s, roofline_s=max(bounds.values()),
             bound=max(bounds, key=bounds.get).removesuffix("_s"), measured_s=measured,
             spread_s=(min(times), max(times)), useful_flops=res.useful_flops,
             mfu=res.useful_flops / (measured * chip.peak_flops), roofline_mfu=res.mfu(chip),
             tokens=tokens, tokens_per_s=tokens / measured, **bounds)
  if decode:
    out.update(slots=tokens, per="step", decode_steps=trips)
  return out
