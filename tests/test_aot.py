"""Ahead-of-time compiles: loop-aware cost reading of compiled HLO (closed forms), slice names,
the length model, and (with libtpu installed) every phase compiled for a TPU topology on this CPU."""
import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from astarpo_jax.aot import chips, hlo_cost, memory_plan as mp, projection
from astarpo_jax.model.config import ModelConfig

needs_libtpu = pytest.mark.skipif(not chips.libtpu_available(),
                                  reason="libtpu not installed: pip install -e '.[test]' brings it (jax[tpu])")


def _compiled_text(fn, *shapes):
  return jax.jit(fn).lower(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)).compile().as_text()


# ----------------------------------------------------------------------------- hlo_cost on CPU programs


def test_scan_of_matmuls_counts_each_trip_where_cost_analysis_counts_one():
  L, B, D = 6, 32, 64
  fn = lambda x, ws: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]  # noqa: E731
  compiled = jax.jit(fn).lower(jax.ShapeDtypeStruct((B, D), jnp.float32),
                               jax.ShapeDtypeStruct((L, D, D), jnp.float32)).compile()
  full, loops = hlo_cost.analyze(compiled.as_text())
  once, _ = hlo_cost.analyze(compiled.as_text(), count_trips=False)
  matmuls = L * 2 * B * D * D
  assert list(loops.values()) == [L]
  assert matmuls <= full.flops <= matmuls * 1.001  # + the loop counter's adds
  assert full.transcendentals == L * B * D  # tanh
  assert once.flops == pytest.approx(compiled.cost_analysis()["flops"], rel=1e-3)  # XLA counts the body once


def test_nested_loops_multiply_their_trip_counts():
  def fn(x, w):
    inner = lambda _, h: h @ w  # noqa: E731
    return jax.lax.scan(lambda h, _: (jax.lax.fori_loop(0, 5, inner, h), None), x, None, length=3)[0]
  full, loops = hlo_cost.analyze(_compiled_text(fn, (16, 32), (32, 32)))
  assert sorted(t for t in loops.values()) == [3, 5]
  assert full.flops == pytest.approx(15 * 2 * 16 * 32 * 32, rel=1e-3)


def test_counter_start_and_step_set_the_trip_count():
  def fn(x, w):  # i = 1, 4, 7: three trips
    return jax.lax.while_loop(lambda s: s[0] < 10, lambda s: (s[0] + 3, s[1] @ w), (1, x))[1]
  full, loops = hlo_cost.analyze(_compiled_text(fn, (8, 16), (16, 16)))
  assert list(loops.values()) == [3]
  assert full.flops == pytest.approx(3 * 2 * 8 * 16 * 16, rel=1e-2)


def test_a_data_dependent_loop_counts_the_trips_it_is_told():
  def fn(x, w):
    return jax.lax.while_loop(lambda s: jnp.sum(s) < 1e6, lambda s: s @ w, x)
  text = _compiled_text(fn, (8, 16), (16, 16))
  costs = [hlo_cost.analyze(text, unknown_trips=k)[0].flops for k in (0, 1, 7)]
  per_trip = costs[1] - costs[0]
  assert list(hlo_cost.analyze(text)[1].values()) == [None]
  assert per_trip == pytest.approx(2 * 8 * 16 * 16, rel=0.1)
  assert costs[2] == pytest.approx(costs[0] + 7 * per_trip)


def test_a_scatter_into_a_donated_buffer_counts_its_updates_not_the_buffer():
  # the decode's per-row cache write: XLA's HloCostAnalysis::HandleScatter counts 3 x updates + indices
  B, S, H = 8, 4096, 64
  fn = lambda buf, x, col: buf.at[jnp.arange(B), col].set(x, unique_indices=True, mode="promise_in_bounds")  # noqa: E731
  compiled = jax.jit(fn, donate_argnums=0).lower(
      jax.ShapeDtypeStruct((B, S, H), jnp.float32), jax.ShapeDtypeStruct((B, H), jnp.float32),
      jax.ShapeDtypeStruct((B,), jnp.int32)).compile()
  full, _ = hlo_cost.analyze(compiled.as_text())
  updates, indices = B * H * 4, B * 2 * 4  # [B, H] fp32; (row, column) int32 per row
  assert 3 * updates + indices <= full.bytes <= 3 * updates + indices + 2 * B * 4 + B * H * 4  # + the index build
  assert full.bytes < B * S * H * 4 / 100  # not the 8 MB buffer


def test_a_fused_embedding_lookup_counts_the_rows_it_gathers_not_the_table():
  # HloCostAnalysis::HandleGather counts a gather as its output read and written plus its indices
  V, D, B = 32768, 256, 8
  fn = lambda table, tok, scale: table[tok] * scale  # noqa: E731  (the gather fuses with the multiply)
  text = jax.jit(fn).lower(jax.ShapeDtypeStruct((V, D), jnp.float32), jax.ShapeDtypeStruct((B,), jnp.int32),
                           jax.ShapeDtypeStruct((B, D), jnp.float32)).compile().as_text()
  assert "fusion(" in text and "gather(" in text
  full, _ = hlo_cost.analyze(text)
  rows = B * D * 4
  assert 3 * rows <= full.bytes <= 3 * rows + B * 4 + 4096  # rows read, scale read, product written (+ indices)
  assert full.bytes < V * D * 4 / 100  # not the 32 MB table


# ----------------------------------------------------------------------------- slices, lengths


def test_slice_names_follow_google_accelerator_types():
  v4 = chips.slice_spec("v4-8")  # TensorCores: 4 chips, megacore
  assert (v4.topology, v4.num_devices, v4.num_hosts) == ("v4:2x2x1", 4, 1)
  v5e = chips.slice_spec("v5e-8")  # chips: one 8-chip host
  assert (v5e.topology, v5e.num_devices, v5e.host_bounds, v5e.num_hosts) == ("v5e:2x4", 8, (2, 4, 1), 1)
  assert (chips.slice_spec("v5p-16").topology, chips.slice_spec("v5p-16").num_hosts) == ("v5p:2x2x2", 2)
  assert chips.slice_spec("v5e:4x8").num_hosts == 8
  assert chips.slice_spec("v6e-8").chip.peak_flops == 918e12
  with pytest.raises(ValueError, match="unknown slice 'tpu-8'"):
    chips.slice_spec("tpu-8")
  with pytest.raises(ValueError, match="odd"):
    chips.slice_spec("v4-7")


@needs_libtpu
def test_each_tpu_chips_usable_hbm_is_what_its_compiler_states():
  """The memory plan's limit per TPU device is the "available HBM" the TPU compiler names when a program
  does not fit (one compile-only device of each kind, megacore where JAX uses it), not an assumed share."""
  import re
  for name in ("v4-8", "v5e-8", "v5p-8", "v6e-8"):
    spec = chips.slice_spec(name)
    sh = jax.sharding.SingleDeviceSharding(chips.topology_devices(name)[0])
    too_big = jax.ShapeDtypeStruct((2 * spec.chip.hbm_bytes // 4,), jnp.float32, sharding=sh)
    with pytest.raises(Exception, match="available HBM") as err:
      jax.jit(lambda x: x + 1, out_shardings=sh).lower(too_big).compile()
    stated = float(re.search(r"available HBM \(([0-9.]+)G\)", str(err.value)).group(1))
    assert round(chips.TPU_AVAILABLE_HBM[spec.chip.kind] / 2**30, 2) == stated, name
    assert spec.chip.hbm_bytes >= stated * 2**30 * 0.99, name  # the vendor's HBM, not less than what is offered
    assert chips.device_spec(name).usable_bytes == chips.TPU_AVAILABLE_HBM[spec.chip.kind]


def test_length_model_matches_sampled_clipped_lognormal():
  cap, rows = 1024, 64
  rng = np.random.default_rng(0)
  draws = np.clip(np.ceil(rng.lognormal(math.log(0.3 * cap), 0.8, size=(4000, rows))), 8, cap)
  assert projection.mean_length(cap) == pytest.approx(draws.mean(), rel=0.01)
  assert projection.expected_max_length(cap, rows) == pytest.approx(draws.max(axis=1).mean(), rel=0.01)


def test_decode_time_is_steps_times_step_time_for_a_flat_cost():
  chip = chips.CHIPS["v5e"]
  flat = {"flops": 1e12, "hbm_bytes": 0.0, "collective_bytes": 0.0}
  segments = {100: flat, 500: flat}
  assert projection.decode_seconds(segments, chip, 64, 256, 200) == pytest.approx(200 * 1e12 / chip.peak_flops)


def test_decode_time_follows_the_engines_attention_window_step_by_step():
  # P = 64, cap 256: windows every 64 columns past the prompt, [128, 192, 256, 319], headroom 32. Rows
  # starting together: steps 1-64 read 128 columns (step s writes column 64 + s - 1), 65-128 read 192,
  # 129-192 read 256, and steps 193-200 the whole cache (256 + 32 > 256).
  chip = chips.CHIPS["v5e"]
  per_column = 1e9
  segments = {w: {"flops": w * per_column, "hbm_bytes": 0.0, "collective_bytes": 0.0} for w in (128, 319)}
  flops = per_column * (64 * 128 + 64 * 192 + 64 * 256 + 8 * 319)
  assert projection.decode_seconds(segments, chip, 64, 256, 200, window_step=64) == pytest.approx(
      flops / chip.peak_flops)
  # The accelerators' default: the whole cache (319 columns) at every step.
  assert projection.decode_seconds(segments, chip, 64, 256, 200) == pytest.approx(200 * 319 * per_column /
                                                                                   chip.peak_flops)


def test_measure_step_times_the_phase_aot_compiles_beside_its_roofline_on_this_backend():
  # astarpo_jax/measure.py (experiments/measure_step.py), the check a lent accelerator runs: here on the CPU (chip figures not this
  # machine's), on a small model: the same HLO count as compiling.read_hlo, inputs built from the shardings, the
  # donated update state rebuilt before every call
  from astarpo_jax.aot import layouts, measure
  cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8)
  run = mp.RunShape(prompt_len=16, response_len=8, rollout_batch=4, micro_batch=4, sample_batch=4, logp_chunk=8,
                    mini_batch=4, stage1_batch=4)
  mesh = layouts.abstract_mesh_devices(jax.devices()[:1], (1, 1, 1))
  chip = chips.CHIPS["h200"]
  r = measure.measure("astarpo_update", cfg, run, mesh, {"name": "astarpo", "logp_chunk": 8}, chip, reps=2)
  assert r["measured_s"] > 0 and r["spread_s"][0] <= r["measured_s"] <= r["spread_s"][1]  # two donated calls ran
  assert r["roofline_s"] == max(r["compute_s"], r["hbm_s"], r["ici_s"]) > 0
  fwd = projection.forward_flops(cfg, 4 * 24, 4 * 24 * 25 / 2, 4 * 8)  # 4 rows of 24 positions, logits on 8
  assert r["compute_s"] * chip.peak_flops >= 3 * fwd * 0.5  # forward + backward


def test_live_flops_count_live_tokens_only_by_hand():
  """One layer, D=2, F=3, one head of H=2 (and one kv head), V=5: 34 matmul weights. A row is a 200-token prompt and
  a response of the mix's mean m: T = 200 + m tokens, 2 x 34 x T for the weights, 4 x H x T(T+1)/2 for attention,
  2 x D x V x m for the logits; scoring 1x, an update 3x, over its optimizer step's rows; a decode counts none."""
  cfg = ModelConfig(vocab_size=5, hidden_size=2, intermediate_size=3, num_layers=1, num_heads=1, num_kv_heads=1,
                    head_dim=2)
  run = mp.RunShape(prompt_len=256, response_len=1024, rollout_batch=16, micro_batch=4, sample_batch=16,
                    reference_batch=8, mini_batch=12)
  m = projection.mean_length(1024)
  T = 200 + m
  fwd = 68 * T + 4 * 2 * T * (T + 1) / 2 + 20 * m
  assert projection.live_flops("reference", cfg, run) == pytest.approx(8 * fwd)
  assert projection.live_flops("astarpo_update", cfg, run) == pytest.approx(12 * 3 * fwd)
  assert projection.live_flops("rollout_decode", cfg, run) == 0.0
  assert 0.4 < T / run.seq_len < 0.5  # the padded row computes ~2.2x the live tokens


# ----------------------------------------------------------------------------- TPU compiles (libtpu)

# Minor dims of every sharded array a multiple of 128 (TPU tiles pad a minor dim of 32 to 128, so a
# smaller model's argument bytes would be mostly padding): D=512 split 4 ways, H=128, S=P+R=256.
TINY = ModelConfig(vocab_size=512, hidden_size=512, intermediate_size=512, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=128, dtype="bfloat16", remat=True)
RUN = mp.RunShape(prompt_len=128, response_len=128, rollout_batch=16, micro_batch=8, sample_batch=16,
                  logp_chunk=64, mini_batch=16, stage1_batch=16)
# TPU tiles pad each small leaf to <= 1 KiB: [M, b] per-row arrays, scalars (AdamW's count and hyper-parameters, step)
PAD = 16384  # bytes


def _hand_sharded_param_elements(cfg, fsdp):
  """Elements per device: the model dim (embed) of every matrix split `fsdp` ways, norms and biases whole."""
  V, D, F, L, N, K, H = (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
                         cfg.num_kv_heads, cfg.head_dim)
  matrices = V * D + L * (D * N * H + 2 * D * K * H + N * H * D + 3 * D * F)
  return matrices // fsdp + L * (2 * D + N * H + 2 * K * H) + D


@needs_libtpu
def test_every_phase_compiles_for_a_v5e_slice_with_the_sharded_arguments():
  from astarpo_jax.aot import compiling, layouts, phases
  devices = chips.topology_devices("v5e:2x2")
  mesh = layouts.abstract_mesh_devices(devices, (1, 4, 1))
  per_device, S, R = _hand_sharded_param_elements(TINY, 4), RUN.seq_len, RUN.response_len
  assert {"astarpo_update", "grpo_update", "ppo_update", "rebel_update", "rloo_update"} <= set(phases.PHASES)
  skip = phases.RESHARD_PHASES + phases.LORA_PHASES  # a sampling mesh (below) or an adapter (test_lora_plan) each
  for phase in (p for p in phases.PHASES if p not in skip):
    res = compiling.compile_phase(phase, TINY, RUN, mesh)
    assert not res.error, (phase, res.error)
    assert res.memory["argument"] > 0 and res.cost["flops"] > 0 and res.peak > res.memory["argument"], phase
    if phase == "reference":  # bf16 params + tokens (int32) and mask (bool), 8 rows split 4 ways
      inputs = (8 // 4) * S * (4 + 1)
      assert 2 * per_device + inputs <= res.memory["argument"] <= 2 * per_device + inputs + PAD
    if phase == "astarpo_update":  # fp32 params, AdamW mu and nu, + M=2 micro-batches of 8 rows split 4 ways
      batch = 2 * (8 // 4) * (S * 4 + S + R + R * 4 + 4 + 4)  # tokens, mask, resp_mask, ref_logp, rewards, vstar
      state = 3 * 4 * per_device
      assert state <= res.memory["argument"] - batch <= state + PAD
    if phase == "ppo_update":  # + the critic (the tied body and a [D] -> 1 head, D split 4 ways) with its AdamW
      critic = per_device + TINY.hidden_size // 4 + 1
      batch = 2 * (8 // 4) * (S * 4 + S + R + 4 + 4 * R * 4 + R * 4)  # old_logp, old_values, adv, returns, ref_logp
      state = 3 * 4 * (per_device + critic)
      assert state <= res.memory["argument"] - batch <= state + PAD
    if phase == "ppo_values":  # PPO's critic forward: the fp32 critic + tokens and mask of 8 rows split 4 ways
      critic, inputs = per_device + TINY.hidden_size // 4 + 1, (8 // 4) * S * (4 + 1)
      assert 4 * critic + inputs <= res.memory["argument"] <= 4 * critic + inputs + PAD
    if phase in phases.DECODE_PHASES:  # the TPU default: the paged decode, its step read at both ends of the
      assert list(res.segments) == [128, 128 + 128 - 1] and res.page_size == 64  # live lengths (P .. P + T - 1)
      hbm = [res.segments[n]["hbm_bytes"] for n in (128, 255)]
      assert 0 < hbm[0] < hbm[1] and not res.cost["kernel_hbm_bytes"] == res.cost["hbm_bytes"]


@needs_libtpu
def test_sampling_mesh_phases_compile_on_it_and_count_the_copy():
  """mesh.sample_shape (2, 2, 1) beside the training mesh (1, 4, 1): the copy takes the fp32 params split 4
  ways and gives bf16 ones split 2 ways (moving them over ICI); the decode runs on that copy, with the
  training params still resident beside it."""
  from astarpo_jax.aot import compiling, layouts
  devices = chips.topology_devices("v5e:2x2")
  mesh, sample = layouts.abstract_mesh_devices(devices, (1, 4, 1)), layouts.abstract_mesh_devices(devices, (2, 2, 1))
  fsdp4, fsdp2 = _hand_sharded_param_elements(TINY, 4), _hand_sharded_param_elements(TINY, 2)
  copy = compiling.compile_phase("rollout_reshard", TINY, RUN, mesh, sample_mesh=sample)
  assert not copy.error, copy.error
  assert 4 * fsdp4 <= copy.memory["argument"] <= 4 * fsdp4 + PAD
  L, D, NH, KH = TINY.num_layers, TINY.hidden_size, TINY.num_heads * TINY.head_dim, TINY.num_kv_heads * TINY.head_dim
  whole = L * (2 * D + NH + 2 * KH) + D  # norms and biases: whole on both meshes, kept as they are (sampler.copy_to)
  assert 2 * (fsdp2 - whole) <= copy.memory["output"] <= 2 * (fsdp2 - whole) + PAD
  assert copy.cost["collective_bytes"] > 0
  dec = compiling.compile_phase("rollout_decode", TINY, RUN, mesh, {"decode_layout": "dense"}, sample_mesh=sample)
  assert not dec.error and dec.mesh_shape == (2, 2, 1)
  cache = 2 * TINY.num_layers * (16 // 4) * (128 + 128 - 1) * TINY.num_kv_heads * TINY.head_dim * 2
  assert 2 * fsdp2 + cache <= dec.memory["argument"] <= 2 * fsdp2 + cache + PAD
  assert dec.resident_other >= 4 * fsdp4 * 3  # the fp32 policy and its AdamW moments stay on the training mesh
  with pytest.raises(ValueError, match="mesh.sample_shape"):
    compiling.compile_phase("rollout_reshard", TINY, RUN, mesh)


@needs_libtpu
def test_the_paged_decode_compiles_for_a_v5e_slice_with_its_kernel_once_per_layer_and_no_copy_of_the_pool():
  """The TPU default: the paged layout, the Pallas kernel a custom call per layer and step, the pool (replicated
  over the batch axes, kv heads over tensor) taken in place: no temporary the size of the pool."""
  from astarpo_jax.aot import compiling, layouts, phases
  from astarpo_jax.sampling import paged_cache
  devices = chips.topology_devices("v5e:2x2")
  for shape in ((4, 1, 1), (2, 1, 2)):
    mesh = layouts.abstract_mesh_devices(devices, shape)
    res = compiling.compile_phase("rollout_decode", TINY, RUN, mesh)
    assert not res.error, (shape, res.error)
    assert res.custom_calls.get("tpu_custom_call") == TINY.num_layers, res.custom_calls
    # its fixed costs per step, on the devices' chip: a grid per kernel call; tensor 2's all-reduces run over 2
    # of the 4 chips (their latency one hop, not three)
    assert res.fixed["chip"] == "v5e" and res.fixed["grid_steps"] >= TINY.num_layers, res.fixed
    assert (shape[2] == 2) == any(k == "all-reduce@2" for k in res.fixed["collectives"]), res.fixed
    layout = phases.page_layout(RUN, RUN.rollout_batch, "tpu")
    pool = paged_cache.pool_bytes(TINY.num_layers, TINY.num_kv_heads // shape[2], TINY.head_dim, 2, layout,
                                  RUN.sample_batch)
    assert pool <= res.memory["argument"] and res.memory["temp"] < pool / 2, (shape, res.memory, pool)
    live = [compiling.paged_kernel_bytes(TINY, RUN.sample_batch, shape, layout.page_size, n) for n in (64, 128, 192)]
    assert live[2] - live[1] == live[1] - live[0] > 0  # one more page per row per 64 tokens


@needs_libtpu
def test_the_token_choice_moves_no_logits_between_devices(monkeypatch):
  """With the vocabulary split over tensor each device draws from its own shard: no collective carries a
  logits-sized array. Before, the [V, B] logits went to rows by an all-to-all (`split_vocab=False`, still the
  path for top-k/top-p), and before that XLA gathered every row's whole vocabulary on every device. A
  vocabulary whose shards do not hold whole blocks of the two-level search (9500: Qwen's 152064 neither)."""
  from astarpo_jax.aot import compiling, layouts
  from astarpo_jax.sampling import engine
  cfg = dataclasses.replace(TINY, vocab_size=9500)
  mesh = layouts.abstract_mesh_devices(chips.topology_devices("v5e:2x2"), (2, 1, 2))

  def logits_moved(res) -> set:  # the collectives carrying a float array with a dim of a vocabulary shard or more
    return {m.group(2) for t in res.hlo.values() for m in re.finditer(
        r"= (?:f32|bf16)\[([\d,]+)\][^ ]* (all-gather|all-to-all|all-reduce|collective-permute)(?:-start)?\(", t)
        if max(int(d) for d in m.group(1).split(",")) >= cfg.vocab_size // 2}

  def compiled():
    jax.clear_caches()  # engine._segment is traced afresh for each
    res = compiling.compile_phase("rollout_decode", cfg, RUN, mesh, keep_hlo=True)
    assert not res.error
    return logits_moved(res)
  assert compiled() == set()
  split = engine.choose_on_mesh
  monkeypatch.setattr(engine, "choose_on_mesh", lambda *a: split(*a, split_vocab=False))
  assert compiled() == {"all-to-all"}
  monkeypatch.setattr(engine, "_rows_on_every_device", lambda logits_VB: logits_VB)
  assert "all-gather" in compiled()
  jax.clear_caches()


def _cuda_plugin() -> bool:
  import importlib.util
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except ModuleNotFoundError:  # no jax_plugins package at all
    return False


@pytest.mark.skipif(not _cuda_plugin(), reason="compile-only CUDA needs jax-cuda12-plugin/-pjrt (docs/tpu.md 0)")
def test_the_paged_decode_compiles_for_h200s_with_the_triton_kernel_and_no_weight_copied_out_of_the_stack(
    monkeypatch):
  """The GPU default: the Triton kernel a custom call per layer, and the decode on the unstacked copy of the
  layers: no layer's weights copied out of the stack (XLA:GPU's copy of a dynamic slice, as on stacked ones)."""
  from astarpo_jax.aot import compiling, layouts, phases
  mesh = layouts.abstract_mesh_devices(chips.topology_devices("h200x2"), (2, 1, 1))

  def copies_of_slices(res) -> int:
    return sum(text.count("copy(%dynamic-slice") + text.count("copy(%dynamic_slice") for text in res.hlo.values())
  res = compiling.compile_phase("rollout_decode", TINY, RUN, mesh, keep_hlo=True)
  assert not res.error, res.error
  assert res.custom_calls.get("__gpu$xla.gpu.triton") == TINY.num_layers, res.custom_calls
  assert copies_of_slices(res) == 0
  params = phases._params
  monkeypatch.setattr(phases, "_params", lambda cfg, mesh, dtype=None, unstacked=False: params(cfg, mesh, dtype))
  stacked = compiling.compile_phase("rollout_decode", TINY, RUN, mesh, keep_hlo=True)
  assert not stacked.error and copies_of_slices(stacked) > 0  # the stacked layers, as before unstacking


@needs_libtpu
def test_packed_rows_compile_for_a_v5e_slice_per_batch_shard_and_cut_the_forward_flops():
  """train.pack_rows on a mesh that splits rows 4 ways: each shard's 2 rows of a micro-batch packed into 1
  (pack_fill 0.5). The update and the reference forward run on half the rows, so their compiled FLOPs
  fall to about half (the [B, R] logits, computed for every response position either way, keep a bit
  more: a hand bound of 0.4-0.7), and the packed arrays are sharded like the rows they hold."""
  from astarpo_jax.aot import compiling, layouts, phases
  mesh = layouts.abstract_mesh_devices(chips.topology_devices("v5e:2x2"), (1, 4, 1))
  for phase in ("astarpo_update", "reference"):
    padded = compiling.compile_phase(phase, TINY, RUN, mesh, {"name": "astarpo"})
    packed = compiling.compile_phase(phase, TINY, RUN, mesh, {"name": "astarpo", "pack_fill": 0.5})
    assert not padded.error and not packed.error, (phase, padded.error, packed.error)
    assert 0.4 < packed.cost["flops"] / padded.cost["flops"] < 0.7, phase
    # MFU's numerator is the model's FLOPs over the rows computed: half the padded one's (1 of 2 rows a shard)
    assert padded.rows_fill == 1.0 and packed.rows_fill == 0.5
    assert packed.useful_flops == pytest.approx(padded.useful_flops / 2)
    assert packed.live_flops == padded.live_flops > 0  # live tokens do not depend on how rows are laid out
    fn, args = phases.PHASES[phase](TINY, phases.method_run(RUN, phases.method_of("astarpo")), mesh, {"pack_fill": 0.5})
    pack = args[-1] if phase == "reference" else {k: args[1][k] for k in ("pack_tokens", "pack_src")}
    lead = (2,) if phase == "astarpo_update" else ()  # M = 2 micro-batches in the update
    assert pack["pack_tokens"].shape == lead + (4, 1, RUN.seq_len)  # 4 shards, 1 packed row each
    assert pack["pack_src"].shape == lead + (4, 2, RUN.response_len)
    tokens = args[1] if phase == "reference" else args[1]["tokens"]  # [(M,) b, S], rows over the batch axes
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*(None,) * len(lead),
                                                                       tokens.sharding.spec[len(lead)]))
    assert tokens.sharding.spec[len(lead)] is not None
    assert pack["pack_tokens"].sharding.is_equivalent_to(rows, 3 + len(lead))


@needs_libtpu
def test_a_phase_too_big_for_the_chip_is_refused_with_the_settings_to_change():
  from astarpo_jax.aot import compiling, layouts
  big = dataclasses.replace(TINY, hidden_size=1024, num_heads=8, num_kv_heads=8, head_dim=128, attention_block=0,
                            num_layers=1)
  run = dataclasses.replace(RUN, prompt_len=256, response_len=7936, micro_batch=64)
  mesh = layouts.abstract_mesh_devices(chips.topology_devices("v5e:2x2"), (1, 4, 1))
  res = compiling.compile_phase("reference", big, run, mesh)
  assert "memory" in res.error.lower(), res.error
  plan = mp.plan_memory(big, run, (1, 4, 1), num_devices=4, usable_bytes=15 * 2**30, device="v5e-4")
  phase = mp.from_aot(res, plan.resident_total)
  assert phase.total > 15 * 2**30
  with pytest.raises(mp.MemoryPlanError, match=r"reference phase needs .*train\.micro_batch"):
    mp.check_fits(dataclasses.replace(plan, phases=dict(plan.phases, reference=phase)))
