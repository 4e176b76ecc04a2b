"""Training methods as plug-ins of the shared loop: one module per method, each with the same few names.

A method module in this package defines
  Config                   frozen dataclass of its hyper-parameters (static in jit), validated on creation,
                           with class attributes METHOD (its name in configs, `config.algo.name`), SOURCE (the
                           paper / code its defaults follow) and NEEDS_VALUE_TABLE (trains on Stage 1's V̂*)
  responses_per_prompt(c)  G responses sampled per prompt (1 for A*-PO and PPO)
  footprint(c)             what it holds and scores besides the policy (memory plan, AOT compile)
  batch_shapes(c, rows, P, R)  {name: (shape, dtype)} of one micro-batch of its loss (memory plan, AOT)
  prepare(ctx, c, state, ro, prompts, blocks)     -> (batch arrays its loss needs, log metrics); `blocks`
                           (scoring.Blocks): rows per fixed-score forward and packing, from the loop
  loss(cfg, c, prompt_len, params, unembed_DV, mb, counts) -> (loss, metrics) of one micro-batch
A method with a critic also defines `critic_layout(cfg)` -> (logical axes, abstract shapes) of the critic's
params and `init_state(cfg, params, c, optimizers, seed)` (the train state with the critic's params), and its
`loss` takes the critic's params after `unembed_DV`. Without them the train state is the policy's
(update.init_train_state) and the loss sees no critic.

Adding a method is adding a module here (and a config that names it): `names()` finds every module,
`get(name, settings)` imports it and binds its Config from a settings mapping (e.g. `config.algo`).

May import: training, sampling, model, infra.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

import numpy as np

from astarpo_jax.training import update


@dataclasses.dataclass(frozen=True)
class Footprint:
  """What a method's step needs besides the policy and its optimizer state."""
  scored: tuple[str, ...]  # param trees scored per rollout without gradients: "reference", "policy", "critic"
  critic: bool = False  # trains a critic of the policy's size (params + its own optimizer state)


def common_batch_shapes(rows: int, prompt_len: int, response_len: int) -> dict:
  """The arrays every method's batch has: the rollout's tokens and masks, and the rewards."""
  S = prompt_len + response_len
  return {"tokens": ((rows, S), np.int32), "mask": ((rows, S), np.bool_), "resp_mask": ((rows, response_len), np.bool_),
          "rewards": ((rows,), np.float32)}


def names() -> list[str]:
  """Every method in this package."""
  return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def config_from(config_cls, settings: Mapping[str, Any]):
  """`config_cls` from the fields of `settings` it declares; other keys belong to other methods."""
  fields = {f.name for f in dataclasses.fields(config_cls)}
  return config_cls(**{k: settings[k] for k in fields if k in settings})


@dataclasses.dataclass(frozen=True)
class Method:
  """A method module bound to its Config: what the loop, the memory plan and the AOT compile call."""
  module: Any
  config: Any

  @property
  def name(self) -> str:
    return self.module.Config.METHOD

  @property
  def needs_value_table(self) -> bool:
    return getattr(self.module.Config, "NEEDS_VALUE_TABLE", False)

  @property
  def text_keys(self) -> tuple[str, ...]:
    return getattr(self.module, "TEXT_KEYS", ("loss", "reward_mean", "kl", "entropy", "response_length",
                                              "grad_norm", "sec_step"))

  def responses_per_prompt(self) -> int:
    return self.module.responses_per_prompt(self.config)

  def footprint(self) -> Footprint:
    return self.module.footprint(self.config)

  def batch_shapes(self, rows: int, prompt_len: int, response_len: int) -> dict:
    return self.module.batch_shapes(self.config, rows, prompt_len, response_len)

  @property
  def has_critic(self) -> bool:
    return hasattr(self.module, "critic_layout")

  def init_state(self, cfg, params, optimizers, seed: int) -> dict:
    if self.has_critic:
      return self.module.init_state(cfg, params, self.config, optimizers, seed)
    return update.init_train_state(params, optimizers)

  def prepare(self, ctx, state, ro, prompts, blocks):
    return self.module.prepare(ctx, self.config, state, ro, prompts, blocks)

  def loss(self, cfg, prompt_len: int, params, unembed_DV, critic, mb, counts):
    if self.has_critic:
      return self.module.loss(cfg, self.config, prompt_len, params, unembed_DV, critic, mb, counts)
    return self.module.loss(cfg, self.config, prompt_len, params, unembed_DV, mb, counts)

  def critic_layout(self, cfg):
    return self.module.critic_layout(cfg)


def get(name: str, settings: Mapping[str, Any] | None = None) -> Method:
  """The method `name` with its Config from `settings` (defaults for fields it does not hold)."""
  if name not in names():
    raise ValueError(f"unknown method {name!r}; the methods are {names()} (one module each in astarpo_jax/methods/)")
  module = importlib.import_module(f"{__name__}.{name}")
  return Method(module, config_from(module.Config, settings or {}))
