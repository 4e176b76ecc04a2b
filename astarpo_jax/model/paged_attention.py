"""Decode attention over a paged KV cache: each row reads only the pages of its own length.

The cache is a pool of pages shared by every row, stacked over layers: keys and values
[L, pages, page_size, K * H] (a token's kv heads side by side in the minor dimension, so that writing one
token's keys is a contiguous update and XLA keeps the pool in the layout the kernel reads, with one kv head
per device too: a per-step copy of the pool otherwise, measured in the TPU compile). Row b's tokens 0..length_B[b]-1 sit in pages table_BM[b, 0], table_BM[b, 1],
... in order (a prompt's full pages may be shared by its samples). Two implementations with one interface
`attend(q_BNH, k_pool, v_pool, layer, lengths_B, table_BM) -> out_BNH` (queries unscaled; fp32 softmax):

  pallas  a TPU Pallas kernel, grid (row, page), every kv head of a page at once: page j is fetched only while
          j * page_size < length (past it the block index repeats, so no DMA is issued and the body is
          skipped): HBM traffic is each row's live pages. The layer is a prefetched scalar, so no layer
          slice of the pool is ever copied. Written here because the shipped kernel
          (jax.experimental.pallas.ops.tpu.paged_attention) casts K/V to bf16 inside, whatever their dtype.
  xla     a gather of every page the table names, masked by length: the CPU tests' path and the GPU's (the
          caller passes only the table columns its longest row needs, as the dense decode's windows).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from astarpo_jax.infra import platforms

MASK = -0.7 * float(jnp.finfo(jnp.float32).max)


def paged_attention_xla(q_BNH, k_pool, v_pool, layer, lengths_B, table_BM):
  """Attention of one query per row over its first lengths_B[b] cached tokens, read through `table_BM`."""
  B, N, H = q_BNH.shape
  page, K = k_pool.shape[2], k_pool.shape[3] // H
  M = table_BM.shape[1]
  dt = q_BNH.dtype

  def rows(pool):  # [B, M, page, K * H] -> [B, K, M * page, H]
    return jnp.take(pool[layer], table_BM, axis=0).reshape(B, M * page, K, H).transpose(0, 2, 1, 3).astype(dt)
  k_BKSH, v_BKSH = rows(k_pool), rows(v_pool)
  q_BKGH = q_BNH.reshape(B, K, N // K, H)
  s_BKGS = jnp.einsum("BKGH,BKSH->BKGS", q_BKGH, k_BKSH).astype(jnp.float32) / math.sqrt(H)
  live_BS = jnp.arange(M * page)[None, :] < lengths_B[:, None]
  s_BKGS = jnp.where(live_BS[:, None, None], s_BKGS, MASK)
  p_BKGS = jax.nn.softmax(s_BKGS, axis=-1).astype(dt)
  return jnp.einsum("BKGS,BKSH->BKGH", p_BKGS, v_BKSH).reshape(B, N, H)


def _kernel(layer_ref, lengths_ref, table_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, page: int,
            scale: float):
  """One (row b, page j) step of an online softmax over every kv head; the accumulators live across j."""
  b, j = pl.program_id(0), pl.program_id(1)
  length = lengths_ref[b]
  K, H = q_ref.shape[0], q_ref.shape[2]

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(j * page < length)
  def _step():
    for h in range(K):  # kv heads of the page (static: a few)
      q_GH = q_ref[h].astype(jnp.float32) * scale
      k_SH, v_SH = (r[:, h * H:(h + 1) * H].astype(jnp.float32) for r in (k_ref, v_ref))
      s_GS = jax.lax.dot_general(q_GH, k_SH, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                 precision=jax.lax.Precision.HIGHEST)
      live = j * page + jax.lax.broadcasted_iota(jnp.int32, s_GS.shape, 1) < length
      s_GS = jnp.where(live, s_GS, MASK)
      m_prev = m_ref[h]
      m_next = jnp.maximum(m_prev, s_GS.max(axis=-1, keepdims=True))
      p_GS = jnp.exp(s_GS - m_next)
      alpha = jnp.exp(m_prev - m_next)
      l_ref[h] = alpha * l_ref[h] + p_GS.sum(axis=-1, keepdims=True)
      acc_ref[h] = alpha * acc_ref[h] + jax.lax.dot_general(
          p_GS, v_SH, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
          precision=jax.lax.Precision.HIGHEST)
      m_ref[h] = m_next

  @pl.when(j == pl.num_programs(1) - 1)
  def _out():
    o_ref[...] = (acc_ref[...] / jnp.maximum(l_ref[...], 1e-30)).astype(o_ref.dtype)


def _page_block(b, j, layer_ref, lengths_ref, table_ref, *, page: int):
  """The pool block of grid step (b, j): the row's j-th page while it is live, else its last live page
  (an unchanged block index: the pipeline issues no copy)."""
  last = jnp.maximum((lengths_ref[b] + page - 1) // page - 1, 0)
  return (layer_ref[0], table_ref[b, jnp.minimum(j, last)], 0, 0)


# Pallas is imported lazily: the CPU-only paths (and the layering test) need none of it.
pl = pltpu = None


def _pallas():
  global pl, pltpu
  if pl is None:
    from jax.experimental import pallas as pl_
    from jax.experimental.pallas import tpu as pltpu_
    pl, pltpu = pl_, pltpu_
  return pl, pltpu


def paged_attention_pallas(q_BNH, k_pool, v_pool, layer, lengths_B, table_BM, interpret: bool = False):
  """The TPU kernel (see the module docstring); `interpret` runs it on the CPU (tests)."""
  pl_, pltpu_ = _pallas()
  B, N, H = q_BNH.shape
  _, _, page, KH = k_pool.shape
  K = KH // H
  M, G = table_BM.shape[1], N // K
  q_BKGH = q_BNH.reshape(B, K, G, H)
  page_spec = pl_.BlockSpec((None, None, page, KH), functools.partial(_page_block, page=page))
  rows = pl_.BlockSpec((None, K, G, H), lambda b, j, *_: (b, 0, 0, 0))
  grid_spec = pltpu_.PrefetchScalarGridSpec(
      num_scalar_prefetch=3, grid=(B, M), in_specs=[rows, page_spec, page_spec], out_specs=rows,
      scratch_shapes=[pltpu_.VMEM((K, G, 1), jnp.float32), pltpu_.VMEM((K, G, 1), jnp.float32),
                      pltpu_.VMEM((K, G, H), jnp.float32)])
  call = pl_.pallas_call(
      functools.partial(_kernel, page=page, scale=1.0 / math.sqrt(H)), grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((B, K, G, H), q_BNH.dtype),
      compiler_params=pltpu_.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret, name="paged_decode_attention")
  layer_1 = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
  return call(layer_1, lengths_B.astype(jnp.int32), table_BM.astype(jnp.int32), q_BKGH, k_pool, v_pool
              ).reshape(B, N, H)


def replay_page_fetches(lengths_B, table_BM, page: int) -> int:
  """Pages (every kv head of each) the kernel's pipeline fetches for K, as many for V: its grid walked in order
  (row, page), the BlockSpec's index map evaluated at each step, a fetch counted where the block index changes."""
  layer = np.zeros((1,), np.int32)
  lengths, table = np.asarray(lengths_B, np.int32), np.asarray(table_BM, np.int32)
  fetched, last = 0, None
  for b in range(table.shape[0]):
    for j in range(table.shape[1]):
      block = tuple(int(x) for x in _page_block(b, j, layer, lengths, table, page=page))
      fetched += block != last
      last = block
  return fetched


def pallas_pages_read(lengths_B, page: int) -> int:
  """Pages the kernel fetches for K (as many for V) for rows of these lengths: the live pages of each row (at
  least one: a row's first block is always fetched), as its grid and BlockSpecs issue them."""
  return int(sum(max(1, -(-int(n) // page)) for n in lengths_B))


def _gpu_kernel(layer_ref, length_ref, table_ref, q_ref, k_ref, v_ref, o_ref, *, page: int, pages_per_block: int,
                scale: float):
  """One (row, kv head) program: an online softmax over the row's live blocks of `pages_per_block` pages, a loop
  whose trip count is the row's own length, so nothing past it is read."""
  from jax.experimental.pallas import triton as plgpu
  h = pl.program_id(1)
  Gp, H = q_ref.shape
  block = pages_per_block * page
  length, layer = length_ref[0], layer_ref[0]
  q_GH = (q_ref[...].astype(jnp.float32) * scale).astype(k_ref.dtype)

  def body(i, carry):
    acc_GH, m_G, l_G = carry
    pages_P = table_ref[pl.ds(i * pages_per_block, pages_per_block)]
    k_SH, v_SH = (r[layer, pages_P, :, pl.ds(h * H, H)].reshape(block, H) for r in (k_ref, v_ref))
    s_GS = plgpu.dot(q_GH, k_SH, trans_b=True, precision=jax.lax.Precision.HIGHEST)
    live_S = i * block + jnp.arange(block) < length
    s_GS = jnp.where(live_S[None, :], s_GS, MASK)
    m_next = jnp.maximum(m_G, s_GS.max(axis=-1))
    p_GS = jnp.exp(s_GS - m_next[:, None])
    alpha = jnp.exp(m_G - m_next)
    acc_GH = alpha[:, None] * acc_GH + plgpu.dot(p_GS.astype(v_SH.dtype), v_SH, precision=jax.lax.Precision.HIGHEST)
    return acc_GH, m_next, alpha * l_G + p_GS.sum(axis=-1)

  init = (jnp.zeros((Gp, H), jnp.float32), jnp.full((Gp,), MASK, jnp.float32), jnp.zeros((Gp,), jnp.float32))
  acc_GH, _, l_G = jax.lax.fori_loop(0, pl.cdiv(length, block), body, init)
  o_ref[...] = (acc_GH / jnp.maximum(l_G, 1e-30)[:, None]).astype(o_ref.dtype)


def gpu_query_rows(group: int) -> int:
  """Query rows a GPU program holds for the `group` query heads of a kv head: a power of two, at least 16
  (Triton's smallest dot); the padding is read and written like the rest."""
  return max(16, 1 << (group - 1).bit_length())


def gpu_pages_per_block(page: int) -> int:
  """Pages a GPU program reads per loop step: 32 tokens (Triton's dot wants >= 16 rows a side)."""
  return max(1, 32 // page)


def paged_attention_triton(q_BNH, k_pool, v_pool, layer, lengths_B, table_BM, interpret: bool = False):
  """The GPU kernel (Pallas on Triton): grid (row, kv head), each program looping over its row's live blocks of
  pages only; the pool is passed whole (no layer slice is copied) and the layer is a scalar operand. The query
  heads of a kv head are padded to 16 (Triton's smallest dot); `interpret` runs it on the CPU (tests)."""
  from jax.experimental.pallas import triton as plgpu
  pl_, _ = _pallas()
  B, N, H = q_BNH.shape
  page, K = k_pool.shape[2], k_pool.shape[3] // H
  G, ppb = N // K, gpu_pages_per_block(page)
  Gp = gpu_query_rows(G)
  q_BKGH = jnp.pad(q_BNH.reshape(B, K, G, H), ((0, 0), (0, 0), (0, Gp - G), (0, 0)))
  table_BM = jnp.pad(table_BM.astype(jnp.int32), ((0, 0), (0, -table_BM.shape[1] % ppb)))
  M = table_BM.shape[1]
  whole = pl_.BlockSpec(k_pool.shape, lambda b, h: (0, 0, 0, 0))
  call = pl_.pallas_call(
      functools.partial(_gpu_kernel, page=page, pages_per_block=ppb, scale=1.0 / math.sqrt(H)),
      grid=(B, K),
      in_specs=[pl_.BlockSpec((1,), lambda b, h: (0,)), pl_.BlockSpec((None, 1), lambda b, h: (b, 0)),
                pl_.BlockSpec((None, M), lambda b, h: (b, 0)),
                pl_.BlockSpec((None, None, Gp, H), lambda b, h: (b, h, 0, 0)), whole, whole],
      out_specs=pl_.BlockSpec((None, None, Gp, H), lambda b, h: (b, h, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((B, K, Gp, H), q_BNH.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2), interpret=interpret,
      name="paged_decode_attention_gpu")
  layer_1 = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
  out_BKGH = call(layer_1, lengths_B.astype(jnp.int32)[:, None], table_BM, q_BKGH, k_pool, v_pool)
  return out_BKGH[:, :, :G].reshape(B, N, H)


def gpu_tokens_read(lengths_B, page: int) -> int:
  """Tokens (every kv head's keys, as many values) the GPU kernel reads for rows of these lengths: each row's
  live blocks of gpu_pages_per_block pages, as its loop issues them."""
  block = gpu_pages_per_block(page) * page
  return int(sum(-(-int(n) // block) * block for n in lengths_B))


IMPLEMENTATIONS = {"xla": paged_attention_xla, "pallas": paged_attention_pallas, "triton": paged_attention_triton}


def default_implementation(backend: str) -> str:
  """The Pallas kernel on TPU, the Triton one on GPU (live pages only); XLA's gather on the CPU (tests)."""
  return "pallas" if backend == "tpu" else "triton" if platforms.is_gpu(backend) else "xla"
