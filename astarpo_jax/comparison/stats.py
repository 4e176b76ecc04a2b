"""The rules the comparison's answer is read by, as pure functions: when a run reaches a target on an axis, the
cost ratio below which A*-PO gets there sooner, a plateau, a tie, and the tests by seed and by problem.

  break-even   A*-PO (a steps to the target) beats GRPO (g steps) in time iff a·c_A + S < g·c_G, S its Stage 1:
               c_A / c_G < (g − S/c_G) / a. S/c_G is Stage 1 in GRPO steps (0 leaves it out).
  plateau      the evaluations in the last quarter of a run's steps: their mean, and the least-squares slope per
               100 steps with its standard error (flat: |slope| < 2 se, or under the tie margin over 100 steps).
  tie          two methods tie when the two-sided 90% t-interval of their difference (per seed, or per problem)
               lies inside ±margin (TOST at 5%); one is better when the interval excludes 0; else undecided.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

TIE_MARGIN = 0.02  # avg@8: under half of run 9's 25-epoch gap (0.048), 4% of GRPO's accuracy
TIE_LEVEL = 0.90  # TOST at 5%: the 90% interval inside ±margin


def first_reach(xs: Sequence[float], accs: Sequence[float], target: float) -> float | None:
  """The x (step, samples, tokens, seconds) of the first evaluation at or above `target`; None if none is."""
  return next((x for x, acc in zip(xs, accs) if acc >= target), None)


def break_even_ratio(a_steps: float, g_steps: float, stage1_in_g_steps: float = 0.0) -> float:
  """The A*-PO / GRPO per-step cost below which A*-PO reaches a target sooner: (g − S) / a, S = Stage 1 in
  GRPO steps."""
  if a_steps <= 0:
    raise ValueError(f"break_even_ratio: a_steps must be > 0 (steps A*-PO took to the target), got {a_steps}")
  return (g_steps - stage1_in_g_steps) / a_steps


@dataclasses.dataclass(frozen=True)
class Plateau:
  mean: float  # mean accuracy of the last quarter's evaluations
  slope_per_100: float  # least-squares slope over them, accuracy per 100 rollout steps
  slope_se: float  # its standard error (nan with fewer than 3 evaluations)
  n: int  # evaluations in the window
  first_step: int  # the window's first evaluation

  def flat(self, margin: float = TIE_MARGIN) -> bool:
    """No trend the data can tell from noise (|slope| < 2 se), or one under the tie margin per 100 steps."""
    return abs(self.slope_per_100) < margin or (math.isfinite(self.slope_se)
                                                and abs(self.slope_per_100) < 2 * self.slope_se)


def plateau(steps: Sequence[int], accs: Sequence[float], last_step: int | None = None) -> Plateau:
  """The plateau of a curve: evaluations at steps > 0.75 x the last step (the lr sweep's late window); with
  `last_step`, the curve read as if it had stopped there (a longer run at a shorter run's steps)."""
  last = max(steps) if last_step is None else last_step
  pts = [(s, a) for s, a in zip(steps, accs) if s > 0 and 0.75 * last < s <= last]
  if not pts:
    raise ValueError(f"plateau: no evaluation after step {0.75 * last:g} (steps {list(steps)})")
  n = len(pts)
  mean = sum(a for _, a in pts) / n
  if n < 2:
    return Plateau(mean, 0.0, math.nan, n, pts[0][0])
  sx = sum(s for s, _ in pts) / n
  sxx = sum((s - sx) ** 2 for s, _ in pts)
  slope = sum((s - sx) * (a - mean) for s, a in pts) / sxx
  se = math.nan
  if n > 2:
    resid = sum((a - mean - slope * (s - sx)) ** 2 for s, a in pts)
    se = math.sqrt(resid / (n - 2) / sxx)
  return Plateau(mean, 100 * slope, 100 * se, n, pts[0][0])


def t_interval(values: Sequence[float], level: float = TIE_LEVEL) -> tuple[float, float, float]:
  """(mean, low, high): the two-sided `level` t-interval of the mean of `values`."""
  from scipy import stats
  n = len(values)
  if n < 2:
    raise ValueError(f"t_interval: needs 2 or more values, got {n}")
  mean = sum(values) / n
  sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
  half = stats.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
  return mean, mean - half, mean + half


@dataclasses.dataclass(frozen=True)
class Tie:
  mean: float
  low: float
  high: float
  margin: float
  verdict: str  # "tie", "A better", "B better", "undecided"

  def text(self, names: tuple[str, str] = ("A", "B")) -> str:
    verdict = {"A better": f"{names[0]} better", "B better": f"{names[1]} better"}.get(self.verdict, self.verdict)
    return f"{self.mean:+.3f} [{self.low:+.3f}, {self.high:+.3f}]: {verdict}"


def tie(diffs: Sequence[float], margin: float = TIE_MARGIN, level: float = TIE_LEVEL) -> Tie:
  """The tie rule on differences A − B (per seed or per problem)."""
  mean, lo, hi = t_interval(diffs, level)
  if -margin < lo and hi < margin:
    verdict = "tie"
  elif lo > 0:
    verdict = "A better"
  elif hi < 0:
    verdict = "B better"
  else:
    verdict = "undecided"
  return Tie(mean, lo, hi, margin, verdict)


def welch_p(a: Sequence[float], b: Sequence[float]) -> float:
  """Two-sided Welch t-test p-value of mean(a) = mean(b) (seeds as independent draws)."""
  from scipy import stats
  return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def paired_p(a: Sequence[float], b: Sequence[float]) -> float:
  """Two-sided paired t-test p-value (pairs: the same seed, or the same problem)."""
  from scipy import stats
  return float(stats.ttest_rel(a, b).pvalue)


def per_problem_rates(sums_by_seed: Sequence[Sequence[float]], k: int) -> list[float]:
  """Each problem's success rate over every seed's k samples: the mean of its per-seed reward sums / k."""
  n = len(sums_by_seed)
  if not n or len({len(s) for s in sums_by_seed}) != 1:
    raise ValueError("per_problem_rates: one list of per-problem sums per seed, all of the same length")
  return [sum(col) / (n * k) for col in zip(*sums_by_seed)]


def problem_counts(a_rates: Sequence[float], b_rates: Sequence[float]) -> tuple[int, int, int]:
  """(problems where A's rate is higher, lower, equal)."""
  higher = sum(x > y for x, y in zip(a_rates, b_rates, strict=True))
  lower = sum(x < y for x, y in zip(a_rates, b_rates))
  return higher, lower, len(a_rates) - higher - lower
