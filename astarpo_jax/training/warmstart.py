"""Supervised warm-start: a short cross-entropy fit on (prompt, target response) pairs.

The CPU demo builds its reference policy this way from the synthetic task's worked answers, so that
pi_ref solves some problems but not all and RL has something to improve. The same step works for
any model (e.g. a short SFT of a base model on formatted answers before A*-PO).

A warm-started reference is cached in its run's folder and may be shared between runs (the demo's tests build it
once; a sweep copies it): the settings it was built from are kept beside it (KEY_FILE), and a run with other
settings is refused (`check_cached`) instead of silently starting from another pi_ref.
"""
from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from astarpo_jax.infra import masks
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.model.decoder import Params
from astarpo_jax.sampling import sampler as sampler_lib
from astarpo_jax.training.scoring import logprobs_and_entropy


def pack(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int,
         resp_len: int | None = None) -> dict[str, np.ndarray]:
  """Left-padded prompts [B, P] followed by right-padded responses [B, R], with masks."""
  P = sampler_lib.bucket_length(max(len(p) for p in prompts))
  R = resp_len or max(len(r) for r in responses)
  prompt_BP, pmask_BP = sampler_lib.left_pad(prompts, pad_id, P)
  resp_BR = np.full((len(responses), R), pad_id, np.int32)
  rmask_BR = np.zeros((len(responses), R), bool)
  for i, r in enumerate(responses):
    r = list(r)[:R]
    resp_BR[i, :len(r)] = r
    rmask_BR[i, :len(r)] = True
  return {"tokens": np.concatenate([prompt_BP, resp_BR], 1), "mask": np.concatenate([pmask_BP, rmask_BR], 1),
          "resp_mask": rmask_BR, "prompt_len": P}


@functools.partial(jax.jit, static_argnames=("cfg", "optimizer", "prompt_len"), donate_argnums=(2, 3))
def sft_step(cfg: ModelConfig, optimizer, params: Params, opt_state, tokens_BS, mask_BS, resp_mask_BR, *,
             prompt_len: int):
  """One AdamW step on the token-mean negative log-likelihood of the response tokens."""
  def loss_fn(p):
    logp_BR, _ = logprobs_and_entropy(cfg, p, tokens_BS, mask_BS, prompt_len)
    return -masks.masked_mean(logp_BR, resp_mask_BR)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def warm_start(cfg: ModelConfig, params: Params, pairs: Sequence[tuple[list[int], list[int]]], *, pad_id: int,
               steps: int, batch_size: int, lr: float = 3e-3, seed: int = 0, log=print) -> tuple[Params, list[float]]:
  """`steps` SFT steps on random batches of (prompt ids, response ids); returns params and losses."""
  if not pairs:
    raise ValueError("warm_start: no (prompt, response) pairs")
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
      optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 20), steps, lr / 10), weight_decay=0.01))
  opt_state = optimizer.init(params)
  rng = np.random.default_rng(seed)
  resp_len = max(len(r) for _, r in pairs)
  hist, t0 = [], time.perf_counter()
  for step in range(steps):
    idx = rng.integers(0, len(pairs), batch_size)
    b = pack([pairs[i][0] for i in idx], [pairs[i][1] for i in idx], pad_id, resp_len)
    params, opt_state, loss = sft_step(cfg, optimizer, params, opt_state, jnp.asarray(b["tokens"]),
                                       jnp.asarray(b["mask"]), jnp.asarray(b["resp_mask"]), prompt_len=b["prompt_len"])
    hist.append(float(loss))
    if log and (step % max(1, steps // 5) == 0 or step == steps - 1):
      log(f"warm-start step {step + 1}/{steps}: nll {hist[-1]:.3f} ({time.perf_counter() - t0:.0f}s)")
  return params, hist


KEY_FILE = "warmstart.json"  # beside the reference's config.json: the settings it was built from


def check_cached(ref_dir: str, key: dict) -> None:
  """Refuses a reference cached in `ref_dir` unless it was built from `key`'s settings (flat {field: value});
  no cached reference (no config.json) passes: the run builds one."""
  if not os.path.exists(os.path.join(ref_dir, "config.json")):
    return
  path = os.path.join(ref_dir, KEY_FILE)
  if not os.path.exists(path):
    raise ValueError(f"{ref_dir}: a cached warm-started reference without {KEY_FILE} (the settings it was built "
                     "from), so it cannot be checked against this run's: delete the folder to rebuild it")
  with open(path) as f:
    stored = json.load(f)
  now = json.loads(json.dumps(key))  # tuples as lists, as stored
  diff = [f"{k}: {stored.get(k)!r} cached, {now.get(k)!r} now" for k in sorted(stored.keys() | now.keys())
          if stored.get(k) != now.get(k)]
  if diff:
    raise ValueError(f"{ref_dir}: the cached warm-started reference was built with other settings ("
                     + "; ".join(diff) + "): delete the folder to rebuild it, or run in another work directory")


def write_key(ref_dir: str, key: dict) -> None:
  """Records `key` (the settings of the reference just built or checked) beside the reference in `ref_dir`."""
  path = os.path.join(ref_dir, KEY_FILE)
  if os.path.exists(os.path.join(ref_dir, "config.json")) and not os.path.exists(path):
    with open(path + ".tmp", "w") as f:
      json.dump(key, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)
