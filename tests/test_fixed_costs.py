"""The fixed costs a roofline leaves out (aot/fixed_costs.py), against hand-worked cases: collectives the schedule
can or can not hide, latency by replica group, GPU launches with and without a command buffer, a Pallas kernel's
grid read from its compile, and the engine's host round trips from its segment log."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from astarpo_jax.aot import chips, fixed_costs, projection
from astarpo_jax.sampling import decode_plan, engine
from astarpo_jax.sampling.token_choice import SamplingConfig
from tests.test_sampler import tiny_model

V5E = chips.CHIPS["v5e"]
ADD = """%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""
# 4 MiB all-reduced over groups of 2 (ring: 2 (n - 1) / n of its bytes = 4 MiB) and a 64 MiB negate beside it.
AR_BYTES, NEG_BYTES = 4 * 2**20, 2 * 64 * 2**20


def _module(body: str) -> str:
  return ("HloModule m, is_scheduled=true\n\n" + ADD + "\nENTRY %main (p0: f32[1024,1024], p1: f32[4096,4096]) -> "
          "f32[1024,1024] {\n  %p0 = f32[1024,1024]{1,0} parameter(0)\n  %p1 = f32[4096,4096]{1,0} parameter(1)\n"
          + body + "}\n")


DEPENDENT = _module("""  %ar = f32[1024,1024]{1,0} all-reduce(%p0), replica_groups={{0,1},{2,3}}, to_apply=%add
  %n = f32[4096,4096]{1,0} negate(%p1)
  ROOT %m = f32[1024,1024]{1,0} multiply(%ar, %ar)
""")
OVERLAPPED = _module("""  %ars = f32[1024,1024]{1,0} all-reduce-start(%p0), replica_groups={{0,1},{2,3}}, to_apply=%add
  %n = f32[4096,4096]{1,0} negate(%p1)
  %ard = f32[1024,1024]{1,0} all-reduce-done(%ars)
  ROOT %m = f32[1024,1024]{1,0} multiply(%ard, %ard)
""")
NOTHING_BESIDE = _module("""  %ars = f32[1024,1024]{1,0} all-reduce-start(%p0), replica_groups={{0,1},{2,3}}, to_apply=%add
  %ard = f32[1024,1024]{1,0} all-reduce-done(%ars)
  %n = f32[4096,4096]{1,0} negate(%p1)
  ROOT %m = f32[1024,1024]{1,0} multiply(%ard, %ard)
""")


def test_a_collective_the_next_op_waits_for_is_exposed_and_one_with_work_beside_it_is_hidden():
  one = AR_BYTES / V5E.ici_bandwidth + V5E.hop_latency_s * 1  # a 2-chip ring: one hop, whatever the slice
  sync = fixed_costs.count(DEPENDENT, V5E)
  assert sync.collective_s == pytest.approx(one) and sync.exposed_s == pytest.approx(one)
  assert dict(sync.collectives) == {("all-reduce", 2): 1}
  hidden = fixed_costs.count(OVERLAPPED, V5E)  # the negate (164 us of HBM) runs between start and done
  assert NEG_BYTES / V5E.hbm_bandwidth > one
  assert hidden.collective_s == pytest.approx(one) and hidden.exposed_s == 0.0
  alone = fixed_costs.count(NOTHING_BESIDE, V5E)  # async, but nothing scheduled between start and done
  assert alone.exposed_s == pytest.approx(one)


@pytest.mark.parametrize("groups, size", [("{{0,1,2,3},{4,5,6,7}}", 4), ("[2,4]<=[8]", 4), ("[4,2]<=[8]", 2),
                                          ("{{0,1,2,3,4,5,6,7}}", 8)])
def test_a_collectives_latency_follows_its_replica_group_not_the_slice(groups, size):
  text = DEPENDENT.replace("{{0,1},{2,3}}", groups)
  ring = 2 * (size - 1) / size * AR_BYTES
  fixed = fixed_costs.count(text, V5E)
  assert dict(fixed.collectives) == {("all-reduce", size): 1}
  assert fixed.exposed_s == pytest.approx(ring / V5E.ici_bandwidth + (size - 1) * V5E.hop_latency_s)


GPU_LOOP = """HloModule g, is_scheduled=true

%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %lim = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %lim), direction=LT
}

%body (b: (s32[], f32[8])) -> (s32[], f32[8]) {
  %b = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %x = f32[8]{0} get-tuple-element(%b), index=1
  %one = s32[] constant(1)
  %i1 = s32[] add(%i, %one)
  %e = f32[8]{0} exponential(%x)
  %y = f32[8]{0} multiply(%e, %x)
  ROOT %t = (s32[], f32[8]{0}) tuple(%i1, %y)
}

%command_buffer (q: f32[8]) -> f32[8] {
  %q = f32[8]{0} parameter(0)
  %q1 = f32[8]{0} negate(%q)
  %q2 = f32[8]{0} abs(%q1)
  ROOT %q3 = f32[8]{0} sqrt(%q2)
}

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %a = f32[8]{0} negate(%p)
  %g = f32[8]{0} call(%a), to_apply=%command_buffer
  %z = s32[] constant(0)
  %t0 = (s32[], f32[8]{0}) tuple(%z, %g)
  %w = (s32[], f32[8]{0}) while(%t0), condition=%cond, body=%body
  ROOT %r = f32[8]{0} get-tuple-element(%w), index=1
}
"""


def test_gpu_launches_are_kernels_outside_command_buffers_and_loop_predicates_go_to_the_host():
  """Hand count: negate (1) + the command buffer's three ops as one graph launch (1) + 5 trips of the loop,
  each its body's add, exponential, multiply (3) and its condition's compare (1): 2 + 20 = 22; 5 host reads."""
  fixed = fixed_costs.count(GPU_LOOP, chips.CHIPS["h100"], gpu=True)
  assert fixed.launches == 22 and fixed.command_buffers == 1 and fixed.host_syncs == 5
  assert fixed_costs.count(GPU_LOOP, chips.CHIPS["h100"], gpu=False).launches == 0  # a TPU launches nothing
  step = fixed_costs.modeled_step({"flops": 0.0, "hbm_bytes": 0.0, "collective_bytes": 0.0}, fixed,
                                  chips.CHIPS["h100"], kernel_bytes=0.0)
  assert step["launch_s"] == pytest.approx(22 * fixed_costs.GPU_LAUNCH_S + 5 * fixed_costs.GPU_SYNC_S)
  assert step["roofline_s"] == 0.0


def test_grid_seconds_take_the_kernels_bytes_or_their_steps_whichever_is_longer_and_megacore_splits():
  fixed = fixed_costs.StepCosts(grid_steps=1000.0, grid_steps_parallel=1000.0)
  cost = {"flops": 0.0, "hbm_bytes": 2e6, "collective_bytes": 0.0}
  v5e = fixed_costs.modeled_step(cost, fixed, V5E, kernel_bytes=1e6)  # 1.2 us of kernel bytes vs 350 us of steps
  assert v5e["modeled_s"] == pytest.approx(1e6 / V5E.hbm_bandwidth + 1000 * fixed_costs.GRID_STEP_S)
  assert v5e["roofline_s"] == pytest.approx(2e6 / V5E.hbm_bandwidth)
  v5p = chips.CHIPS["v5p"]  # megacore: the parallel rows run on two TensorCores
  assert fixed_costs.grid_seconds(fixed, v5p) == pytest.approx(500 * fixed_costs.GRID_STEP_S)


@pytest.mark.skipif(not chips.libtpu_available(), reason="compiling for a TPU needs libtpu (the tpu/test extra)")
def test_a_pallas_kernels_grid_is_read_from_its_compile_and_multiplied_by_its_loop():
  """A kernel of grid (4, 3) (rows "parallel", columns "arbitrary") called once per trip of a 5-trip loop."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu
  devices = chips.topology_devices("v5e:2x2")
  trips, block = 5, (8, 128)

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0

  double = pl.pallas_call(kernel, grid=(4, 3), in_specs=[pl.BlockSpec(block, lambda i, j: (i, j))],
                          out_specs=pl.BlockSpec(block, lambda i, j: (i, j)),
                          out_shape=jax.ShapeDtypeStruct((32, 384), jnp.float32),
                          compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")))
  x = jax.ShapeDtypeStruct((32, 384), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(devices[0]))
  mesh = jax.sharding.Mesh(np.array(devices[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
  with jax.set_mesh(mesh):
    text = jax.jit(lambda x: jax.lax.fori_loop(0, trips, lambda i, y: double(y), x)).lower(x).compile().as_text()
  fixed = fixed_costs.count(text, V5E)
  assert fixed.grid_steps == trips * 4 * 3 and fixed.grid_steps_parallel == trips * 4 * 3


def test_round_trips_are_the_engines_segments_hand_worked_for_two_min_free():
  """4 slots (no ladder), rows needing [2, 4, 1, 5, 3, 6] decode steps. min_free=1: a segment of 1 step (row 2
  ends), one of 1 (row 0 ends, row 4 in), then rows 1, 3, 4, 5 to the end (6 steps): 3 trips, 8 steps. min_free=2:
  2 steps (rows 2 and 0 end), then rows 1, 3, 4, 5 to the end (6 steps): 2 trips, 8 steps."""
  cfg, params = tiny_model(seed=3)
  budgets = np.array([2, 4, 1, 5, 3, 6], np.int32) + 1  # the first token is drawn at prefill
  tokens = np.arange(1, 25, dtype=np.int32).reshape(6, 4) % (cfg.vocab_size - 3) + 3
  scfg = SamplingConfig(temperature=1.0, max_new_tokens=8, stop_ids=())
  trips = {}
  for min_free in (1, 2):
    stats = decode_plan.RunStats()
    engine.generate(cfg, params, tokens, np.ones_like(tokens, bool), jax.random.key(0), scfg, budget_R=budgets,
                    slots=4, min_slots=4, min_free=min_free, window_step=None, stats=stats)
    trips[min_free] = fixed_costs.host_trips(stats.segment_log)
  assert trips[1]["trips"] == 3 and trips[2]["trips"] == 2
  assert trips[1]["steps"] == trips[2]["steps"] == 8
  assert fixed_costs.engine_trips(budgets, 4, 6, 2)["trips"] == 2  # its own one-layer model, same schedule
  for min_free in (1, 2):  # the projection's simulator schedules as the engine does
    sim = projection.simulate_continuous(budgets - 1, 4, lambda active, live: 1.0, min_free=min_free, min_slots=4)
    assert (sim["trips"], sim["steps"]) == (trips[min_free]["trips"], 8)
  assert fixed_costs.host_seconds(3, multi_host=True) == pytest.approx(3 * fixed_costs.HOST_TRIP_S["pod"])
