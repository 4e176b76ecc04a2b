"""The update every method shares: optimizer, gradient accumulation and one guarded optimizer step.

A mini-batch arrives as M micro-batches on a leading axis (whatever fits memory); their gradients
are summed by a `lax.scan` with each micro-batch loss normalised by the mini-batch's counts, so the
sum equals the full-batch gradient. The step then clips by global norm and applies AdamW, and leaves
the whole state untouched when the loss or a gradient is not finite (`metrics["finite"]` tells the
loop, which stops the run). A method plugs in only its micro-batch loss. The train state is an
explicit pytree {"params", "opt_state", "step"}, plus {"value_params", "value_opt_state"} for a method
with a critic (PPO), taken and returned by the jitted step (donated). With LoRA (model/lora.py) "params" is the
adapter alone: its optimizer state is the adapter's, and the frozen base (π_ref's tree) enters the step as a
separate argument, never donated, never differentiated.

Where the weights travel (`gather_weights`): "per_micro_batch" leaves the compute-dtype cast inside the forward,
so on an FSDP mesh every micro-batch all-gathers each layer's weights for its forward and again for its backward;
"per_step" casts the params to the compute dtype once per optimizer step and gathers that copy over the batch axes
(data, fsdp; a tensor split stays) before the micro-batch scan, every micro-batch's forward and backward reading it,
each micro-batch's gradient reduce-scattered into an accumulator sharded as the params (master weights and AdamW
state stay sharded). It holds the copy and one micro-batch's gradient of it whole on every device.
"per_step_local" gathers the same copy but runs the micro-batch scan per device (a shard_map over the batch axes):
each device accumulates its own rows' gradient in the master dtype, with no cross-device reduction, and one
reduce-scatter a step puts the sum on the params' sharding. It moves each micro-batch's gradient never and holds a
whole master-dtype accumulator besides (4 bytes a param per device, over the tensor split). Full fine-tuning of a
policy without a critic (a loss additive over any split of a micro-batch's rows, as over its micro-batches).

Axis letters as in model.py; M micro-batches, b rows per micro-batch, P prompt length, R response length.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from astarpo_jax.infra import sharding as sharding_lib
from astarpo_jax.model import decoder as model_lib, lora
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.model.decoder import Params
from astarpo_jax.training import optimizers as optimizers_lib

TrainState = dict[str, Any]  # {"params", "opt_state", "step"} (+ {"value_params", "value_opt_state"})


class Counts(NamedTuple):
  """The mini-batch's sequence and response-token counts, which every micro-batch loss divides by."""
  num_seqs: jax.Array
  num_tokens: jax.Array


# loss(params, unembed_DV, critic_params or None, micro_batch, counts) -> (loss, metrics)
LossFn = Callable[[Params, Any, Any, dict, Counts], tuple[jax.Array, dict]]


@dataclasses.dataclass(frozen=True)
class Optimizers:
  """The policy's optimizer, and the critic's for a method that trains one."""
  policy: optax.GradientTransformation
  critic: optax.GradientTransformation | None = None


def make_optimizer(lr: float = 1e-6, weight_decay: float = 0.01, grad_clip: float = 1.0, b1: float = 0.9,
                   b2: float = 0.999, eps: float = 1e-8, warmup_steps: int = 0,
                   zero_lr_steps: int = 0, kind: str = "adamw", mu_dtype: str = "") -> optax.GradientTransformation:
  """AdamW at a constant learning rate, global-norm clipping first.

  `zero_lr_steps` first steps at lr 0 (AdamW's moments still update): what verl's constant schedule
  with zero warm-up gives the official runs' first rollout. Then an optional linear warm-up. `kind` / `mu_dtype`
  (optim.kind, optim.mu_dtype): AdamW (official) or a memory-saving deviation (training/optimizers.py).
  """
  lr_sched = optax.constant_schedule(lr) if warmup_steps <= 0 else optax.join_schedules(
      [optax.linear_schedule(0.0, lr, warmup_steps), optax.constant_schedule(lr)], [warmup_steps])
  if zero_lr_steps > 0:
    lr_sched = optax.join_schedules([optax.constant_schedule(0.0), lr_sched], [zero_lr_steps])
  return optax.chain(optax.clip_by_global_norm(grad_clip) if grad_clip > 0 else optax.identity(),
                     optimizers_lib.scale_rule(kind, lr_sched, b1, b2, eps, weight_decay, mu_dtype))


def init_train_state(params: Params, optimizers: Optimizers, critic_params: Params | None = None) -> TrainState:
  """The train state of `params` (and of a critic's params, with its own optimizer state). An attached LoRA
  policy (base + adapter) keeps only its adapter: the base stays π_ref's, frozen, outside the state."""
  if lora.has_adapter(params):
    params = lora.split(params)[1]
  state = {"params": params, "opt_state": optimizers.policy.init(params), "step": jnp.zeros((), jnp.int32)}
  if critic_params is not None:
    if optimizers.critic is None:
      raise ValueError("init_train_state: critic params given without a critic optimizer")
    state.update(value_params=critic_params, value_opt_state=optimizers.critic.init(critic_params))
  return state


GATHER_MODES = ("auto", "per_step_local", "per_step", "per_micro_batch")


def resolve_gather(mode: str, copy_bytes: int, free_bytes: int | None, acc_bytes: int | None = None) -> str:
  """The train.gather_weights mode to compile: "auto" gathers once per step when the compute copy and one
  micro-batch's gradient of it (2 x `copy_bytes` per device) fit the `free_bytes` left beside the resident state
  (None: no limit known, as on the CPU), and accumulates locally ("per_step_local") when a whole accumulator of
  `acc_bytes` per device fits beside them too (`acc_bytes` None: local accumulation does not apply, LoRA or a
  critic)."""
  if mode not in GATHER_MODES:
    raise ValueError(f"train.gather_weights={mode!r}: use one of {GATHER_MODES}")
  if mode != "auto":
    return mode
  fits = lambda need: free_bytes is None or need <= free_bytes  # noqa: E731
  if acc_bytes is not None and fits(2 * copy_bytes + acc_bytes):
    return "per_step_local"
  return "per_step" if fits(2 * copy_bytes) else "per_micro_batch"


def gathered_shardings(param_shardings):
  """The shardings of the once-per-step compute copy: each param's with the batch axes (data, fsdp) dropped,
  so it is whole over them and keeps its tensor split."""
  return jax.tree.map(lambda sh: sharding_lib.without_axes(sh, sharding_lib.DEFAULT_RULES["batch"] or ()),
                      param_shardings)


def compute_copy(cfg: ModelConfig, params: Params, copy_shardings) -> Params:
  """The params cast to the compute dtype (every layer casts each weight before use anyway) and gathered."""
  dt = jnp.dtype(cfg.dtype)
  cast = lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x  # noqa: E731
  if model_lib.train_layer_form() == "unstacked":  # GPUs: per-layer arrays once a step (layer_forms.py)
    params = model_lib.unstack_layers(params)
    copy_shardings = model_lib.unstacked_shardings(copy_shardings, cfg.num_layers)
  return jax.tree.map(lambda x, sh: jax.lax.with_sharding_constraint(cast(x), sh), params, copy_shardings)


def accumulate_gradients(cfg: ModelConfig, loss_fn, params: Params, batch, extra=None, base: Params | None = None,
                         acc_like: Params | None = None, acc_shardings=None):
  """(Σ gradients of `params`, Σ gradients of `extra`, Σ metrics) of
  `loss_fn(params, unembed_DV, extra, micro_batch) -> (loss, metrics)` over the leading axis of `batch`.

  A tied output projection enters `loss_fn` as its own argument `unembed_DV` (None when untied), for
  `scoring.logprobs_and_entropy`: the embedding transposed once per step, its gradient accumulated in
  [D, V] and added back transposed once. Left inside the loss, XLA:CPU forms each micro-batch's [V, D]
  gradient with a transposed-operand matmul, ~30% slower. Costs two [D, V] arrays of the param dtype.
  `extra` (a critic's params) is differentiated as it is. `base` (LoRA): `params` is an adapter, the loss sees
  it attached to the frozen base, whose output projection enters as a constant (no gradient).
  `acc_like` (gather_weights "per_step"): `params` is the gathered compute copy and its gradients accumulate in
  `acc_like`'s dtypes (the master params'), constrained to `acc_shardings` (theirs) every micro-batch.
  """
  tied = cfg.tie_embeddings and base is None
  inputs = (params, model_lib.unembed_matrix(cfg, params) if tied else None, extra)
  if base is None:
    call = lambda args, mb: loss_fn(*args, mb)  # noqa: E731
  else:
    fixed_DV = model_lib.unembed_matrix(cfg, base) if cfg.tie_embeddings else None
    call = lambda args, mb: loss_fn(lora.attach(base, args[0]), fixed_DV, args[2], mb)  # noqa: E731
  grad_fn = jax.value_and_grad(call, has_aux=True)
  first = jax.tree.map(lambda x: x[0], batch)
  metric_zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: call(inputs, first)[1]))

  def place(acc):  # the params' accumulator in the master dtype, sharded as the params
    if acc_shardings is None:
      return acc
    return (jax.tree.map(jax.lax.with_sharding_constraint, acc[0], acc_shardings),) + tuple(acc[1:])

  def body(carry, mb):
    g_acc, m_acc = carry
    (_, m), g = grad_fn(inputs, mb)
    g_acc = place(jax.tree.map(lambda a, b: a + b.astype(a.dtype), g_acc, g))
    return (g_acc, jax.tree.map(jnp.add, m_acc, m)), None

  restack = acc_like is not None and model_lib.is_unstacked(params) and not model_lib.is_unstacked(acc_like)
  if restack:  # the unstacked compute copy's gradients accumulate per layer, stacked once after the scan
    acc_like = jax.eval_shape(model_lib.unstack_layers, acc_like)
    if acc_shardings is not None:
      acc_shardings = model_lib.unstacked_shardings(acc_shardings, cfg.num_layers)
  like = inputs if acc_like is None else (acc_like,) + inputs[1:]
  zeros = place(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), like))
  if acc_like is not None and tied:  # the unembedding's gradient in the embedding's master dtype
    zeros = (zeros[0], zeros[1].astype(acc_like["embed"].dtype), zeros[2])
  ((grads, g_unembed_DV, g_extra), metrics), _ = jax.lax.scan(body, (zeros, metric_zeros), batch)
  if restack:
    grads = model_lib.stack_layers(grads)
  if tied:
    grads = dict(grads, embed=grads["embed"] + g_unembed_DV.T)
  return grads, g_extra, metrics


def _manual_spec(sh: jax.sharding.NamedSharding, axes: tuple[str, ...]) -> jax.sharding.PartitionSpec:
  """`sh`'s spec with only the mesh `axes` kept (a shard_map's manual axes; the others stay automatic)."""
  return sharding_lib.without_axes(sh, tuple(a for a in sh.mesh.axis_names if a not in axes)).spec


def _reduce_scatter(g, spec: jax.sharding.PartitionSpec, axes: tuple[str, ...]):
  """One device's partial gradient summed over the manual `axes` onto `spec`'s split: scattered along the dims that
  `spec` splits over some of them, summed whole over the rest."""
  split = [(d, (e,) if isinstance(e, str) else tuple(e)) for d, e in enumerate(spec) if e]
  summed = tuple(a for a in axes if not any(a in names for _, names in split))
  if summed:
    g = jax.lax.psum(g, summed)
  for d, names in split:  # the dims after d merged (no transposed copy): XLA:TPU all-reduces [L, D, H, hd] instead
    shape = list(g.shape)
    g = jax.lax.psum_scatter(g.reshape(*shape[:d + 1], -1), names, scatter_dimension=d, tiled=True)
    g = g.reshape(*shape[:d], -1, *shape[d + 1:])
  return g


def accumulate_locally(cfg: ModelConfig, loss_fn, copy: Params, batch, acc_like: Params, param_shardings):
  """(Σ gradients on `param_shardings`, Σ metrics) as `accumulate_gradients` with `acc_like`, but per device
  (gather_weights "per_step_local"): a shard_map over the batch axes (data, fsdp; the tensor axis stays automatic)
  runs each device's rows of every micro-batch against the whole compute `copy`, accumulates that device's partial
  gradient in the master dtype, and reduce-scatters it once onto the params' sharding; the metrics are summed
  over the devices (each device's rows carry their share of the mini-batch's counts, as each micro-batch does)."""
  mesh = jax.tree.leaves(param_shardings)[0].mesh
  axes = tuple(a for a in sharding_lib.DEFAULT_RULES["batch"] or () if a in mesh.axis_names)
  specs = jax.tree.map(lambda sh: _manual_spec(sh, axes), param_shardings)
  like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), acc_like)
  P = jax.sharding.PartitionSpec

  def per_device(copy, batch):
    grads, _, metrics = accumulate_gradients(cfg, loss_fn, copy, batch, acc_like=like)
    return jax.tree.map(lambda g, spec: _reduce_scatter(g, spec, axes), grads, specs), jax.lax.psum(metrics, axes)

  # check_vma off: the copy enters whole on every device and its gradient must stay each device's own (a typed
  # shard_map would all-reduce it, the transpose of the copy's broadcast to the varying rows)
  grads, metrics = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(None, axes)), out_specs=(specs, P()),
                                 axis_names=set(axes), check_vma=False)(copy, batch)
  return jax.tree.map(jax.lax.with_sharding_constraint, grads, param_shardings), metrics


def _apply(optimizer, grads, opt_state, params):
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def update_step(cfg: ModelConfig, loss: LossFn, optimizers: Optimizers, state: TrainState,
                batch: dict[str, jax.Array], base: Params | None = None, copy_shardings=None,
                param_shardings=None, local: bool = False) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer update on a mini-batch given as M micro-batches (leading axis of every array).

  Every batch has tokens [M, b, P+R], mask [M, b, P+R], resp_mask [M, b, R] and rewards [M, b]; the
  rest is the method's (see its `prepare`). A state with a critic updates it too, with its own
  optimizer. A non-finite loss or gradient leaves the whole state untouched. `base` (LoRA): the frozen base
  the adapter in state["params"] is attached to. `copy_shardings` (gather_weights "per_step", full fine-tuning):
  the compute copy's (`gathered_shardings`), the accumulator's `param_shardings`; `local` (gather_weights
  "per_step_local", no critic): that copy's gradients accumulated per device (`accumulate_locally`).
  """
  counts = Counts(jnp.asarray(batch["rewards"].size, jnp.float32),
                  jnp.maximum(batch["resp_mask"].sum().astype(jnp.float32), 1.0))
  critic = state.get("value_params")
  micro_loss = lambda p, u, c, mb: loss(p, u, c, mb, counts)  # noqa: E731
  if local and copy_shardings is not None and base is None and critic is None:
    copy = compute_copy(cfg, state["params"], copy_shardings)
    grads, metrics = accumulate_locally(cfg, micro_loss, copy, batch, state["params"], param_shardings)
    critic_grads = None
  elif copy_shardings is not None and base is None:
    copy = compute_copy(cfg, state["params"], copy_shardings)
    grads, critic_grads, metrics = accumulate_gradients(cfg, micro_loss, copy, batch, critic,
                                                        acc_like=state["params"], acc_shardings=param_shardings)
  else:
    grads, critic_grads, metrics = accumulate_gradients(cfg, micro_loss, state["params"], batch, critic, base)
  grad_norm = optax.tree.norm(grads)
  params, opt_state = _apply(optimizers.policy, grads, state["opt_state"], state["params"])
  new = {"params": params, "opt_state": opt_state}
  finite = jnp.isfinite(grad_norm) & jnp.isfinite(metrics["loss"])
  if critic is not None:
    critic_grad_norm = optax.tree.norm(critic_grads)
    new["value_params"], new["value_opt_state"] = _apply(optimizers.critic, critic_grads, state["value_opt_state"],
                                                         critic)
    finite = finite & jnp.isfinite(critic_grad_norm) & jnp.isfinite(metrics["value_loss"])
    metrics = dict(metrics, value_grad_norm=critic_grad_norm)
  # A non-finite step leaves the state untouched; the loop sees `finite` and stops the run.
  new_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, {k: state[k] for k in new})
  new_state["step"] = state["step"] + finite.astype(jnp.int32)
  return new_state, dict(metrics, grad_norm=grad_norm, finite=finite)


def jit_update_step(cfg: ModelConfig, loss: LossFn, optimizers: Optimizers, state_shardings=None,
                    batch_sharding=None, lora_base: bool = False, base_shardings=None,
                    gather_weights: str = "per_micro_batch"):
  """`step(state, batch) -> (state, metrics)`, jitted with the state donated (explicit shardings when given);
  with `lora_base` `step(state, batch, base)`, the frozen base not donated (π_ref holds the same arrays).
  `gather_weights` "per_step" / "per_step_local" (with state shardings; resolve "auto" first: `resolve_gather`): the
  compute copy gathered once per optimizer step, its gradients reduced per micro-batch or once (module docstring);
  LoRA keeps the base as placed."""
  if gather_weights not in GATHER_MODES[1:]:
    raise ValueError(f"gather_weights={gather_weights!r}: use one of {GATHER_MODES[1:]} ('auto' resolves "
                     "first: update.resolve_gather)")
  local = gather_weights == "per_step_local"
  if local and (lora_base or (state_shardings is not None and "value_params" in state_shardings)):
    raise ValueError("gather_weights='per_step_local' accumulates a full fine-tuned policy's gradients per device; "
                     "with a LoRA base or a critic use 'per_step' (or 'auto', which resolves to it)")
  copy = None
  if gather_weights in ("per_step", "per_step_local") and state_shardings is not None and not lora_base:
    copy = dict(copy_shardings=gathered_shardings(state_shardings["params"]), param_shardings=state_shardings["params"],
                local=local)
  fn = functools.partial(update_step, cfg, loss, optimizers, **(copy or {}))
  if state_shardings is None:
    return jax.jit(fn, donate_argnums=(0,))
  in_shardings = (state_shardings, batch_sharding) + ((base_shardings,) if lora_base else ())
  return jax.jit(fn, donate_argnums=(0,), in_shardings=in_shardings, out_shardings=(state_shardings, None))


def state_shardings(cfg: ModelConfig, optimizers: Optimizers, mesh: jax.sharding.Mesh, critic_axes=None,
                    critic_shapes=None, rules=sharding_lib.DEFAULT_RULES,
                    lora_cfg: lora.LoraConfig | None = None) -> TrainState:
  """NamedShardings of the train state: params (and a critic's, given its logical axes and shapes) by the
  rule table, every param-shaped optimizer leaf (AdamW's mu, nu) like its param, the other optimizer
  leaves (counts, hyper-parameters) and the step replicated. With `lora_cfg` the params are its adapter's."""
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def with_optimizer(optimizer, param_sh, param_shapes):
    opt_shapes = jax.eval_shape(optimizer.init, param_shapes)
    return optimizers_lib.place_state(opt_shapes, optax.tree_map_params(  # a factored moment: replicated
        optimizer, lambda _, s: s, opt_shapes, param_sh, transform_non_params=lambda _: replicated))

  if lora_cfg is None:
    params, shapes = model_lib.param_shardings(cfg, mesh, rules), model_lib.abstract_params(cfg)[1]
  else:
    axes, shapes = lora.adapter_layout(cfg, lora_cfg)
    params = sharding_lib.tree_shardings(mesh, axes, shapes, rules)
  out = {"params": params, "opt_state": with_optimizer(optimizers.policy, params, shapes), "step": replicated}
  if critic_axes is not None:
    critic = sharding_lib.tree_shardings(mesh, critic_axes, critic_shapes, rules)
    out.update(value_params=critic, value_opt_state=with_optimizer(optimizers.critic, critic, critic_shapes))
  return out


def batch_sharding(mesh: jax.sharding.Mesh, micro_batch: int) -> jax.sharding.NamedSharding:
  """Sharding of every [M, b, ...] batch array: the micro-batch rows b split over the rule of `batch`."""
  axes = sharding_lib.DEFAULT_RULES["batch"] or ()
  ways = sharding_lib.batch_ways(mesh)
  if micro_batch % ways:
    raise ValueError(f"micro_batch={micro_batch} is not divisible by the mesh's {'x'.join(axes)} = {ways} "
                     f"batch shards: pick a micro_batch that is a multiple of {ways} or change the mesh shape")
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, axes))


def split_microbatches(batch: dict[str, np.ndarray], micro_batch: int) -> dict[str, np.ndarray]:
  """[B, ...] arrays -> [B/micro_batch, micro_batch, ...]."""
  B = len(batch["rewards"])
  if B % micro_batch:
    raise ValueError(f"mini-batch of {B} is not divisible by micro_batch={micro_batch}")
  return {k: np.asarray(v).reshape(B // micro_batch, micro_batch, *np.shape(v)[1:]) for k, v in batch.items()}
