"""The paged KV cache of the engine on accelerators: a pool of pages, a page table per decode slot.

A sampling call's pool holds, per layer, `layout.total` pages of `page_size` tokens ([L, pages, page, K * H]):
  - every prompt's pages (its prefill, shifted so its first real token is at position 0): its full pages
    are shared, read-only, by all its samples (no copy per sample); its partial last page is copied into
    a page of the slot's own when a sample is inserted, since decoding appends to it;
  - the slots' own pages, taken from a stack of free pages as a row crosses into a new page, and given
    back when the row is committed;
  - one last page no row owns: finished slots write there (model/decoder.decode_step_paged).
A row's token at position t sits at page table_BM[b, t // page_size], offset t % page_size, so attention
reads only the pages of the row's length (model/paged_attention.py).

`pool_layout` sizes the pool for the worst case (every prompt of the bucket's full length, every slot at
its longest row), so a call never runs out of pages mid-decode; the memory plan calls it for its bytes,
and `check_pool` refuses, before any sampling, a pool capped below that with the settings to change.
Axis letters: L layers, K kv heads, H head dim, B slots, M table columns, C prompts, P prompt columns.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from astarpo_jax.infra import multihost, sharding
from astarpo_jax.model import decoder, paged_attention

DEFAULT_PAGE_SIZE = {"tpu": 64, "gpu": 16, "cpu": 16}


@dataclasses.dataclass(frozen=True)
class PageLayout:
  """Static sizes of one call's pool (hashable: a jit's static argument)."""
  page_size: int
  num_prompts: int
  prompt_pages: int  # pages per prompt: P / page_size
  row_pages: int  # M, the page table's width: pages of a row at its longest (P + T tokens)
  slot_pages: int  # pages a slot may own at once: its partial prompt page and T new tokens

  @property
  def shared(self) -> int:
    return self.num_prompts * self.prompt_pages

  def free_pages(self, slots: int) -> int:
    return slots * self.slot_pages

  def total(self, slots: int) -> int:
    return self.shared + self.free_pages(slots) + 1  # + the page no row owns


def pool_layout(num_prompts: int, P: int, T: int, page_size: int) -> PageLayout:
  """The pool of a call with `num_prompts` prompts padded to P tokens and T new tokens per row; a page size
  that does not divide P (a short bucket) is reduced to their greatest common divisor."""
  if page_size < 1:
    raise ValueError(f"page_size={page_size}: must be >= 1")
  page_size = math.gcd(page_size, P)
  return PageLayout(page_size=page_size, num_prompts=num_prompts, prompt_pages=P // page_size,
                    row_pages=-(-(P + T) // page_size), slot_pages=-(-(page_size - 1 + T) // page_size))


def pool_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, layout: PageLayout,
               slots: int) -> int:
  """Bytes of the pool's keys and values."""
  return 2 * num_layers * num_kv_heads * layout.total(slots) * layout.page_size * head_dim * dtype_bytes


def check_pool(layout: PageLayout, slots: int, max_pages: int | None) -> None:
  """Refuses a pool capped (`max_pages`) below what the call needs, before anything is sampled."""
  need = layout.total(slots)
  if max_pages is not None and max_pages < need:
    raise ValueError(
        f"sampling.max_pages={max_pages}: this call needs {need} pages of {layout.page_size} tokens "
        f"({layout.num_prompts} prompts x {layout.prompt_pages} + {slots} slots x {layout.slot_pages} + 1); "
        "raise it, or lower sampling.max_batch (slots), the prompts per call (stage1.chunk_prompts, "
        "train.rollout_batch) or sampling.max_new_tokens")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pages:
  """The pool and its free-page stack (device state, carried through the engine's programs)."""
  k: jax.Array  # [L, pages, page_size, K * H]
  v: jax.Array
  free_F: jax.Array  # [F] int32: free page ids in free_F[:top]
  top: jax.Array  # [] int32
  exhausted: jax.Array  # [] bool: an allocation found the stack empty (cannot happen at the sized pool)


def prompt_pages(k_LCPKH, length_C, page_size: int) -> jax.Array:
  """A prefill's left-padded keys (or values) [L, C, P, K, H] as pages [L, C * P / page, page, K * H], each
  prompt shifted so its first real token is at position 0."""
  L, C, P, K, H = k_LCPKH.shape
  src_CP = (jnp.arange(P)[None, :] + (P - length_C)[:, None]) % P  # position t <- column t + pad
  shifted = jnp.take_along_axis(k_LCPKH, src_CP[None, :, :, None, None], axis=2)
  return shifted.reshape(L, C * (P // page_size), page_size, K * H)


def init(k_prompts, v_prompts, layout: PageLayout, slots: int) -> Pages:
  """The pool: the prompts' pages [L, shared, page, K * H], then the slots' free pages and the unowned one."""
  L, shared, page, KH = k_prompts.shape
  rest = layout.free_pages(slots) + 1
  pad = lambda x: jnp.concatenate([x, jnp.zeros((L, rest, page, KH), x.dtype)], axis=1)  # noqa: E731
  return Pages(k=pad(k_prompts), v=pad(v_prompts),
               free_F=jnp.arange(shared, shared + layout.free_pages(slots), dtype=jnp.int32)[::-1],
               top=jnp.asarray(layout.free_pages(slots), jnp.int32), exhausted=jnp.zeros((), bool))


def alloc(pages: Pages, need_B) -> tuple[Pages, jax.Array]:
  """A fresh page for each row with need_B (popped from the stack in row order); -1 elsewhere."""
  need = need_B.astype(jnp.int32)
  idx_B = pages.top - jnp.cumsum(need)  # the k-th needing row takes free_F[top - k]
  page_B = jnp.where(need_B, pages.free_F[jnp.clip(idx_B, 0, pages.free_F.shape[0] - 1)], -1)
  exhausted = pages.exhausted | jnp.any(need_B & (idx_B < 0))
  return dataclasses.replace(pages, top=pages.top - jnp.sum(need), exhausted=exhausted), page_B


def release(pages: Pages, table_BM, first_B, end_B, release_B) -> Pages:
  """Pushes back the pages of rows with release_B: table columns [first_B, end_B) (the row's own pages)."""
  M = table_BM.shape[1]
  own_BM = release_B[:, None] & (jnp.arange(M)[None, :] >= first_B[:, None]) & (jnp.arange(M)[None, :] < end_B[:, None])
  own = own_BM.reshape(-1)
  slot = jnp.where(own, pages.top + jnp.cumsum(own.astype(jnp.int32)) - 1, pages.free_F.shape[0])
  free_F = pages.free_F.at[slot].set(table_BM.reshape(-1), mode="drop")
  return dataclasses.replace(pages, free_F=free_F, top=pages.top + jnp.sum(own.astype(jnp.int32)))


def copy_page(pages: Pages, src, dst) -> Pages:
  """Page `dst` := page `src`, every layer and kv head (a prompt's partial page into a slot's own)."""
  move = lambda x: x.at[:, dst].set(x[:, src])  # noqa: E731
  return dataclasses.replace(pages, k=move(pages.k), v=move(pages.v))


def pages_used(pos_B, page_size: int):
  """Table columns a row holds tokens in, with pos_B tokens cached."""
  return (pos_B + page_size - 1) // page_size


def insert(pages: Pages, table_BM, shared_B, s, p, length, P: int):
  """Slot s takes a row of prompt p (`length` real tokens, padded to P): a page table naming the prompt's full
  pages and, when its last page is partial, a page of the slot's own holding a copy of it."""
  page, M = pages.k.shape[2], table_BM.shape[1]
  per_prompt = P // page
  full, partial = length // page, length % page > 0
  pages, own = alloc(pages, partial[None])
  pages = jax.lax.cond(partial, lambda pg: copy_page(pg, p * per_prompt + full, own[0]), lambda pg: pg, pages)
  j_M = jnp.arange(M)
  row_M = jnp.where(j_M < full, p * per_prompt + j_M, jnp.where((j_M == full) & partial, own[0], 0))
  return (pages, jax.lax.dynamic_update_index_in_dim(table_BM, row_M, s, 0),
          jax.lax.dynamic_update_index_in_dim(shared_B, full, s, 0))


def decode_step(cfg, attention: str, window: int, dparams, pages: Pages, table_BM, last_B, pos_B, active_B):
  """One paged decode step of every slot: a slot whose next position starts a page takes a fresh one, then the
  model's step (model/decoder.decode_step_paged) with `attention` reading the pool through the table columns
  covering `window` positions (every kernel: the TPU one's grid does not grow with them, its SMEM table does).
  Returns (logits [V, B], pages, table)."""
  page = pages.k.shape[2]
  pages, new_B = alloc(pages, active_B & (pos_B % page == 0))
  col_B = jnp.where(new_B >= 0, pos_B // page, table_BM.shape[1])  # M: dropped
  table_BM = table_BM.at[jnp.arange(pos_B.shape[0]), col_B].set(new_B, mode="drop")
  cols = min(table_BM.shape[1], -(-window // page))
  attend = attention_on_mesh(paged_attention.IMPLEMENTATIONS[attention], cfg)
  logits_VB, kv = decoder.decode_step_paged(cfg, dparams, {"k": pages.k, "v": pages.v}, last_B, pos_B, active_B,
                                            table_BM[:, :cols], attend)
  return logits_VB, dataclasses.replace(pages, k=kv["k"], v=kv["v"]), table_BM


def attention_on_mesh(attend, cfg):
  """Under a mesh, the attention runs per device (shard_map): each device's slots (the batch axes) read the
  pool's kv heads it holds (the tensor axis; the pool is replicated over the batch axes), no collective."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return attend
  P = jax.sharding.PartitionSpec
  rows = sharding.logical_to_spec(("batch",), None, dict(mesh.shape))[0]
  t = mesh.shape.get("tensor", 1)
  head = "tensor" if t > 1 and cfg.num_kv_heads % t == 0 else None  # else every device reads all heads
  heads, pool = P(rows, head, None), P(None, None, None, head)
  return jax.shard_map(attend, mesh=mesh, in_specs=(heads, pool, pool, P(), P(rows), P(rows, None)),
                       out_specs=heads, check_vma=False)


def check_returned(pages: Pages, free_pages: int) -> int:
  """After a call every slot page is back on the stack (allocated = freed); an exhausted stack would mean a
  pool sized wrong, never silently wrong rows. Returns the pages on the stack."""
  top, exhausted = (int(multihost.to_host(x)) for x in (pages.top, pages.exhausted))
  if exhausted or top != free_pages:
    raise RuntimeError(f"paged cache: {free_pages - top} pages not returned (stack exhausted: {bool(exhausted)}); "
                       "this is a bug in the engine's page accounting")
  return top


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def first_prompts(pool, num: int, n: int, page_size: int):
  """A paged prefill pool (engine.Pool) of prompts [0, num) only: the last prefill chunk's repeats dropped."""
  cut = lambda x, k, axis=0: jax.lax.slice_in_dim(x, 0, k, axis=axis)  # noqa: E731
  per_prompt = pool.live_pP.shape[1] // page_size
  return dataclasses.replace(pool, cache=jax.tree.map(lambda x: cut(x, num * per_prompt, 1), pool.cache),
                             live_pP=cut(pool.live_pP, num), length_p=cut(pool.length_p, num),
                             first_R=cut(pool.first_R, num * n), first_logp_R=cut(pool.first_logp_R, num * n))
