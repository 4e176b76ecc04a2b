"""The estimators, per problem first and then over problems: pure numpy on plain arrays and lists.

pass@k (Chen et al. 2021): from n samples of a problem with c correct, the chance that k drawn without
replacement hold a correct one, 1 - C(n-c, k) / C(n, k), averaged over problems; unbiased, unlike the share of
problems solved among the first k samples. maj@k: the answers of the first k samples grouped by the grader's
equivalence; the largest group wins, a tie goes to the group whose first member came first (the earliest
sample); the problem scores the reward of that group's first member; samples without an answer vote for nothing.
Intervals are over problems: a standard error, a percentile bootstrap, and for two models on the same problems a
paired bootstrap of the per-problem difference and McNemar's exact test on the problems where one of them passes.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def ks_for(n: int) -> list[int]:
  """The k of pass@k and maj@k reported for n samples: 1, 2, 4, ... up to n, and n itself."""
  if n < 1:
    raise ValueError(f"n={n}: need at least one sample per problem")
  out = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
  return out if out[-1] == n else out + [n]


def pass_at_k(n: int, c: int, k: int) -> float:
  """1 - C(n-c, k) / C(n, k) for one problem: n samples, c correct; as the product 1 - prod_{i=n-c+1..n} (1 - k/i)
  (no large binomials)."""
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
  if n - c < k:
    return 1.0
  return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_at_k_P(correct_PN: np.ndarray, k: int) -> np.ndarray:
  """Per-problem unbiased pass@k of a [P, N] array of 0/1 correctness."""
  correct_PN = np.asarray(correct_PN, bool)
  n = correct_PN.shape[1]
  return np.array([pass_at_k(n, int(c), k) for c in correct_PN.sum(axis=1)], np.float64)


def majority(answers: Sequence[str | None], same: Callable[[str, str], bool]) -> int | None:
  """The index of the sample whose answer wins the vote (the first member of the largest group; ties: the group
  that appeared first), or None when no sample has an answer. Identical strings are equal without asking `same`."""
  groups: list[list[int]] = []  # sample indices, grouped; a group's first member is its representative
  for i, a in enumerate(answers):
    if a is None:
      continue
    for g in groups:
      rep = answers[g[0]]
      if a == rep or same(a, rep):
        g.append(i)
        break
    else:
      groups.append([i])
  if not groups:
    return None
  best = max(range(len(groups)), key=lambda j: (len(groups[j]), -groups[j][0]))  # size, then first seen
  return groups[best][0]


def maj_at_k_P(answers_PN: Sequence[Sequence[str | None]], rewards_PN: np.ndarray, k: int,
               same: Callable[[str, str], bool]) -> np.ndarray:
  """Per-problem maj@k over the first k samples: the reward of the winning group's first member (0 with no answer)."""
  out = []
  for answers, rewards in zip(answers_PN, np.asarray(rewards_PN, np.float64)):
    win = majority(list(answers[:k]), same)
    out.append(0.0 if win is None else float(rewards[win]))
  return np.array(out, np.float64)


def mean_se(x_P: np.ndarray) -> dict[str, float]:
  """Mean over problems and its standard error, std (ddof 1) / sqrt(P) (0 for a single problem)."""
  x_P = np.asarray(x_P, np.float64)
  if x_P.size == 0:
    raise ValueError("mean_se: no problems")
  se = float(x_P.std(ddof=1) / math.sqrt(x_P.size)) if x_P.size > 1 else 0.0
  return {"mean": float(x_P.mean()), "se": se}


def bootstrap_ci(x_P: np.ndarray, level: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
                 seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
  """Percentile bootstrap interval of the mean over problems (problems resampled with replacement)."""
  x_P = np.asarray(x_P, np.float64)
  idx = np.random.default_rng(seed).integers(0, x_P.size, size=(resamples, x_P.size))
  means = x_P[idx].mean(axis=1)
  lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
  return float(lo), float(hi)


def estimate(x_P: np.ndarray) -> dict[str, float]:
  """mean, se and the 95% bootstrap interval (ci_lo, ci_hi) of per-problem values."""
  lo, hi = bootstrap_ci(x_P)
  return {**mean_se(x_P), "ci_lo": lo, "ci_hi": hi}


def mcnemar_p(a_P: np.ndarray, b_P: np.ndarray) -> dict[str, float]:
  """McNemar's exact test on 0/1 per-problem outcomes: b01 problems only A passes, b10 only B; two-sided
  binomial p of the smaller count under Binomial(b01 + b10, 1/2)."""
  a_P, b_P = np.asarray(a_P) > 0.5, np.asarray(b_P) > 0.5
  only_a, only_b = int((a_P & ~b_P).sum()), int((~a_P & b_P).sum())
  m = only_a + only_b
  tail = sum(math.comb(m, i) for i in range(min(only_a, only_b) + 1)) / 2 ** m if m else 1.0
  return {"only_a": only_a, "only_b": only_b, "p": float(min(1.0, 2 * tail))}


def paired(a_P: np.ndarray, b_P: np.ndarray, resamples: int = BOOTSTRAP_RESAMPLES,
           seed: int = BOOTSTRAP_SEED) -> dict[str, float]:
  """A - B on the same problems: the mean per-problem difference, its standard error and a paired bootstrap 95%
  interval (problems resampled, both models' values kept together); McNemar's test where both are 0/1."""
  a_P, b_P = np.asarray(a_P, np.float64), np.asarray(b_P, np.float64)
  if a_P.shape != b_P.shape:
    raise ValueError(f"paired: {a_P.shape} vs {b_P.shape} problems; compare the same problems")
  d_P = a_P - b_P
  lo, hi = bootstrap_ci(d_P, resamples=resamples, seed=seed)
  out = {"a": float(a_P.mean()), "b": float(b_P.mean()), "diff": float(d_P.mean()), "se": mean_se(d_P)["se"],
         "ci_lo": lo, "ci_hi": hi, "num_problems": int(a_P.size)}
  if np.isin(a_P, (0.0, 1.0)).all() and np.isin(b_P, (0.0, 1.0)).all():
    out["mcnemar"] = mcnemar_p(a_P, b_P)
  return out
