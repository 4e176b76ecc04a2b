"""Jitted update steps of the baselines A*-PO is compared against: GRPO, PPO (with a critic) and REBEL.

Same conventions as `train.train_step`: the state is an explicit pytree that the step takes and
returns (donated); a mini-batch arrives as M micro-batches on a leading axis whose gradients are
accumulated with a `lax.scan`, the losses normalised by the mini-batch's counts (so the sum equals
the full-batch gradient); a non-finite loss or gradient leaves the state untouched and is reported
in `metrics["finite"]`. The losses themselves are `baseline_losses`.

Rows of a batch are responses; the G responses to one prompt are adjacent (prompt-major), so a
micro-batch of whole prompts never splits a group (GRPO) or a pair (REBEL, G = 2).

Axis letters as in train.py: M micro-batches, b rows per micro-batch, P padded prompt length,
R response length, S = P + R, D model dim.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from astarpo_jax import baseline_losses as BL
from astarpo_jax import losses
from astarpo_jax import model as model_lib
from astarpo_jax.model import ModelConfig, Params
from astarpo_jax.train import accumulate_gradients, response_logprobs

ALGOS = ("grpo", "ppo", "rebel")
DEFAULT_GROUP_SIZE = {"grpo": 8, "ppo": 1, "rebel": 2}  # verl's GRPO example n=8; PPO one response; REBEL a pair

# {"params", "opt_state", "step"}; PPO adds {"value_params", "value_opt_state"}.
BaselineState = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class BaselineConfig:
  """Hyper-parameters of a baseline (static arguments of its jitted step). Defaults: verl / REBEL paper."""
  algo: str
  group_size: int = 0  # responses per prompt; 0 = DEFAULT_GROUP_SIZE[algo]
  clip_eps: float = 0.2  # GRPO / PPO ratio clip
  kl_coef: float = 1e-3  # GRPO: weight of the k3 KL loss to pi_ref; PPO: KL-in-reward weight; REBEL: unused
  entropy_coef: float = 0.0  # token-mean entropy bonus, for every baseline
  loss_agg: str = "token_mean"  # GRPO's reduction, see baseline_losses.aggregate
  value_clip: float = 0.5  # PPO value-loss clip (verl's cliprange_value)
  gae_gamma: float = 1.0  # PPO GAE (verl's defaults)
  gae_lambda: float = 1.0
  rebel_eta: float = 1.0  # REBEL step size η (REBEL code/paper default, TL;DR)
  logp_chunk: int = 256  # response positions per block of logits

  def __post_init__(self):
    def bad(field, why):
      raise ValueError(f"BaselineConfig.{field}: {why}")
    if self.algo not in ALGOS:
      bad("algo", f"{self.algo!r} is not one of {ALGOS}")
    if self.group_size == 0:
      object.__setattr__(self, "group_size", DEFAULT_GROUP_SIZE[self.algo])
    g = self.group_size
    if not isinstance(g, int) or g < 1:
      bad("group_size", f"must be a positive int (or 0 for the default), got {g!r}")
    if self.algo == "grpo" and g < 2:
      bad("group_size", f"GRPO needs >= 2 responses per prompt for its group statistics, got {g}")
    if self.algo == "rebel" and g != 2:
      bad("group_size", f"REBEL regresses on pairs: it needs exactly 2 responses per prompt, got {g}")
    for f in ("clip_eps", "value_clip", "rebel_eta", "gae_gamma", "gae_lambda"):
      if not getattr(self, f) > 0:
        bad(f, f"must be > 0, got {getattr(self, f)}")
    for f in ("kl_coef", "entropy_coef"):
      if not getattr(self, f) >= 0:
        bad(f, f"must be >= 0, got {getattr(self, f)}")
    if self.loss_agg not in BL.LOSS_AGG_MODES:
      bad("loss_agg", f"{self.loss_agg!r} is not one of {BL.LOSS_AGG_MODES}")
    if not isinstance(self.logp_chunk, int) or self.logp_chunk < 1:
      bad("logp_chunk", f"must be a positive int, got {self.logp_chunk!r}")

  @property
  def needs_reference(self) -> bool:
    """Whether a step needs log pi_ref of the responses (the KL terms); REBEL never does."""
    return self.algo in ("grpo", "ppo") and self.kl_coef > 0


# ---------------------------------------------------------------------------------------------
# The PPO critic: a copy of the network with a scalar head on the final hidden state.

def init_value_params(cfg: ModelConfig, params: Params, seed: int = 0) -> Params:
  """Critic params: a copy of `params` (no LM head) plus a [D] -> 1 head, w ~ N(0, 0.02²), b = 0.

  As verl's critic (an HF token-classification head on the same checkpoint as the actor).
  """
  body = {k: jax.tree.map(jnp.copy, v) for k, v in params.items() if k != "lm_head"}
  w_D = 0.02 * jax.random.normal(jax.random.key(seed), (cfg.hidden_size,), jnp.float32)
  return {"body": body, "head": {"w": w_D.astype(params["embed"].dtype), "b": jnp.zeros((), params["embed"].dtype)}}


def token_values(cfg: ModelConfig, value_params: Params, tokens_BS, mask_BS, prompt_len: int) -> jax.Array:
  """V(s_t) [B, R] in fp32 for each response position: the head on the hidden state at P+t-1.

  The state before response token t is everything up to P+t-1, the same position whose logits
  give token t, so values and log-probs line up.
  """
  positions_BS = model_lib.positions_from_mask(mask_BS)
  h_BSD, _ = model_lib.hidden_states(cfg, value_params["body"], tokens_BS, positions_BS, mask_BS)
  h_BRD = h_BSD[:, prompt_len - 1:-1].astype(jnp.float32)
  head = value_params["head"]
  return jnp.einsum("BRD,D->BR", h_BRD, head["w"].astype(jnp.float32)) + head["b"].astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("cfg", "prompt_len"))
def critic_values(cfg: ModelConfig, value_params: Params, tokens_BS, mask_BS, *, prompt_len: int) -> jax.Array:
  """The critic's V [B, R] on rollout rows, no gradients (`token_values`, jitted)."""
  return token_values(cfg, value_params, tokens_BS, mask_BS, prompt_len)


@functools.partial(jax.jit, static_argnames=("bcfg",))
def ppo_targets(bcfg: BaselineConfig, values_BR, resp_mask_BR, rewards_B, old_logp_BR, ref_logp_BR=None):
  """(advantages, returns), each [B, R], for a whole rollout before any update.

  Reward at the last response token, minus kl_coef·(old_logp − ref_logp) on every token when
  `ref_logp_BR` is given; GAE(γ, λ) on the critic's `values_BR`; advantages whitened over the rollout.
  """
  kl_BR = None if ref_logp_BR is None else old_logp_BR - ref_logp_BR
  r_BR = BL.outcome_token_rewards(rewards_B, resp_mask_BR, kl_BR, bcfg.kl_coef)
  return BL.gae_advantages(r_BR, values_BR, resp_mask_BR, gamma=bcfg.gae_gamma, lam=bcfg.gae_lambda)


# ---------------------------------------------------------------------------------------------
# Micro-batch losses.

def _grpo_loss(params, unembed_DV, value_params, cfg, bcfg, prompt_len, mb, num_seqs, num_tokens):
  del value_params
  logp_bR, ent_bR = response_logprobs(cfg, params, mb["tokens"], mb["mask"], prompt_len, bcfg.logp_chunk,
                                      unembed_DV=unembed_DV)
  return BL.grpo_loss(logp_bR, mb["old_logp"], mb.get("ref_logp"), mb["resp_mask"], mb["adv"], ent_bR,
                      clip_eps=bcfg.clip_eps, kl_coef=bcfg.kl_coef, entropy_coef=bcfg.entropy_coef,
                      loss_agg=bcfg.loss_agg, num_seqs=num_seqs, num_tokens=num_tokens)


def _ppo_loss(params, unembed_DV, value_params, cfg, bcfg, prompt_len, mb, num_seqs, num_tokens):
  del num_seqs
  logp_bR, ent_bR = response_logprobs(cfg, params, mb["tokens"], mb["mask"], prompt_len, bcfg.logp_chunk,
                                      unembed_DV=unembed_DV)
  pg, m = BL.ppo_policy_loss(logp_bR, mb["old_logp"], mb["resp_mask"], mb["adv"], ent_bR, clip_eps=bcfg.clip_eps,
                             entropy_coef=bcfg.entropy_coef, num_tokens=num_tokens)
  values_bR = token_values(cfg, value_params, mb["tokens"], mb["mask"], prompt_len)
  vf, vm = BL.ppo_value_loss(values_bR, mb["old_values"], mb["returns"], mb["resp_mask"], value_clip=bcfg.value_clip,
                             num_tokens=num_tokens)
  # The two param trees are disjoint, so d(pg + vf)/d policy = d pg and d(pg + vf)/d critic = d vf.
  return pg + vf, dict(m, **vm)


def _rebel_loss(params, unembed_DV, value_params, cfg, bcfg, prompt_len, mb, num_seqs, num_tokens):
  del value_params
  logp_bR, ent_bR = response_logprobs(cfg, params, mb["tokens"], mb["mask"], prompt_len, bcfg.logp_chunk,
                                      unembed_DV=unembed_DV)
  pairs = lambda x: x.reshape(x.shape[0] // 2, 2, *x.shape[1:])  # noqa: E731  rows 2i, 2i+1 -> pair i
  loss, m = BL.rebel_loss(pairs(logp_bR), pairs(mb["old_logp"]), pairs(mb["resp_mask"]), pairs(mb["rewards"]),
                          eta=bcfg.rebel_eta, num_seqs=num_seqs / 2)
  entropy = losses.masked_sum(ent_bR, mb["resp_mask"]) / num_tokens
  loss = loss - bcfg.entropy_coef * entropy
  return loss, dict(m, entropy=entropy, loss=loss)


_LOSSES = {"grpo": _grpo_loss, "ppo": _ppo_loss, "rebel": _rebel_loss}


# ---------------------------------------------------------------------------------------------
# The step.

def init_state(params: Params, optimizer: optax.GradientTransformation, value_params: Params | None = None,
               value_optimizer: optax.GradientTransformation | None = None) -> BaselineState:
  """The train state; with `value_params` (PPO) the critic and its own optimizer state too.

  Its arrays are committed to their devices, as restored ones are: jit caches committed and
  uncommitted arguments apart, so a run resumed in the same process reuses the compiled programs.
  """
  state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}
  if value_params is not None:
    if value_optimizer is None:
      raise ValueError("init_state: `value_params` given without a `value_optimizer`")
    state.update(value_params=value_params, value_opt_state=value_optimizer.init(value_params))
  return jax.tree.map(lambda x: jax.device_put(x, x.sharding), state)


def _update(optimizer, grads, opt_state, params):
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


@functools.partial(jax.jit, static_argnames=("cfg", "bcfg", "optimizer", "prompt_len", "value_optimizer"),
                   donate_argnames=("state",))
def train_step(cfg: ModelConfig, bcfg: BaselineConfig, optimizer: optax.GradientTransformation, prompt_len: int,
               state: BaselineState, batch: dict[str, jax.Array],
               value_optimizer: optax.GradientTransformation | None = None) -> tuple[BaselineState, dict]:
  """One optimizer update of a baseline on a mini-batch given as M micro-batches.

  Every method: tokens [M, b, S] int32, mask [M, b, S] bool, resp_mask [M, b, R] bool,
  old_logp [M, b, R] f32 (log-probs under the policy that sampled), rewards [M, b] f32.
  GRPO adds adv [M, b] (group-normalised) and ref_logp [M, b, R] when kl_coef > 0; PPO adds
  adv, returns and old_values [M, b, R] (`critic_values`, `ppo_targets`); REBEL needs nothing more (b even,
  rows 2i and 2i+1 the pair). PPO updates policy and critic, each with its own optimizer.
  """
  num_seqs = jnp.asarray(batch["rewards"].size, jnp.float32)
  num_tokens = jnp.maximum(batch["resp_mask"].sum().astype(jnp.float32), 1.0)
  algo_loss = _LOSSES[bcfg.algo]

  def loss_fn(params, unembed_DV, value_params, mb):
    return algo_loss(params, unembed_DV, value_params, cfg, bcfg, prompt_len, mb, num_seqs, num_tokens)

  if bcfg.algo == "ppo":
    policy_grads, value_grads, metrics = accumulate_gradients(cfg, loss_fn, state["params"], batch,
                                                              state["value_params"])
    grad_norm, value_grad_norm = optax.tree.norm(policy_grads), optax.tree.norm(value_grads)
    params, opt_state = _update(optimizer, policy_grads, state["opt_state"], state["params"])
    vparams, vopt_state = _update(value_optimizer, value_grads, state["value_opt_state"], state["value_params"])
    new = {"params": params, "opt_state": opt_state, "value_params": vparams, "value_opt_state": vopt_state}
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(value_grad_norm) & jnp.isfinite(metrics["loss"])
    finite = finite & jnp.isfinite(metrics["value_loss"])
    metrics = dict(metrics, value_grad_norm=value_grad_norm)
  else:
    grads, _, metrics = accumulate_gradients(cfg, loss_fn, state["params"], batch)
    grad_norm = optax.tree.norm(grads)
    params, opt_state = _update(optimizer, grads, state["opt_state"], state["params"])
    new = {"params": params, "opt_state": opt_state}
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(metrics["loss"])
  # A non-finite step leaves the whole state untouched; the loop sees `finite` and stops the run.
  new_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, {k: state[k] for k in new})
  new_state["step"] = state["step"] + finite.astype(jnp.int32)
  return new_state, dict(metrics, grad_norm=grad_norm, finite=finite)


def jit_train_step(cfg: ModelConfig, bcfg: BaselineConfig, optimizer, prompt_len: int, value_optimizer=None):
  """`step(state, batch) -> (state, metrics)`: `train_step` with its static arguments bound."""
  if bcfg.algo == "ppo" and value_optimizer is None:
    raise ValueError("jit_train_step: PPO needs a `value_optimizer` for its critic")
  return functools.partial(train_step, cfg, bcfg, optimizer, prompt_len, value_optimizer=value_optimizer)
