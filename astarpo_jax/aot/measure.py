"""A compiled phase timed on this process's devices beside the roofline phases.py projects for it.

The check a lent accelerator allows (experiments/measure_step.py): the program is the one phases.PHASES builds
for the tables of docs/tpu.md, compiled here, its roofline read from its HLO as phases.read_hlo reads it, then
run on random inputs placed with the program's own shardings.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from astarpo_jax.aot import phases


def random_inputs(args, seed: int):
  """Concrete arrays for a pytree of ShapeDtypeStructs, placed with their shardings: floats ~ N(0, 0.02),
  booleans True (every token real), integers 0, PRNG keys from `seed`."""
  leaves, tree = jax.tree.flatten(args)
  out = []
  for i, a in enumerate(leaves):
    if not isinstance(a, jax.ShapeDtypeStruct):
      out.append(a)
      continue
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
      make = lambda s=a.shape, i=i: jax.random.split(jax.random.key(seed + i), s) if s else jax.random.key(seed + i)  # noqa: E731
    elif jnp.issubdtype(a.dtype, jnp.floating):
      make = lambda s=a.shape, d=a.dtype, i=i: (0.02 * jax.random.normal(jax.random.key(seed + i), s)).astype(d)  # noqa: E731
    else:
      make = lambda s=a.shape, d=a.dtype: jnp.full(s, d == jnp.bool_, d)  # noqa: E731
    out.append(jax.jit(make, out_shardings=a.sharding)() if a.sharding is not None else make())
  return jax.tree.unflatten(tree, out)


def measure(phase: str, cfg, run, mesh, settings: dict, chip, reps: int) -> dict:
  """Roofline seconds (compute, HBM, ICI, their max) of `phase`'s compiled program and its measured median."""
  run, settings, _ = phases.bind_phase(phase, run, settings)
  fn, args = phases.PHASES[phase](cfg, run, mesh, settings)
  t = time.perf_counter()
  compiled = phases._compile(fn, args, mesh)
  compile_s = time.perf_counter() - t
  res = phases.read_hlo(phases.PhaseResult(phase, tuple(mesh.devices.shape), compile_s), {None: compiled.as_text()},
                     cfg, run, mesh.devices.size)
  bounds = {k: v for k, v in res.times(chip).items() if k != "projected_s"}  # compute_s, hbm_s, ici_s
  times = []
  with jax.set_mesh(mesh):
    for rep in range(reps + 1):
      inputs = random_inputs(args, seed=rep)
      jax.block_until_ready(inputs)
      t = time.perf_counter()
      jax.block_until_ready(compiled(*inputs))
      if rep:  # the first call is the warm-up
        times.append(time.perf_counter() - t)
  return dict(phase=phase, compile_s=compile_s, roofline_s=max(bounds.values()),
              bound=max(bounds, key=bounds.get).removesuffix("_s"), measured_s=float(np.median(times)),
              spread_s=(min(times), max(times)), useful_flops=res.useful_flops, **bounds)
