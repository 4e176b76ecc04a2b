"""One model over an evaluation's set runs: its records sampled (or read back), then its figures.

Both entry points call `evaluate`: `experiment.evaluate_all` (main.py's evaluation during and after training and
in mode=eval) with the run's sets, and experiments/evaluate.py; with the same params, sets, sampling, key and
chunking they produce the same records, hence the same figures. Every set run draws from the same key (its
chunks fold in their first row).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax

from astarpo_jax.evals import samples as samples_lib, summary


@dataclasses.dataclass
class Evaluation:
  records: list[dict]  # every response (samples.py's records), set run after set run
  results: list[dict]  # summary.set_figures of each set run, in order


def runs_of(greedy_sets: Mapping[str, Sequence], sampled_sets: Mapping[str, Sequence], n: int
            ) -> list[samples_lib.SetRun]:
  """A run config's set runs: greedy pass@1 on each of `greedy_sets`, n samples on each of `sampled_sets`
  (name -> prompts)."""
  return ([samples_lib.SetRun(name, "greedy", 1, tuple(p)) for name, p in greedy_sets.items()]
          + [samples_lib.SetRun(name, "sampled", n, tuple(p)) for name, p in sampled_sets.items()])


def evaluate(engine: samples_lib.Engine, params, runs: Sequence[samples_lib.SetRun], seed: int, *,
             pass_threshold: float = 1.0, meta: Mapping[str, Mapping] | None = None, model_id: str = "",
             out_dir: str | None = None, log=print) -> Evaluation:
  """Samples and grades every run (resuming from `out_dir`'s chunks), then its figures (summary.set_figures);
  every run draws from the key of `seed` + 1 (the run's evaluation key); `meta`: set name -> (uid ->
  level/subject) for the sets that have them."""
  key = jax.random.key(seed + 1)
  graders = [g for g, _ in engine.graders]
  records, results = [], []
  for run in runs:
    recs = samples_lib.sample_set(engine, params, run, key, model_id=model_id, out_dir=out_dir, log=log)
    records += recs
    results.append(summary.set_figures(recs, run.name, run.mode, run.n, graders, pass_threshold,
                                       (meta or {}).get(run.name)))
  return Evaluation(records, results)


def regrade(records: Sequence[dict], runs: Sequence[samples_lib.SetRun], graders, *, pass_threshold: float = 1.0,
            meta: Mapping[str, Mapping] | None = None) -> Evaluation:
  """`records` graded again by `graders` ((name, grade) pairs) and their figures, without sampling."""
  golds = {p.uid: p.target for run in runs for p in run.prompts}
  names = [g for g, _ in graders]
  fresh, results = [], []
  for run in runs:
    recs = [r for r in records if r["set"] == run.name and r["mode"] == run.mode]
    if not recs:
      raise ValueError(f"regrade: the kept samples have no {run.label} (mode {run.mode}); pass the sets and --n "
                       "of the evaluation that sampled them")
    recs = samples_lib.regrade(recs, golds, graders)
    fresh += recs
    results.append(summary.set_figures(recs, run.name, run.mode, run.n, names, pass_threshold,
                                       (meta or {}).get(run.name)))
  return Evaluation(fresh, results)
