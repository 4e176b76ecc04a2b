"""The TPU decode attention over a paged KV cache: a grid of row blocks, each streaming its rows' live pages.

Grid (B / R,): grid step g holds rows [g R, (g + 1) R) and walks their work items in order, an item being one
row's block of `pages_per_item` (P) table columns. A row of length n has ceil(n / (P * page)) items and a row of
length 0 none; only the item's live columns (j < ceil(n / page)) are copied, one DMA per page for K and one for V
(every kv head of the device: the pool's minor dimension), from the pool left in HBM (memory_space ANY, the
layer a prefetched scalar: no layer slice is copied) into a ring of `slots` VMEM buffers that runs `slots` items
ahead of the compute, across row boundaries. So grid steps are B / R a layer whatever the lengths and the table
width, and the copies are exactly each row's live pages; an online softmax in fp32 per kv head, the output
written when a row's last item is done (rows of length 0 give 0).

`fixed_cost` models what this costs beyond the bytes and FLOPs a roofline counts: grid steps x a per-step
overhead, the ring's fill (one DMA latency a grid step), the stall when the bytes in flight do not cover the
latency (Little's law), and one issue per DMA descriptor. The layout in the module docstring of
paged_attention.py; axis letters B rows, K kv heads, G query heads a kv head, H head dim, M table columns,
P pages an item, D ring slots.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

MASK = -0.7 * float(np.finfo(np.float32).max)
RING_BYTES = 2 << 20  # K bytes the ring holds (as many for V): K + V ~1.5 us of v5p's HBM bandwidth

# Per-step costs the model takes as defaults. STEP_S: the per-grid-step overhead docs/tpu.md has used (~0.35 us;
# no published source found: an assumption). DMA_LATENCY_S / DMA_ISSUE_S: an HBM->VMEM copy's start-up latency
# and the scalar core's cost to issue one descriptor (no published TPU figures found: assumptions, ~1 us and
# ~10 cycles at ~1 GHz). Callers pass their own.
STEP_S, DMA_LATENCY_S, DMA_ISSUE_S = 0.35e-6, 1.0e-6, 10e-9


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static shape of one kernel call."""
  rows_per_step: int  # R
  pages_per_item: int  # P
  slots: int  # D

  def grid(self, rows: int) -> int:
    return rows // self.rows_per_step


def plan(rows: int, cols: int, page_bytes: int, rows_per_step: int | None = None, pages_per_item: int = 4) -> Plan:
  """R: half the rows when even (a 'parallel' grid of 2 that v4/v5p's two TensorCores split), else all; P capped
  at the table's width; D: enough slots for RING_BYTES of K (2 to 32)."""
  if rows_per_step is None:
    rows_per_step = rows // 2 if rows % 2 == 0 and rows > 1 else rows
  if rows_per_step < 1 or rows % rows_per_step:
    raise ValueError(f"rows_per_step={rows_per_step}: must divide the {rows} rows")
  P = max(1, min(pages_per_item, cols))
  return Plan(rows_per_step, P, int(np.clip(RING_BYTES // (P * page_bytes), 2, 32)))


def schedule(lengths_B, page: int, p: Plan) -> tuple[jax.Array, jax.Array]:
  """(items a grid step walks [B / R], next live row after each row [B]): what the kernel gets prefetched."""
  lengths = jnp.asarray(lengths_B, jnp.int32)
  B = lengths.shape[0]
  items_G = (-(-lengths // (p.pages_per_item * page))).reshape(-1, p.rows_per_step).sum(axis=1)
  live_row_B = jnp.where(lengths > 0, jnp.arange(B, dtype=jnp.int32), B)
  next_B = jnp.concatenate([jax.lax.cummin(live_row_B, reverse=True)[1:], jnp.full((1,), B, jnp.int32)])
  return items_G.astype(jnp.int32), next_B


def _kernel(layer_ref, lengths_ref, table_ref, next_ref, items_ref, q_ref, k_hbm, v_hbm, o_ref, k_buf, v_buf, sems,
            m_ref, l_ref, acc_ref, *, page: int, cols: int, pages_per_item: int, slots: int, scale: float):
  """Grid step g: the ring of item copies and the online softmax over the rows of its block (module docstring)."""
  pl, pltpu = _pallas()
  g = pl.program_id(0)
  R, K, _, H = q_ref.shape
  B, P, D = lengths_ref.shape[0], pages_per_item, slots
  span, layer = P * page, layer_ref[0]
  row0, n_items = g * R, items_ref[g]

  def length(row):  # a cursor past the last item points at row B: read nothing there
    return lengths_ref[jnp.minimum(row, B - 1)]

  def advance(row, j):  # the next item: this row's next block, else the next row with tokens
    more = (j + 1) * span < length(row)
    return jnp.where(more, row, next_ref[jnp.minimum(row, B - 1)]), jnp.where(more, j + 1, 0)

  def copies(row, j, slot, start: bool):  # the item's live pages, K and V, into ring slot `slot`
    live_pages = jax.lax.div(length(row) + page - 1, page)  # lax.div: no sign fix-up (Mosaic lowers it anywhere)
    for p in range(P):
      col = j * P + p

      @pl.when(col < live_pages)
      def _():
        page_id = table_ref[jnp.minimum(row, B - 1) * cols + jnp.minimum(col, cols - 1)]
        for i, (src, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf))):
          copy = pltpu.make_async_copy(src.at[layer, page_id], buf.at[slot, p], sems.at[i, slot])
          copy.start() if start else copy.wait()

  def attend(row, j, slot):
    n = length(row)

    @pl.when(j == 0)
    def _init():
      m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
      l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
      acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    local = row - row0
    for h in range(K):  # the device's kv heads (static: a few); page by page, so no reshape of the ring's slot
      q_GH = q_ref[local, h].astype(jnp.float32) * scale
      s_pages, v_pages = [], []
      for p in range(P):
        start_tok = (j * P + p) * page
        k_SH = k_buf[slot, p, :, pl.ds(h * H, H)].astype(jnp.float32)
        s_GS = jax.lax.dot_general(q_GH, k_SH, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                   precision=jax.lax.Precision.HIGHEST)
        s_pages.append(jnp.where(start_tok + jax.lax.broadcasted_iota(jnp.int32, (1, page), 1) < n, s_GS, MASK))
        # a page past the row's end was not copied: its slot holds stale or uninitialized data, zeroed here
        live_S1 = start_tok + jax.lax.broadcasted_iota(jnp.int32, (page, 1), 0) < n
        v_pages.append(jnp.where(live_S1, v_buf[slot, p, :, pl.ds(h * H, H)].astype(jnp.float32), 0.0))
      m_prev = m_ref[h]
      m_next = functools.reduce(jnp.maximum, [s_GS.max(axis=-1, keepdims=True) for s_GS in s_pages], m_prev)
      alpha = jnp.exp(m_prev - m_next)
      l_h, acc_h = alpha * l_ref[h], alpha * acc_ref[h]
      for s_GS, v_SH in zip(s_pages, v_pages):
        p_GS = jnp.exp(s_GS - m_next)
        l_h = l_h + p_GS.sum(axis=-1, keepdims=True)
        acc_h = acc_h + jax.lax.dot_general(p_GS, v_SH, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                                            precision=jax.lax.Precision.HIGHEST)
      m_ref[h], l_ref[h], acc_ref[h] = m_next, l_h, acc_h

    @pl.when((j + 1) * span >= n)
    def _out():
      o_ref[local] = (acc_ref[...] / jnp.maximum(l_ref[...], 1e-30)).astype(o_ref.dtype)

  o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)  # rows of length 0 (no items) stay 0
  first = jnp.where(lengths_ref[row0] > 0, row0, next_ref[row0])

  def fill(s, cursor):  # items 0 .. D-1 into the ring
    copies(*cursor, s, start=True)
    return advance(*cursor)
  ahead = jax.lax.fori_loop(0, jnp.minimum(n_items, D), fill, (first, jnp.int32(0)))  # used once n_items > D

  def body(t, carry):
    row, j, ahead_row, ahead_j = carry
    slot = jax.lax.rem(t, D)
    copies(row, j, slot, start=False)
    attend(row, j, slot)

    @pl.when(t + D < n_items)
    def _():
      copies(ahead_row, ahead_j, slot, start=True)  # item t + D into the slot just read
    return (*advance(row, j), *advance(ahead_row, ahead_j))

  jax.lax.fori_loop(0, n_items, body, (first, jnp.int32(0), *ahead))


# Pallas is imported lazily: the CPU-only paths (and the layering test) need none of it.
_PALLAS = None


def _pallas():
  global _PALLAS
  if _PALLAS is None:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    _PALLAS = pl, pltpu
  return _PALLAS


def paged_attention_pallas(q_BNH, k_pool, v_pool, layer, lengths_B, table_BM, interpret=False,
                           rows_per_step: int | None = None, pages_per_item: int = 4):
  """The TPU kernel (module docstring). `interpret`: True (or a pltpu.InterpretParams) runs it on the CPU in
  TPU interpret mode, which simulates the DMAs and semaphores and fills unwritten VMEM with NaN (tests)."""
  pl, pltpu = _pallas()
  B, N, H = q_BNH.shape
  _, _, page, KH = k_pool.shape
  K, M = KH // H, table_BM.shape[1]
  if KH % H or N % max(K, 1) or v_pool.shape != k_pool.shape or table_BM.shape[0] != B:
    raise ValueError(f"paged attention: queries {q_BNH.shape} (rows, heads, head dim), pools {k_pool.shape} / "
                     f"{v_pool.shape} (layers, pages, page, kv heads x head dim), table {table_BM.shape}: the pools' "
                     "minor dimension must be whole kv heads, the query heads a multiple of them, one table row a row")
  G = N // K
  p = plan(B, M, page * KH * k_pool.dtype.itemsize, rows_per_step, pages_per_item)
  items_G, next_B = schedule(lengths_B, page, p)
  rows = pl.BlockSpec((p.rows_per_step, K, G, H), lambda g, *_: (g, 0, 0, 0))
  hbm = pl.BlockSpec(memory_space=pl.ANY)
  ring = (p.slots, p.pages_per_item, page, KH)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=5, grid=(p.grid(B),), in_specs=[rows, hbm, hbm], out_specs=rows,
      scratch_shapes=[pltpu.VMEM(ring, k_pool.dtype), pltpu.VMEM(ring, v_pool.dtype),
                      pltpu.SemaphoreType.DMA((2, p.slots)), pltpu.VMEM((K, G, 1), jnp.float32),
                      pltpu.VMEM((K, G, 1), jnp.float32), pltpu.VMEM((K, G, H), jnp.float32)])
  if interpret is True:
    interpret = pltpu.InterpretParams()
  call = pl.pallas_call(
      functools.partial(_kernel, page=page, cols=M, pages_per_item=p.pages_per_item, slots=p.slots,
                        scale=1.0 / math.sqrt(H)),
      grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((B, K, G, H), q_BNH.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)), interpret=interpret,
      name="paged_decode_attention")
  layer_1 = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
  table = table_BM.astype(jnp.int32).reshape(-1)  # 1-D in SMEM (a 2-D one pads its minor dimension)
  return call(layer_1, lengths_B.astype(jnp.int32), table, next_B, items_G, q_BNH.reshape(B, K, G, H), k_pool,
              v_pool).reshape(B, N, H)


def pages_read(lengths_B, page: int) -> int:
  """Pages the kernel copies for K (as many for V): each row's live pages, none for a row of length 0."""
  return int(sum(-(-int(n) // page) for n in lengths_B))


def fixed_cost(lengths_B, layers: int, page: int, page_bytes: int, hbm_bandwidth: float, cols: int, *,
               rows_per_step: int | None = None, pages_per_item: int = 4, cores: int = 1, step_s: float = STEP_S,
               dma_latency_s: float = DMA_LATENCY_S, dma_issue_s: float = DMA_ISSUE_S) -> dict:
  """The kernel's cost on one device in one decode step (every layer) beyond its bytes / bandwidth, for rows of
  these lengths and `page_bytes` a page of K (the device's kv heads): grid steps x `step_s`; the ring's fill, one
  `dma_latency_s` a grid step with items; the stall when the bytes in flight while an item is computed (D - 1
  items, K and V) carry less than bandwidth x latency (Little's law: rate = min(bandwidth, in flight / latency));
  `dma_issue_s` a descriptor (two a live page). `cores` TensorCores split the 'parallel' grid and the bandwidth."""
  lengths = np.asarray(lengths_B, np.int64)
  B = lengths.shape[0]
  p = plan(B, cols, page_bytes, rows_per_step, pages_per_item)
  span = p.pages_per_item * page
  items_G = (-(-lengths // span)).reshape(-1, p.rows_per_step).sum(axis=1)
  pages = pages_read(lengths, page)
  items = int(items_G.sum())
  live_bytes = 2 * pages * page_bytes * layers
  in_flight = (p.slots - 1) * 2 * page_bytes * (pages / items if items else 0.0)
  bw = hbm_bandwidth / cores
  rate = min(bw, in_flight / dma_latency_s) if in_flight else bw
  out = {"grid_steps": p.grid(B) * layers, "items": items * layers, "dmas": 2 * pages * layers,
         "live_bytes": live_bytes, "rows_per_step": p.rows_per_step, "pages_per_item": p.pages_per_item,
         "slots": p.slots}
  out["grid_s"] = out["grid_steps"] / cores * step_s
  out["fill_s"] = int((items_G > 0).sum()) * layers / cores * dma_latency_s
  out["stall_s"] = live_bytes / cores * (1.0 / rate - 1.0 / bw)
  out["issue_s"] = out["dmas"] / cores * dma_issue_s
  out["fixed_s"] = out["grid_s"] + out["fill_s"] + out["stall_s"] + out["issue_s"]
  return out

