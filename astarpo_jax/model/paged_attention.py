"""Decode attention over a paged KV cache: each row reads only the pages of its own length.

The cache is a pool of pages shared by every row, stacked over layers: keys and values
[L, pages, page_size, K * H] (a token's kv heads side by side in the minor dimension, so that writing one
token's keys is a contiguous update and XLA keeps the pool in the layout the kernel reads, with one kv head
per device too: a per-step copy of the pool otherwise, measured in the TPU compile). Row b's tokens
0..length_B[b]-1 sit in pages table_BM[b, 0], table_BM[b, 1], ... in order (a prompt's full pages may be shared
by its samples). Three implementations, one interface
`attend(q_BNH, k_pool, v_pool, layer, lengths_B, table_BM) -> out_BNH` (queries unscaled; fp32 softmax):

  pallas  a TPU Pallas kernel (paged_attention_tpu.py): a grid of row blocks, each walking its rows' live pages
          with manual double-buffered copies, so grid steps do not grow with the table's width and only live
          pages are copied; the layer is a prefetched scalar (no layer slice of the pool is copied). Written
          here because the shipped kernels do not fit: jax.experimental.pallas.ops.tpu.paged_attention casts K/V
          to bf16 inside and wants a [K, pages, page, H] pool per layer, ragged_paged_attention a pool of K and
          V interleaved per layer.
  triton  the GPU kernel (Pallas on Triton): grid (row, kv head), a loop over the row's live blocks of pages.
  xla     a gather of every page the table names, masked by length: the CPU tests' path and the GPU's (the
          caller passes only the table columns its longest row needs, as the dense decode's windows).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from astarpo_jax.infra import platforms
from astarpo_jax.model.paged_attention_tpu import pages_read as pallas_pages_read, paged_attention_pallas  # noqa: F401

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


# Pallas is imported lazily: the CPU-only paths (and the layering test) need none of it.
pl = None


def _pallas():
  global pl
  if pl is None:
    from jax.experimental import pallas as pl_
    pl = pl_
  return pl


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
  pl_ = _pallas()
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
