"""Stage 2 of A*-PO: the jitted update step and the on-policy training loop.

Per step: a batch of prompts -> one response each from the current policy (sampler) -> rewards
(grader) -> log-probs of those responses under pi_ref -> the A*-PO regression loss -> AdamW on
mini-batches, each accumulated over micro-batches that fit memory. The train state is an explicit
pytree {"params", "opt_state", "step"} that the update step takes and returns (donated).

Axis letters as in model.py; here P is the padded prompt length, R the response length,
M the number of micro-batches in a mini-batch and b the micro-batch size.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from astarpo_jax import losses
from astarpo_jax import model as model_lib
from astarpo_jax import sharding as sharding_lib
from astarpo_jax.model import ModelConfig, Params

TrainState = dict[str, Any]  # {"params": Params, "opt_state": optax state, "step": int32 []}


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """The A*-PO regression hyper-parameters (static arguments of the jitted step)."""
  beta2: float = 1e-3
  entropy_coef: float = 1e-3
  logp_chunk: int = 256  # response positions per block of [b, chunk, V] logits


def make_optimizer(lr: float = 1e-6, weight_decay: float = 0.01, grad_clip: float = 1.0, b1: float = 0.9,
                   b2: float = 0.999, eps: float = 1e-8, warmup_steps: int = 0) -> optax.GradientTransformation:
  """AdamW at a constant learning rate (after an optional linear warm-up), global-norm clipping first."""
  lr_sched = optax.constant_schedule(lr) if warmup_steps <= 0 else optax.join_schedules(
      [optax.linear_schedule(0.0, lr, warmup_steps), optax.constant_schedule(lr)], [warmup_steps])
  return optax.chain(optax.clip_by_global_norm(grad_clip) if grad_clip > 0 else optax.identity(),
                     optax.inject_hyperparams(optax.adamw)(learning_rate=lr_sched, b1=b1, b2=b2, eps=eps,
                                                           weight_decay=weight_decay))


def init_train_state(params: Params, optimizer: optax.GradientTransformation) -> TrainState:
  return {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}


def response_logprobs(cfg: ModelConfig, params: Params, tokens_BS, mask_BS, prompt_len: int, chunk: int = 256,
                      with_entropy: bool = True, unembed_DV=None):
  """(logp_BR, entropy_BR) of the response tokens `tokens_BS[:, P:]` given everything before them.

  The logits of response position t come from the hidden state at P+t-1; they are formed one
  `chunk` of positions at a time, so the full [B, R, V] fp32 logits never exist at once.
  `unembed_DV` overrides the output projection taken from `params` (see `train_step`).
  """
  h_BRD, unembed_DV = _response_hidden(cfg, params, tokens_BS, mask_BS, prompt_len, unembed_DV)
  logp_BR, ent_BR = losses.chunked_logprobs_entropy(h_BRD, unembed_DV, tokens_BS[:, prompt_len:], chunk=chunk)
  return (logp_BR, ent_BR) if with_entropy else logp_BR


def _response_hidden(cfg: ModelConfig, params: Params, tokens_BS, mask_BS, prompt_len: int, unembed_DV=None):
  """Hidden states [B, R, D] that predict the response tokens, and the [D, V] unembedding, in the compute dtype."""
  dt = jnp.dtype(cfg.dtype)
  positions_BS = model_lib.positions_from_mask(mask_BS)
  h_BSD, _ = model_lib.hidden_states(cfg, params, tokens_BS, positions_BS, mask_BS)
  if unembed_DV is None:
    unembed_DV = model_lib.unembed_matrix(cfg, params)
  return h_BSD[:, prompt_len - 1:-1].astype(dt), unembed_DV.astype(dt)


# Block of logits [B, REF_CHUNK, REF_VOCAB_CHUNK] of the gradient-free scoring forward.
REF_CHUNK, REF_VOCAB_CHUNK = 32, 4096


@functools.partial(jax.jit, static_argnames=("cfg", "prompt_len", "chunk", "vocab_chunk"))
def reference_logprobs(cfg: ModelConfig, ref_params: Params, tokens_BS, mask_BS, *, prompt_len: int,
                       chunk: int = REF_CHUNK, vocab_chunk: int = REF_VOCAB_CHUNK):
  """log pi_ref of the response tokens [B, R]: one forward of the frozen reference, no gradients.

  Without a backward to feed, the logits are formed in [B, chunk, vocab_chunk] blocks that stay in
  cache (`losses.vocab_chunked_logprobs`), never the whole [B, chunk, V].
  """
  h_BRD, unembed_DV = _response_hidden(cfg, ref_params, tokens_BS, mask_BS, prompt_len)
  return losses.vocab_chunked_logprobs(h_BRD, unembed_DV, tokens_BS[:, prompt_len:], chunk=chunk,
                                       vocab_chunk=vocab_chunk)


def _microbatch_loss(params, unembed_DV, cfg: ModelConfig, lcfg: LossConfig, prompt_len: int, mb, num_seqs,
                     num_tokens):
  logp_bR, ent_bR = response_logprobs(cfg, params, mb["tokens"], mb["mask"], prompt_len, lcfg.logp_chunk,
                                      unembed_DV=unembed_DV)
  return losses.astarpo_loss(logp_bR, mb["ref_logp"], mb["resp_mask"], mb["rewards"], mb["vstar"], ent_bR,
                             beta2=lcfg.beta2, entropy_coef=lcfg.entropy_coef,
                             num_seqs=num_seqs, num_tokens=num_tokens)


def accumulate_gradients(cfg: ModelConfig, loss_fn, params: Params, batch, extra=None):
  """(Σ gradients of `params`, Σ gradients of `extra`, Σ metrics) of
  `loss_fn(params, unembed_DV, extra, micro_batch) -> (loss, metrics)` over the leading axis of `batch`.

  A tied output projection enters `loss_fn` as its own argument `unembed_DV` (None when untied),
  for `response_logprobs`: the embedding transposed once per step, its gradient accumulated in
  [D, V] and added back transposed once. Left inside the loss, XLA:CPU forms each micro-batch's
  [V, D] gradient with a transposed-operand matmul, ~30% slower. Costs two [D, V] arrays of the param
  dtype. `extra` (PPO's critic) is differentiated as it is.
  """
  tied = cfg.tie_embeddings
  inputs = (params, model_lib.unembed_matrix(cfg, params) if tied else None, extra)
  grad_fn = jax.value_and_grad(lambda args, mb: loss_fn(*args, mb), has_aux=True)
  first = jax.tree.map(lambda x: x[0], batch)
  metric_zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: loss_fn(*inputs, first)[1]))

  def body(carry, mb):
    g_acc, m_acc = carry
    (_, m), g = grad_fn(inputs, mb)
    return (jax.tree.map(jnp.add, g_acc, g), jax.tree.map(jnp.add, m_acc, m)), None

  zeros = jax.tree.map(jnp.zeros_like, inputs)
  ((grads, g_unembed_DV, g_extra), metrics), _ = jax.lax.scan(body, (zeros, metric_zeros), batch)
  if tied:
    grads = dict(grads, embed=grads["embed"] + g_unembed_DV.T)
  return grads, g_extra, metrics


def train_step(cfg: ModelConfig, lcfg: LossConfig, optimizer: optax.GradientTransformation, prompt_len: int,
               state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer update on a mini-batch given as M micro-batches (leading axis of every array).

  batch: tokens [M, b, P+R] int32, mask [M, b, P+R] bool, resp_mask [M, b, R] bool,
  ref_logp [M, b, R] f32, rewards [M, b] f32, vstar [M, b] f32. The loss is normalised by the
  mini-batch's sequence and token counts, so the accumulated gradient equals the full-batch one.
  """
  num_seqs = jnp.asarray(batch["rewards"].size, jnp.float32)
  num_tokens = jnp.maximum(batch["resp_mask"].sum().astype(jnp.float32), 1.0)

  def loss_fn(params, unembed_DV, _, mb):
    return _microbatch_loss(params, unembed_DV, cfg, lcfg, prompt_len, mb, num_seqs, num_tokens)

  grads, _, metrics = accumulate_gradients(cfg, loss_fn, state["params"], batch)
  grad_norm = optax.tree.norm(grads)
  updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  finite = jnp.isfinite(grad_norm) & jnp.isfinite(metrics["loss"])
  # A non-finite step leaves the state untouched; the loop sees `finite` and stops the run.
  new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                           {"params": params, "opt_state": opt_state}, {"params": state["params"],
                                                                        "opt_state": state["opt_state"]})
  new_state["step"] = state["step"] + finite.astype(jnp.int32)
  metrics = dict(metrics, grad_norm=grad_norm, finite=finite)
  return new_state, metrics


def jit_train_step(cfg: ModelConfig, lcfg: LossConfig, optimizer, prompt_len: int, state_shardings=None,
                   batch_sharding=None):
  """The jitted update step with the state donated (and explicit shardings when given)."""
  fn = functools.partial(train_step, cfg, lcfg, optimizer, prompt_len)
  if state_shardings is None:
    return jax.jit(fn, donate_argnums=(0,))
  return jax.jit(fn, donate_argnums=(0,), in_shardings=(state_shardings, batch_sharding),
                 out_shardings=(state_shardings, None))


def state_shardings(cfg: ModelConfig, optimizer: optax.GradientTransformation, mesh: jax.sharding.Mesh,
                    rules=sharding_lib.DEFAULT_RULES) -> TrainState:
  """NamedShardings of the train state: params by the rule table, every param-shaped optimizer leaf
  (AdamW's mu, nu) like its param, the other optimizer leaves (counts, hyper-parameters) and step replicated."""
  params = sharding_lib.param_shardings(cfg, mesh, rules)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  _, abstract = model_lib.abstract_params(cfg)
  opt_shapes = jax.eval_shape(optimizer.init, abstract)
  opt_state = optax.tree_map_params(optimizer, lambda _, s: s, opt_shapes, params,
                                    transform_non_params=lambda _: replicated)
  return {"params": params, "opt_state": opt_state, "step": replicated}


def batch_sharding(mesh: jax.sharding.Mesh, micro_batch: int) -> jax.sharding.NamedSharding:
  """Sharding of every [M, b, ...] batch array: the micro-batch rows b split over the rule of `batch`."""
  axes = sharding_lib.DEFAULT_RULES["batch"] or ()
  ways = int(np.prod([mesh.shape[a] for a in axes]))
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
