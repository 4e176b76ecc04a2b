"""PPO (Schulman et al. 2017) for LLMs as verl runs it: one response per prompt, a critic (a copy of the
network with a scalar head), the outcome reward at the last token minus a KL-in-reward to π_ref,
GAE(γ, λ), the clipped surrogate and a clipped value loss; policy and critic each with their optimizer."""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from astarpo_jax.methods import Footprint, _baseline_arrays as arrays, common_batch_shapes
from astarpo_jax.model import decoder as model_lib, lora
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.model.decoder import Params
from astarpo_jax.sampling import rollout
from astarpo_jax.training import baseline_losses as BL, packing, scoring, update


@dataclasses.dataclass(frozen=True)
class Config(arrays.RatioSettings):
  """group_size (default 1), clip_eps, kl_coef (the KL-in-reward weight), entropy_coef, logp_chunk, old_logp,
  tis_cap (per token), mismatch_blocks, and:"""
  METHOD = "ppo"
  SOURCE = "Schulman et al. 2017; verl's PPO defaults (clip 0.2, cliprange_value 0.5, critic lr 1e-5, GAE 1/1)"
  value_clip: float = 0.5  # verl's cliprange_value
  gae_gamma: float = 1.0
  gae_lambda: float = 1.0


responses_per_prompt = arrays.group_size


def footprint(c: Config) -> Footprint:
  return Footprint(scored=(("reference",) if c.kl_coef > 0 else ()) + ("critic",) + arrays.scored_policy(c),
                   critic=True)


# ---------------------------------------------------------------------------------------------
# The critic: a copy of the network with a scalar head on the final hidden state.

def init_critic(cfg: ModelConfig, params: Params, seed: int = 0) -> Params:
  """Critic params: a copy of `params` (no LM head) plus a [D] -> 1 head, w ~ N(0, 0.02²), b = 0.

  As verl's critic (an HF token-classification head on the same checkpoint as the actor). A LoRA policy's
  critic is a full copy of its base in cfg.param_dtype, trained whole (the adapter is the policy's only).
  """
  if lora.has_adapter(params):
    params = model_lib.cast_params(lora.split(params)[0], cfg.param_dtype)
  body = {k: jax.tree.map(jnp.copy, v) for k, v in params.items() if k != "lm_head"}
  w_D = 0.02 * jax.random.normal(jax.random.key(seed), (cfg.hidden_size,), jnp.float32)
  return {"body": body, "head": {"w": w_D.astype(params["embed"].dtype), "b": jnp.zeros((), params["embed"].dtype)}}


def critic_layout(cfg: ModelConfig):
  """(logical axes, abstract shapes) of the critic's params, for their shardings."""
  axes = model_lib.logical_axes(cfg)
  body_axes = {k: v for k, v in axes.items() if k != "lm_head"}
  shapes = jax.eval_shape(lambda p: init_critic(cfg, p), model_lib.abstract_params(cfg)[1])
  return {"body": body_axes, "head": {"w": ("embed",), "b": ()}}, shapes


def token_values(cfg: ModelConfig, critic: Params, tokens_BS, mask_BS, prompt_len: int, pack=None) -> jax.Array:
  """V(s_t) [B, R] in fp32 for each response position: the head on the hidden state at P+t-1.

  The state before response token t is everything up to P+t-1, the same position whose logits give
  token t, so values and log-probs line up. `pack`: the rows packed (train.pack_rows), as the policy's
  forward (scoring.response_hidden).
  """
  head = critic["head"]
  # The critic has no LM head (an untied model's `lm_head` is dropped): hand response_hidden a stand-in
  # projection, which it only casts, instead of letting it look one up in the body.
  h_BRD, _ = scoring.response_hidden(cfg, critic["body"], tokens_BS, mask_BS, prompt_len, unembed_DV=head["w"][:, None],
                                     pack=pack)
  return (jnp.einsum("BRD,D->BR", h_BRD.astype(jnp.float32), head["w"].astype(jnp.float32))
          + head["b"].astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("cfg", "prompt_len"))
def critic_values(cfg: ModelConfig, critic: Params, tokens_BS, mask_BS, *, prompt_len: int, pack=None) -> jax.Array:
  """The critic's V [B, R] on rollout rows, no gradients (`token_values`, jitted)."""
  return token_values(cfg, critic, tokens_BS, mask_BS, prompt_len, pack)


@functools.partial(jax.jit, static_argnames=("c",))
def targets(c: Config, values_BR, resp_mask_BR, rewards_B, old_logp_BR, ref_logp_BR=None):
  """(advantages, returns), each [B, R], for a whole rollout before any update.

  Reward at the last response token, minus kl_coef·(old_logp − ref_logp) on every token when
  `ref_logp_BR` is given; GAE(γ, λ) on the critic's `values_BR`; advantages whitened over the rollout.
  """
  kl_BR = None if ref_logp_BR is None else old_logp_BR - ref_logp_BR
  r_BR = BL.outcome_token_rewards(rewards_B, resp_mask_BR, kl_BR, c.kl_coef)
  return BL.gae_advantages(r_BR, values_BR, resp_mask_BR, gamma=c.gae_gamma, lam=c.gae_lambda)


# ---------------------------------------------------------------------------------------------
# The method's functions.

def batch_shapes(c: Config, rows: int, prompt_len: int, response_len: int) -> dict:
  out = dict(common_batch_shapes(rows, prompt_len, response_len),
             **{k: ((rows, response_len), np.float32) for k in ("old_logp", "old_values", "adv", "returns")})
  if c.kl_coef > 0:
    out["ref_logp"] = ((rows, response_len), np.float32)
  if c.tis_cap > 0:
    out["tis_w"] = ((rows, response_len), np.float32)
  return out


def init_state(cfg, params, c: Config, optimizers: update.Optimizers, seed: int) -> dict:
  if optimizers.critic is None:
    raise ValueError("ppo: the critic needs its own optimizer (update.Optimizers(policy=..., critic=...))")
  return update.init_train_state(params, optimizers, init_critic(cfg, params, seed))


def prepare(ctx, c: Config, state, ro: rollout.Rollout, prompts, blocks: scoring.Blocks):
  """Old-policy and π_ref log-probs, the critic's values, GAE advantages and returns."""
  batch, secs = arrays.policy_arrays(ctx, c, state, ro, blocks, with_reference=c.kl_coef > 0)
  t = time.perf_counter()
  values_BR = scoring.in_packed_blocks(
      lambda tok, m, pk=None: critic_values(ctx.cfg, state["value_params"], tok, m, prompt_len=ro.prompt_len,
                                            pack=pk),
      blocks.rows, batch["tokens"], batch["mask"], ro.prompt_len, ctx.row_sharding, blocks.pack)
  values_BR = np.where(batch["resp_mask"], values_BR, 0.0).astype(np.float32)
  adv, returns = jax.device_get(targets(c, values_BR, batch["resp_mask"], ro.rewards_B, batch["old_logp"],
                                        batch.get("ref_logp")))
  batch.update(old_values=values_BR, adv=adv, returns=returns)
  secs["sec_values"] = time.perf_counter() - t
  metrics = arrays.kl_and_group_metrics(batch, c.group_size)
  metrics["value_mean"] = float(np.where(batch["resp_mask"], values_BR, 0.0).sum() / max(batch["resp_mask"].sum(), 1))
  return batch, dict(metrics, **secs)


def loss(cfg, c: Config, prompt_len: int, params, unembed_DV, critic, mb, counts: update.Counts):
  """Clipped surrogate of the policy plus the critic's clipped value loss (disjoint param trees, so each
  gets only its own term's gradient)."""
  logp_bR, ent_bR = scoring.batch_logprobs_and_entropy(cfg, params, mb, prompt_len, c.logp_chunk,
                                                       unembed_DV=unembed_DV)
  pg, m = BL.ppo_policy_loss(logp_bR, mb["old_logp"], mb["resp_mask"], mb["adv"], ent_bR, clip_eps=c.clip_eps,
                             entropy_coef=c.entropy_coef, num_tokens=counts.num_tokens, tis_BT=mb.get("tis_w"))
  values_bR = token_values(cfg, critic, mb["tokens"], mb["mask"], prompt_len, packing.from_batch(mb))
  vf, vm = BL.ppo_value_loss(values_bR, mb["old_values"], mb["returns"], mb["resp_mask"], value_clip=c.value_clip,
                             num_tokens=counts.num_tokens)
  return pg + vf, dict(m, **vm)
