"""The evaluation's estimators against hand-worked cases, brute force and closed forms (evals/metrics, summary)."""
import itertools
import math

import numpy as np
import pytest

from astarpo_jax.evals import metrics, summary


def test_pass_at_k_matches_the_hand_worked_binomials():
  # n=5 samples, c=2 correct: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10; pass@4 = 1 (only 3 wrong ones)
  assert metrics.pass_at_k(5, 2, 1) == pytest.approx(0.4, abs=1e-12)
  assert metrics.pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-12)
  assert metrics.pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10, abs=1e-12)
  assert metrics.pass_at_k(5, 2, 4) == 1.0 and metrics.pass_at_k(5, 0, 5) == 0.0


def test_pass_at_k_equals_the_share_of_k_subsets_holding_a_correct_sample():
  rng = np.random.default_rng(0)
  for _ in range(40):
    n = int(rng.integers(1, 9))
    correct = rng.random(n) < rng.random()
    for k in range(1, n + 1):
      subsets = list(itertools.combinations(range(n), k))
      brute = np.mean([correct[list(s)].any() for s in subsets])
      assert metrics.pass_at_k(n, int(correct.sum()), k) == pytest.approx(brute, abs=1e-12), (n, correct, k)


def test_pass_at_k_is_not_the_first_k_share():
  # Problem 0 has its one correct sample last: the first-k share says 0 at k=1, the estimator 1/4.
  correct_PN = np.array([[0, 0, 0, 1], [1, 1, 1, 1]], bool)
  assert metrics.pass_at_k_P(correct_PN, 1).tolist() == [0.25, 1.0]
  assert metrics.pass_at_k_P(correct_PN, 2)[0] == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))


def test_reported_ks_are_powers_of_two_up_to_n_and_n():
  assert metrics.ks_for(8) == [1, 2, 4, 8]
  assert metrics.ks_for(6) == [1, 2, 4, 6]
  assert metrics.ks_for(1) == [1]


def test_maj_groups_frac_and_decimal_under_math_verify_and_breaks_the_tie_by_first_seen():
  answers = ["3", "\\frac12", "0.5", None, "3"]  # math_verify: {3, 3} and {\frac12, 0.5}: a tie of two
  rewards = np.array([0.0, 1.0, 1.0, 0.0, 0.0])
  same = summary.equivalence("math_verify")
  assert metrics.majority(answers, same) == 0  # the group seen first ("3", sample 0) wins the tie
  assert metrics.majority(["\\frac12", "3", "0.5", "3", "1/2"], same) == 0  # {\frac12, 0.5, 1/2} beats {3, 3}
  assert metrics.maj_at_k_P([answers], rewards[None], 5, same).tolist() == [0.0]
  assert metrics.maj_at_k_P([answers], rewards[None], 3, same).tolist() == [1.0]  # 3 | \frac12, 0.5: 1 vs 2
  assert metrics.maj_at_k_P([["0.5", "3", "\\frac{1}{2}"]], np.array([[1.0, 0.0, 1.0]]), 3, same).tolist() == [1.0]
  # Under the hendrycks string rules \frac14 and 0.25 differ (math_verify: equal): the two 3s win there
  assert metrics.majority(["\\frac14", "0.25", "3", "3"], summary.equivalence("hendrycks")) == 2
  assert metrics.majority(["\\frac14", "0.25", "3", "3"], same) == 0
  assert metrics.majority([None, None], same) is None


def test_maj_is_not_reported_for_a_user_function_and_says_why():
  records = [{"uid": "u/0", "sample": j, "rewards": {"my.py:fn": float(j == 0)}, "answers": {"my.py:fn": None},
              "length": 3, "truncated": False} for j in range(2)]
  _, values, notes = summary.per_problem(records, "sampled", 2, ["my.py:fn"])
  assert not any(m.startswith("maj@") for m in values["my.py:fn"])
  assert "no answer extractor" in notes["my.py:fn"]
  assert values["my.py:fn"]["pass@1"].tolist() == [0.5] and values["my.py:fn"]["pass@2"].tolist() == [1.0]


def test_standard_error_and_bootstrap_interval_of_a_mean():
  x = np.array([1.0, 0.0, 1.0, 1.0])
  f = metrics.estimate(x)
  assert f["mean"] == 0.75 and f["se"] == pytest.approx(np.sqrt(0.25 / 4), abs=1e-12)  # s^2 = 0.25, /P
  assert f["ci_lo"] <= 0.75 <= f["ci_hi"] and f["ci_lo"] >= 0.0 and f["ci_hi"] <= 1.0
  wide = metrics.estimate(np.tile(x, 100))  # more problems, a narrower interval
  assert wide["ci_hi"] - wide["ci_lo"] < f["ci_hi"] - f["ci_lo"]


def test_mcnemar_exact_p_and_paired_difference():
  a = np.array([1, 1, 1, 1, 1, 0, 1, 0], float)
  b = np.array([0, 0, 0, 0, 0, 0, 1, 0], float)
  p = metrics.paired(a, b)
  assert p["mcnemar"] == {"only_a": 5, "only_b": 0, "p": 2 / 32}  # two-sided binomial: 2 * (1/2)^5
  assert p["diff"] == 5 / 8 and p["ci_lo"] > 0  # every discordant problem favours A
  same = metrics.paired(a, a)
  assert same["diff"] == same["ci_lo"] == same["ci_hi"] == 0.0 and same["mcnemar"]["p"] == 1.0
  with pytest.raises(ValueError, match="same problems"):
    metrics.paired(a, b[:4])
