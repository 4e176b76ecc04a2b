"""The critics' questions that vary A*-PO alone against the main table: its betas, Stage-1 filtering and N."""
from __future__ import annotations

import os

from astarpo_jax.comparison import context as cx
from astarpo_jax.comparison.context import Context
from astarpo_jax.comparison.headline import main_target_if_run, seed_specs, time_to_target
from astarpo_jax.comparison.runs import write_csv

FILTER_N = 32  # the filtered run's Stage-1 N: the critics' Pass@N > 0 filter


def variant_table(ctx: Context, variants: list[tuple[str, list[tuple[str, object]]]]):
  rows, csv_rows = [], []
  target = main_target_if_run(ctx)
  for label, overrides in variants:
    runs = cx.runs(ctx, seed_specs(ctx, "astarpo", overrides))
    t, to_target = time_to_target(runs, target) if target is not None else ([None] * len(runs), "-")
    rows.append([label, f"{runs[0].lr:.3g}", cx.pm([r.final_acc for r in runs]), to_target,
                 cx.pm([r.total_s for r in runs], 0),
                 cx.pm([r.stage1_s for r in runs], 0), cx.pm([r.extra["kl_seq"] for r in runs], 3),
                 str(runs[0].steps)])
    csv_rows += [{"variant": label, "seed": r.seed, "lr": r.lr, "final_acc": r.final_acc, "time_to_target_s": tt,
                  "total_s": r.total_s, "stage1_s": r.stage1_s, "kl_seq": r.extra["kl_seq"], "steps": r.steps}
                 for r, tt in zip(runs, t)]
  return rows, csv_rows, target


def variants(ctx: Context, field: str, values) -> list[tuple[str, list]]:
  """(label, overrides) per value; the config's own value gets no override, so the main runs are reused."""
  own = cx.astarpo_value(ctx, field)
  return [(f"{field}={v}", [] if v == own else [(field, v)]) for v in values]


def study(ctx: Context, name: str, intro: str, variants_: list[tuple[str, list]]) -> list[str]:
  rows, csv_rows, target = variant_table(ctx, variants_)
  write_csv(os.path.join(ctx.workdir, f"{name}.csv"), csv_rows)
  where = (f"s to target: the main table's, {target:.3f}; a seed that never reaches it counts its whole training "
           "time (marked)." if target is not None else "s to target: - (the main table's runs are not in this "
                                                           "work directory).")
  return [intro, where, ""] + cx.table(["A*-PO with", "lr", "final acc", "s to target", "train s (with Stage 1)",
                                        "Stage 1 s", "KL seq", "rollout steps"], rows)


def stronger_beta2(ctx: Context) -> float:
  """beta2 / 5: a regression target (r - V*) / beta2 five times larger, which Adam's normalised steps chase
  further from pi_ref (the beta study's variant, and the budget study's second A*-PO row)."""
  return cx.astarpo_value(ctx, "algo.beta2") / 5


def beta_pairs(b1: float, b2: float) -> list[tuple[str, float, float]]:
  """The beta study's (label, beta1, beta2), the config's own pair first, duplicates dropped."""
  pairs = [("the config", b1, b2), (f"β1 = β2 = {b2:g}", b2, b2),
           ("β1 = 1/2, β2 = 1e-3 (the paper's split)", .5, 1e-3),
           (f"β1 = 0 (V* = the pass rate), β2 = {b2:g}", 0.0, b2), ("β1 = β2 = 1/2", .5, .5),
           (f"β1 = {b1:g}, β2 = {b2 / 5:g} (β2 / 5)", b1, b2 / 5)]
  seen, out = set(), []
  for label, x1, x2 in pairs:
    if (x1, x2) not in seen:
      seen.add((x1, x2))
      out.append((label, x1, x2))
  return out


def beta(ctx: Context) -> list[str]:
  b1, b2 = cx.astarpo_value(ctx, "stage1.beta1"), cx.astarpo_value(ctx, "algo.beta2")
  variants_ = [(f"{label} (β1 = {x1:g}, β2 = {x2:g})", ([] if x1 == b1 else [("stage1.beta1", x1)])
                + ([] if x2 == b2 else [("algo.beta2", x2)])) for label, x1, x2 in beta_pairs(b1, b2)]
  return study(ctx, "beta", f"The task config's β1 = {b1:g}, β2 = {b2:g} against β1 = β2 at the config's β2, the "
               "paper's "
               "split, β1 = 0, β1 = β2 = 1/2 (earlier runs' setting) and β2 / 5.", variants_)


def filter_overrides(ctx: Context, n_samples: int, drop: bool) -> list[tuple[str, object]]:
  """Stage 1 at `n_samples`, dropping the prompts none of them solved when `drop`, for the config's rollout steps
  (the unfiltered runs' number of updates: the filter is not confounded with training length)."""
  c = cx.base(ctx, "astarpo").config()
  if not c.train.num_steps:
    raise ValueError("filter: the config sets train.epochs, not train.num_steps; the filtered runs need a fixed "
                     "number of rollout steps to take as many updates as the unfiltered ones")
  out: list[tuple[str, object]] = [("stage1.drop_all_fail", True)] if drop else []
  if n_samples != c.stage1.n_samples:
    out.append(("stage1.n_samples", n_samples))
  return out


def filtering(ctx: Context) -> list[str]:
  n = cx.astarpo_value(ctx, "stage1.n_samples")
  return study(ctx, "filter", f"Training on every prompt (V* = 0 where Stage 1 saw no success) against dropping the "
               f"prompts no Stage-1 sample solved (stage1.drop_all_fail) at the config's N = {n} and at N = {FILTER_N} "
               "(the critics' Pass@N > 0 filter); a filtered run takes the config's rollout steps over the prompts kept "
               f"(as many updates as the unfiltered one, more epochs over fewer prompts). N = {FILTER_N} unfiltered "
               "separates the larger N from the filter.",
               [("every prompt", []), (f"drop_all_fail, N = {n}", filter_overrides(ctx, n, True)),
                (f"every prompt, N = {FILTER_N}", filter_overrides(ctx, FILTER_N, False)),
                (f"drop_all_fail, N = {FILTER_N}", filter_overrides(ctx, FILTER_N, True))])


def n_samples(ctx: Context) -> list[str]:
  return study(ctx, "n_samples", "Stage 1's N: more samples cost Stage-1 time and sharpen V*.",
               variants(ctx, "stage1.n_samples", [2, 4, 8, 16]))
