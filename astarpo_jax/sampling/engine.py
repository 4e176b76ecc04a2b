"""Continuous batching over a fixed number of decode slots: prefill -> insert -> generate.

Every prompt is prefilled once (batched, one program per prompt bucket) into a pool holding its KV
cache; with `num_samples = n` the n samples of a prompt share that prefill (prefix sharing). The
first token of every row is drawn at prefill. Decoding runs in a fixed number of slots (static
shapes) in `lax.while_loop` segments; a segment returns to the host when enough slots have finished
(or, with nothing left to insert, when the rows left fit in half the slots). Between segments the
host commits finished rows to the output, copies the next pending rows' prompt caches into the free
slots, and, once the rows left fit in half the slots, compacts the state into half as many (a
ladder of slot counts, one decode program each), so a tail of long rows does not run at the full
batch's cost. The host decides from a small replicated flag array, so every process of a
multi-host run takes the same decisions.

A row's randomness is fold_in(key, row): one uniform per step, index t for its t-th token. Its
tokens therefore do not depend on the schedule (which slot, which other rows, when inserted).

Two cache layouts (`layout`): "dense", each slot's own [P + T - 1] columns, a prompt's cache copied
into the slot at insertion (the CPU's, with its fused weights and attention windows); and "paged"
(paged_cache.py), one pool of pages with a page table per slot, a prompt's full pages shared by its
samples, attention reading each row's live pages only (the accelerators'; model/paged_attention.py).

Axis letters as in model/decoder.py; here R is output rows (prompts x samples), C prompts per prefill
chunk, P the padded prompt length, T = max_new_tokens, S = P + T - 1 cache columns (generated
token i sits at column P + i; the last token is never fed back), B slots, M page-table columns.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from astarpo_jax.infra import multihost, sharding
from astarpo_jax.infra.sharding import constrain
from astarpo_jax.model import decoder as model_lib, lora, paged_attention
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.model.decoder import Params
from astarpo_jax.sampling import decode_cache, decode_plan, paged_cache, token_choice


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pool:
  """Prefilled prompts (index p) and every row's first token (index r = p * n + j)."""
  cache: dict  # dense: a DecodeCache with P columns, one row per prompt; paged: {"k", "v"} prompt pages
  live_pP: jax.Array  # [prompts, P] bool, real prompt tokens
  length_p: jax.Array  # [prompts] int32, prompt lengths (the first generated token's position)
  first_R: jax.Array  # [R] int32
  first_logp_R: jax.Array  # [R] f32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
  """The decode state of B slots; a slot is free when done (finished, or never filled)."""
  row_B: jax.Array  # [B] int32, output row held, -1 when none
  step_B: jax.Array  # [B] int32, tokens generated so far
  last_B: jax.Array  # [B] int32, the token fed at the next step
  pos_B: jax.Array  # [B] int32, its position
  budget_B: jax.Array  # [B] int32, the row's max new tokens
  done_B: jax.Array  # [B] bool
  stopped_B: jax.Array  # [B] bool, emitted a stop token
  tokens_BT: jax.Array  # [B, T] int32
  logp_BT: jax.Array  # [B, T] f32
  u_BT: jax.Array  # [B, T] f32, the row's uniforms
  live_BP: jax.Array  # [B, P] bool, real prompt tokens in the cache's first P columns (dense)
  table_BM: jax.Array  # [B, M] int32, the slot's page table (paged; [B, 1] zeros when dense)
  shared_B: jax.Array  # [B] int32, table columns holding the prompt's shared pages (paged)
  cache: dict | paged_cache.Pages  # dense: a DecodeCache with S columns; paged: the call's pool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rows:
  """The output under construction, one entry per row."""
  tokens_RT: jax.Array
  logp_RT: jax.Array
  length_R: jax.Array
  stopped_R: jax.Array


def _batch_axes(x):
  """Slot/row arrays: split the leading axis over the mesh's batch axes (no-op without a mesh)."""
  return constrain(x, ("batch",) + (None,) * (x.ndim - 1))


def _row_uniforms(key, rows_R, T: int):
  """[R, T] uniforms of rows `rows_R`: uniform(fold_in(key, row), (T,)), as the static sampler drew them."""
  return jax.vmap(lambda r: jax.random.uniform(jax.random.fold_in(key, r), (T,), jnp.float32))(rows_R)


def _is_stop(tok_B, stop_ids):
  return functools.reduce(jnp.logical_or, [tok_B == s for s in stop_ids], jnp.zeros(tok_B.shape, bool))


# ----------------------------------------------------------------------------- device programs


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _prefill(cfg: ModelConfig, scfg: token_choice.SamplingConfig, n: int, fused: bool, page_size: int, params: Params,
             tokens_CP, mask_CP, key, row0) -> Pool:
  """Prefill C prompts once; draw the first token of each of their n rows (rows row0 + p*n + j). With
  `page_size` the prompts' keys and values come back as pages (paged layout), else as a decode cache."""
  C, P = tokens_CP.shape
  cache = model_lib.init_cache(cfg, C, P)
  h_CPD, cache = model_lib.hidden_states(cfg, params, tokens_CP, model_lib.positions_from_mask(mask_CP), mask_CP,
                                         cache)
  logits_VC = model_lib.logits_from_hidden(cfg, params, h_CPD[:, -1:])[:, 0].T  # last column is real: left padding
  u_NC = _row_uniforms(key, row0 + jnp.arange(C * n), scfg.max_new_tokens)[:, 0].reshape(C, n).T
  first_NC, first_logp_NC = jax.lax.map(lambda u_C: token_choice.choose_tokens(logits_VC, u_C, scfg), u_NC)
  length_C = jnp.sum(mask_CP, axis=1, dtype=jnp.int32)
  if page_size:
    pool_cache = {k: paged_cache.prompt_pages(cache[k], length_C, page_size) for k in ("k", "v")}
  else:  # each prompt may go to any slot: the pool is replicated over the batch axes (kv heads split as the params)
    pool_cache = decode_cache.constrain(decode_cache.from_prefill(cache, fused), rows=None)
  return Pool(cache=pool_cache, live_pP=mask_CP, length_p=length_C,
              first_R=first_NC.T.reshape(C * n), first_logp_R=first_logp_NC.T.reshape(C * n))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def _empty_slots(cfg: ModelConfig, T: int, P: int, B: int, fused: bool, layout: paged_cache.PageLayout | None = None,
                 pages: paged_cache.Pages | None = None) -> Slots:
  i32 = lambda v: _batch_axes(jnp.full((B,), v, jnp.int32))  # noqa: E731
  zeros = lambda shape, dt: _batch_axes(jnp.zeros(shape, dt))  # noqa: E731
  return Slots(
      row_B=i32(-1), step_B=i32(0), last_B=i32(0), pos_B=i32(0), budget_B=i32(0),
      done_B=_batch_axes(jnp.ones((B,), bool)), stopped_B=zeros((B,), bool), tokens_BT=zeros((B, T), jnp.int32),
      logp_BT=zeros((B, T), jnp.float32), u_BT=zeros((B, T), jnp.float32), live_BP=zeros((B, P), bool),
      table_BM=zeros((B, layout.row_pages if layout else 1), jnp.int32), shared_B=i32(0),
      cache=pages if layout else decode_cache.constrain(decode_cache.init(cfg, B, P + T - 1, fused)))


def _commit(rows: Rows, slots: Slots) -> tuple[Rows, Slots]:
  """Copy every finished slot's row into the output; the slot then holds no row."""
  R = rows.length_R.shape[0]
  dest_B = jnp.where(slots.done_B & (slots.row_B >= 0), slots.row_B, R)  # R: dropped
  put = lambda out, x: out.at[dest_B].set(x, mode="drop")  # noqa: E731
  rows = Rows(tokens_RT=put(rows.tokens_RT, slots.tokens_BT), logp_RT=put(rows.logp_RT, slots.logp_BT),
              length_R=put(rows.length_R, slots.step_B), stopped_R=put(rows.stopped_R, slots.stopped_B))
  cache = slots.cache
  if isinstance(cache, paged_cache.Pages):  # a committed row gives its own pages back
    page = cache.k.shape[2]
    cache = paged_cache.release(cache, slots.table_BM, slots.shared_B, paged_cache.pages_used(slots.pos_B, page),
                                slots.done_B & (slots.row_B >= 0))
  return rows, dataclasses.replace(slots, row_B=jnp.where(slots.done_B, -1, slots.row_B), cache=cache)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2, 3))
def _refill(scfg: token_choice.SamplingConfig, n: int, rows: Rows, slots: Slots, pool: Pool, key, slot_I, row_I,
            budget_R, count) -> tuple[Rows, Slots]:
  """Commit finished slots, then insert rows row_I[:count] into slots slot_I[:count]: their prompt's
  cache (copied from the pool), uniforms and first token."""
  rows, slots = _commit(rows, slots)
  T = scfg.max_new_tokens

  def insert(i, st: Slots) -> Slots:
    s, r = slot_I[i], row_I[i]
    p = r // n
    first, budget = pool.first_R[r], budget_R[r]
    stopped = _is_stop(first, scfg.stop_ids)
    one = lambda x, v: jax.lax.dynamic_update_index_in_dim(x, jnp.asarray(v, x.dtype), s, 0)  # noqa: E731
    return Slots(
        row_B=one(st.row_B, r), step_B=one(st.step_B, 1), last_B=one(st.last_B, first),
        pos_B=one(st.pos_B, pool.length_p[p]), budget_B=one(st.budget_B, budget),
        done_B=one(st.done_B, stopped | (budget <= 1)), stopped_B=one(st.stopped_B, stopped),
        tokens_BT=one(st.tokens_BT, jnp.full((T,), scfg.pad_id, jnp.int32).at[0].set(first)),
        logp_BT=one(st.logp_BT, jnp.zeros((T,), jnp.float32).at[0].set(pool.first_logp_R[r])),
        u_BT=one(st.u_BT, _row_uniforms(key, r[None], T)[0]), live_BP=one(st.live_BP, pool.live_pP[p]),
        **_insert_cache(st, pool, s, p))

  return rows, jax.lax.fori_loop(0, count, insert, slots)


def _insert_cache(st: Slots, pool: Pool, s, p) -> dict:
  """Slot s's cache for prompt p: dense, the prompt's columns copied in; paged, its page table (paged_cache)."""
  if not isinstance(st.cache, paged_cache.Pages):
    return {"cache": decode_cache.write(st.cache, decode_cache.take_rows(pool.cache, p[None]), s),
            "table_BM": st.table_BM, "shared_B": st.shared_B}
  pages, table_BM, shared_B = paged_cache.insert(st.cache, st.table_BM, st.shared_B, s, p, pool.length_p[p],
                                                 pool.live_pP.shape[1])
  return {"cache": pages, "table_BM": table_BM, "shared_B": shared_B}


@functools.partial(jax.jit, donate_argnums=(0,))
def _commit_and_keep(rows: Rows, slots: Slots, keep_K) -> tuple[Rows, Slots]:
  """Commit finished slots, then keep slots keep_K only (a smaller slot count)."""
  rows, slots = _commit(rows, slots)
  take = lambda x: _batch_axes(jnp.take(x, keep_K, axis=0))  # noqa: E731
  kept = {f.name: take(getattr(slots, f.name)) for f in dataclasses.fields(Slots) if f.name != "cache"}
  if isinstance(slots.cache, paged_cache.Pages):  # the pool is shared: the kept slots' tables still name their pages
    return rows, Slots(**kept, cache=slots.cache)
  return rows, Slots(**kept, cache=decode_cache.constrain(decode_cache.take_rows(slots.cache, keep_K)))


def _rows_on_every_device(logits_VB):
  """The token choice's logits with the whole vocabulary and the rows split over every mesh axis, tensor too:
  a vocab-sharded [V, B] goes there by one all-to-all, and each device chooses its share of the rows. Left to
  itself XLA gathered every row's logits on every device, which then all chose every row's token (7B on
  v5p-8: 156 MB of fp32 logits per device per step, and their copies). For top-k/top-p; see `choose_on_mesh`."""
  mesh = jax.sharding.get_abstract_mesh()
  axes = () if mesh.empty else tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
  if not axes or logits_VB.shape[1] % math.prod(mesh.shape[a] for a in axes):
    return logits_VB
  return jax.lax.with_sharding_constraint(logits_VB, jax.sharding.PartitionSpec(None, axes))


def choose_on_mesh(logits_VB, u_B, scfg: token_choice.SamplingConfig, split_vocab: bool = True):
  """Token and log-prob per row from the decode's [V, B] logits. With the vocabulary split over tensor (and
  no top-k/top-p) each device draws from its own shard (token_choice.choose_tokens_split: per-row scalars and
  one block cross devices, the logits never move); otherwise the rows go whole to one device each
  (`_rows_on_every_device`). `split_vocab=False` forces the latter (for comparison)."""
  mesh = jax.sharding.get_abstract_mesh()
  t = 1 if mesh.empty else mesh.shape.get("tensor", 1)
  V, B = logits_VB.shape
  if not (split_vocab and t > 1 and V % t == 0 and token_choice.splits_vocab(scfg)):
    return token_choice.choose_tokens(_rows_on_every_device(logits_VB), u_B, scfg)
  P = jax.sharding.PartitionSpec
  rows = sharding.logical_to_spec(("batch",), (B,), dict(mesh.shape))[0]
  draw = functools.partial(token_choice.choose_tokens_split, scfg=scfg, axis="tensor")
  return jax.shard_map(draw, mesh=mesh, in_specs=(P("tensor", rows), P(rows)), out_specs=(P(rows), P(rows)),
                       check_vma=False)(logits_VB, u_B)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(5,))
def _segment(cfg: ModelConfig, scfg: token_choice.SamplingConfig, window: int, attention: str, dparams: Params,
             slots: Slots, exit_free) -> tuple[Slots, jax.Array, jax.Array]:
  """Decode every unfinished slot until `exit_free` slots are done (or all are), attending over the
  cache's first `window` columns only: the segment also returns once an unfinished slot's next column
  would fall outside it. Returns the state and the done flags and steps, replicated for the host.
  `attention`: "dense", or the paged_attention implementation reading the pool (the XLA gather reads the
  page-table columns covering `window` positions; the Pallas kernel each row's live pages)."""
  P, T = slots.live_BP.shape[1], scfg.max_new_tokens
  B = slots.row_B.shape[0]
  iota_B = jnp.arange(B)

  def cond(st: Slots):
    n_done = jnp.sum(st.done_B, dtype=jnp.int32)
    fits = jnp.all(st.done_B | (P + st.step_B - 1 < window))  # every next column inside the window
    return (n_done < exit_free) & (n_done < B) & fits

  def body(st: Slots) -> Slots:
    if attention == "dense":
      live_BW = jnp.concatenate([st.live_BP, jnp.arange(window - P)[None, :] < st.step_B[:, None]], axis=1)
      logits_VB, cache = model_lib.decode_step(cfg, dparams, st.cache, st.last_B, st.pos_B, P + st.step_B - 1,
                                               live_BW)
      table_BM = st.table_BM
    else:
      logits_VB, cache, table_BM = paged_cache.decode_step(cfg, attention, window, dparams, st.cache, st.table_BM,
                                                           st.last_B, st.pos_B, ~st.done_B)
    u_B = jnp.take_along_axis(st.u_BT, jnp.minimum(st.step_B, T - 1)[:, None], axis=1)[:, 0]
    tok_B, logp_B = choose_on_mesh(logits_VB, u_B, scfg)
    active_B = ~st.done_B
    col_B = jnp.where(active_B, st.step_B, T)  # T: dropped
    step_B = st.step_B + active_B
    stop_B = active_B & _is_stop(tok_B, scfg.stop_ids)
    return dataclasses.replace(
        st, step_B=step_B, last_B=jnp.where(active_B, tok_B, st.last_B), pos_B=st.pos_B + active_B,
        done_B=st.done_B | stop_B | (step_B >= st.budget_B), stopped_B=st.stopped_B | stop_B,
        tokens_BT=st.tokens_BT.at[iota_B, col_B].set(tok_B, mode="drop"),
        logp_BT=st.logp_BT.at[iota_B, col_B].set(logp_B, mode="drop"), cache=cache, table_BM=table_BM)

  slots = jax.lax.while_loop(cond, body, slots)
  return slots, constrain(slots.done_B, (None,)), constrain(slots.step_B, (None,))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _empty_rows(T: int, R: int) -> Rows:
  return Rows(tokens_RT=jnp.zeros((R, T), jnp.int32), logp_RT=jnp.zeros((R, T), jnp.float32),
              length_R=jnp.zeros((R,), jnp.int32), stopped_R=jnp.zeros((R,), bool))


@functools.partial(jax.jit, static_argnums=0)
def _output(pad_id: int, rows: Rows) -> token_choice.SampleOutput:
  T = rows.tokens_RT.shape[1]
  mask_RT = jnp.arange(T)[None, :] < rows.length_R[:, None]
  return jax.tree.map(_batch_axes, token_choice.SampleOutput(
      tokens_BT=jnp.where(mask_RT, rows.tokens_RT, pad_id), logp_BT=jnp.where(mask_RT, rows.logp_RT, 0.0),
      mask_BT=mask_RT, length_B=rows.length_R, finished_B=rows.stopped_R, truncated_B=~rows.stopped_R))


def _timed_wait(x, t0: float) -> float:
  jax.block_until_ready(x)
  return time.perf_counter() - t0


@functools.partial(jax.jit, static_argnums=1)
def _concat_pools(pools: list[Pool], paged: bool) -> Pool:
  rest = [dataclasses.replace(p, cache=None) for p in pools]
  if paged:  # prompt pages [L, pages, page, K * H]: along the pages
    cache = jax.tree.map(lambda *x: jnp.concatenate(x, axis=1), *[p.cache for p in pools])
  else:
    cache = decode_cache.concat([p.cache for p in pools])
  return dataclasses.replace(jax.tree.map(lambda *x: jnp.concatenate(x), *rest), cache=cache)


def prefill_pool(cfg: ModelConfig, params: Params, tokens_pP, mask_pP, key, scfg, n: int, fused: bool, chunk: int,
                 stats: decode_plan.RunStats, page_size: int = 0) -> Pool:
  """Every prompt prefilled once, `chunk` prompts per call (the last chunk repeats its last prompt; paged, its
  pages are then dropped, so prompt p's pages are p * P / page_size onwards)."""
  num = tokens_pP.shape[0]
  pools, t0 = [], time.perf_counter()
  for c0 in range(0, num, chunk):
    idx = np.minimum(np.arange(c0, c0 + chunk), num - 1)
    tokens = tokens_pP[idx] if isinstance(tokens_pP, np.ndarray) else jnp.asarray(tokens_pP)[idx]
    pools.append(_prefill(cfg, scfg, n, fused, page_size, params, tokens, mask_pP[idx], key, np.int32(c0 * n)))
    stats.prefill_calls += 1
    stats.prefill_rows += chunk
  pool = pools[0] if len(pools) == 1 else _concat_pools(pools, bool(page_size))
  if page_size and chunk * len(pools) > num:  # the repeated prompts of the last chunk
    pool = paged_cache.first_prompts(pool, num, n, page_size)
  stats.prefill_seconds += _timed_wait(pool, t0)
  return pool


def program_config(cfg: ModelConfig, params: Params) -> ModelConfig:
  """The model config the sampler's programs are keyed by: a LoRA model config (model/lora.py) reduced to its
  ModelConfig fields when the params carry no adapter (the merged copy a LoRA run samples from), so that a LoRA
  run's rollouts run the programs its evaluations compiled (same shapes, same computation)."""
  if type(cfg) is ModelConfig or lora.has_adapter(params):
    return cfg
  return ModelConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(ModelConfig)})


def _exit_free(schedule: str, B: int, smallest: int, pending: int, min_free: int) -> int:
  """The done slots at which a segment returns to the host: all of them (static, or the last rows on the
  ladder's smallest rung), `min_free` while rows are pending, else half the slots (to step down the ladder)."""
  if schedule == "static" or (not pending and B == smallest):
    return B + 1  # run until every slot is done
  return min(min_free, pending) if pending else B - B // 2


def _decode_setup(cfg: ModelConfig, params: Params, scfg, layout, page_size, max_pages, attention, num: int, P: int,
                  B: int):
  """(page layout or None, attention, decode params) of a run: `generate`'s arguments, else scfg's, else the
  backend's; a paged pool too small for B slots is refused here, before anything runs."""
  backend, T = jax.default_backend(), scfg.max_new_tokens
  layout = layout or scfg.kv_layout or decode_plan.default_layout(backend)
  page_size, max_pages = page_size or scfg.page_size or None, max_pages or scfg.max_pages or None
  if layout not in ("dense", "paged"):
    raise ValueError(f"layout={layout!r}: 'dense' or 'paged'")
  if layout == "dense":
    return None, "dense", model_lib.decode_params(cfg, params) if T > 1 else params
  pages_at = paged_cache.pool_layout(num, P, T, page_size or paged_cache.DEFAULT_PAGE_SIZE.get(backend, 16))
  paged_cache.check_pool(pages_at, B, max_pages)
  attention = attention or scfg.paged_attention or paged_attention.default_implementation(backend)
  dparams = (model_lib.compute_dtype_params(cfg, params) if backend == "cpu"  # the CPU's decode copy is fused
             else model_lib.decode_params(cfg, params, backend))
  return pages_at, attention, dparams


def generate(cfg: ModelConfig, params: Params, tokens_pP, mask_pP, key, scfg, *, num_samples: int = 1,
             budget_R: np.ndarray | None = None, slots: int = 64, min_slots: int | None = None, ways: int = 1,
             schedule: str = "continuous", min_free: int | None = None, prefill_chunk: int | None = None,
             window_step: int | None = -1, stats: decode_plan.RunStats | None = None, layout: str | None = None,
             page_size: int | None = None, attention: str | None = None,
             max_pages: int | None = None) -> token_choice.SampleOutput:
  """Rows r = p * num_samples + j (prompt p, sample j), each up to budget_R[r] new tokens.

  `schedule`: "continuous" refills finished slots between segments (a segment returns to the host once
  `min_free` slots are free: None, `decode_plan.default_min_free`) and steps down the slot ladder for the tail (to `min_slots`;
  None, `decode_plan.default_min_slots`); "static" runs rows
  in chunks of `slots`, the next chunk starting when the whole chunk has finished (for comparison).
  `window_step`: each segment attends over the smallest window of `decode_plan.attention_windows` that its
  furthest slot needs (-1: `decode_plan.default_window_step(T)`; None: always the whole cache).
  `layout`: "dense" or "paged" (None: `decode_plan.default_layout`); paged, `page_size` tokens a page (None: the
  backend's paged_cache.DEFAULT_PAGE_SIZE), `attention` "pallas", "triton" or "xla" (None: scfg's, else the
  backend's), and a pool
  capped at `max_pages` is refused before anything is sampled when it is too small.
  """
  if schedule not in ("continuous", "static"):
    raise ValueError(f"schedule={schedule!r}: must be 'continuous' or 'static'")
  stats = stats if stats is not None else decode_plan.RunStats()
  num, P = mask_pP.shape
  n, T = num_samples, scfg.max_new_tokens
  R = num * n
  budget_R = np.full(R, T, np.int32) if budget_R is None else np.asarray(budget_R, np.int32)
  cfg = program_config(cfg, params)
  if min_slots is None:
    min_slots = decode_plan.default_min_slots(slots, T)
  ladder = decode_plan.slot_ladder(slots, min_slots, ways) if schedule == "continuous" else [slots]
  B = ladder[0]
  pages_at, attention, dparams = _decode_setup(cfg, params, scfg, layout, page_size, max_pages, attention, num, P, B)
  fused = model_lib.is_fused(dparams)
  pool = prefill_pool(cfg, params, tokens_pP, mask_pP, key, scfg, n, fused,
                      prefill_chunk or -(-min(num, slots) // ways) * ways, stats,
                      pages_at.page_size if pages_at else 0)
  pages = paged_cache.init(pool.cache["k"], pool.cache["v"], pages_at, B) if pages_at else None
  st, rows = _empty_slots(cfg, T, P, B, fused, pages_at, pages), _empty_rows(T, R)
  budget_dev = jnp.asarray(budget_R)
  step = decode_plan.default_window_step(T) if window_step == -1 else window_step
  windows = decode_plan.attention_windows(P, T, step)
  headroom = decode_plan.window_headroom(windows)
  done_B, step_B, next_row = np.ones(B, bool), np.zeros(B, np.int32), 0
  while True:
    t_segment = time.perf_counter()
    pending, active = R - next_row, int((~done_B).sum())
    if not pending and not active:
      break
    while schedule == "continuous" and B > ladder[-1] and active + pending <= B // 2:
      keep = np.concatenate([np.flatnonzero(~done_B), np.flatnonzero(done_B)])[:B // 2]
      rows, st = _commit_and_keep(rows, st, jnp.asarray(keep, jnp.int32))
      done_B, step_B, B = done_B[keep], step_B[keep], B // 2
      stats.compactions.append(B)
    free = np.flatnonzero(done_B)
    k = min(len(free), pending) if schedule == "continuous" or not active else 0
    if k:  # (finished slots left in place are committed by the next refill, compaction or the end)
      slot_I, row_I = np.zeros(B, np.int32), np.zeros(B, np.int32)
      slot_I[:k], row_I[:k] = free[:k], np.arange(next_row, next_row + k)
      rows, st = _refill(scfg, n, rows, st, pool, key, slot_I, row_I, budget_dev, np.int32(k))
    next_row += k
    active_B = ~done_B
    active_B[free[:k]], step_B[free[:k]] = True, 1
    window = decode_plan.pick_window(windows, P, int(step_B[active_B].max(initial=1)), headroom)
    exit_free = _exit_free(schedule, B, ladder[-1], R - next_row, min_free or decode_plan.default_min_free(ladder[0]))
    st, done_dev, step_dev = _segment(cfg, scfg, window, attention, dparams, st, np.int32(exit_free))
    steps_before = step_B.copy()
    done_B, step_B = multihost.to_host(done_dev).astype(bool), multihost.to_host(step_dev).astype(np.int32)
    stats.segment_log.append((B, window, int((step_B - steps_before)[active_B].max(initial=0)),
                              time.perf_counter() - t_segment))
    stats.segments += 1
    stats.windows[window] = stats.windows.get(window, 0) + 1
  rows, st = _refill(scfg, n, rows, st, pool, key, np.zeros(B, np.int32), np.zeros(B, np.int32), budget_dev,
                     np.int32(0))
  if pages_at is not None:
    stats.pages_returned = paged_cache.check_returned(st.cache, pages_at.free_pages(ladder[0]))
  return _output(scfg.pad_id, rows)
