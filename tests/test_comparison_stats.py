"""The comparison's reading rules (astarpo_jax/comparison/stats.py) against hand-worked cases."""
import math

import pytest

from astarpo_jax.comparison import stats


def test_break_even_ratio_is_grpos_steps_over_astarpos_less_stage1_in_grpo_steps():
  # run 9's 0.494 target: A*-PO 170 steps, GRPO 70 -> A*-PO is sooner only while its step costs < 70/170 of GRPO's
  assert stats.break_even_ratio(170, 70) == pytest.approx(0.41176, abs=1e-5)
  assert stats.break_even_ratio(170, 70, stage1_in_g_steps=2) == pytest.approx(0.4)
  with pytest.raises(ValueError, match="a_steps"):
    stats.break_even_ratio(0, 70)


def test_first_reach_is_the_first_evaluation_at_or_above_the_target():
  assert stats.first_reach([10, 20, 30], [0.4, 0.5, 0.45], 0.5) == 20
  assert stats.first_reach([10, 20, 30], [0.4, 0.45, 0.45], 0.5) is None


def test_plateau_of_a_straight_line_is_its_last_quarter_mean_and_slope_with_zero_error():
  steps = list(range(10, 101, 10))
  p = stats.plateau(steps, [0.3 + 0.001 * s for s in steps])  # window: steps 80, 90, 100
  assert (p.n, p.first_step) == (3, 80)
  assert p.mean == pytest.approx(0.39) and p.slope_per_100 == pytest.approx(0.1) and p.slope_se == pytest.approx(0)
  assert not p.flat()  # +0.1 per 100 steps, exactly: still rising


def test_plateau_of_a_level_noisy_window_has_slope_zero_and_its_hand_worked_error():
  # 0.5, 0.52, 0.5 at 80, 90, 100: slope 0; residuals' sum of squares 2 x 0.00667² + 0.01333² = 2.6667e-4 over
  # 1 dof, Σ(s - 90)² = 200
  p = stats.plateau([10, 80, 90, 100], [0.1, 0.5, 0.52, 0.5])
  assert p.mean == pytest.approx(0.506667, abs=1e-6) and p.slope_per_100 == pytest.approx(0, abs=1e-12)
  assert p.slope_se == pytest.approx(0.11547, abs=1e-5)  # sqrt(2.6667e-4 / 200) = 1.1547e-3 per step
  assert p.flat()


def test_tie_rule_reads_the_90_percent_interval_against_the_margin():
  # mean 0, sd 0.0079057, t(0.95, 4) = 2.131847: half-width 0.0075373
  t = stats.tie([0.01, -0.01, 0.0, 0.005, -0.005], margin=0.02)
  assert (t.low, t.high) == pytest.approx((-0.0075373, 0.0075373), abs=1e-6) and t.verdict == "tie"
  # mean 0.05, sd 0.01, t(0.95, 2) = 2.919986: [0.03314, 0.06686]
  t = stats.tie([0.05, 0.04, 0.06])
  assert (t.low, t.high) == pytest.approx((0.033141, 0.066859), abs=1e-5) and t.verdict == "A better"
  assert stats.tie([-0.05, -0.04, -0.06]).verdict == "B better"
  assert stats.tie([0.05, -0.03, 0.02]).verdict == "undecided"
  assert "GRPO better" in stats.tie([-0.05, -0.04, -0.06]).text(("A*-PO", "GRPO"))


def test_welch_and_paired_p_values_match_hand_worked_t_statistics():
  # Welch: t = -3 / sqrt(1/3 + 1/3) = -3.6742, df = 4: p = 0.02131
  assert stats.welch_p([1, 2, 3], [4, 5, 6]) == pytest.approx(0.02131, abs=1e-4)
  # paired differences 1, 2, 3: t = 2 / (1 / sqrt 3) = 3.4641, df = 2: p = 0.07418
  assert stats.paired_p([2, 4, 6], [1, 2, 3]) == pytest.approx(0.07418, abs=1e-4)


def test_per_problem_rates_pool_every_seeds_samples_and_counts_compare_problem_by_problem():
  rates = stats.per_problem_rates([[8, 0, 4], [6, 2, 4]], k=8)
  assert rates == pytest.approx([14 / 16, 2 / 16, 8 / 16])
  assert stats.problem_counts([0.5, 0.2, 0.3], [0.4, 0.2, 0.6]) == (1, 1, 1)
  with pytest.raises(ValueError, match="same length"):
    stats.per_problem_rates([[1, 2], [1]], k=8)
  assert math.isnan(stats.plateau([100], [0.5]).slope_se)


def test_plateau_read_at_an_earlier_step_ignores_the_evaluations_after_it():
  """A curve evaluated every 10 steps to 300, read at step 100: the window is steps 80, 90, 100 (mean of 0.38,
  0.39, 0.40 = 0.39, slope 0.1 per 100 steps), not the last quarter of 300."""
  steps = list(range(0, 301, 10))
  p = stats.plateau(steps, [0.3 + 0.001 * s for s in steps], last_step=100)
  assert (p.n, p.first_step) == (3, 80)
  assert p.mean == pytest.approx(0.39) and p.slope_per_100 == pytest.approx(0.1)
