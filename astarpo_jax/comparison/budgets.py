"""The budget studies: A*-PO given more rollout steps than the main table's, against the others' times.

  equal_time  A*-PO given GRPO's whole-run time (Stage 1 included) as extra epochs over the same prompts: its
              accuracy at GRPO's time, one extra run per seed
  budget      A*-PO at k x the rollout steps (config beta2 and beta2 / 5): when it reaches the main table's target
  long_sweep  the lr sweep again at k x the steps (A*-PO also with beta2 / 5); its choice is `long`'s lr
  long        every method at k x the steps, the target re-read from these runs
"""
from __future__ import annotations

import json
import math
import os

from astarpo_jax.comparison import context as cx, summary as cmp
from astarpo_jax.comparison.context import Context
from astarpo_jax.comparison.headline import main_runs, reference_accuracy, seed_specs, target_of, time_to_target
from astarpo_jax.comparison.questions import stronger_beta2
from astarpo_jax.comparison.runs import LABELS, TASKS, write_csv
from astarpo_jax.comparison.sweep import chosen_scales, load_choice, lr_choice_path, sweep_grid, sweep_header

BUDGET_MULTIPLES = (1, 3)  # A*-PO's rollout steps in the budget study, x the config's
EQUAL_TIME_OF = "grpo"  # the method whose whole-run time A*-PO is given in the equal-time study


def budget(ctx: Context) -> list[str]:
  """The main table stops every method at the same number of rollout steps, where A*-PO has spent a fraction
  of the others' time; here A*-PO runs k x the steps, and its time to the main table's target (Stage 1
  included) is set against each method's from the main runs, seed by seed."""
  groups = main_runs(ctx)
  target = target_of(groups)
  steps = cx.astarpo_value(ctx, "train.num_steps")
  rows, csv_rows = [], []

  def row(label: str, runs: list[cmp.RunSummary]) -> None:
    t, to_target = time_to_target(runs, target)
    rows.append([label, cmp.fmt_pm([r.final_acc for r in runs]), to_target, cmp.fmt_pm([r.total_s for r in runs], 0),
                 cmp.fmt_pm([r.extra["kl_seq"] for r in runs], 3)])
    csv_rows.extend({"run": label, "seed": r.seed, "final_acc": r.final_acc, "time_to_target_s": tt,
                     "total_s": r.total_s, "kl_seq": r.extra["kl_seq"]} for r, tt in zip(runs, t))

  for k in sorted(BUDGET_MULTIPLES):  # k = 1: the main runs themselves (no override, the same specs)
    overrides = cx.steps_overrides(k * steps) if k > 1 else []
    runs = cx.runs(ctx, seed_specs(ctx, "astarpo", overrides))
    row(f"A*-PO, {k * steps} steps", runs)
    longest = runs  # the last multiple's runs: the ratios below
  # the beta study's beta2 / 5, given the same longest budget: does the setting that lifted A*-PO's 50-step
  # accuracy also bring it to the target sooner?
  b2 = stronger_beta2(ctx)
  stronger = cx.runs(ctx, seed_specs(ctx, "astarpo", [("algo.beta2", b2)] + overrides))
  row(f"A*-PO with β2 = {b2:g}, {k * steps} steps", stronger)
  for label, runs in groups.items():
    if label != "A*-PO":
      row(f"{label}, {steps} steps", runs)
  write_csv(os.path.join(ctx.workdir, "budget.csv"), csv_rows)
  ratios = [[label, cmp.paired_ratio(longest, runs, target, ("A*-PO", label)),
             cmp.paired_ratio(stronger, runs, target, ("A*-PO", label))] for label, runs in groups.items()
            if label != "A*-PO"]
  return ([f"Target: the main table's, {target:.3f} (95% of the best method's mean final accuracy). A run that never "
           "reaches it counts its whole training time (marked). Seeds: " + str(ctx.seeds) + ".", ""]
          + cx.table(["run", "final acc", "s to target", "train s (with Stage 1)", "KL seq"], rows)
          + ["", f"A*-PO with {max(BUDGET_MULTIPLES) * steps} steps: time to target ÷ the method's (main runs), per "
             "seed (mean ± std over the seeds where both reach it):", ""]
          + cx.table(["method", "A*-PO ÷ method", f"A*-PO with β2 = {b2:g} ÷ method"], ratios))


STRONGER = "astarpo_stronger_beta2"  # the long studies' key for A*-PO with beta2 / 5


def long_groups(ctx: Context) -> dict[str, tuple[str, str, list]]:
  """The long studies' runs, key -> (label, method, overrides): every method at k x the rollout steps, and
  A*-PO with beta2 / 5 as well."""
  k, steps = max(BUDGET_MULTIPLES), cx.astarpo_value(ctx, "train.num_steps")
  longer = cx.steps_overrides(k * steps)
  groups = {m: (f"{LABELS[m]}, {k * steps} steps", m, longer) for m in ctx.methods}
  if "astarpo" in ctx.methods:
    b2 = stronger_beta2(ctx)
    groups[STRONGER] = (f"A*-PO with β2 = {b2:g}, {k * steps} steps", "astarpo", [("algo.beta2", b2)] + longer)
  return groups


def long_sweep(ctx: Context) -> list[str]:
  """The lr sweep again at the long study's steps: a method whose best lr over 50 steps is too timid (or
  too bold) for 150 would be handicapped there. Its choice is what `long` then uses."""
  groups = long_groups(ctx)
  choice, rows, csv_rows = sweep_grid(ctx, groups, "_long")
  write_csv(os.path.join(ctx.workdir, "long_sweep.csv"), csv_rows)
  labels = {key: label for key, (label, _, _) in groups.items()}
  short, _ = short_scales(ctx)
  moved = [labels[key] for key, s in choice.items() if s != short.get(key, 1.0)]
  seed0_path = lr_choice_path(ctx, "_long", (0,))
  seed0 = json.load(open(seed0_path)) if tuple(ctx.sweep_seeds) != (0,) and os.path.exists(seed0_path) else None
  return ([f"lr sweep at the long study's steps, {cx.seeds_text(ctx.sweep_seeds)}: config lr times 1/3, 1, 3, "
           "chosen by the mean held-out accuracy of the evaluations in the last quarter of the rollout steps over the "
           "seeds "
           "(used by --study=long).", ""]
          + cx.table(sweep_header(ctx, "run"), rows)
          + ["", "chosen: " + ", ".join(f"{labels[key]} x{s:.3g}" for key, s in choice.items()),
             "differs from the main sweep's choice: " + (", ".join(moved) if moved else "none")]
          + ([] if seed0 is None else ["differs from seed 0's long choice: " + (", ".join(
              labels[key] for key, s in choice.items() if key in seed0 and s != seed0[key]) or "none")]))


def short_scales(ctx: Context) -> tuple[dict[str, float], str]:
  """The (50-step) lr sweep's choice by long-study key: A*-PO's for A*-PO with beta2 / 5."""
  scales, how = chosen_scales(ctx)
  return {**scales, STRONGER: scales.get("astarpo", 1.0)}, how


def long_scales(ctx: Context) -> tuple[dict[str, float], str]:
  """The long sweep's choice for the runs it swept, the lr sweep's for any other."""
  scales, how = short_scales(ctx)
  choice, long_how = load_choice(ctx, "_long")
  if not choice:
    return scales, how
  return {**scales, **choice}, f"the long lr sweep's choice ({long_how}; for runs it did not sweep: {how})"


def long_budget(ctx: Context) -> list[str]:
  """The budget study's target is 95% of the others' 50-step accuracy, which they may pass with more steps.
  Here every method trains k x the steps, the target is 95% of the best mean final accuracy among these
  runs, and A*-PO's time to it (config beta2 and beta2 / 5; the budget study's own runs) is set against
  each method's, seed by seed."""
  k, steps = max(BUDGET_MULTIPLES), cx.astarpo_value(ctx, "train.num_steps")
  scales, how = long_scales(ctx)
  groups, method_of = {}, {}
  for key, (label, method, overrides) in long_groups(ctx).items():
    groups[label] = cx.runs(ctx, seed_specs(ctx, method, overrides, scales.get(key, 1.0)))
    method_of[label] = LABELS[method]
  target = target_of(groups)
  rows, csv_rows = [], []
  for label, runs in groups.items():
    t, to_target = time_to_target(runs, target)
    late = [cmp.late_accuracy(r.curve, r.steps) for r in runs]
    rows.append([label, f"{runs[0].lr:.3g}", cmp.fmt_pm([r.final_acc for r in runs]), cmp.fmt_pm(late), to_target,
                 cmp.fmt_pm([r.total_s for r in runs], 0), cmp.fmt_pm([r.extra["kl_seq"] for r in runs], 3)])
    csv_rows += [{"run": label, "seed": r.seed, "lr": r.lr, "final_acc": r.final_acc, "late_acc": la,
                  "time_to_target_s": tt, "total_s": r.total_s, "kl_seq": r.extra["kl_seq"]}
                 for r, la, tt in zip(runs, late, t)]
  write_csv(os.path.join(ctx.workdir, "long.csv"), csv_rows)
  cmp.plot_bands(groups, reference_accuracy(groups), os.path.join(ctx.workdir, "long.png"),
                 f"{ctx.task} ({ctx.size}), {k * steps} steps, seeds {ctx.seeds}", metric=TASKS[ctx.task][1],
                 target=target)
  mine = [label for label in groups if method_of[label] == LABELS["astarpo"]]
  ratios = [[label] + [cmp.paired_ratio(groups[a], runs, target, (LABELS["astarpo"], method_of[label])) for a in mine]
            for label, runs in groups.items() if label not in mine]
  return ([f"Every method at {k * steps} rollout steps ({k}x the main table's); lr: {how}. Target: 95% of the best "
           f"mean final accuracy among these runs = {target:.3f}; a seed that never reaches it counts its whole "
           "training time (marked). late acc: mean of the evaluations in the last quarter of the steps. Seeds: "
           + str(ctx.seeds) + ".", ""]
          + cx.table(["run", "lr", "final acc", "late acc", "s to target", "train s (with Stage 1)", "KL seq"], rows)
          + ["", "Time to target ÷ the method's, per seed (mean ± std over the seeds where both reach it):", ""]
          + cx.table(["method"] + [f"{a} ÷ method" for a in mine], ratios))


def equal_time_steps(ctx: Context, a_runs: list[cmp.RunSummary], budget_s: float) -> tuple[int, int]:
  """(rollout steps, epochs): whole epochs over the training prompts that A*-PO's main runs' mean seconds per step
  fit, with their mean Stage 1, into `budget_s` (never fewer than the main table's epochs)."""
  c = cx.base(ctx, "astarpo").config()
  per_epoch = max(1, c.data.num_train // c.train.rollout_batch)
  per_step = cmp.mean_std([r.train_s / r.steps for r in a_runs])[0]
  stage1 = cmp.mean_std([r.stage1_s for r in a_runs])[0]
  main_steps = a_runs[0].steps
  epochs = max(math.ceil(main_steps / per_epoch), math.ceil(max(budget_s - stage1, 0.0) / per_step / per_epoch))
  return epochs * per_epoch, epochs


def equal_time(ctx: Context) -> list[str]:
  """The main table gives every method the same epochs, where A*-PO spends a fraction of GRPO's time. Here A*-PO
  is given GRPO's mean whole-run time: as many more epochs over the same prompts as its per-step time fits (one
  extra run per seed), and its accuracy read at GRPO's time (the last evaluation at or before it) against
  GRPO's final accuracy, seed by seed."""
  groups = main_runs(ctx)
  a_label, g_label = LABELS["astarpo"], LABELS[EQUAL_TIME_OF]
  if a_label not in groups or g_label not in groups:
    raise ValueError(f"equal_time: needs {a_label} and {g_label} among --methods")
  a_runs, g_runs = groups[a_label], groups[g_label]
  budget_s = cmp.mean_std([r.total_s for r in g_runs])[0]
  steps, epochs = equal_time_steps(ctx, a_runs, budget_s)
  longer = cx.runs(ctx, seed_specs(ctx, "astarpo", cx.steps_overrides(steps)))
  at_budget = [cmp.accuracy_at(r.curve, budget_s) for r in longer]
  gain = [acc - g.final_acc for (acc, _), g in zip(at_budget, g_runs)]
  target = target_of(groups)
  to_target = {key: time_to_target(runs, target)[1] for key, runs in (("main", a_runs), ("longer", longer),
                                                                        ("grpo", g_runs))}
  rows = [[f"{a_label}, {a_runs[0].steps} steps (the main table)", cx.pm([r.final_acc for r in a_runs]), "-",
           to_target["main"], cx.pm([r.total_s for r in a_runs], 0), cx.pm([r.extra["kl_seq"] for r in a_runs], 3)],
          [f"{a_label}, {steps} steps ({epochs} epochs)", cx.pm([r.final_acc for r in longer]),
           cx.pm([acc for acc, _ in at_budget]) + f" (step {', '.join(str(s) for _, s in at_budget)})",
           to_target["longer"], cx.pm([r.total_s for r in longer], 0), cx.pm([r.extra["kl_seq"] for r in longer], 3)],
          [f"{g_label}, {g_runs[0].steps} steps (the main table)", cx.pm([r.final_acc for r in g_runs]), "-",
           to_target["grpo"], cx.pm([r.total_s for r in g_runs], 0), cx.pm([r.extra["kl_seq"] for r in g_runs], 3)]]
  cmp.plot_bands({f"{a_label}, {steps} steps": longer, f"{g_label}, {g_runs[0].steps} steps": g_runs},
                 reference_accuracy(groups), os.path.join(ctx.workdir, "equal_time.png"),
                 f"{ctx.task} ({ctx.size}): A*-PO at {g_label}'s time", metric=TASKS[ctx.task][1], target=target)
  write_csv(os.path.join(ctx.workdir, "equal_time.csv"), [
      {"run": f"{a_label}, {steps} steps", "seed": r.seed, "budget_s": budget_s, "acc_at_budget": acc,
       "step_at_budget": step, "final_acc": r.final_acc, "total_s": r.total_s, "kl_seq": r.extra["kl_seq"],
       f"{g_label}_final_acc": g.final_acc} for r, (acc, step), g in zip(longer, at_budget, g_runs)])
  return ([f"A*-PO given {g_label}'s mean whole-run time, {budget_s:.0f} s: its main runs' seconds per step and Stage "
           f"1 fit {steps} rollout steps ({epochs} epochs over the same prompts). acc at {g_label}'s time: the last "
           "evaluation at or before it (the step it was taken at, per seed). Seeds: " + str(ctx.seeds) + ".", ""]
          + cx.table(["run", "final acc", f"acc at {budget_s:.0f} s", f"s to the main target ({target:.3f})",
                      "train s (with Stage 1)", "KL seq"], rows)
          + ["", f"A*-PO's accuracy at {g_label}'s time − {g_label}'s final, per seed: "
             + ", ".join(f"{x:+.3f}" for x in gain) + f" (mean {cmp.mean_std(gain)[0]:+.3f})"])
