"""A run's evaluations on the comparison's four axes (astarpo_jax/comparison/answer.py: run_axes), hand-worked
from a two-step run's metrics."""
import dataclasses
import json

import pytest

from astarpo_jax.comparison import answer


def test_axes_accumulate_samples_tokens_and_cpu_seconds_from_stage1_on(tmp_path):
  rows = [{"step": 1, "train/sec_step": 5.0, "train/cpu_step": 2.0, "train/response_length": 10.0, "train/kl": 0.1},
          {"step": 2, "train/sec_step": 7.0, "train/cpu_step": 3.0, "train/response_length": 20.0, "train/kl": 0.3},
          {"step": 2, "eval/chains/avg@8": 0.5, "eval/chains/pass@1": 0.9}]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  result = {"spec": {"task": "chains"}, "needs_stage1": True, "stage1_summary": {"num_samples": 1024},
            "stage1_tokens": 1000, "cpu_s": {"stage1": 4.0}, "times_s": {"stage1": 6.0}, "rows_per_step": 32,
            "reference_acc": 0.35}
  ax = answer.run_axes(str(tmp_path), result)
  assert ax["steps"] == [0, 2] and ax["acc"] == [0.35, 0.5]
  assert ax["responses"] == [1024, 1024 + 2 * 32]
  assert ax["tokens"] == pytest.approx([1000, 1000 + 32 * 10 + 32 * 20])
  assert ax["cpu_s"] == pytest.approx([4.0, 9.0]) and ax["wall_s"] == pytest.approx([6.0, 18.0])
  assert ax["kl_train_late"] == [0.3]  # the last quarter of 2 steps: step 2
  assert ax["step_median"] == {"cpu_s": 3.0, "wall_s": 7.0}  # steps 2..N: the first step compiles
  grpo = dict(result, needs_stage1=False)  # no Stage 1: every axis starts at 0
  ax = answer.run_axes(str(tmp_path), grpo)
  assert ax["responses"] == [0, 64] and ax["cpu_s"] == pytest.approx([0.0, 5.0])


def _fake_run(seed: int, slope: float, step_cost: float, stage1: bool, steps: int):
  """(summary, result, axes) of a run whose accuracy rises 0.35 + slope x step to a cap of 0.52."""
  from astarpo_jax.comparison import summary as cmp
  evals = list(range(0, steps + 1, 10))
  acc = [min(0.35 + slope * s, 0.52) + 0.001 * seed for s in evals]
  s1 = 4.0 if stage1 else 0.0
  ax = {"steps": evals, "acc": acc, "responses": [s * 32 for s in evals], "tokens": [s * 3200 for s in evals],
        "cpu_s": [s1 + step_cost * s for s in evals], "wall_s": [s1 + 2 * step_cost * s for s in evals],
        "kl_train_late": [0.02], "step_median": {"cpu_s": step_cost, "wall_s": 2 * step_cost}}
  per_problem = [8 * (i % 2) for i in range(100)]
  result = {"reference_acc": acc[0], "final_per_problem": per_problem, "reference_per_problem": per_problem}
  summary = cmp.RunSummary("x", seed, 1e-5, s1, step_cost * steps, steps, [(0.0, s, a) for s, a in zip(evals, acc)],
                           acc[-1], 0, {}, {"kl_seq": 2.0})
  return summary, result, ax


def test_axes_study_reads_targets_break_even_and_plateaus_from_its_runs(tmp_path, monkeypatch):
  """A*-PO rises 0.001 a step at 0.5 CPU s a step (Stage 1 4 s), GRPO 0.003 a step at 2.5 s: to 0.45 A*-PO takes
  100 steps, GRPO 40 (first evaluations at or above), so the break-even ratio is 40/100 = 0.40, and with Stage 1
  (4 / 2.5 = 1.6 GRPO steps) (40 - 1.6) / 100 = 0.384; the measured CPU ratio is 0.5 / 2.5 = 0.20."""
  from astarpo_jax.comparison import context as cx

  ctx = cx.Context(str(tmp_path), "chains", "paper", ["astarpo", "grpo"], [1, 2, 3], False, lambda s: None, "")

  def fake_group_runs(ctx_, specs):
    sp = specs[0]
    if sp.method == "grpo":
      return [_fake_run(s.seed, 0.003, 2.5, False, 300) for s in specs]
    k8 = ("algo.group_size", 8) in sp.overrides
    return [_fake_run(s.seed, 0.003 if k8 else 0.001, 2.5 if k8 else 0.5, True, 100 if k8 else 756) for s in specs]
  monkeypatch.setattr(answer, "group_runs", fake_group_runs)
  page = "\n".join(answer.axes(ctx))
  assert "| 0.450 | 100 | 40 | 0.40 | 0.38 |" in page, page
  assert "Measured here: 0.20" in page and "1.6 GRPO steps" in page
  assert "| GRPO, 300 steps | 0.522 ± 0.001 | 0.000 ± 0.000 |" in page  # capped at 0.52 + 0.001 x seed: flat
  assert "plateau by seed: +0.000" in page and ": tie" in page
  assert "A*-PO k = 8, 100 steps − GRPO, 300 steps read at step 100 (GRPO's window 0.522 ± 0.001" in page
  page = "\n".join(answer.seeds_study(dataclasses.replace(ctx, size="paper")))
  assert "A*-PO higher on 0, lower on 0, equal on 100" in page
