"""Summaries of training runs for comparing methods: curves, time to a threshold, means over seeds.

A run is read from its work directory (metrics.jsonl, written by loop.run) and the worker's result
dict (experiments/compare.py). Training time is the sum of the loop's per-step wall times (sampling,
grading, scoring forwards, updates; not evaluation, checkpoints or logging) plus Stage 1 for A*-PO.
Pure functions over plain dicts and lists, so the tables can be rebuilt from saved files.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Sequence

PHASES = ("sample", "grade", "ref", "old_logp", "values", "update")


@dataclasses.dataclass
class RunSummary:
  """One run: its settings' label, seed, learning rate, the accuracy curve and the figures of the tables."""
  label: str
  seed: int
  lr: float
  stage1_s: float
  train_s: float  # Σ per-step wall times
  steps: int
  curve: list[tuple[float, int, float]]  # (training seconds incl. Stage 1, rollout step, held-out accuracy)
  final_acc: float
  tokens_sampled: int  # response tokens of every rollout (and of Stage 1)
  phase_s: dict[str, float]  # mean seconds per step (steps 2..N) of each phase
  extra: dict  # KL, memory, loads: whatever the worker measured
  sample_share_median: float = math.nan  # sampling's share of the median step (steps 2..N): no compile step moves it

  @property
  def total_s(self) -> float:
    return self.stage1_s + self.train_s


def read_metrics(workdir: str) -> tuple[list[dict], list[dict]]:
  """(train rows, eval rows) of a run's metrics.jsonl."""
  train, evals = [], []
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    for line in f:
      m = json.loads(line)
      (train if "train/sec_step" in m else evals).append(m)
  return train, evals


def summarize(label: str, seed: int, lr: float, result: dict, train_rows: list[dict], eval_rows: list[dict],
              metric: str, rows_per_step: int) -> RunSummary:
  """A RunSummary from a worker's result and the run's metrics rows.

  `metric` is the eval key of the held-out accuracy (e.g. "chains/pass@1"); `rows_per_step` the
  responses sampled per rollout (prompts x responses per prompt), for the token count.
  """
  stage1_s = float(result["times_s"].get("stage1", 0.0)) if result.get("needs_stage1") else 0.0
  cum, t = {}, stage1_s
  for m in train_rows:
    t += m["train/sec_step"]
    cum[m["step"]] = t
  ref_acc = result["reference_acc"]
  curve = [(0.0, 0, ref_acc)] + ([(stage1_s, 0, ref_acc)] if stage1_s else [])
  curve += [(cum[m["step"]], m["step"], m[f"eval/{metric}"]) for m in eval_rows
            if f"eval/{metric}" in m and m["step"] in cum]
  steady = train_rows[1:] or train_rows  # the first step also compiles
  phase = {p: sum(m.get(f"train/sec_{p}", 0.0) for m in steady) / max(len(steady), 1) for p in PHASES}
  # A step that meets a new shape (a response bucket, a packed row count) compiles inside its update or
  # forward: seconds that the mean of `phase` keeps and a step's share should not.
  shares = [m.get("train/sec_sample", 0.0) / max(sum(m.get(f"train/sec_{p}", 0.0) for p in PHASES), 1e-9)
            for m in steady]
  share = statistics.median(shares) if shares else math.nan
  tokens = sum(int(round(m["train/response_length"] * rows_per_step)) for m in train_rows)
  tokens += int(result.get("stage1_tokens", 0)) if result.get("needs_stage1") else 0
  return RunSummary(label, seed, lr, stage1_s, sum(m["train/sec_step"] for m in train_rows), len(train_rows), curve,
                    float(result["final_acc"]), tokens, phase, dict(result.get("extra", {})), share)


def time_to_reach(curve: Sequence[tuple[float, int, float]], target: float) -> float | None:
  """Training seconds at the first evaluation at or above `target`; None when no evaluation reaches it."""
  return next((t for t, _, acc in curve if acc >= target), None)


def accuracy_at(curve: Sequence[tuple[float, int, float]], seconds: float) -> tuple[float, int]:
  """(accuracy, rollout step) of the last evaluation at or before `seconds` of training time (Stage 1 included):
  what the run had reached when that much time was spent; its first evaluation where none is that early."""
  before = [(acc, step) for t, step, acc in curve if t <= seconds]
  return before[-1] if before else (curve[0][2], curve[0][1])


def late_accuracy(curve: Sequence[tuple[float, int, float]], num_steps: int) -> float:
  """Mean held-out accuracy of the evaluations in the last quarter of the rollout steps (the lr sweep's
  criterion); the last evaluation when none falls there."""
  late = [acc for _, step, acc in curve if step > 0 and step > 0.75 * num_steps]
  return sum(late) / len(late) if late else curve[-1][2]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
  """Mean and sample standard deviation (0 for one value)."""
  n = len(values)
  mean = sum(values) / n
  return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0


def time_to_threshold(runs: Sequence[RunSummary], target: float) -> tuple[list[float], int]:
  """Per seed: the training time to `target`, or (not reached) the run's whole training time; and how
  many seeds did not reach it."""
  times, missed = [], 0
  for r in runs:
    t = time_to_reach(r.curve, target)
    if t is None:
      missed += 1
      t = r.total_s
    times.append(t)
  return times, missed


def paired_ratio(a_runs: Sequence[RunSummary], b_runs: Sequence[RunSummary], target: float,
                 names: tuple[str, str] = ("A", "B")) -> str:
  """A's time to `target` ÷ B's, seed by seed, over the seeds where both reach it after some training, as
  'mean ± std (k/n seeds)'; a seed where either never reaches it (or B is there before training) has no
  time-to-accuracy ratio, so it is left out and counted, never filled with a whole run's time."""
  ratios, a_hit, b_hit = [], 0, 0
  for a, b in zip(a_runs, b_runs, strict=True):
    if a.seed != b.seed:
      raise ValueError(f"paired_ratio pairs runs by seed: {a.seed} against {b.seed}")
    ta, tb = time_to_reach(a.curve, target), time_to_reach(b.curve, target)
    a_hit, b_hit = a_hit + (ta is not None), b_hit + (tb is not None)
    if ta is not None and tb:
      ratios.append(ta / tb)
  n = len(a_runs)
  if not ratios:
    return f"n/a: no seed where both reach it after training ({names[0]} {a_hit}/{n}, {names[1]} {b_hit}/{n})"
  return f"{fmt_pm(ratios, 2)} ({len(ratios)}/{n} seeds where both reach it)"


def fmt_pm(values: Sequence[float], digits: int = 3) -> str:
  """'mean ± std' of `values`."""
  m, s = mean_std(values)
  return f"{m:.{digits}f} ± {s:.{digits}f}"


def plot_bands(groups: dict[str, list[RunSummary]], ref_acc: float, path: str, title: str = "",
               metric: str = "accuracy", target: float | None = None) -> None:
  """Held-out `metric` against training time: per method the mean over seeds at each evaluation (mean
  time on x) with a ±1 std band; a dashed line at the reference's `ref_acc`, a dotted one at `target`."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.2))
  for label, runs in groups.items():
    n = min(len(r.curve) for r in runs)
    ts = [mean_std([r.curve[i][0] for r in runs])[0] for i in range(n)]
    acc = [mean_std([r.curve[i][2] for r in runs]) for i in range(n)]
    mean = [a for a, _ in acc]
    line, = ax.plot(ts, mean, marker="o", ms=3, label=f"{label} ({len(runs)} seeds)")
    ax.fill_between(ts, [a - s for a, s in acc], [a + s for a, s in acc], color=line.get_color(), alpha=0.2)
  ax.axhline(ref_acc, color="gray", lw=0.8, ls="--")
  if target is not None:
    ax.axhline(target, color="black", lw=0.8, ls=":", label=f"target {target:.3f}")
  ax.set_xlabel("training wall-clock s (A*-PO includes Stage 1)")
  ax.set_ylabel(f"held-out {metric}")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  if title:
    ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
