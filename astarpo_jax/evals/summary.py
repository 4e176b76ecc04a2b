"""Figures from kept records: per set and mode, per grader, by MATH level and subject, overall, model vs baseline.

Every figure is a mean over problems of a per-problem value (greedy pass@1: the greedy response's reward; avg@n:
the mean reward of the n samples; pass@k: the unbiased estimator over samples with r >= pass_threshold; maj@k:
metrics.maj_at_k_P), with its standard error and 95% bootstrap interval over problems (metrics.estimate).
Overall pools the problems of every set evaluated with the same metric (each problem counts once).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from astarpo_jax.evals import metrics
from astarpo_jax.rewards import grading, user_grader

NO_EXTRACTOR = ("not reported: a user's reward function has no answer extractor, so its answers cannot be grouped "
                "by equivalence for a vote")
EQUIV_TIMEOUT_S = 5.0


def equivalence(grader: str) -> Callable[[str, str], bool] | None:
  """Whether two extracted answers are the same under `grader`'s comparison (its answer-vs-gold rule, each
  answer screened as a model answer is, under the per-item time limit, in this process); None for a user's
  function."""
  if user_grader.is_spec(grader):
    return None

  memo: dict[tuple[str, str], bool] = {}  # a set's answers repeat across samples and k: compare each pair once

  def same(a: str, b: str) -> bool:
    if (a, b) not in memo:
      screened = grading.screen(a) is None and grading.screen(b) is None
      memo[a, b] = screened and grading.run_job(grader, a, b, EQUIV_TIMEOUT_S)[0] == 1.0
    return memo[a, b]
  return same


def _arrays(records: Sequence[dict], n: int, grader: str) -> tuple[list[str], np.ndarray, list[list]]:
  """(problem uids, rewards [P, n], answers [P][n]) of one set and mode's records, problem-major."""
  by_uid: dict[str, list[dict]] = defaultdict(list)
  for r in records:
    by_uid[r["uid"]].append(r)
  uids = list(by_uid)
  bad = [u for u in uids if len(by_uid[u]) != n]
  if bad:
    raise ValueError(f"{len(bad)} problems do not have {n} samples (e.g. {bad[0]}: {len(by_uid[bad[0]])})")
  rows = [sorted(by_uid[u], key=lambda r: r["sample"]) for u in uids]
  rewards = np.array([[r["rewards"][grader] for r in row] for row in rows], np.float64)
  return uids, rewards, [[r["answers"].get(grader) for r in row] for row in rows]


def per_problem(records: Sequence[dict], mode: str, n: int, graders: Sequence[str], pass_threshold: float = 1.0
                ) -> tuple[list[str], dict[str, dict[str, np.ndarray]], dict[str, str]]:
  """(uids, {grader: {metric: per-problem values}}, {grader: why maj@k is missing}) of one set and mode."""
  values, notes = {}, {}
  uids: list[str] = []
  for g in graders:
    uids, rewards_PN, answers_PN = _arrays(records, n, g)
    if mode == "greedy":
      values[g] = {"pass@1": rewards_PN[:, 0]}
      continue
    v = {f"avg@{n}": rewards_PN.mean(axis=1)}
    correct = rewards_PN >= pass_threshold
    ks = metrics.ks_for(n)
    v.update({f"pass@{k}": metrics.pass_at_k_P(correct, k) for k in ks})
    same = equivalence(g)
    if same is None:
      notes[g] = NO_EXTRACTOR
    else:
      v.update({f"maj@{k}": metrics.maj_at_k_P(answers_PN, rewards_PN, k, same) for k in ks})
    values[g] = v
  return uids, values, notes


def set_figures(records: Sequence[dict], name: str, mode: str, n: int, graders: Sequence[str],
                pass_threshold: float = 1.0, meta: Mapping[str, Mapping] | None = None) -> dict:
  """Every figure of one set and mode (see the module docstring); `meta` (uid -> {"level", "subject"}) adds the
  headline grader's figures by MATH level and subject."""
  uids, values, notes = per_problem(records, mode, n, graders, pass_threshold)
  head = graders[0]
  out = {"set": name, "mode": mode, "n": n, "num_problems": len(uids), "num_responses": len(records),
         "response_length": float(np.mean([r["length"] for r in records])),
         "truncation_share": float(np.mean([r["truncated"] for r in records])),
         "pass_rate": float(np.mean([r["rewards"][head] >= pass_threshold for r in records])),
         "graders": {g: {m: metrics.estimate(x) for m, x in v.items()} for g, v in values.items()},
         "per_problem": {"uids": uids, **{g: {m: x.tolist() for m, x in v.items()} for g, v in values.items()}}}
  if notes:
    out["maj@k"] = {g: why for g, why in notes.items()}
  if meta:
    for field in ("level", "subject"):
      groups: dict[str, list[int]] = defaultdict(list)
      for i, u in enumerate(uids):
        if u in meta and meta[u].get(field) is not None:
          groups[str(meta[u][field])].append(i)
      out[f"by_{field}"] = {key: {"num_problems": len(ix), **{m: metrics.mean_se(x[ix]) for m, x in values[head].items()
                                                              if not m.startswith(("pass@", "maj@")) or m == "pass@1"}}
                            for key, ix in sorted(groups.items())}
  return out


def overall(results: Sequence[dict]) -> dict:
  """Per grader and metric, the estimate over the problems of every set that has it (each problem once); the
  greedy pass@1 is "greedy pass@1", apart from the samples' pass@1."""
  pooled: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
  for res in results:
    for g, v in res["per_problem"].items():
      if g != "uids":
        for m, x in v.items():
          pooled[g][f"greedy {m}" if res["mode"] == "greedy" else m] += list(x)
  return {g: {m: {**metrics.estimate(np.array(x)), "num_problems": len(x)} for m, x in v.items()}
          for g, v in pooled.items()}


def compare(results: Sequence[dict], baseline: Sequence[dict], grader: str) -> dict:
  """Model minus baseline per set, mode and metric of `grader`, paired on the problems both evaluated."""
  base = {(r["set"], r["mode"], r["n"]): r for r in baseline}
  out = {}
  for res in results:
    other = base.get((res["set"], res["mode"], res["n"]))
    if other is None or grader not in res["per_problem"] or grader not in other["per_problem"]:
      continue
    a_uids, b_uids = res["per_problem"]["uids"], other["per_problem"]["uids"]
    if a_uids != b_uids:
      raise ValueError(f"{res['set']}: the model and the baseline were evaluated on different problems")
    for m, a in res["per_problem"][grader].items():
      if m in other["per_problem"][grader]:
        label = f"{res['set']}/{'greedy ' if res['mode'] == 'greedy' else ''}{m}"
        out[label] = metrics.paired(np.array(a), np.array(other["per_problem"][grader][m]))
  return out


def run_report_rows(results: Sequence[dict], graders: Sequence[str]) -> dict:
  """The run report's rows (experiment.evaluate_all, report.json): `<set>/pass@1` or `<set>/avg@n` with the
  headline grader's accuracy (mean reward), pass_rate, response_length, truncation_rate, num_prompts, k, se, and
  for a sampled set pass@k and maj@k; `<set>/<metric>/<grader>` with each other grader's accuracy."""
  out = {}
  head = graders[0]
  for res in results:
    metric = "pass@1" if res["mode"] == "greedy" else f"avg@{res['n']}"
    label = f"{res['set']}/{metric}"
    figs = res["graders"][head]
    row = {"accuracy": figs[metric]["mean"], "se": figs[metric]["se"], "pass_rate": res["pass_rate"],
           "response_length": res["response_length"], "truncation_rate": res["truncation_share"],
           "num_prompts": res["num_problems"], "k": res["n"]}
    row.update({m: f["mean"] for m, f in figs.items() if m.startswith(("pass@", "maj@")) and res["mode"] == "sampled"})
    out[label] = row
    out.update({f"{label}/{g}": {"accuracy": res["graders"][g][metric]["mean"]} for g in graders[1:]})
  return out
