"""The main table: every method at its chosen lr over the evaluation seeds, and what the other studies read
from it (its runs, its target: 95% of the best method's mean final accuracy)."""
from __future__ import annotations

import os

from astarpo_jax.comparison import context as cx, summary as cmp
from astarpo_jax.comparison.context import Context
from astarpo_jax.comparison.runs import LABELS, TASKS, RunSpec, run_dir_of, write_csv
from astarpo_jax.comparison.sweep import chosen_scales


def seed_specs(ctx: Context, method: str, overrides=(), lr_scale: float | None = None) -> list[RunSpec]:
  """`method` with `overrides`, one run per seed, at `lr_scale` (default: the lr sweep's choice)."""
  if lr_scale is None:
    lr_scale = chosen_scales(ctx)[0].get(method, 1.0)
  return [cx.base(ctx, method, s, lr_scale, overrides) for s in ctx.seeds]


def main_specs(ctx: Context) -> dict[str, list[RunSpec]]:
  """The main table's runs: every method at its chosen lr, one per seed."""
  return {m: seed_specs(ctx, m) for m in ctx.methods}


def main_runs(ctx: Context) -> dict[str, list[cmp.RunSummary]]:
  return {LABELS[m]: cx.runs(ctx, specs) for m, specs in main_specs(ctx).items()}


def target_of(groups: dict[str, list[cmp.RunSummary]]) -> float:
  """The accuracy every time-to-target is read at: 95% of the best method's mean final accuracy."""
  return 0.95 * max(cmp.mean_std([r.final_acc for r in runs])[0] for runs in groups.values())


def reference_accuracy(groups: dict[str, list[cmp.RunSummary]]) -> float:
  """pi_ref's held-out accuracy for the plots' dashed line: every run's step-0 evaluation, averaged."""
  return cmp.mean_std([r.curve[0][2] for runs in groups.values() for r in runs])[0]


def time_to_target(runs: list[cmp.RunSummary], target: float) -> tuple[list[float], str]:
  """Per seed the time to `target` (a whole run's time where never reached) and the table's cell for it."""
  t, missed = cmp.time_to_threshold(runs, target)
  return t, cmp.fmt_pm(t, 0) + (f" ({missed}/{len(runs)} not reached)" if missed else "")


def main_table(ctx: Context) -> list[str]:
  groups = main_runs(ctx)
  _, how = chosen_scales(ctx)
  target = target_of(groups)
  rows, csv_rows = [], []
  for label, runs in groups.items():
    t, to_target = time_to_target(runs, target)
    step = [sum(r.phase_s.values()) for r in runs]
    sample_share = [r.phase_s["sample"] / max(s, 1e-9) for r, s in zip(runs, step)]
    median_share = [r.sample_share_median for r in runs]
    stage1_share = [r.stage1_s / r.total_s for r in runs]
    mem = [r.extra["compiled_bytes"] for r in runs][0]
    rows.append([label, f"{runs[0].lr:.3g}", cmp.fmt_pm([r.final_acc for r in runs]),
                 to_target, cmp.fmt_pm(stage1_share, 2), cmp.fmt_pm([r.total_s for r in runs], 0),
                 f"{cmp.fmt_pm(median_share, 2)} / {cmp.fmt_pm(sample_share, 2)}",
                 cmp.fmt_pm([r.tokens_sampled / 1e3 for r in runs], 0),
                 cmp.fmt_pm([r.extra["kl_seq"] for r in runs], 3), cmp.fmt_pm([r.extra["peak_rss_mb"] for r in runs], 0),
                 f"{mem['update'] / 2**20:.0f} / {mem['reference'] / 2**20:.0f} / {mem['sample'] / 2**20:.0f}"])
    for r, tt in zip(runs, t):
      csv_rows.append({"method": label, "seed": r.seed, "lr": r.lr, "final_acc": r.final_acc, "time_to_target_s": tt,
                       "stage1_s": r.stage1_s, "train_s": r.train_s, "tokens": r.tokens_sampled,
                       "sample_share_median_step": r.sample_share_median, **r.extra,
                       **{f"s_per_step_{k}": v for k, v in r.phase_s.items()}})
  write_csv(os.path.join(ctx.workdir, "main.csv"), csv_rows)
  cmp.plot_bands(groups, reference_accuracy(groups), os.path.join(ctx.workdir, "comparison.png"),
                 f"{ctx.task} ({ctx.size})", metric=TASKS[ctx.task][1])
  a_runs = groups.get("A*-PO")
  ratio_rows = [[label, cmp.paired_ratio(a_runs, runs, target, ("A*-PO", label))] for label, runs in groups.items()
                if a_runs and label != "A*-PO"]
  return ([f"lr: {how}. Target: 95% of the best method's mean final accuracy = {target:.3f}. Seeds: {ctx.seeds}. "
           "Training time: Σ per-step wall times + Stage 1 (A*-PO); a seed that never reaches the target counts its "
           "whole training time (marked). Memory: peak RSS of the run's process, and the compiled per-device bytes "
           "(this backend) of the update step / the scoring forward / the sampler (formula).", ""]
          + cx.table(["method", "lr", "final acc", "s to target", "Stage-1 share", "train s",
                    "sampling share: median step / mean", "k tokens sampled", "KL seq", "peak RSS MB", "update / score / sample MiB"], rows)
          + ["", "A*-PO time to target ÷ the method's, per seed (mean ± std over the seeds where both reach it):", ""]
          + cx.table(["method", "A*-PO ÷ method"], ratio_rows))


def main_target_if_run(ctx: Context) -> float | None:
  """The main table's target when every main run of these seeds is already in the work directory (a
  question study never launches the other methods' runs just for this column)."""
  specs = [sp for specs in main_specs(ctx).values() for sp in specs]
  if not all(os.path.exists(os.path.join(run_dir_of(sp, ctx.workdir, ctx.code_id), "result.json")) for sp in specs):
    return None
  return target_of(main_runs(ctx))
