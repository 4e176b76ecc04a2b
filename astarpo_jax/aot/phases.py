"""Every step of a run compiled ahead of time for a TPU slice, on a machine without one.

Each phase is built from shapes alone (`jax.ShapeDtypeStruct`s carrying the run's shardings, no
weights) and compiled by the real TPU compiler for compile-only devices (`chips.topology_devices`).
The compiled program gives per-device memory (`memory_analysis()`: an out-of-memory here is the
one the chip would report) and, read from its HLO with loop trip counts (`hlo_cost`), FLOPs, HBM
bytes and collective bytes, from which a roofline time: the largest of FLOPs / peak, HBM bytes /
HBM bandwidth and collective bytes / ICI bandwidth (a projection: it assumes perfect overlap).

PHASES is the one table of calls into the library: each builder takes (cfg, run, mesh, settings) and
returns (jitted function, abstract arguments with shardings). Re-point a builder when the library moves.
With a sampling mesh (config mesh.sample_shape) the sampling phases compile on it, on the copy of the
params `sampler.sampling_params` makes, and the `*_reshard` phases compile that copy itself.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import time
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from astarpo_jax import methods
from astarpo_jax.aot import hlo_cost, projection
from astarpo_jax.aot.chips import ChipSpec
from astarpo_jax.aot.memory_plan import RunShape, resident_bytes
from astarpo_jax.infra import platforms, sharding
from astarpo_jax.model import decoder, paged_attention
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.sampling import decode_plan, engine, paged_cache, sampler
from astarpo_jax.sampling.token_choice import SamplingConfig
from astarpo_jax.training import packing, scoring, update

# ----------------------------------------------------------------------------- abstract arguments


def _sds(shape, dtype, sh):
  dtype = dtype if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) else jnp.dtype(dtype)
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sh)


def _logical(mesh: Mesh, names, shape) -> NamedSharding:
  return NamedSharding(mesh, sharding.logical_to_spec(names, shape, dict(mesh.shape)))


def _params(cfg: ModelConfig, mesh: Mesh, dtype: str | None = None, unstacked: bool = False):
  """Abstract params in `dtype` (default cfg.param_dtype), placed by the rule table; `unstacked`: their layers
  as a list (decoder.unstack_layers: the GPU's sampling copy)."""
  c = cfg if dtype is None else dataclasses.replace(cfg, param_dtype=dtype)
  _, shapes = decoder.abstract_params(c)
  shardings = decoder.param_shardings(c, mesh)
  if unstacked:
    shapes = jax.eval_shape(decoder.unstack_layers, shapes)
    shardings = decoder.unstacked_shardings(shardings, cfg.num_layers)
  return jax.tree.map(lambda s, sh: _sds(s.shape, s.dtype, sh), shapes, shardings)


def _on_gpu(mesh: Mesh) -> bool:
  return platforms.is_gpu(mesh.devices.flat[0].platform)


def _rows(mesh: Mesh, shape) -> NamedSharding:
  """A [B, ...] array with its rows split over the batch axes, the rest whole."""
  return _logical(mesh, ("batch",) + (None,) * (len(shape) - 1), shape)


def method_of(name: str, settings: Mapping | None = None) -> methods.Method:
  """The method `name` bound to the config's settings (config.algo + train.logp_chunk, as
  run_config.build_method); fields a method does not declare are its defaults."""
  return methods.get(name, settings or {})


def method_run(run: RunShape, method: methods.Method) -> RunShape:
  """`run` with the method's responses per prompt: the same prompts per micro-batch, the method's rows."""
  return dataclasses.replace(run, rows_per_prompt=method.responses_per_prompt())


def optimizers_for(method: methods.Method) -> update.Optimizers:
  """AdamW for the policy (and the critic's, for a method with one); the schedule does not change shapes."""
  return update.Optimizers(update.make_optimizer(), update.make_optimizer() if method.footprint().critic else None)


# ----------------------------------------------------------------------------- phase builders
# The only calls into the library. Each: (cfg, run, mesh, settings) -> (jitted fn, abstract args).
# Sampling (engine.py): a prefill chunk of `rows` prompts and one decode segment over `rows` slots. On
# TPU the decode runs on the params in the compute dtype, on GPU on those with their layers unstacked
# (decoder.decode_params; the fused copy is the CPU's).


def _sampling(run: RunShape) -> SamplingConfig:
  return SamplingConfig(max_new_tokens=run.response_len, stop_ids=(1,))


def _slots_sharding(mesh: Mesh, path, leaf, paged: bool = False) -> NamedSharding:
  """Slot state: slots over the batch axes; the stacked KV cache [L, B, S, K, H] also splits kv heads; a page
  pool [L, pages, page, K * H] splits kv heads only (replicated over the batch axes), its free stack is whole."""
  in_cache = any(getattr(k, "name", getattr(k, "key", None)) == "cache" for k in path)
  if in_cache and paged:
    names = (None, None, None, "kv_heads") if leaf.ndim == 4 else (None,) * leaf.ndim
    return _logical(mesh, names, leaf.shape)
  if in_cache and leaf.ndim == 5:
    return _logical(mesh, (None, "batch", None, "kv_heads", None), leaf.shape)
  return _rows(mesh, leaf.shape)


def decode_layout(mesh: Mesh, settings) -> tuple[str, str]:
  """(KV layout, attention) a decode phase compiles: settings["decode_layout"] or the engine's default for
  the mesh's platform (paged on TPU/GPU), settings["paged_attention"] or the platform's kernel (Pallas on TPU,
  Triton on GPU)."""
  platform = mesh.devices.flat[0].platform
  layout = (settings or {}).get("decode_layout") or decode_plan.default_layout(platform)
  attention = (settings or {}).get("paged_attention") or paged_attention.default_implementation(platform)
  return layout, "dense" if layout == "dense" else attention


def page_layout(run: RunShape, prompts: int, platform: str, page_size: int | None = None) -> paged_cache.PageLayout:
  """The pool of a decode call over `prompts` prompts (a rollout's, or a Stage-1 chunk's) of the bucket's full
  length, each slot at its longest row (paged_cache.pool_layout, as the engine sizes it)."""
  return paged_cache.pool_layout(prompts, run.prompt_len, run.response_len,
                                 page_size or paged_cache.DEFAULT_PAGE_SIZE.get(platform, 16))


def _sample_copy(settings) -> bool:
  """Whether a sampling phase runs on the sampling mesh's copy (compute dtype) rather than the params as stored."""
  return (settings or {}).get("sample_mesh") is not None


def _prefill(cfg: ModelConfig, run: RunShape, mesh: Mesh, rows: int, param_dtype: str, settings=None):
  """One prefill chunk (the engine prefills at most a slot count of prompts per call); paged, its keys and
  values come back as the prompts' pages."""
  scfg, P = _sampling(run), run.prompt_len
  paged = decode_layout(mesh, settings)[0] == "paged"
  page = page_layout(run, 1, mesh.devices.flat[0].platform, (settings or {}).get("page_size")).page_size if paged else 0
  fn = jax.jit(lambda params, tokens, mask, key: engine._prefill(cfg, scfg, 1, False, page, params, tokens, mask, key,
                                                                  jnp.int32(0)))
  key = jax.eval_shape(lambda: jax.random.key(0))
  unstacked = _on_gpu(mesh) and param_dtype == cfg.dtype and _sample_copy(settings)  # sampler.sampling_params
  args = (_params(cfg, mesh, param_dtype, unstacked), _sds((rows, P), jnp.int32, _rows(mesh, (rows, P))),
          _sds((rows, P), bool, _rows(mesh, (rows, P))), _sds(key.shape, key.dtype, NamedSharding(mesh, PartitionSpec())))
  return fn, args


def _decode(cfg: ModelConfig, run: RunShape, mesh: Mesh, rows: int, prompts: int, settings=None):
  """One decode segment: the while_loop over steps of `rows` slots, on the params in the compute dtype
  (decoder.decode_params casts an fp32 policy once per call, off the CPU). Dense: each slot's cache holds
  P + T - 1 columns; paged: the call's page pool (`page_layout`) and a page table per slot."""
  scfg, P, T = _sampling(run), run.prompt_len, run.response_len
  params = _params(cfg, mesh, cfg.dtype, unstacked=_on_gpu(mesh))  # decoder.decode_params
  layout, attention = decode_layout(mesh, settings)
  pages_at = page_layout(run, prompts, mesh.devices.flat[0].platform, (settings or {}).get("page_size")) \
      if layout == "paged" else None

  def empty():
    if pages_at is None:
      return engine._empty_slots(cfg, T, P, rows, False)
    shape = (cfg.num_layers, pages_at.shared, pages_at.page_size, cfg.num_kv_heads * cfg.head_dim)
    prompts = jnp.zeros(shape, cfg.dtype)
    return engine._empty_slots(cfg, T, P, rows, False, pages_at, paged_cache.init(prompts, prompts, pages_at, rows))
  slots = jax.eval_shape(empty)
  slots = jax.tree_util.tree_map_with_path(lambda path, leaf: _sds(leaf.shape, leaf.dtype, _slots_sharding(
      mesh, path, leaf, pages_at is not None)), slots)
  window = P + (run.decode_len or T) - 1  # columns attended (the cache keeps P + T - 1)
  fn = jax.jit(lambda p, st: engine._segment(cfg, scfg, window, attention, p, st, jnp.int32(rows + 1))[:2],
               donate_argnums=(1,))
  return fn, (params, slots)


def _reshard(cfg: ModelConfig, mesh: Mesh, sample_mesh: Mesh, param_dtype: str):
  """`sampler.sampling_params`: the params as stored on the training mesh -> the compute-dtype copy on the
  sampling mesh (one call per sampling call). Both meshes order the same devices, so one program."""
  c = dataclasses.replace(cfg, param_dtype=param_dtype)
  out = decoder.param_shardings(c, sample_mesh)  # as the eager device_put places it (inside a jit it only hints)
  backend = "gpu" if _on_gpu(mesh) else "tpu"
  if backend == "gpu":  # the GPU's copy has its layers unstacked
    out = decoder.unstacked_shardings(out, c.num_layers)
  fn = jax.jit(lambda p: sampler.sampling_params(c, p, sample_mesh, backend=backend), out_shardings=out)
  return fn, (_params(c, mesh),)


def build_stage1_reshard(cfg, run, mesh, settings=None):
  return _reshard(cfg, mesh, settings["sample_mesh"], run.ref_param_dtype)


def build_rollout_reshard(cfg, run, mesh, settings=None):
  return _reshard(cfg, mesh, settings["sample_mesh"], cfg.param_dtype)


def build_stage1_prefill(cfg, run, mesh, settings=None):
  return _prefill(cfg, run, mesh, run.stage1_rows, cfg.dtype if _sample_copy(settings) else run.ref_param_dtype,
                  settings)


def build_stage1_decode(cfg, run, mesh, settings=None):
  return _decode(cfg, run, mesh, run.stage1_rows, run.stage1_prompts or run.rollout_batch, settings)


def build_rollout_prefill(cfg, run, mesh, settings=None):
  return _prefill(cfg, run, mesh, run.sample_batch, cfg.dtype if _sample_copy(settings) else cfg.param_dtype,
                  settings)


def build_rollout_decode(cfg, run, mesh, settings=None):
  return _decode(cfg, run, mesh, run.sample_batch, run.rollout_batch, settings)


def build_reference(cfg, run, mesh, settings=None):
  """`scoring.logprobs` (the gradient-free scoring forward every method's prepare runs) on the
  reference params, `run.reference_rows` rows at a time as the loop runs it."""
  ref_cfg = dataclasses.replace(cfg, param_dtype=run.ref_param_dtype)
  B, S = run.reference_rows, run.seq_len
  fn = jax.jit(lambda p, t, m, pk: scoring.logprobs(ref_cfg, p, t, m, prompt_len=run.prompt_len, pack=pk))
  return fn, (_params(ref_cfg, mesh), _sds((B, S), jnp.int32, _rows(mesh, (B, S))),
              _sds((B, S), bool, _rows(mesh, (B, S))), _packed(run, mesh, B, settings))


def build_values(cfg, run, mesh, settings=None):
  """PPO's critic forward (`ppo.critic_values`, no gradients) on `run.reference_rows` rollout rows: the one
  scoring forward a critic method adds to π_ref's, run as often as the reference phase."""
  from astarpo_jax.methods import ppo
  axes, shapes = ppo.critic_layout(cfg)
  critic = jax.tree.map(lambda s, sh: _sds(s.shape, s.dtype, sh), shapes,
                        sharding.tree_shardings(mesh, axes, shapes, sharding.DEFAULT_RULES))
  B, S = run.reference_rows, run.seq_len
  fn = jax.jit(lambda c, t, m, pk: ppo.critic_values(cfg, c, t, m, prompt_len=run.prompt_len, pack=pk))
  return fn, (critic, _sds((B, S), jnp.int32, _rows(mesh, (B, S))), _sds((B, S), bool, _rows(mesh, (B, S))),
              _packed(run, mesh, B, settings))


def _packed(run, mesh: Mesh, rows: int, settings, lead: tuple = ()) -> dict | None:
  """A micro-batch's packed arrays (train.pack_rows) when `settings` has `pack_fill`, else None."""
  if not (settings or {}).get("pack_fill"):
    return None
  shapes = packing.packed_shapes(rows, run.prompt_len, run.response_len, sharding.batch_ways(mesh),
                                 settings["pack_fill"])
  sh = NamedSharding(mesh, PartitionSpec(*(None,) * len(lead), update.batch_sharding(mesh, rows).spec[1]))
  return {k: _sds(lead + shape, dtype, sh) for k, (shape, dtype) in shapes.items()}


def build_update(name: str, cfg, run, mesh, settings=None):
  """The method's jitted, donated update step (`update.jit_update_step` with its loss), on abstract train
  state sharded by `update.state_shardings` (a critic's too) and [M, b, ...] micro-batches of its batch."""
  method = method_of(name, settings)
  optimizers, run = optimizers_for(method), method_run(run, method)
  critic = method.critic_layout(cfg) if method.footprint().critic else (None, None)
  shardings = update.state_shardings(cfg, optimizers, mesh, *critic)
  shapes = jax.eval_shape(lambda p, c: update.init_train_state(p, optimizers, c), decoder.abstract_params(cfg)[1],
                          critic[1])
  state = jax.tree.map(lambda s, sh: _sds(s.shape, s.dtype, sh), shapes, shardings)
  bsh = update.batch_sharding(mesh, run.micro_rows)
  M = run.mini_rows // run.micro_rows
  batch = {k: _sds((M,) + tuple(shape), dtype, bsh) for k, (shape, dtype) in
           method.batch_shapes(run.micro_rows, run.prompt_len, run.response_len).items()}
  batch.update(_packed(run, mesh, run.micro_rows, settings, (M,)) or {})
  step = update.jit_update_step(cfg, functools.partial(method.loss, cfg, run.prompt_len), optimizers, shardings, bsh)
  return step, (state, batch)


Builder = Callable[..., tuple]
UPDATE_METHODS = ("astarpo", "grpo", "ppo", "rebel", "rloo")
PHASES: dict[str, Builder] = {
    "stage1_reshard": build_stage1_reshard,
    "rollout_reshard": build_rollout_reshard,
    "stage1_prefill": build_stage1_prefill,
    "stage1_decode": build_stage1_decode,
    "rollout_prefill": build_rollout_prefill,
    "rollout_decode": build_rollout_decode,
    "reference": build_reference,
    "ppo_values": build_values,
    **{f"{m}_update": functools.partial(build_update, m) for m in UPDATE_METHODS},
}
DECODE_PHASES = ("stage1_decode", "rollout_decode")
SAMPLING_PHASES = ("stage1_prefill", "stage1_decode", "rollout_prefill", "rollout_decode")  # on the sampling mesh
RESHARD_PHASES = ("stage1_reshard", "rollout_reshard")  # only with a sampling mesh


def update_method(phase: str) -> str | None:
  """'grpo' for 'grpo_update'; None for a phase that is no method's update."""
  return phase[:-len("_update")] if phase.endswith("_update") else None


# ----------------------------------------------------------------------------- compiling and reading


def resident_other(phase: str, cfg: ModelConfig, run: RunShape, mesh: Mesh, method: methods.Method,
                   sample_copy: bool = False) -> int:
  """Per-device bytes of the resident state a phase does not take as an argument (it stays in HBM
  meanwhile), on the training mesh `mesh`: Stage 1 holds only the reference; Stage 2 holds the policy,
  its optimizer state, a critic and the reference (for a method that scores it) throughout.
  `sample_copy`: a sampling phase runs on the sampling mesh's copy, so the params it samples with stay
  resident beside it (the copy is its argument)."""
  resident = resident_bytes(cfg, run.ref_param_dtype, optimizers_for(method), mesh, method)
  if phase.startswith("stage1"):
    return resident["ref_params"] if sample_copy and phase in SAMPLING_PHASES else 0
  if "reference" not in method.footprint().scored:
    resident.pop("ref_params")
  taken = {"rollout_prefill": ("params",), "rollout_decode": ("params",), "rollout_reshard": ("params",),
           "reference": ("ref_params",), "ppo_values": ("critic",)}.get(phase, ("params", "opt_state", "critic", "critic_opt_state"))
  if sample_copy and phase in SAMPLING_PHASES:
    taken = ()
  return sum(v for k, v in resident.items() if k not in taken)


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
  useful_flops: float = 0.0  # per device
  collectives: dict = dataclasses.field(default_factory=dict)
  custom_calls: dict = dataclasses.field(default_factory=dict)
  segments: dict = dataclasses.field(default_factory=dict)  # decode: columns attended -> per-step cost
  page_size: int = 0  # a paged decode: its segments are keyed by live tokens per slot (decode_step_at)
  top_ops: list = dataclasses.field(default_factory=list)  # [(opcode, JAX op, TFLOP, HBM GB, all-space GB)]
  hlo: dict = dataclasses.field(default_factory=dict, repr=False)  # keep_hlo: {None or cache slots: HLO text}

  @property
  def peak(self) -> int:
    m = self.memory
    return self.resident_other + m["argument"] + m["output"] - m["alias"] + m["temp"] + m["code"] if m else 0

  def times(self, chip: ChipSpec, cost: dict | None = None) -> dict:
    """Roofline seconds: compute, HBM, ICI, and the projection (their max)."""
    c = cost or self.cost
    hops = max(int(np.prod(self.mesh_shape)) - 1, 1) if self.mesh_shape else 1
    t = {"compute_s": c["flops"] / chip.peak_flops, "hbm_s": c["hbm_bytes"] / chip.hbm_bandwidth,
         "ici_s": c["collective_bytes"] / chip.ici_bandwidth
         + c.get("collective_count", 0.0) * chip.collective_latency(hops)}
    t["projected_s"] = max(t.values())
    return t

  def mfu(self, chip: ChipSpec) -> float:
    return self.useful_flops / (self.times(chip)["projected_s"] * chip.peak_flops) if self.cost else 0.0


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


def bind_phase(phase: str, run: RunShape, settings: Mapping | None, sample_mesh: Mesh | None = None):
  """(run, settings, method) as `phase`'s builder in PHASES takes them: an update phase binds its method
  to the settings and the run to its rows per prompt; the settings carry the sampling mesh."""
  settings = dict(settings or {})
  own = update_method(phase) or ("ppo" if phase == "ppo_values" else None)  # a phase of one method
  method = method_of(own or settings.get("name", "astarpo"), settings)
  run = method_run(run, method) if own else run
  settings["sample_mesh"] = sample_mesh
  return run, settings, method


def compile_phase(phase: str, cfg: ModelConfig, run: RunShape, mesh: Mesh, settings: Mapping | None = None,
                  keep_hlo: bool = False, sample_mesh: Mesh | None = None) -> PhaseResult:
  """Build, compile and read one phase; a compile error (the chip's OOM) is returned, not raised.
  A decode phase compiles the engine's segment at its smallest and largest attention window for the
  target's default (`decode_plan.default_window_step`: the whole cache only on TPU/GPU).

  `settings`: the config's method settings (config.algo as a dict, with train.logp_chunk); an update
  phase binds its method to them, the other phases count the resident state of `settings["name"]`'s
  method (default A*-PO). `sample_mesh`: the sampling mesh (mesh.sample_shape, over `mesh`'s devices in
  the same order; None = sample on `mesh`): the sampling phases compile on it, the reshard phases onto it."""
  if phase in RESHARD_PHASES and sample_mesh is None:
    raise ValueError(f"{phase} compiles the copy onto a sampling mesh: set mesh.sample_shape")
  run, settings, method = bind_phase(phase, run, settings, sample_mesh)
  on = sample_mesh if sample_mesh is not None and phase in SAMPLING_PHASES else mesh
  decode = phase in DECODE_PHASES
  windows = decode_plan.attention_windows(run.prompt_len, run.response_len,
                                     decode_plan.default_window_step(run.response_len, on.devices.flat[0].platform))
  # decode_len d: the segment attends over P + d - 1 columns
  segments = tuple(sorted({w - run.prompt_len + 1 for w in (windows[0], windows[-1])})) if decode else (None,)
  res = PhaseResult(phase, tuple(on.devices.shape), 0.0)
  res.resident_other = resident_other(phase, cfg, run, mesh, method, sample_copy=sample_mesh is not None)
  texts = {}
  for seg in segments:
    seg_run = dataclasses.replace(run, decode_len=seg) if seg else run
    fn, args = PHASES[phase](cfg, seg_run, on, settings)
    t = time.perf_counter()
    try:
      compiled = _compile(fn, args, on)
    except Exception as e:  # noqa: BLE001  the compiler's verdict is the result
      res.compile_s += time.perf_counter() - t
      res.error = out_of_memory(str(e)) or f"{type(e).__name__}: {str(e)[:600]}"
      return res
    res.compile_s += time.perf_counter() - t
    ma = compiled.memory_analysis()
    res.memory = {k: int(getattr(ma, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
    res.memory["code"] = int(ma.generated_code_size_in_bytes)
    xla = compiled.cost_analysis() or {}
    res.xla = {"flops": float(xla.get("flops", 0)), "bytes": float(xla.get("bytes accessed", 0))}
    texts[run.prompt_len + seg - 1 if seg else None] = compiled.as_text()
  read_hlo(res, texts, cfg, run, mesh.devices.size)
  if decode and res.cost.get("kernel_hbm_bytes"):  # paged: the kernel's bytes at each live length
    res.page_size = page_layout(run, run.rollout_batch, on.devices.flat[0].platform,
                                (settings or {}).get("page_size")).page_size
    S = run.prompt_len + run.response_len - 1
    res.segments = {n: decode_step_at(res, cfg, run, n, res.page_size) for n in (run.prompt_len, S)}
    res.cost = dict(res.segments[S])  # the step at the full cache, as the dense phases report it
  res.hlo = texts if keep_hlo else {}
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
  (plus the copy onto it once per rollout, per decode step of the rollout's mean length), and the fastest that
  fits the chip chosen. Returns (rows, chosen shape or None when none fits)."""
  mesh = abstract_mesh_devices(devices, mesh_shape)
  rows = []
  for shape in sample_layout_candidates(cfg, len(devices)):
    sample = None if tuple(shape) == tuple(mesh_shape) else abstract_mesh_devices(devices, shape)
    dec = compile_phase("rollout_decode", cfg, run, mesh, settings, sample_mesh=sample)
    row = {"shape": shape, "error": dec.error}
    if not dec.error:
      page = page_layout(run, run.rollout_batch, devices[0].platform, (settings or {}).get("page_size")).page_size
      cost = decode_step_at(dec, cfg, run, live_len, page)
      row.update(dec.times(chip, cost), peak=dec.peak, fits=dec.peak <= usable_bytes, result=dec, page_size=page,
                 mesh=sample if sample is not None else mesh,
                 hbm_bytes=cost["hbm_bytes"], collective_bytes=cost["collective_bytes"],
                 collectives=cost.get("collective_count", 0.0))
      if sample is not None:
        copy = compile_phase("rollout_reshard", cfg, run, mesh, settings, sample_mesh=sample)
        row["copy_s"] = copy.times(chip)["projected_s"] if not copy.error else float("nan")
      else:
        row["copy_s"] = 0.0
      steps = projection.expected_max_length(run.response_len, run.sample_batch)
      row["step_with_copy_s"] = row["projected_s"] + row["copy_s"] / max(steps, 1)
    rows.append(row)
  fitting = [r for r in rows if not r["error"] and r["fits"]]
  chosen = min(fitting, key=lambda r: r["step_with_copy_s"])["shape"] if fitting else None
  return rows, chosen


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
