"""The one table of calls into the library that the ahead-of-time tools compile (PHASES).

Each phase is built from shapes alone (`jax.ShapeDtypeStruct`s carrying the run's shardings, no weights):
a builder takes (cfg, run, mesh, settings) and returns (jitted function, abstract arguments with shardings).
Re-point a builder when the library moves. With a sampling mesh (config mesh.sample_shape) the sampling phases
compile on it, on the copy of the params `sampler.sampling_params` makes, and the `*_reshard` phases compile
that copy itself. Compiling and reading a phase: aot/compiling.py; meshes and what fits: aot/layouts.py.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from astarpo_jax import methods
from astarpo_jax.aot import projection
from astarpo_jax.aot.memory_plan import RunShape
from astarpo_jax.infra import platforms, sharding
from astarpo_jax.model import decoder, lora, paged_attention
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.sampling import decode_plan, engine, paged_cache, sampler
from astarpo_jax.sampling.token_choice import SamplingConfig
from astarpo_jax.training import optimizers as optimizers_lib, packing, scoring, update

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


def optimizers_for(method: methods.Method, run: RunShape | None = None) -> update.Optimizers:
  """The policy's optimizer as `run` names it (optim.kind, optim.mu_dtype: training/optimizers.py; AdamW without
  `run`) and AdamW for a critic, for a method with one; the schedule does not change shapes."""
  policy = (optimizers_lib.policy_optimizer(1e-6, kind=run.optimizer, mu_dtype=run.mu_dtype) if run
            else update.make_optimizer())
  return update.Optimizers(policy, update.make_optimizer() if method.footprint().critic else None)


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


@dataclasses.dataclass(frozen=True)
class Programs:
  """A phase the run makes as several programs, compiled one by one (the reshard, `sampler.sampling_params`):
  `before`, a whole-tree program on the training mesh whose output the copy reads (the cast to the compute dtype,
  on GPU with the layers unstacked: decoder.decode_params), or None when the params are already so; `leaves`, one
  (jitted copy, its abstract leaf, how many leaves of the tree it copies) per distinct (shape, dtype, shardings)."""
  before: tuple | None
  leaves: tuple


def _reshard(cfg: ModelConfig, mesh: Mesh, sample_mesh: Mesh, param_dtype: str):
  """`sampler.sampling_params` as the run makes it: the params as stored on the training mesh -> (cast once to
  the compute dtype there, when stored wider, or on GPU unstacked: `before`) -> each leaf copied onto the sampling
  mesh by its own program (`sampler.copy_to`, a jit of the identity with the leaf's out_sharding). Returns
  (Programs, the abstract params as stored)."""
  c = dataclasses.replace(cfg, param_dtype=param_dtype)
  backend = "gpu" if _on_gpu(mesh) else "tpu"
  stored = _params(c, mesh)
  before = None
  copied = stored
  if decoder.makes_decode_copy(c, backend):  # placed as the compiler propagates the stored leaves' shardings
    copied = _params(cfg, mesh, cfg.dtype, unstacked=backend == "gpu")
    before = (jax.jit(lambda p: decoder.decode_params(c, p, backend),
                      out_shardings=jax.tree.map(lambda x: x.sharding, copied)), (stored,))
  out = decoder.param_shardings(dataclasses.replace(cfg, param_dtype=cfg.dtype if before else param_dtype),
                                sample_mesh)
  if backend == "gpu":  # the GPU's copy has its layers unstacked
    out = decoder.unstacked_shardings(out, c.num_layers)
  counts: dict = {}
  for x, sh in zip(jax.tree.leaves(copied), jax.tree.leaves(out)):
    if x.sharding.is_equivalent_to(sh, len(x.shape)):  # copy_to keeps it as it is: no program, no new bytes
      continue
    key = (x.shape, x.dtype, x.sharding, sh)
    counts[key] = counts.get(key, 0) + 1
  leaves = tuple((jax.jit(sampler._identity, out_shardings=sh), (_sds(shape, dtype, src),), n)
                 for (shape, dtype, src, sh), n in counts.items())
  return Programs(before, leaves), (stored,)


def build_stage1_reshard(cfg, run, mesh, settings=None):
  return _reshard(cfg, mesh, settings["sample_mesh"], run.ref_param_dtype)


def _rollout_params_dtype(cfg) -> str:
  """The dtype of the params a rollout samples from: the policy's as stored, or with LoRA the merged copy
  (lora.sampling_params: the adapter folded into the base in the compute dtype, once per rollout)."""
  return cfg.dtype if lora.of(cfg) is not None else cfg.param_dtype


def build_rollout_reshard(cfg, run, mesh, settings=None):
  return _reshard(cfg, mesh, settings["sample_mesh"], _rollout_params_dtype(cfg))


def build_stage1_prefill(cfg, run, mesh, settings=None):
  return _prefill(cfg, run, mesh, run.stage1_rows, cfg.dtype if _sample_copy(settings) else run.ref_param_dtype,
                  settings)


def build_stage1_decode(cfg, run, mesh, settings=None):
  return _decode(cfg, run, mesh, run.stage1_rows, run.stage1_prompts or run.rollout_batch, settings)


def build_rollout_prefill(cfg, run, mesh, settings=None):
  return _prefill(cfg, run, mesh, run.sample_batch, cfg.dtype if _sample_copy(settings) else _rollout_params_dtype(cfg),
                  settings)


def build_rollout_decode(cfg, run, mesh, settings=None):
  return _decode(cfg, run, mesh, run.sample_batch, run.rollout_batch, settings)


def build_rollout_decode_adapter(cfg, run, mesh, settings=None):
  """The rollout decode with a LoRA adapter applied in every projection (x W + s (x A) B, layer_forms.Rows) instead
  of merged into a copy once per rollout (build_rollout_decode, lora.sampling_params): its arguments are the base
  (π_ref's tree) and the adapter cast to the compute dtype. On the training mesh (a sampling mesh would need its
  own copy of the base, which is what the merge saves)."""
  lcfg = lora.of(cfg)
  if lcfg is None:
    raise ValueError("rollout_decode_adapter compiles a LoRA config's decode (model.lora.rank > 0)")
  fn, (base, slots) = _decode(cfg, run, mesh, run.sample_batch, run.rollout_batch, settings)
  axes, shapes = lora.adapter_layout(cfg, lcfg, cfg.dtype)
  adapter = jax.tree.map(lambda s, sh: _sds(s.shape, s.dtype, sh), shapes, sharding.tree_shardings(mesh, axes, shapes))
  return fn, (lora.attach(base, adapter), slots)


def build_reference(cfg, run, mesh, settings=None):
  """`scoring.logprobs` (the gradient-free scoring forward every method's prepare runs) on the
  reference params, `run.reference_rows` rows at a time as the loop runs it; settings["ref_replicated"]: those
  params held whole over the batch axes (update.gathered_shardings), so no call gathers them."""
  ref_cfg = dataclasses.replace(cfg, param_dtype=run.ref_param_dtype)
  B, S = run.reference_rows, run.seq_len
  fn = jax.jit(lambda p, t, m, pk: scoring.logprobs(ref_cfg, p, t, m, prompt_len=run.prompt_len, pack=pk))
  params = _params(ref_cfg, mesh)
  if (settings or {}).get("ref_replicated"):
    params = jax.tree.map(lambda x: _sds(x.shape, x.dtype, update.gathered_shardings(x.sharding)), params)
  return fn, (params, _sds((B, S), jnp.int32, _rows(mesh, (B, S))),
              _sds((B, S), bool, _rows(mesh, (B, S))), _packed(run, mesh, B, settings, blocks=_score_blocks(run)))


def _score_blocks(run: RunShape) -> int:
  """The scoring calls of a rollout's rows packed together (scoring.in_packed_blocks: the whole blocks)."""
  return max(1, run.rollout_batch * run.rows_per_prompt // run.reference_rows)


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
              _packed(run, mesh, B, settings, blocks=_score_blocks(run)))


def mix_fill(run: RunShape, shards: int, rows: int, blocks: int, draws: int = 9, seed: int = 0) -> float:
  """The packed share of a shard's rows when `blocks` calls of `rows` rows are packed together (an optimizer
  step's micro-batches, or a rollout's scoring blocks): each row a prompt of projection.PROMPT_TOKENS and a
  response drawn from projection's length mix, packed as packing.pack_microbatches packs them."""
  cdf_T = np.array([projection.length_cdf(t, run.response_len) for t in range(run.response_len + 1)])
  u = np.random.default_rng(seed).uniform(size=(draws, blocks * shards, rows // shards))
  resp = np.minimum(np.searchsorted(cdf_T, u), run.response_len)  # inverse CDF: the first t with P(<= t) >= u
  return packing.fill_of_lengths(min(projection.PROMPT_TOKENS, run.prompt_len) + resp, run.seq_len)


def computed_fill(phase: str, run: RunShape, mesh: Mesh, settings) -> float:
  """The share of a call's rows that it computes: packed (`_packed`), the packed rows over the rows; else 1."""
  fill = (settings or {}).get("pack_fill")
  if not fill or not (phase in ("reference", "ppo_values") or update_method(phase)):
    return 1.0
  rows, blocks = ((run.micro_rows, run.mini_rows // run.micro_rows) if update_method(phase)
                  else (run.reference_rows, _score_blocks(run)))
  shards = sharding.batch_ways(mesh)
  if fill == "mix":
    fill = mix_fill(run, shards, rows, blocks)
  (_, Q, _), _ = packing.packed_shapes(rows, run.prompt_len, run.response_len, shards, fill)["pack_tokens"]
  return Q / (rows // shards)


def _packed(run, mesh: Mesh, rows: int, settings, lead: tuple = (), blocks: int = 1) -> dict | None:
  """A micro-batch's packed arrays (train.pack_rows) when `settings` has `pack_fill` (a share of the rows, or
  "mix": `mix_fill` over `blocks` calls packed together), else None."""
  fill = (settings or {}).get("pack_fill")
  if not fill:
    return None
  if fill == "mix":
    fill = mix_fill(run, sharding.batch_ways(mesh), rows, blocks)
  shapes = packing.packed_shapes(rows, run.prompt_len, run.response_len, sharding.batch_ways(mesh), fill)
  sh = NamedSharding(mesh, PartitionSpec(*(None,) * len(lead), update.batch_sharding(mesh, rows).spec[1]))
  return {k: _sds(lead + shape, dtype, sh) for k, (shape, dtype) in shapes.items()}


def build_update(name: str, cfg, run, mesh, settings=None):
  """The method's jitted, donated update step (`update.jit_update_step` with its loss), on abstract train
  state sharded by `update.state_shardings` (a critic's too) and [M, b, ...] micro-batches of its batch; with a
  LoRA model config (lora.model_config) on the adapter's state and the frozen base in run.ref_param_dtype."""
  method = method_of(name, settings)
  optimizers, run = optimizers_for(method, run), method_run(run, method)
  critic = method.critic_layout(cfg) if method.footprint().critic else (None, None)
  adapter = lora.of(cfg)  # LoRA: the state is the adapter's, the frozen base (π_ref's tree) a further argument
  shardings = update.state_shardings(cfg, optimizers, mesh, *critic, lora_cfg=adapter)
  policy = decoder.abstract_params(cfg)[1] if adapter is None else lora.adapter_layout(cfg, adapter)[1]
  shapes = jax.eval_shape(lambda p, c: update.init_train_state(p, optimizers, c), policy, critic[1])
  shardings["opt_state"] = optimizers_lib.place_state(shapes["opt_state"], shardings["opt_state"])
  state = jax.tree.map(lambda s, sh: _sds(s.shape, s.dtype, sh), shapes, shardings)
  bsh = update.batch_sharding(mesh, run.micro_rows)
  M = run.mini_rows // run.micro_rows
  batch = {k: _sds((M,) + tuple(shape), dtype, bsh) for k, (shape, dtype) in
           method.batch_shapes(run.micro_rows, run.prompt_len, run.response_len).items()}
  batch.update(_packed(run, mesh, run.micro_rows, settings, (M,), blocks=M) or {})
  if adapter is not None:
    base = _params(cfg, mesh, run.ref_param_dtype)
    step = update.jit_update_step(cfg, functools.partial(method.loss, cfg, run.prompt_len), optimizers, shardings, bsh,
                                  lora_base=True, base_shardings=jax.tree.map(lambda x: x.sharding, base))
    return step, (state, batch, base)
  gather = (settings or {}).get("gather_weights") or "per_micro_batch"  # "auto": the first that fits of
  if gather == "auto":  # layouts.compile_gathered's order, as update.resolve_gather's
    gather = "per_step" if method.footprint().critic else "per_step_local"
  step = update.jit_update_step(cfg, functools.partial(method.loss, cfg, run.prompt_len), optimizers, shardings, bsh,
                                gather_weights=gather)
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
    "rollout_decode_adapter": build_rollout_decode_adapter,
    "reference": build_reference,
    "ppo_values": build_values,
    **{f"{m}_update": functools.partial(build_update, m) for m in UPDATE_METHODS},
}
DECODE_PHASES = ("stage1_decode", "rollout_decode", "rollout_decode_adapter")
SAMPLING_PHASES = ("stage1_prefill", "stage1_decode", "rollout_prefill", "rollout_decode")  # on the sampling mesh
RESHARD_PHASES = ("stage1_reshard", "rollout_reshard")  # only with a sampling mesh
LORA_PHASES = ("rollout_decode_adapter",)  # only for a config with an adapter (model.lora.rank > 0)


def update_method(phase: str) -> str | None:
  """'grpo' for 'grpo_update'; None for a phase that is no method's update."""
  return phase[:-len("_update")] if phase.endswith("_update") else None


def bind_phase(phase: str, run: RunShape, settings: Mapping | None, sample_mesh: Mesh | None = None):
  """(run, settings, method) as `phase`'s builder in PHASES takes them: an update phase binds its method
  to the settings and the run to its rows per prompt; the settings carry the sampling mesh."""
  settings = dict(settings or {})
  own = update_method(phase) or ("ppo" if phase == "ppo_values" else None)  # a phase of one method
  method = method_of(own or settings.get("name", "astarpo"), settings)
  run = method_run(run, method) if own else run
  settings["sample_mesh"] = sample_mesh
  return run, settings, method
