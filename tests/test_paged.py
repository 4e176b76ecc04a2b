"""The paged KV cache: the decode attention over pages (the TPU and GPU kernels in interpret mode, XLA's gather) equals
dense attention over each row's own tokens, the TPU kernel copies exactly each row's live pages and its grid, read
from the call lowered for a TPU, does not grow with the table's width; the engine's paged layout gives the rows of a
stepwise full forward, every page a call takes is given back, and a pool too small is refused before anything runs."""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from astarpo_jax.model import decoder, paged_attention, paged_attention_tpu
from astarpo_jax.sampling import decode_plan, engine, paged_cache, sampler as sampler_lib
from tests.test_engine import SCFG, stepwise_reference
from tests.test_sampler import PROMPTS, response, tiny_model

L, K, N, H, PAGE = 2, 2, 4, 16, 8


def _rows_in_pages(rng):
  """Six rows' keys and values as contiguous sequences (the reference) and in a shuffled pool: rows 0, 1 and 5 are
  samples of one prompt (its two full pages shared, its partial third page copied into each row's own page),
  row 2 ends exactly at a page boundary, row 3 holds one token, row 4 fills the table's width (5 pages)."""
  prompt = rng.normal(size=(2, L, K, 20, H))  # k/v of a 20-token prompt: pages 0, 1 full, 4 tokens in page 2
  new = (3, 9, None, None, None, 1)  # tokens each prompt row adds (None: not a prompt row)
  seqs = [np.concatenate([prompt, rng.normal(size=(2, L, K, n, H))], axis=3) if n else None for n in new]
  seqs[2:5] = [rng.normal(size=(2, L, K, n, H)) for n in (16, 1, 40)]
  order = rng.permutation(40)
  pool = rng.normal(size=(2, L, 40, PAGE, K * H))  # pages no row names hold noise
  table = np.zeros((6, 5), np.int32)
  nxt = iter(order)
  shared = [next(nxt), next(nxt)]
  for b, s in enumerate(seqs):
    n = s.shape[3]
    for j in range(-(-n // PAGE)):
      page = shared[j] if new[b] and j < 2 else next(nxt)
      table[b, j] = page
      chunk = s[:, :, :, j * PAGE:(j + 1) * PAGE]  # [2, L, K, n, H]
      pool[:, :, page, :chunk.shape[3]] = chunk.transpose(0, 1, 3, 2, 4).reshape(2, L, -1, K * H)
  lengths = np.array([s.shape[3] for s in seqs], np.int32)
  return seqs, pool, table, lengths


def _dense(q_BNH, seqs, layer):
  """Softmax attention of each row's query over its own keys and values, in float64."""
  out = []
  for b, s in enumerate(seqs):
    k, v = s[0, layer], s[1, layer]  # [K, n, H]
    q = q_BNH[b].reshape(K, N // K, H)
    scores = np.einsum("kgh,knh->kgn", q, k) / np.sqrt(H)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    out.append(np.einsum("kgn,knh->kgh", p / p.sum(-1, keepdims=True), v).reshape(N, H))
  return np.stack(out)


# one compiled interpret-mode TPU kernel for the tests' shapes (each compile takes a while on the CPU)
_PALLAS = jax.jit(functools.partial(paged_attention.paged_attention_pallas, interpret=True))
IMPLS = {"pallas": _PALLAS, "triton": functools.partial(paged_attention.paged_attention_triton, interpret=True),
         "xla": paged_attention.paged_attention_xla}


def _f32(*xs):
  return [jnp.asarray(x, jnp.float32) for x in xs]


@pytest.mark.parametrize("impl", ["pallas", "triton", "xla"])
def test_paged_attention_equals_dense_attention_over_each_rows_own_tokens(impl):
  rng = np.random.default_rng(0)
  seqs, pool, table, lengths = _rows_in_pages(rng)
  q = rng.normal(size=(len(seqs), N, H))
  with jax.default_matmul_precision("highest"):
    for layer in range(L):
      got = IMPLS[impl](*_f32(q, pool[0], pool[1]), layer, jnp.asarray(lengths), jnp.asarray(table))
      np.testing.assert_allclose(np.asarray(got), _dense(q, seqs, layer), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["pallas", "triton"])
def test_the_last_token_a_row_owns_is_attended(impl):
  # the reference with one token fewer differs from the kernel: nothing the row owns is masked
  rng = np.random.default_rng(1)
  seqs, pool, table, lengths = _rows_in_pages(rng)
  q = rng.normal(size=(len(seqs), N, H))
  got = np.asarray(IMPLS[impl](*_f32(q, pool[0], pool[1]), 0, jnp.asarray(lengths), jnp.asarray(table)))
  short = _dense(q, [s[:, :, :, :-1] if s.shape[3] > 1 else s for s in seqs], 0)
  assert all(np.abs(got[b] - short[b]).max() > 1e-3 for b in range(len(seqs)) if lengths[b] > 1)


def test_the_tpu_kernel_reads_no_page_outside_its_rows_live_pages():
  # every page but each row's live ones holds NaN, and TPU interpret mode fills unwritten VMEM with NaN: a read of
  # either would spread. Row 3 is cut to length 0: its output is 0 and its one page is poisoned too.
  rng = np.random.default_rng(2)
  seqs, pool, table, lengths = _rows_in_pages(rng)
  lengths[3] = 0
  live = {int(table[b, j]) for b, n in enumerate(lengths) for j in range(-(-int(n) // PAGE))}
  poisoned = pool.copy()
  poisoned[:, :, [p for p in range(pool.shape[2]) if p not in live]] = np.nan
  q = rng.normal(size=(len(seqs), N, H))
  got = np.asarray(_PALLAS(*_f32(q, poisoned[0], poisoned[1]), 1, jnp.asarray(lengths), jnp.asarray(table)))
  rows = [b for b in range(len(seqs)) if b != 3]
  with jax.default_matmul_precision("highest"):
    np.testing.assert_allclose(got[rows], _dense(q[rows], [seqs[b] for b in rows], 1), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[3], 0.0)


def test_the_tpu_kernels_dmas_are_each_rows_live_pages_and_their_bytes():
  # the DMAs TPU interpret mode executes (its dma_start, recorded): per row, the table's first ceil(n / page)
  # pages of the layer asked for, once each for K and for V, a page of every kv head each; none for an empty row;
  # and its race detector finds no read of a ring slot racing a copy into it
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interp
  from jax.experimental.pallas import tpu as pltpu
  page, M, layer = 4, 7, 1  # shapes no other test compiles: the kernel is traced here, with the recorder in place
  lengths = np.array([9, 0, 28, 1, 13, 4], np.int32)
  table = np.random.default_rng(3).permutation(6 * M).astype(np.int32).reshape(6, M)
  pool = np.random.default_rng(4).normal(size=(2, L, 6 * M, page, K * H)).astype(np.float32)
  seen, start = [], interp.dma_start

  def record(token, device_id, core, src_space, src_id, src_transforms, *rest, **kw):
    (index,) = src_transforms
    seen.append((int(src_id), tuple(int(i) for i in index.indices[:2]), int(np.prod(index.get_indexer_shape()))))
    return start(token, device_id, core, src_space, src_id, src_transforms, *rest, **kw)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(interp, "dma_start", record)
    q = np.random.default_rng(5).normal(size=(6, N, H))
    jax.block_until_ready(paged_attention.paged_attention_pallas(
        *_f32(q, pool[0], pool[1]), layer, jnp.asarray(lengths), jnp.asarray(table),
        interpret=pltpu.InterpretParams(detect_races=True)))
  assert not interp.races.races_found  # no slot of the ring read while a copy into it was in flight
  k_id, v_id = sorted({src for src, _, _ in seen})
  owner = {int(p): b for b, row in enumerate(table) for p in row}
  for src in (k_id, v_id):
    pages = [idx for s, idx, _ in seen if s == src]
    for b, n in enumerate(lengths):
      assert sorted(p for lay, p in pages if owner[p] == b) == sorted(table[b, :-(-int(n) // page)]), (src, b)
    assert all(lay == layer for lay, _ in pages)
  assert {size for _, _, size in seen} == {page * K * H}  # elements a DMA: one page, every kv head
  assert len(seen) == 2 * (3 + 0 + 7 + 1 + 4 + 1) == 2 * paged_attention.pallas_pages_read(lengths, page)


def _lowered_tpu_grid(rows, query_heads, cols, page=64, head_dim=128):
  """The grid of the TPU kernel lowered for a TPU (no TPU needed) for one device's rows, one kv head and a table of
  `cols` columns, read back from the lowered tpu_custom_call's Mosaic module (aot.fixed_costs.mosaic_grid)."""
  from jax._src.lib.mlir import ir
  from astarpo_jax.aot import fixed_costs
  pool = jax.ShapeDtypeStruct((1, rows * cols + 1, page, head_dim), jnp.bfloat16)
  args = (jax.ShapeDtypeStruct((rows, query_heads, head_dim), jnp.bfloat16), pool, pool,
          jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.int32),
          jax.ShapeDtypeStruct((rows, cols), jnp.int32))
  module = jax.jit(paged_attention.paged_attention_pallas).trace(*args).lower(lowering_platforms=("tpu",)).compiler_ir()
  bodies = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for o in block.operations:
          attrs = o.operation.attributes
          if o.operation.name == "stablehlo.custom_call" and "tpu_custom_call" in str(attrs["call_target_name"]):
            bodies.append(json.loads(ir.StringAttr(attrs["backend_config"]).value_bytes)["custom_call_config"]["body"])
          walk(o.operation)
  walk(module.operation)
  return [fixed_costs.mosaic_grid(body) for body in bodies]


@pytest.mark.parametrize("name,B,G", [("1.5B v5e-8 (4,1,2): 64 slots a chip", 64, 6),
                                      ("7B v5p-8 (1,1,4): 256 slots a chip", 256, 7)])
def test_the_lowered_tpu_kernels_grid_does_not_grow_with_the_table_width(name, B, G):
  # read from the lowered call: two grid steps a layer (half the rows each, the megacore's split) at 20 table
  # columns (1,280 tokens of 64) and at 40; the old kernel's grid was (rows, columns): 64 x 20 a layer for 1.5B
  grids = [_lowered_tpu_grid(B, G, cols) for cols in (20, 40)]
  assert grids == [[((2,), ("parallel",))]] * 2, name
  cost = paged_attention_tpu.fixed_cost([390] * B, 28, 64, 64 * 128 * 2, 819e9, 20)
  assert cost["grid_steps"] == 28 * grids[0][0][0][0]  # the model counts the lowered kernel's grid, once a layer


def test_the_tpu_kernel_refuses_a_pool_of_partial_kv_heads_naming_the_shapes():
  q, pool = jnp.zeros((2, 4, 16)), jnp.zeros((1, 4, 8, 24))  # 24 lanes: not whole heads of 16
  with pytest.raises(ValueError, match=r"queries \(2, 4, 16\).*pools \(1, 4, 8, 24\).*whole kv heads"):
    paged_attention.paged_attention_pallas(q, pool, pool, 0, jnp.ones((2,), jnp.int32), jnp.zeros((2, 3), jnp.int32))


def test_the_fixed_cost_model_on_a_hand_worked_case():
  # 4 rows of 130, 0, 64, 300 tokens, pages of 64 (3, 0, 1, 5 pages), 2 layers, items of 2 pages, 2 rows a grid
  # step; a page of K 1,000 bytes, so the ring has 32 slots (2 MiB // 2,000 > 32); bandwidth 1e9 B/s
  cost = paged_attention_tpu.fixed_cost([130, 0, 64, 300], 2, 64, 1000, 1e9, 20, rows_per_step=2, pages_per_item=2,
                                        step_s=1e-6, dma_latency_s=1e-5, dma_issue_s=1e-8)
  assert (cost["grid_steps"], cost["slots"], cost["items"], cost["dmas"]) == (4, 32, 2 * (2 + 0 + 1 + 3), 2 * 2 * 9)
  assert cost["live_bytes"] == 2 * 9 * 1000 * 2
  assert cost["grid_s"] == pytest.approx(4e-6) and cost["fill_s"] == pytest.approx(4e-5)
  assert cost["issue_s"] == pytest.approx(36 * 1e-8)
  # in flight while an item is computed: 31 items x K and V x 1,000 bytes x 1.5 live pages an item = 93 kB, whose
  # rate over 1e-5 s (9.3e9 B/s) beats the bandwidth: no stall; at 1e-3 s it is 9.3e7 B/s
  assert cost["stall_s"] == 0.0
  slow = paged_attention_tpu.fixed_cost([130, 0, 64, 300], 2, 64, 1000, 1e9, 20, rows_per_step=2, pages_per_item=2,
                                        dma_latency_s=1e-3)
  assert slow["stall_s"] == pytest.approx(36000 / 9.3e7 - 36000 / 1e9)


def test_the_gpu_kernel_reads_no_page_past_its_rows_live_blocks():
  # every page outside the table entries of each row's live blocks holds NaN (a read of one would spread it);
  # the tokens of those blocks are what gpu_tokens_read counts, the kernel's bytes in the projections. The kernel
  # pads the table to whole blocks with page 0, which a row's last block reads past the table's width.
  rng = np.random.default_rng(2)
  seqs, pool, table, lengths = _rows_in_pages(rng)
  block = paged_attention.gpu_pages_per_block(PAGE)
  padded = np.pad(table, ((0, 0), (0, -table.shape[1] % block)))
  read = {int(padded[b, j]) for b, n in enumerate(lengths) for j in range(-(-int(n) // (block * PAGE)) * block)}
  poisoned = pool.copy()
  poisoned[:, :, [p for p in range(pool.shape[2]) if p not in read]] = np.nan
  q = jnp.asarray(rng.normal(size=(len(seqs), N, H)), jnp.float32)
  got = paged_attention.paged_attention_triton(q, *_f32(poisoned[0], poisoned[1]), 1, jnp.asarray(lengths),
                                               jnp.asarray(table), interpret=True)
  with jax.default_matmul_precision("highest"):
    np.testing.assert_allclose(np.asarray(got), _dense(np.asarray(q), seqs, 1), rtol=1e-5, atol=1e-6)
  assert paged_attention.gpu_tokens_read(lengths, PAGE) == sum(-(-int(n) // 32) * 32 for n in lengths)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the Triton kernel compiled, not interpreted: a GPU's "
                    "(experiments/device_check.py runs it)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_gpu_kernel_compiled_equals_dense_attention(dtype):
  # Triton's dots at HIGHEST precision for fp32; bf16 K/V as the decode keeps them, at bf16's tolerance
  rng = np.random.default_rng(3)
  seqs, pool, table, lengths = _rows_in_pages(rng)
  q = rng.normal(size=(len(seqs), N, H))
  as_dt = lambda x: jnp.asarray(x, dtype)  # noqa: E731
  ref_seqs = [np.asarray(as_dt(s), np.float64) for s in seqs]
  for layer in range(L):
    got = paged_attention.paged_attention_triton(as_dt(q), as_dt(pool[0]), as_dt(pool[1]), layer,
                                                 jnp.asarray(lengths), jnp.asarray(table))
    want = _dense(np.asarray(as_dt(q), np.float64), ref_seqs, layer)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, **tol)


def test_prompt_pages_start_at_the_first_real_token():
  # a left-padded prefill [L, C, P, K, H] -> pages whose position t holds the prompt's t-th real token
  P, C = 8, 2
  k = np.arange(C * P, dtype=np.float32).reshape(1, C, P, 1, 1) * np.ones((1, 1, 1, 1, 2), np.float32)
  pages = np.asarray(paged_cache.prompt_pages(jnp.asarray(k), jnp.asarray([3, 8]), 4))  # [1, 4, 4, 2]
  flat = pages[0, :, :, 0].reshape(C, P)
  np.testing.assert_array_equal(flat[0, :3], [5, 6, 7])  # prompt 0: columns 5..7 of row 0
  np.testing.assert_array_equal(flat[1], np.arange(8, 16))


def test_pages_are_taken_from_the_stack_and_given_back():
  layout = paged_cache.pool_layout(num_prompts=2, P=8, T=6, page_size=4)
  z = jnp.zeros((1, layout.shared, 4, 2))
  pages = paged_cache.init(z, z, layout, slots=2)
  assert layout.slot_pages == 3 and int(pages.top) == 6 and pages.k.shape[1] == 4 + 6 + 1
  pages, got = paged_cache.alloc(pages, jnp.asarray([True, False, True]))
  assert got.tolist() == [4, -1, 5] and int(pages.top) == 4  # the stack's top first, in row order
  table = jnp.asarray([[0, 4, 9], [1, 5, 7]])
  pages = paged_cache.release(pages, table, jnp.asarray([1, 1]), jnp.asarray([2, 3]), jnp.asarray([True, False]))
  assert int(pages.top) == 5 and int(pages.free_F[4]) == 4  # row 0's own page (column 1) only
  pages, got = paged_cache.alloc(pages, jnp.asarray([True] * 6))
  assert bool(pages.exhausted)  # six asked, five free: flagged, never a silent wrong page


@pytest.fixture(scope="module")
def mixed():
  cfg, params = tiny_model(seed=9)
  prompts = (PROMPTS + [[2, 2, 5], [9], [4, 4, 4, 4], [30, 1], [11, 12, 13], [6, 6]])[:10]
  budgets = np.array([12, 3, 7, 1, 12, 5, 9, 2, 12, 6], np.int32)
  return cfg, params, prompts, budgets


@pytest.mark.parametrize("name,kw", [
    ("2 slots, refills", dict(max_batch=2)),
    ("4 slots, ladder down to 1", dict(max_batch=4, min_slots=1)),
    ("2 slots, windows of 2 positions", dict(max_batch=2, window_step=2)),
    ("3 samples per prompt sharing its pages", dict(max_batch=3, num_samples=3)),
    ("the layers unstacked, as the GPU's copy", dict(max_batch=2, unstacked=True)),
])
def test_the_paged_layout_gives_the_rows_of_a_stepwise_full_forward(mixed, name, kw):
  cfg, params, prompts, budgets = mixed
  key, kw = jax.random.key(5), dict(kw)
  n = kw.pop("num_samples", 1)
  run_params = decoder.unstack_layers(params) if kw.pop("unstacked", False) else params  # prefill and decode
  stats = decode_plan.RunStats()
  out = jax.device_get(sampler_lib.sample(cfg, run_params, prompts, key, SCFG, num_samples=n, layout="paged",
                                          page_size=4, attention="xla", stats=stats,
                                          max_new_tokens_B=budgets if n == 1 else None, **kw))
  B = stats.segment_log[0][0]
  assert stats.pages_returned == paged_cache.pool_layout(len(prompts), 16, SCFG.max_new_tokens, 4).free_pages(B)
  for i, prompt in enumerate(prompts):
    for j in range(n):
      r = i * n + j
      toks, logps = stepwise_reference(cfg, params, prompt, key, r, SCFG, int(budgets[i]) if n == 1 else 12)
      assert response(out, r) == toks, (name, r)
      np.testing.assert_allclose(out.logp_BT[r, :len(toks)], logps, atol=1e-4, err_msg=f"{name} row {r}")


def test_a_pool_too_small_is_refused_before_anything_runs(mixed, monkeypatch):
  cfg, params, prompts, _ = mixed

  def no_prefill(*a, **k):
    raise AssertionError("prefilled before the pool was checked")
  monkeypatch.setattr(engine, "_prefill", no_prefill)
  with pytest.raises(ValueError, match=r"sampling.max_pages=20: this call needs \d+ pages.*sampling.max_batch"):
    sampler_lib.sample(cfg, params, prompts, jax.random.key(0), SCFG, max_batch=4, layout="paged", page_size=4,
                       max_pages=20)


def test_the_paged_layout_on_meshes_gives_the_one_device_rows():
  import json
  import os
  import subprocess
  import sys
  worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paged_mesh_worker.py")
  run = subprocess.run([sys.executable, worker], capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  got = json.loads(run.stdout.strip().splitlines()[-1])
  assert len(got) == 2
  for shape, r in got.items():
    assert r["tokens_equal"] and r["logp_max_diff"] < 1e-5 and r["pages_returned"] > 0, (shape, r)
