"""Batched autoregressive sampling: the API Stage 1, Stage 2, GRPO and evaluation call.

`sample_padded` / `sample` run `engine.generate`: every prompt is prefilled once (left-padded to a
length bucket, `bucket_length`, so a run compiles one prefill per bucket), and a fixed number of
decode slots is kept busy by continuous batching: when a row stops, the next pending row takes its
slot. `num_samples = n` returns n rows per prompt (prompt-major) from one prefill of the prompt;
`max_new_tokens_B` gives each row its own budget. The forward itself (full, prefill and one-token
decode) lives in model.py; this module and engine.py keep only scheduling and token choice
(token_choice.py).

Each row's uniforms come from `fold_in(key, global row index)`, one per step, so a row's sample
depends only on the key, its index, its prompt and its budget: not on the slot count, the schedule
or the other rows (up to float rounding of the batched matmuls).
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from astarpo_jax.infra import multihost, sharding as sharding_lib
from astarpo_jax.model import decoder as model_lib
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.model.decoder import Params
from astarpo_jax.sampling import decode_plan, engine
from astarpo_jax.sampling.token_choice import SampleOutput, SamplingConfig

# Decode slots when the caller gives none: a CPU step's cost grows with the slots (64 keeps it near
# the best tokens/s of the bench model); accelerators amortise the weight reads over more rows.
DEFAULT_SLOTS = {"cpu": 64, "gpu": 256, "tpu": 256}


def decode_slots(max_batch: int | None, rows: int, backend: str | None = None) -> int:
  """Decode slots a call of `rows` output rows gets (before rounding to the mesh's batch shards):
  `max_batch`, or the backend's default, never more than the rows."""
  return min(max_batch or DEFAULT_SLOTS.get(backend or jax.default_backend(), 64), rows)


def bucket_length(n: int) -> int:
  """Padded prompt length: the next power of two (at least 16) up to 128, then a multiple of 128."""
  if n <= 128:
    return max(16, 1 << (max(n, 1) - 1).bit_length())
  return -(-n // 128) * 128


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, length: int | None = None):
  """Token lists -> left-padded (tokens [B, P] int32, mask [B, P] bool) numpy arrays."""
  if not len(prompts):
    raise ValueError("prompts is empty: pass at least one prompt")
  lengths = [len(p) for p in prompts]
  P = max(lengths) if length is None else length
  if P < max(lengths):
    raise ValueError(f"length={length} is shorter than the longest prompt ({max(lengths)} tokens)")
  tokens_BP = np.full((len(prompts), P), pad_id, np.int32)
  mask_BP = np.zeros((len(prompts), P), bool)
  for i, p in enumerate(prompts):
    if len(p):
      tokens_BP[i, P - len(p):] = p
      mask_BP[i, P - len(p):] = True
  return tokens_BP, mask_BP


def _check_inputs(cfg: ModelConfig, scfg: SamplingConfig, mask_BP: np.ndarray) -> np.ndarray:
  """Prompt lengths [B]; rejects empty prompts, right padding and overlong requests."""
  lengths_B = mask_BP.sum(axis=-1)
  P = mask_BP.shape[1]
  if (lengths_B == 0).any():
    raise ValueError(f"prompts {np.flatnonzero(lengths_B == 0)[:8].tolist()} are empty: each needs >= 1 token")
  left_padded_BP = np.arange(P)[None, :] >= (P - lengths_B)[:, None]
  if (mask_BP != left_padded_BP).any():
    bad = np.flatnonzero((mask_BP != left_padded_BP).any(axis=-1))[:8].tolist()
    raise ValueError(f"rows {bad} of the prompt mask are not left-padded (pads must all come first)")
  if scfg.top_k > cfg.vocab_size:
    raise ValueError(f"top_k={scfg.top_k} exceeds vocab_size={cfg.vocab_size}")
  for s in scfg.stop_ids + (scfg.pad_id,):
    if not 0 <= s < cfg.vocab_size:
      raise ValueError(f"token id {s} in stop_ids/pad_id is outside the vocabulary [0, {cfg.vocab_size})")
  need = int(lengths_B.max()) + scfg.max_new_tokens
  if need > cfg.max_position_embeddings:
    raise ValueError(f"prompt ({int(lengths_B.max())}) + max_new_tokens ({scfg.max_new_tokens}) = {need} "
                     f"exceeds max_position_embeddings={cfg.max_position_embeddings}")
  return lengths_B


def _budgets(max_new_tokens_B, B: int, n: int, cap: int) -> np.ndarray | None:
  """Per-row budgets [B * n] from [B] (one per prompt) or [B * n] ints in [1, cap]."""
  if max_new_tokens_B is None:
    return None
  budget = np.asarray(max_new_tokens_B)
  if budget.shape not in ((B,), (B * n,)) or not np.issubdtype(budget.dtype, np.integer):
    raise ValueError(f"max_new_tokens_B has shape {budget.shape} {budget.dtype}: give ints of shape [{B}] (per "
                     f"prompt) or [{B * n}] (per output row)")
  if budget.min() < 1 or budget.max() > cap:
    raise ValueError(f"max_new_tokens_B must lie in [1, max_new_tokens={cap}]; got [{budget.min()}, {budget.max()}]")
  return np.repeat(budget, n) if budget.shape == (B,) and n > 1 else budget


def on_mesh(cfg: ModelConfig, params: Params, mesh: jax.sharding.Mesh) -> bool:
  """Whether every leaf of `params` already has the sharding the rule table gives it on `mesh`."""
  want = model_lib.param_shardings(cfg, mesh)
  return all(getattr(x, "sharding", None) == s for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(want)))


def _identity(x):
  return x


def copy_to(x, sharding: jax.sharding.Sharding):
  """`x` on `sharding`, copied on the devices by one small program of its own (a jit of the identity, cached per
  shape, dtype and the two shardings) when `x` already lies on the same devices: eager `jax.device_put` of a
  fully addressable array onto another mesh over the same devices in the same order takes jax's slow path
  (jax 0.10.2 `array._array_shard_arg` -> `shard_sharded_device_array_slow_path`: no source shard is the target
  slice, so it fetches the whole array to the host, `x._value`, cached on `x`, and puts its slices back). Host
  arrays and other device sets go through `jax.device_put`; an array already so placed is returned as it is."""
  if not isinstance(x, jax.Array) or x.sharding.device_set != sharding.device_set:
    return jax.device_put(x, sharding)
  if x.sharding.is_equivalent_to(sharding, x.ndim):
    return x
  return jax.jit(_identity, out_shardings=sharding)(x)


def sampling_params(cfg: ModelConfig, params: Params, mesh: jax.sharding.Mesh, backend: str | None = None) -> Params:
  """`params` moved onto the sampling mesh `mesh` (placed by the rule table): a resharding copy per sampling
  call, leaf by leaf (`copy_to`: one small on-device program a leaf, so on each device at most one leaf's transfer
  temporaries are live beside the finished leaves, and nothing goes through the host: the compile-only
  `*_reshard` phases count it so). Off the CPU the params are first cast to the compute dtype on their own mesh
  (`model.decode_params`: what the decode runs on anyway, and every layer casts each weight, norm
  scales included, to cfg.dtype before use, so prefill and decode compute the same values), so the
  copy moves and holds half the bytes of an fp32 policy. On the CPU they move as stored (the engine
  builds its fused decode copy on the sampling mesh). On GPU the copy's layers are unstacked
  (`model.unstack_layers`), which prefill and decode both run on."""
  if (backend or jax.default_backend()) != "cpu":
    params = model_lib.decode_params(cfg, params, backend)
    cfg = dataclasses.replace(cfg, param_dtype=cfg.dtype)
  shardings = model_lib.param_shardings(cfg, mesh)
  if model_lib.is_unstacked(params):
    shardings = model_lib.unstacked_shardings(shardings, cfg.num_layers)
  return jax.tree.map(copy_to, params, shardings)


def _replicated_on(x: jax.Array, mesh: jax.sharding.Mesh) -> jax.Array:
  """A small input the caller placed on its own mesh (a multi-process run's key and prompt tokens are
  global arrays on the training mesh), replicated on the sampling mesh: one program cannot take arrays
  of two meshes, and a committed array crosses meshes only through the host here (`multihost`'s pair)."""
  here = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  if x.sharding == here:
    return x
  move = lambda a: multihost.from_host(multihost.to_host(a), here)  # noqa: E731
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return jax.random.wrap_key_data(move(jax.random.key_data(x)), impl=jax.random.key_impl(x))
  return move(x)


def sample_padded(cfg: ModelConfig, params: Params, tokens_BP, mask_BP, key: jax.Array, scfg: SamplingConfig,
                  max_batch: int | None = None, *, num_samples: int = 1, max_new_tokens_B=None,
                  schedule: str = "continuous", min_slots: int | None = None, window_step: int | None = -1,
                  stats: decode_plan.RunStats | None = None, mesh: jax.sharding.Mesh | None = None,
                  layout: str | None = None, page_size: int | None = None, attention: str | None = None,
                  max_pages: int | None = None) -> SampleOutput:
  """Sample `num_samples` responses per left-padded prompt row: B * num_samples output rows, row
  p * num_samples + j the j-th sample of prompt p, drawn exactly as if each prompt had been repeated
  num_samples times (each prompt is prefilled once and its cache shared by its samples).

  `max_batch`: decode slots (the rows decoded at once; default `DEFAULT_SLOTS` for the backend).
  `max_new_tokens_B`: per-row budgets ([B] per prompt or [B * num_samples] per row, each <=
  scfg.max_new_tokens); a row that reaches its budget is truncated exactly as at the global cap.
  `schedule="static"` runs rows in chunks of `max_batch` without refills (for comparison).
  `window_step`: decode attends over a window of the cache (multiples of this many columns past the
  prompt) as long as the furthest row needs (-1: `decode_plan.default_window_step`, None: the whole cache).
  Log-probs are those of the distribution each token was drawn from (after temperature, top-k
  and top-p); at temperature 1 without filtering they are the model's log π(y_t | x, y_<t).
  `mesh`: the mesh to sample on (config `mesh.sample_shape`): params sharded otherwise are copied onto
  it once per call (`sampling_params`) and the sampler runs under `jax.set_mesh(mesh)`; the outputs
  are on `mesh` (rows over its batch axes). Params already on it, or None: the params as given, under
  the caller's mesh context.
  `layout`, `page_size`, `attention`, `max_pages`: the KV cache's layout (engine.generate; None: the
  backend's, dense on the CPU, paged elsewhere).
  Memory: the params (plus, on the CPU only, a fused copy of the layer weights; plus the sampling
  mesh's copy when it differs), every prompt's cache (B·P columns), and the slots' cache,
  2·L·slots·(P + T)·K·H values in the compute dtype.
  """
  mask_np = np.asarray(mask_BP).astype(bool)
  if not isinstance(tokens_BP, jax.Array):
    tokens_BP = np.asarray(tokens_BP)
  if np.ndim(tokens_BP) != 2 or np.shape(tokens_BP) != mask_np.shape:
    raise ValueError(f"tokens {np.shape(tokens_BP)} and mask {mask_np.shape} must both be [B, P]")
  lengths_B = _check_inputs(cfg, scfg, mask_np)
  if not (isinstance(key, jax.Array) and (jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
                                          or (key.dtype == jnp.uint32 and key.shape == (2,)))):
    raise ValueError(f"key must be one PRNG key, e.g. jax.random.key(0); got {type(key).__name__} "
                     f"{getattr(key, 'dtype', '')}{getattr(key, 'shape', '')}")
  if not isinstance(num_samples, int) or num_samples < 1:
    raise ValueError(f"num_samples={num_samples!r}: must be an int >= 1")
  if max_batch is not None and max_batch < 1:
    raise ValueError(f"max_batch={max_batch}: must be >= 1 (or None for the backend default)")
  B, P_in = mask_np.shape
  budget_R = _budgets(max_new_tokens_B, B, num_samples, scfg.max_new_tokens)
  # Trim the common left padding and re-pad to the bucket of the longest prompt.
  P = bucket_length(int(lengths_B.max()))
  cut = max(P_in - P, 0)
  xp = np if isinstance(tokens_BP, np.ndarray) else jnp  # host arrays stay on the host until the jit
  widths = ((0, 0), (P - (P_in - cut), 0))
  tokens_BP = xp.pad(tokens_BP[:, cut:].astype(np.int32), widths, constant_values=scfg.pad_id)
  mask_BP = np.pad(mask_np[:, cut:], widths)
  context = contextlib.nullcontext()
  if mesh is not None and not on_mesh(cfg, params, mesh):
    params, context = sampling_params(cfg, params, mesh), jax.set_mesh(mesh)
    key, tokens_BP = (_replicated_on(x, mesh) if isinstance(x, jax.Array) else x for x in (key, tokens_BP))
  with context:
    ways = sharding_lib.batch_ways(jax.sharding.get_abstract_mesh())
    slots = -(-decode_slots(max_batch, B * num_samples) // ways) * ways
    return engine.generate(cfg, params, tokens_BP, mask_BP, key, scfg, num_samples=num_samples, budget_R=budget_R,
                           slots=slots, min_slots=min_slots, ways=ways, schedule=schedule, window_step=window_step,
                           stats=stats, layout=layout, page_size=page_size, attention=attention, max_pages=max_pages)


def sample(cfg: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], key: jax.Array,
           scfg: SamplingConfig, max_batch: int | None = None, **kwargs) -> SampleOutput:
  """Sample responses to prompts given as lists of token ids (any lengths); see `sample_padded`."""
  if not len(prompts):
    raise ValueError("prompts is empty: pass at least one prompt")
  tokens_BP, mask_BP = left_pad(prompts, scfg.pad_id)
  return sample_padded(cfg, params, tokens_BP, mask_BP, key, scfg, max_batch, **kwargs)
