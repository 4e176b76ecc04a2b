"""Per-device memory of a Stage-2 run, from shapes alone, before any weight is loaded.

A Stage-2 step has three phases that never overlap, on top of state that is always resident:

  resident   policy params, AdamW moments (mu, nu), frozen reference params
  sample     KV cache of the sampler, its per-layer copy of the weights, prefill and logits work
  reference  the scoring forwards, micro_batch rows at a time (`scoring.logprobs`)
  update     the jitted update step's temporaries: gradients, remat residuals, one layer's
             activations, logits chunks (the state itself is donated and updated in place)

Any method plans the same way (methods.Method): its responses per prompt multiply every row count,
and a method with a critic (PPO) holds a second network with its own optimizer state. With LoRA
(`RunShape.lora`) the policy's params and optimizer state are the adapter's, the reference is the frozen
base (one copy, in its own dtype), the update computes no weight gradient, and each rollout samples from
the adapter merged into a compute-dtype copy of the base (`lora_merged_copy` in the sample phase).

  peak = resident + max(sample, reference, update)

Resident bytes are exact: every leaf's shard shape under the rule table. The reference and update
phases are either compiled (`jax.jit(...).lower(abstract inputs).compile().memory_analysis()`,
nothing allocated) or estimated by the formulas in `estimate_*`; the sample phase is always the
formula. XLA's figures are those of the backend that compiled them: on CPU, bf16 arithmetic is
widened to fp32 and collectives are scheduled differently from TPU/GPU, so a CPU-compiled plan is
an estimate of the accelerator's too.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, NamedSharding

from astarpo_jax import methods
from astarpo_jax.aot.run_shape import (GiB, RunShape, _local, format_bytes,  # noqa: F401 (re-exported)
                                       tree_bytes_per_device)
from astarpo_jax.infra import platforms, sharding as sharding_lib
from astarpo_jax.model import decoder as model_lib, lora as lora_lib
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.sampling import paged_cache
from astarpo_jax.training import optimizers as optimizers_lib, scoring, update

PHASES = ("sample", "reference", "update")


class MemoryPlanError(ValueError):
  """The run does not fit the device; the message names the settings that would make it fit."""


# ----------------------------------------------------------------------------- resident state
# RunShape and the byte counts live in run_shape.py.


def _state_layout(cfg: ModelConfig, method: methods.Method, optimizers: update.Optimizers, mesh,
                  lora: lora_lib.LoraConfig | None = None):
  """(abstract train state, its shardings) of `method`: params (with `lora` the adapter's), optimizer state, and
  a critic if it has one."""
  abstract = model_lib.abstract_params(cfg)[1] if lora is None else lora_lib.adapter_layout(cfg, lora)[1]
  critic = method.critic_layout(cfg) if method.footprint().critic else (None, None)
  shardings = update.state_shardings(cfg, optimizers, mesh, *critic, lora_cfg=lora)
  shapes = jax.eval_shape(lambda p, c: update.init_train_state(p, optimizers, c), abstract, critic[1])
  shardings["opt_state"] = optimizers_lib.place_state(shapes["opt_state"], shardings["opt_state"])
  return shapes, shardings


def resident_bytes(cfg: ModelConfig, ref_param_dtype: str, optimizers: update.Optimizers, mesh,
                   method: methods.Method, lora: lora_lib.LoraConfig | None = None) -> dict[str, int]:
  """Per-device bytes of the policy params, the optimizer state, the reference params (and a critic's). With
  `lora` the params and optimizer state are the adapter's, the reference the frozen base the adapter reads."""
  lora = lora if lora is not None else lora_lib.of(cfg)  # a LoRA model config carries its adapter
  shapes, shardings = _state_layout(cfg, method, optimizers, mesh, lora)
  _, model_shapes = model_lib.abstract_params(cfg)
  ref = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(ref_param_dtype)), model_shapes)
  out = {"params": tree_bytes_per_device(shapes["params"], shardings["params"]),
         "opt_state": tree_bytes_per_device(shapes["opt_state"], shardings["opt_state"]),
         "ref_params": tree_bytes_per_device(ref, model_lib.param_shardings(cfg, mesh))}
  if "value_params" in shapes:
    out["critic"] = tree_bytes_per_device(shapes["value_params"], shardings["value_params"])
    out["critic_opt_state"] = tree_bytes_per_device(shapes["value_opt_state"], shardings["value_opt_state"])
  return out


# ----------------------------------------------------------------------------- analytic phases


def kv_bytes_per_token(cfg: ModelConfig, kv_heads: int | None = None) -> int:
  """Keys and values of one cached token over every layer, in the compute dtype (`kv_heads`: a device's)."""
  heads = cfg.num_kv_heads if kv_heads is None else kv_heads
  return cfg.num_layers * 2 * heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize


def _dims(cfg: ModelConfig, mesh_shape: dict[str, int]):
  return (_local(cfg.num_heads, "heads", mesh_shape), _local(cfg.num_kv_heads, "kv_heads", mesh_shape),
          _local(cfg.intermediate_size, "mlp", mesh_shape), _local(cfg.vocab_size, "vocab", mesh_shape))


def _layer_weights_unsharded_by_fsdp(cfg: ModelConfig, mesh_shape: dict[str, int]) -> int:
  """Elements of one layer's weights on a device once FSDP has gathered them (tensor split kept)."""
  n, k, f, _ = _dims(cfg, mesh_shape)
  D, H = cfg.hidden_size, cfg.head_dim
  return D * (2 * n + 2 * k) * H + 3 * D * f


@dataclasses.dataclass(frozen=True)
class Phase:
  """Extra bytes per device while one phase runs, what they are made of, and where they came from."""
  total: int
  parts: dict[str, int]  # components (analytic ones may not all be live at once: see each formula)
  source: str  # "analytic" or "compiled (<backend>)"


def estimate_sample(cfg: ModelConfig, run: RunShape, mesh_shape: dict[str, int], params_bytes: int,
                    page_size: int = 0) -> Phase:
  """Sampler (engine.py): the slots' KV cache slots x (P+R) x L x K x H x 2 (k, v) x dtype, the prompt
  pool's cache (every prompt prefilled once: prompts x P, same factors, on every batch shard), the outputs
  (rows x R x 9 bytes), plus the larger of one prefill chunk's attention [slots, N, P, P] fp32 x2 and
  the token choice's [slots, V] fp32 x4. The decode writes the slot cache in place (no second cache:
  docs/tpu.md 4.5); the copy of the weights it samples with is the caller's (`_sample_phase`). With
  `page_size` (the paged layout of TPU/GPU) the cache is the page pool instead, as sampling/paged_cache.pool_layout
  sizes it: every prompt's pages and each slot's longest row, on every batch
  shard (the pool is replicated over the batch axes)."""
  slots = _local(run.sample_batch, "batch", mesh_shape)
  prompts = run.rollout_batch  # the pool is replicated over the batch axes: any slot may take any prompt
  rows = _local(run.rollout_batch * run.rows_per_prompt, "batch", mesh_shape)
  n, k, _, v = _dims(cfg, mesh_shape)
  per_column = kv_bytes_per_token(cfg, k)
  if page_size:
    pool = paged_cache.pool_layout(prompts, run.prompt_len, run.response_len, page_size)
    slots_all = run.sample_batch
    kv = {"page_pool": pool.total(slots_all) * page_size * per_column, "kv_cache": 0, "prompt_pool": 0}
  else:
    kv = {"kv_cache": slots * run.seq_len * per_column, "prompt_pool": prompts * run.prompt_len * per_column}
  parts = {**kv,
           "rows_out": rows * run.response_len * 9,
           "prefill_attention": slots * n * run.prompt_len ** 2 * 4 * 2,
           "token_choice": slots * v * 4 * 4}
  total = (parts["kv_cache"] + parts["prompt_pool"] + parts.get("page_pool", 0) + parts["rows_out"]
           + max(parts["prefill_attention"], parts["token_choice"]))
  return Phase(total, parts, "analytic")


def estimate_reference(cfg: ModelConfig, run: RunShape, mesh_shape: dict[str, int]) -> Phase:
  """Reference forward on `run.reference_rows` rows, no gradients, one layer live at a time (lax.scan):
  gathered weights + hidden states [rows, S, D] x2 + the larger of one layer (scores and probs
  [rows, N, S, S] in fp32 and the compute dtype, MLP [rows, S, 3F]) and a [rows, 32, 4096] logits block."""
  dt = jnp.dtype(cfg.dtype).itemsize
  rows, S = _local(run.reference_rows, "batch", mesh_shape), run.seq_len
  n, _, f, v = _dims(cfg, mesh_shape)
  D = cfg.hidden_size
  parts = {"layer_weight_copies": (_layer_weights_unsharded_by_fsdp(cfg, mesh_shape) + D * v) * dt,
           "hidden_states": rows * S * D * dt * 2,
           "layer": rows * n * S * S * (4 + 4 + dt) + rows * S * 3 * f * dt,
           # one [rows, 32, 4096] block of logits and its exp, fp32 (scoring.logprobs)
           "logits_chunk": rows * min(scoring.SCORE_CHUNK, run.response_len) * min(scoring.SCORE_VOCAB_CHUNK, v) * 4 * 2}
  total = parts["layer_weight_copies"] + parts["hidden_states"] + max(parts["layer"], parts["logits_chunk"])
  return Phase(total, parts, "analytic")


def estimate_update(cfg: ModelConfig, run: RunShape, mesh_shape: dict[str, int], params_bytes: int,
                    critic: bool = False) -> Phase:
  """Train step: fp32 gradient accumulator + this micro-batch's gradients + AdamW's update tree
  (3x params), remat residuals (each layer's input [b, S, D]), FSDP-gathered weights of one layer
  and of the unembedding with their gradients, for tied embeddings a [D, V] copy of the embedding
  and its gradient, plus the larger of one layer's recomputed
  activations with their gradients and a logits chunk [b, chunk, V] fp32 x3. A critic (a second
  network of the policy's size) doubles the gradients, residuals and weight copies. With LoRA (`run.lora`)
  `params_bytes` is the adapter's, the gathered base weights get no gradient, the tied unembedding no copy
  (it is not trained), and the critic (a full network) keeps its own weight gradients."""
  dt = jnp.dtype(cfg.dtype).itemsize
  pb = jnp.dtype(cfg.param_dtype).itemsize
  b, S, D = _local(run.micro_rows, "batch", mesh_shape), run.seq_len, cfg.hidden_size
  nets = 2 if critic else 1
  n, _, f, v = _dims(cfg, mesh_shape)
  one_layer = b * n * S * S * (4 * 4 + dt) + b * S * f * 6 * dt + b * S * D * 6 * 4
  weights = (_layer_weights_unsharded_by_fsdp(cfg, mesh_shape) + D * v)
  lora = run.lora is not None
  parts = {"gradients_and_update": 3 * params_bytes * (1 if lora else nets),
           "residuals": nets * (cfg.num_layers * b * S * D * dt if cfg.remat else cfg.num_layers * one_layer),
           # the policy's gathered weights with their gradients (LoRA: the frozen base's, read only), a critic's
           "layer_weight_copies": weights * ((dt if lora else 2 * dt + pb) + (2 * dt + pb if critic else 0)),
           "layer": one_layer,
           "logits_chunk": b * min(run.logp_chunk, run.response_len) * v * 4 * 3,
           # tied embeddings: the [D, V] transposed copy and its gradient accumulator (update.accumulate_gradients)
           "tied_unembed": (_local(D, "embed", mesh_shape) * v * (dt if lora else 2 * pb)
                            if cfg.tie_embeddings else 0)}
  total = (parts["gradients_and_update"] + parts["residuals"] + parts["layer_weight_copies"] +
           parts["tied_unembed"] + max(parts["layer"], parts["logits_chunk"]))
  return Phase(total, parts, "analytic")


# ----------------------------------------------------------------------------- compiled phases


def _sds(shape, dtype, sharding):
  return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)


def _analysis(compiled) -> dict[str, int] | None:
  ma = compiled.memory_analysis()
  if ma is None:
    return None
  return {k: int(getattr(ma, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}


def _check_devices(mesh_shape: tuple[int, int, int]):
  n = math.prod(mesh_shape)
  if jax.device_count() < n:
    raise ValueError(f"compiling the plan for mesh {mesh_shape} needs {n} devices, this process has "
                     f"{jax.device_count()}: on CPU start it with XLA_FLAGS=--xla_force_host_platform_device_count={n} "
                     "(experiments/memory_plan.py does), or plan without compiling")
  return sharding_lib.make_mesh(mesh_shape, devices=jax.devices()[:n])


def compiled_update_bytes(cfg: ModelConfig, method: methods.Method, optimizers: update.Optimizers, run: RunShape,
                          mesh_shape: tuple[int, int, int], mini_batch: int) -> Phase | None:
  """XLA's per-device figures for the method's jitted, donated update step on abstract state and batch
  (temporaries, and batch inputs); None where the backend gives no memory analysis."""
  mesh = _check_devices(mesh_shape)
  shapes, shardings = _state_layout(cfg, method, optimizers, mesh, run.lora)
  state = jax.tree.map(lambda s, sh: _sds(s.shape, s.dtype, sh), shapes, shardings)
  bsh = update.batch_sharding(mesh, run.micro_rows)
  M, P, R = mini_batch // run.micro_batch, run.prompt_len, run.response_len
  batch = {k: _sds((M,) + shape, dtype, bsh) for k, (shape, dtype) in
           method.batch_shapes(run.micro_rows, P, R).items()}
  base, base_sh = (), None
  if run.lora is not None:  # the frozen base: an argument of the step, resident (not the phase's own bytes)
    base_cfg = dataclasses.replace(cfg, param_dtype=run.ref_param_dtype)
    base_sh = model_lib.param_shardings(base_cfg, mesh)
    base = (jax.tree.map(lambda s, sh: _sds(s.shape, s.dtype, sh), model_lib.abstract_params(base_cfg)[1], base_sh),)
    cfg = lora_lib.model_config(cfg, run.lora)
  with jax.set_mesh(mesh):
    step = update.jit_update_step(cfg, functools.partial(method.loss, cfg, P), optimizers, shardings, bsh,
                                  lora_base=bool(base), base_shardings=base_sh)
    compiled = step.lower(state, batch, *base).compile()
  ma = _analysis(compiled)
  if ma is None:
    return None
  state_bytes = tree_bytes_per_device(state, shardings) + (tree_bytes_per_device(base[0], base_sh) if base else 0)
  parts = {"temporaries": ma["temp"], "batch": ma["argument"] - state_bytes + ma["output"] - ma["alias"]}
  return Phase(sum(parts.values()), parts, f"compiled ({jax.default_backend()})")


def compiled_reference_bytes(cfg: ModelConfig, ref_param_dtype: str, run: RunShape,
                             mesh_shape: tuple[int, int, int]) -> Phase | None:
  """XLA's per-device figures for `scoring.logprobs` on `run.reference_rows` rows."""
  mesh = _check_devices(mesh_shape)
  ref_cfg = dataclasses.replace(cfg, param_dtype=ref_param_dtype)
  shardings = model_lib.param_shardings(ref_cfg, mesh)
  _, abstract = model_lib.abstract_params(ref_cfg)
  params = jax.tree.map(lambda s, sh: _sds(s.shape, s.dtype, sh), abstract, shardings)
  B, S = run.reference_rows, run.seq_len
  rows = NamedSharding(mesh, sharding_lib.logical_to_spec(("batch", None), (B, S), dict(mesh.shape)))
  with jax.set_mesh(mesh):
    compiled = scoring.logprobs.lower(ref_cfg, params, _sds((B, S), jnp.int32, rows), _sds((B, S), bool, rows),
                                              prompt_len=run.prompt_len).compile()
  ma = _analysis(compiled)
  if ma is None:
    return None
  parts = {"temporaries": ma["temp"],
           "inputs_and_output": ma["argument"] - tree_bytes_per_device(params, shardings) + ma["output"]}
  return Phase(sum(parts.values()), parts, f"compiled ({jax.default_backend()})")


def from_aot(result, resident_total: int, platform: str = "tpu") -> Phase:
  """A plan phase from an `aot.PhaseResult` compiled for the target itself: everything the phase adds to
  the resident state (its own inputs and outputs, temporaries, program code). A phase the compiler
  refused (out of memory) gets the bytes its message names, or more than any device has."""
  if result.error:
    used = (re.search(r"Used ([0-9.]+)([KMGT]?)(?:i?B)? of ([0-9.]+)([KMGT]?)", result.error)
            or re.search(r"HLO temporaries \(([0-9.]+)([KMGT]?)\)", result.error))  # libtpu 0.0.42's wording
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    total = int(float(used.group(1)) * scale[used.group(2)]) if used else 1 << 50
    return Phase(total, {"compile error": total}, f"compiled ({platform}): {result.error[:200]}")
  m = result.memory
  resident_args = resident_total - result.resident_other
  parts = {"temporaries": m["temp"], "code": m["code"],
           "inputs_and_outputs": m["argument"] + m["output"] - m["alias"] - resident_args}
  return Phase(sum(parts.values()), parts, f"compiled ({platform})")


# ----------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Per-device bytes: resident state and each phase's extra."""
  device: str
  usable_bytes: int | None
  mesh_shape: tuple[int, int, int]
  run: RunShape
  remat: bool
  resident: dict[str, int]
  phases: dict[str, Phase]

  @property
  def resident_total(self) -> int:
    return sum(self.resident.values())

  @property
  def peak_phase(self) -> str:
    return max(PHASES, key=lambda p: self.phases[p].total)

  @property
  def peak(self) -> int:
    return self.resident_total + self.phases[self.peak_phase].total

  def table(self) -> str:
    """A markdown table of the plan."""
    g = format_bytes
    rows = [f"| resident: {k} | {g(v)} | exact |" for k, v in self.resident.items()]
    for name in PHASES:
      ph = self.phases[name]
      rows.append(f"| {name} phase | {g(ph.total)} | {ph.source}: "
                  + ", ".join(f"{k} {g(v)}" for k, v in ph.parts.items()) + " |")
    limit = "unknown" if self.usable_bytes is None else g(self.usable_bytes)
    verdict = "?" if self.usable_bytes is None else ("fits" if self.peak <= self.usable_bytes else "DOES NOT FIT")
    rows.append(f"| **peak** (resident + {self.peak_phase}) | **{g(self.peak)}** | usable {limit}: {verdict} |")
    return "\n".join(["| per device | bytes | how |", "|---|---:|---|"] + rows)


def _sample_phase(cfg: ModelConfig, run: RunShape, ms: dict[str, int], params_bytes: int, sample_shape,
                  num_devices: int, page_size: int = 0, backend: str = "") -> Phase:
  """The sample phase on the sampling mesh with the params' copy there, or on the training mesh with the copy
  the decode makes there (model.makes_decode_copy): both the compute-dtype params, placed as on that mesh."""
  own_mesh = sample_shape and tuple(sharding_lib.resolve_mesh_shape(sample_shape, num_devices)) != tuple(ms.values())
  mesh = AbstractMesh(sharding_lib.resolve_mesh_shape(sample_shape, num_devices) if own_mesh else tuple(ms.values()),
                      sharding_lib.MESH_AXES)
  phase = estimate_sample(cfg, run, dict(mesh.shape), params_bytes, page_size)
  if run.lora is not None:  # the adapter merged into a compute-dtype copy of the base, once per rollout
    _, shapes = model_lib.abstract_params(dataclasses.replace(cfg, param_dtype=cfg.dtype))
    train_mesh = AbstractMesh(tuple(ms.values()), sharding_lib.MESH_AXES)  # merged where the base lives
    merged = tree_bytes_per_device(shapes, model_lib.param_shardings(cfg, train_mesh))
    phase = Phase(phase.total + merged, dict(phase.parts, lora_merged_copy=merged), phase.source)
    if not own_mesh and backend != "cpu" and not platforms.is_gpu(backend):
      return phase  # the decode runs on the merged copy itself
  elif not own_mesh and not model_lib.makes_decode_copy(cfg, backend):
    return phase
  _, shapes = model_lib.abstract_params(dataclasses.replace(cfg, param_dtype=cfg.dtype))
  copy = tree_bytes_per_device(shapes, model_lib.param_shardings(cfg, mesh))
  return Phase(phase.total + copy, dict(phase.parts, **{"sampling_copy" if own_mesh else "decode_copy": copy}),
               phase.source)


def plan_memory(cfg: ModelConfig, run: RunShape, mesh_shape: Sequence[int], *, num_devices: int,
                ref_param_dtype: str = "bfloat16", optimizers: update.Optimizers | None = None,
                method: methods.Method | None = None, mini_batch: int | None = None,
                usable_bytes: int | None = None, device: str = "", compile: bool = False,
                sample_shape: Sequence[int] | None = None, page_size: int = 0, backend: str = "") -> MemoryPlan:
  """The per-device plan for `cfg` and `run` on a (data, fsdp, tensor) mesh of `num_devices`.

  compile=True lowers and compiles the reference forward and the update step on abstract inputs
  (this process needs the mesh's device count); otherwise both phases use the `estimate_*` formulas.
  `method` defaults to A*-PO with its defaults; `run.rows_per_prompt` must be the method's.
  `sample_shape`: the sampling mesh (config mesh.sample_shape, resolved): the sample phase is planned on
  it, plus the compute-dtype copy of the params it holds (sampler.sampling_params). `page_size`: the decode's
  paged layout (TPU/GPU: sampling/paged_cache.DEFAULT_PAGE_SIZE), 0 the dense one (the CPU's). `backend` ("cpu",
  "tpu", "gpu"): which copy of the weights the decode makes without a sampling mesh (model.makes_decode_copy).
  """
  shape = sharding_lib.resolve_mesh_shape(mesh_shape, num_devices)
  method = method or methods.get("astarpo", {"logp_chunk": run.logp_chunk})
  if run.rows_per_prompt != method.responses_per_prompt():
    raise ValueError(f"run.rows_per_prompt={run.rows_per_prompt} but {method.name} samples "
                     f"{method.responses_per_prompt()} responses per prompt")
  critic = method.footprint().critic
  optimizers = optimizers or update.Optimizers(update.make_optimizer(), update.make_optimizer() if critic else None)
  mesh = AbstractMesh(shape, sharding_lib.MESH_AXES)
  ms = dict(mesh.shape)
  update.batch_sharding(mesh, run.micro_rows)  # a micro-batch the mesh cannot split fails here, with its fix
  resident = resident_bytes(cfg, ref_param_dtype, optimizers, mesh, method, run.lora)
  phases = {"sample": _sample_phase(cfg, run, ms, resident["params"], sample_shape, num_devices, page_size, backend),
            "reference": estimate_reference(cfg, run, ms),
            "update": estimate_update(cfg, run, ms, resident["params"], critic)}
  if compile:
    phases["reference"] = compiled_reference_bytes(cfg, ref_param_dtype, run, shape) or phases["reference"]
    phases["update"] = (compiled_update_bytes(cfg, method, optimizers, run, shape, mini_batch or run.micro_batch)
                        or phases["update"])
  return MemoryPlan(device, usable_bytes, shape, run, cfg.remat, resident, phases)


def _advice(plan: MemoryPlan, phase: str) -> str:
  r, tensor = plan.run, plan.mesh_shape[2]
  more = f"more devices on the fsdp axis (mesh.shape, now {plan.mesh_shape}) or a bigger device"
  if phase == "resident":
    return (f"params + AdamW state + reference alone need this much: use {more}, keep the reference in "
            "bfloat16 (model.ref_param_dtype), or store the policy in bfloat16 (model.param_dtype; AdamW's "
            "moments follow it, so this halves both, at a cost in update precision)")
  if phase == "sample":
    return (f"lower sampling.max_batch (now {r.sample_batch} decode slots; 0 means the backend's default) or "
            f"sampling.max_new_tokens (now {r.response_len}), or use {more}")
  if phase == "reference":
    return (f"the scoring forwards run on {r.reference_rows} rows at once: lower {r.micro_setting} or "
            f"data.max_prompt_tokens / sampling.max_new_tokens, or use {more}")
  remat = "" if plan.remat else "set model.remat=True, "
  return (f"{remat}lower {r.micro_setting} or train.logp_chunk (now {r.logp_chunk}), "
          f"or use {more}; tensor parallelism (mesh.shape tensor={tensor}) splits heads, mlp and vocab")


def check_fits(plan: MemoryPlan, usable_bytes: int | None = None) -> None:
  """Raises MemoryPlanError naming the phase that overflows and the settings to change."""
  limit = usable_bytes if usable_bytes is not None else plan.usable_bytes
  if limit is None:
    raise ValueError("check_fits: no device memory known; pass usable_bytes (see chips.device_spec, chips.device_memory_bytes)")
  g = format_bytes
  where = f"{plan.device or 'the device'} (mesh {plan.mesh_shape}, {g(limit)} usable per device)"
  if plan.resident_total > limit:
    raise MemoryPlanError(f"resident state {g(plan.resident_total)} per device exceeds {where}: "
                          f"{_advice(plan, 'resident')}")
  over = [p for p in PHASES if plan.resident_total + plan.phases[p].total > limit]
  if over:
    details = "; ".join(f"{p} phase needs {g(plan.resident_total + plan.phases[p].total)} "
                        f"({plan.phases[p].source}) - {_advice(plan, p)}" for p in over)
    raise MemoryPlanError(f"the run does not fit {where}: {details}")
