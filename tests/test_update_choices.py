"""Choices made by compiling for a TPU slice (with libtpu, compile-only): the update's compute copy gathered once
per optimizer step moves fewer collective bytes and falls back when it does not fit; π_ref's scoring micro-batch is
the largest that fits; the projections pack at the length mix's fill (phases.mix_fill)."""
import dataclasses

import pytest

from astarpo_jax.aot import chips, phases
from tests.test_aot import RUN, TINY, needs_libtpu


def _mesh():
  from astarpo_jax.aot import layouts
  return layouts.abstract_mesh_devices(chips.topology_devices("v5e:2x2"), (1, 4, 1))


@needs_libtpu
def test_update_gathering_once_per_step_gathers_the_bf16_copy_once():
  """FSDP over 4 chips, 2 micro-batches: the per-micro-batch step gathers the weights (cast to bf16 first) in
  each forward and backward (4 x 3/4 x 2 bytes a param at least, as all-gathers or the collective permutes of
  XLA's collective matmuls); once per step it all-gathers the bf16 copy once: 3/4 x 2 bytes a param."""
  from astarpo_jax.aot import compiling
  mesh, params = _mesh(), TINY.num_params
  per_mb = compiling.compile_phase("astarpo_update", TINY, RUN, mesh, {"gather_weights": "per_micro_batch"})
  per_step = compiling.compile_phase("astarpo_update", TINY, RUN, mesh, {"gather_weights": "per_step"})
  local = compiling.compile_phase("astarpo_update", TINY, RUN, mesh, {"gather_weights": "per_step_local"})
  assert not per_mb.error and not per_step.error and not local.error
  moved = lambda r: r.collectives.get("all-gather", 0) + r.collectives.get("collective-permute", 0)  # noqa: E731
  assert moved(per_mb) >= 4 * 3 / 4 * 2 * params
  assert 3 / 4 * 2 * params <= per_step.collectives.get("all-gather", 0) <= 1.05 * 3 / 4 * 2 * params
  assert per_step.cost["collective_bytes"] < per_mb.cost["collective_bytes"]
  assert per_step.cost["flops"] == pytest.approx(per_mb.cost["flops"], rel=0.02)  # the same arithmetic
  # per device accumulation: the same one gather, then one reduce-scatter of the fp32 gradient (3/4 x 4 bytes a
  # param) where per_step reduces each micro-batch's; nothing else of a param's size
  assert 0.99 * 3 / 4 * 2 * params <= local.collectives.get("all-gather", 0) <= 1.05 * 3 / 4 * 2 * params
  assert local.cost["collective_bytes"] <= 1.05 * 3 / 4 * (2 + 4) * params < per_step.cost["collective_bytes"]


@needs_libtpu
def test_auto_falls_back_to_per_micro_batch_gathers_when_the_copy_does_not_fit():
  from astarpo_jax.aot import layouts
  settings = {"gather_weights": "auto"}
  res, how, why = layouts.compile_gathered("astarpo_update", TINY, RUN, _mesh(), settings, usable_bytes=1 << 40)
  assert how == "per_step_local" and why.startswith("per_step_local fits")
  res, how, why = layouts.compile_gathered("astarpo_update", TINY, RUN, _mesh(), settings, usable_bytes=1 << 20)
  assert how == "per_micro_batch" and "does not fit" in why and not res.error


@needs_libtpu
def test_score_batch_chosen_is_the_largest_that_fits():
  """Scoring at 1, 2, 4 micro-batches a call (8, 16, 32 rows of 16 in the rollout... up to the rollout's 16
  prompts): with the limit between the 1- and 2-micro-batch peaks, 1 is chosen and the search stops there."""
  from astarpo_jax.aot import layouts
  run = dataclasses.replace(RUN, rollout_batch=32)
  spec = chips.slice_spec("v5e:2x2")
  rows, chosen = layouts.choose_score_batch(TINY, run, _mesh(), {}, 1 << 40, spec.chip)
  assert [r["score_micro_batches"] for r in rows] == [1, 2, 4] and chosen == 4  # up to the whole rollout
  peaks = [r["peak"] for r in rows]
  assert peaks == sorted(peaks) and peaks[0] < peaks[-1]
  assert [r["step_s"] / r["call_s"] for r in rows] == [4, 2, 1]  # calls a rollout
  limit = (peaks[0] + peaks[1]) // 2
  rows, chosen = layouts.choose_score_batch(TINY, run, _mesh(), {}, limit, spec.chip)
  assert chosen == 1 and [r["fits"] for r in rows] == [True, False]


def test_projection_packs_at_the_length_mix_fill():
  """2 rows a shard of prompt 200 + responses of the mix (median 0.3 x 1,024) in rows of 1,280: over 8 micro-batches
  x 8 shards some pair does not fit one row, so nothing is saved; 16 rows a shard pack into fewer rows."""
  run = dataclasses.replace(RUN, prompt_len=256, response_len=1024, rollout_batch=256, micro_batch=16, mini_batch=128)
  assert phases.mix_fill(run, shards=8, rows=16, blocks=8) == 1.0
  assert phases.mix_fill(run, shards=8, rows=128, blocks=1) < 0.75


def test_update_batch_chosen_is_the_fastest_step_that_fits(monkeypatch):
  """Hand-worked: micro-batches of 16, 32, 64 prompts in a 128-prompt step (8, 4, 2 micro-batches); each doubling
  adds 2 GiB of peak; seconds a step 1.0, 0.7, 0.8 (the largest slower). Candidates stop at the first that does
  not fit; the fastest that fits is chosen, not the largest."""
  from astarpo_jax.aot import compiling, layouts
  spec = chips.slice_spec("v5e:2x2")
  secs, peaks, seen = {16: 1.0, 32: 0.7, 64: 0.8, 128: 0.75}, {16: 4, 32: 6, 64: 8, 128: 10}, []

  def fake(phase, cfg, run, mesh, settings, usable_bytes):
    seen.append(run.micro_batch)
    flops = secs[run.micro_batch] * spec.chip.peak_flops  # compute-bound: roofline = flops / peak
    res = compiling.PhaseResult(phase, (1, 4, 1), 0.0, memory={"argument": peaks[run.micro_batch] << 30, "output": 0,
                                "alias": 0, "temp": 0, "code": 0}, cost={"flops": flops, "hbm_bytes": 0.0,
                                "collective_bytes": 0.0}, useful_flops=flops / 2)
    return res, "per_step", "as configured"

  monkeypatch.setattr(layouts, "compile_gathered", fake)
  run = dataclasses.replace(RUN, micro_batch=16, mini_batch=128, rollout_batch=256)
  rows, chosen = layouts.choose_update_batch("astarpo_update", TINY, run, None, {}, 9 << 30, spec.chip)
  assert seen == [16, 32, 64, 128] and [r["fits"] for r in rows] == [True, True, True, False]
  assert [r["micro_batches"] for r in rows] == [8, 4, 2, 1] and chosen == 32
  assert [r["mfu"] for r in rows[:3]] == pytest.approx([0.5, 0.5, 0.5])
  seen.clear()
  rows, chosen = layouts.choose_update_batch("astarpo_update", TINY, run, None, {}, 3 << 30, spec.chip)
  assert seen == [16] and chosen is None
