"""The per-method whole-run projection (aot/method_runs.py) against hand-worked sums of phase times."""
import math

import pytest

from astarpo_jax.aot import memory_plan as mp, method_runs
from astarpo_jax.aot.chips import ChipSpec
from astarpo_jax.aot.compiling import PhaseResult
from astarpo_jax.model.config import ModelConfig

# A chip whose roofline time is the FLOP count: a phase "costs" its flops in seconds.
CHIP = ChipSpec("test", 1 << 40, 1.0, 1e30, 1e30, "a hand-made chip")
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8)
# One-token responses: every row takes one decode step, so a call of R rows through S slots takes ceil(R / S).
RUN = mp.RunShape(prompt_len=4, response_len=1, rollout_batch=8, micro_batch=2, sample_batch=4, mini_batch=4,
                  stage1_batch=4, stage1_prompts=4)
PLAN = method_runs.Plan(num_prompts=16, epochs=2, n_samples=2, stage1_chunks=1, rollouts=1)
SETTINGS = {"astarpo": {}, "grpo": {"group_size": 4, "kl_coef": 1e-3}, "rloo": {"group_size": 2, "kl_coef": 0.0},
            "ppo": {"group_size": 1, "kl_coef": 1e-3}, "rebel": {}}
UPDATE_S = {"astarpo": 7.0, "grpo": 11.0, "rloo": 13.0, "ppo": 17.0, "rebel": 19.0}


def _phase(name, seconds):
  return PhaseResult(name, (1, 1, 1), 0.0, cost={"flops": seconds, "hbm_bytes": 0.0, "collective_bytes": 0.0})


def _results():
  out = {n: _phase(n, s) for n, s in {"stage1_reshard": 0.5, "stage1_prefill": 1.0, "rollout_reshard": 0.25,
                                       "rollout_prefill": 2.0, "reference": 3.0, "ppo_values": 5.0,
                                       "stage1_decode": 0.03, "rollout_decode": 0.01}.items()}
  out.update({f"{m}_update": _phase(f"{m}_update", s) for m, s in UPDATE_S.items()})
  return out


def test_each_methods_step_is_the_sum_of_its_phases_and_only_astarpo_pays_stage1():
  shapes = {m: method_runs.method_shape(m, s) for m, s in SETTINGS.items()}
  assert [(shapes[m].rows_per_prompt, shapes[m].reference, shapes[m].critic, shapes[m].stage1) for m in SETTINGS] == [
      (1, True, False, True), (4, True, False, False), (2, False, False, False), (1, True, True, False),
      (2, False, False, False)]
  # π's own scoring calls: every one of the rollout's for the methods with old log-probs (the training forward, by
  # default), A*-PO's one for its mismatch metric
  assert [shapes[m].policy_calls for m in SETTINGS] == [1, -1, -1, -1, -1]
  runs = {m: RUN for m in SETTINGS}
  decode = {4: _phase("rollout_decode", 0.01), 8: _phase("rollout_decode", 0.015), 16: _phase("rollout_decode", 0.02)}
  rows = {(r["method"], r["setting"]): r for r in method_runs.whole_runs(_results(), CFG, CHIP, runs, shapes, decode,
                                                                         PLAN)}
  # Hand-worked: copy 0.25 + prefill of 8 prompts (2.0 per 4) + decode + reference calls of 2 rows x 3.0, the
  # policy's old-log-prob calls as many at the same 3.0 (A*-PO: one, its mismatch metric) (+ PPO's critic calls
  # x 5.0) + 8 / 4 = 2 optimizer steps.
  expect = {"astarpo": 0.25 + 4 + 2 * 0.01 + 4 * 3 + 1 * 3 + 2 * 7,  # 8 rows through 4 slots: 2 steps
            "grpo": 0.25 + 4 + 8 * 0.01 + 16 * 3 + 16 * 3 + 2 * 11,  # 32 rows: 8 steps at 4 slots
            "rloo": 0.25 + 4 + 4 * 0.01 + 8 * 3 + 2 * 13,  # no KL term: no reference forward, the old log-probs'
            "ppo": 0.25 + 4 + 2 * 0.01 + 4 * 3 + 4 * 3 + 4 * 5 + 2 * 17,
            "rebel": 0.25 + 4 + 4 * 0.01 + 8 * 3 + 2 * 19}
  for m, step in expect.items():
    assert rows[(m, "config")]["step_s"] == pytest.approx(step), m
  # Wide: as many slots as rows, up to 16 compiled: GRPO's 32 rows take 2 steps of 0.02, REBEL's 16 one step.
  assert rows[("grpo", "wide")]["slots"] == 16 and rows[("grpo", "wide")]["decode_s"] == pytest.approx(0.04)
  assert rows[("rebel", "wide")]["decode_s"] == pytest.approx(0.02)
  assert rows[("astarpo", "wide")]["slots"] == 8 and rows[("astarpo", "wide")]["decode_s"] == pytest.approx(0.015)
  # Stage 1: 16 prompts in calls of 4, each 8 rows through 4 slots (2 steps of 0.03) + prefill 1.0 + copy 0.5.
  stage1_h = 4 * (2 * 0.03 + 1.0 + 0.5) / 3600
  steps = 2 * (16 // 8)
  assert rows[("astarpo", "config")]["stage1_h"] == pytest.approx(stage1_h)
  assert rows[("grpo", "config")]["stage1_h"] == 0.0
  # Wide, Stage 1's 8 rows a call take one step of the 8-slot decode.
  assert rows[("astarpo", "wide")]["stage1_h"] == pytest.approx(4 * (0.015 + 1.0 + 0.5) / 3600)
  total = {m: (stage1_h if m == "astarpo" else 0.0) + steps * s / 3600 for m, s in expect.items()}
  assert rows[("astarpo", "config")]["total_h"] == pytest.approx(total["astarpo"])
  assert rows[("astarpo", "config")]["vs_grpo"] == pytest.approx(total["astarpo"] / total["grpo"])
  assert rows[("grpo", "wide")]["vs_grpo"] == 1.0


def test_a_rollout_through_one_slot_takes_every_token_and_through_enough_slots_the_longest():
  step = lambda active, live: 1.0
  lengths = method_runs.projection.sample_lengths(64, 12, seed=3)
  one = method_runs.rollout_seconds(step, 12, 1, 64, seed=3)
  wide = method_runs.rollout_seconds(step, 12, 12, 64, seed=3)
  assert one["steps"] == int(lengths.sum()) and wide["steps"] == int(lengths.max())
  assert math.isclose(one["seconds"], lengths.sum()) and math.isclose(wide["seconds"], lengths.max())


def test_the_modeled_edge_adds_each_phases_exposed_collectives_host_trips_and_grading_to_the_roofline():
  """Hand-worked modeled run: the decode's step 0.01 + 0.004 s of exposed collectives, the reference's call
  3 + 1 s; each sampling call of 8 one-token rows through 4 slots is 2 segments (4 rows, then 4 more to the end):
  2 host trips of fixed_costs.HOST_TRIP_S["host"]; every sampled row graded at Plan.grade_per_s."""
  shapes = {m: method_runs.method_shape(m, SETTINGS[m]) for m in ("astarpo", "grpo")}
  results = _results()
  results["reference"].fixed = {"exposed_s": 1.0}
  decode = {4: _phase("rollout_decode", 0.01)}
  decode[4].fixed = {"exposed_s": 0.004}
  trip = method_runs.fixed_costs.HOST_TRIP_S["host"]
  by = {}
  for modeled in (False, True):
    plan = method_runs.Plan(num_prompts=16, epochs=2, n_samples=2, stage1_chunks=1, rollouts=1, modeled=modeled)
    by[modeled] = {r["method"]: r for r in method_runs.whole_runs(results, CFG, CHIP, {m: RUN for m in shapes},
                                                                  shapes, decode, plan) if r["setting"] == "config"}
  low, high = by[False]["astarpo"], by[True]["astarpo"]
  assert low["step_s"] == pytest.approx(0.25 + 4 + 2 * 0.01 + 5 * 3 + 2 * 7) and low["edge"] == "roofline"
  assert high["trips"] == 2 and high["decode_s"] == pytest.approx(2 * 0.014 + 2 * trip)
  assert high["step_s"] == pytest.approx(0.25 + 4 + 2 * 0.014 + 2 * trip + 8 / 300 + 5 * (3 + 1) + 2 * 7)
  assert high["stage1_h"] == pytest.approx(4 * (2 * 0.03 + 2 * trip + 1.0 + 0.5 + 8 / 300) / 3600)
  assert high["besides_h"] == 0.0  # 4 steps: no evaluation or save (every 50)
  grpo = by[True]["grpo"]  # 32 rows: 8 segments of one step each (4 rows a refill), the last to the end
  assert grpo["trips"] == 8 and grpo["grade_s"] == pytest.approx(32 / 300)
  assert high["vs_grpo"] == pytest.approx(high["total_h"] / grpo["total_h"])


def test_a_whole_run_adds_its_evaluations_and_checkpoint_saves_at_their_stated_costs():
  """Hand-worked: 50 epochs of 16 prompts in rollouts of 8 = 100 steps; MATH500 stood in by 8 rows evaluated every
  50 steps (2 evaluations), a checkpoint every 25 (4 saves). An evaluation: 8 one-token rows through the config's
  4 slots (2 decode steps of 0.01 s, 2 host trips), their prefill (2.0 s per 4 prompts) and two graders' passes;
  a save writes 12 bytes a parameter at checkpoint_bytes_per_s. The roofline edge counts neither."""
  shapes = {m: method_runs.method_shape(m, SETTINGS[m]) for m in ("astarpo", "grpo")}
  decode = {4: _phase("rollout_decode", 0.01)}
  trip = method_runs.fixed_costs.HOST_TRIP_S["host"]
  kw = dict(num_prompts=16, epochs=50, n_samples=2, stage1_chunks=1, rollouts=1, eval_every=50, eval_rows=8,
            checkpoint_every=25, checkpoint_bytes_per_s=1e6, grade_per_s=100.0)
  by = {}
  for modeled in (False, True):
    plan = method_runs.Plan(modeled=modeled, **kw)
    by[modeled] = [r for r in method_runs.whole_runs(_results(), CFG, CHIP, {m: RUN for m in shapes}, shapes, decode,
                                                     plan)]
  evaluation = 2 * 0.01 + 2 * trip + 2.0 * 8 / 4 + 2 * 8 / 100.0
  save = 12 * CFG.num_params / 1e6
  assert all(r["besides_h"] == pytest.approx((2 * evaluation + 4 * save) / 3600) for r in by[True])
  assert all(r["besides_h"] == 0.0 for r in by[False])
  for r in by[True]:
    assert r["total_h"] == pytest.approx(r["stage1_h"] + r["stage2_h"] + r["besides_h"])
