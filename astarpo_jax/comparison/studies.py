"""The comparison's studies (experiments/compare.py --study=NAME): which runs each needs and the tables it writes.

  sweep      lr in {1/3, 1, 3} x each method's config lr, seed 0; the lr of each method chosen by mean
             held-out accuracy over the last quarter of its rollout steps (saved for `main`)
  main       every method at its chosen lr, over the seeds: final accuracy, time to 95% of the best
             method's mean final accuracy (Stage 1 included for A*-PO), KL to pi_ref, tokens, memory
  beta       A*-PO's beta1 against beta2: beta1 = beta2, the paper's beta1 = 1/2, the plain mean, the paper's
             beta2 = 1e-3, beta2 / 5, and the plain mean with beta2 / 5
  filter     Stage-1 filtering of prompts no sample solved (stage1.drop_all_fail) against none
  n_samples  Stage 1's N in {2, 4, 8, 16}
  falsifier  on training prompts pi_ref never solves in 32 samples: avg@8 before and after training, per method
  budget     A*-PO given 3x the rollout steps (its main runs take a fraction of GRPO's time), with the config's
             beta2 and with beta2 / 5: when it reaches the main table's target, against each method's time to it
  long_sweep the sweep again at 3x the rollout steps (A*-PO also with beta2 / 5); its choice is long's lr
  long       every method given 3x the rollout steps (A*-PO also with beta2 / 5), the target re-read from these
             runs: does the budget study's speed-up hold when the others train as long? (neither long study is
             in --study=all)
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable

from astarpo_jax.comparison import falsifier as falsifier_study, summary as cmp
from astarpo_jax.comparison.runs import LABELS, LR_SCALES, TASKS, RunSpec, ensure_run, run_dir_of, summary_of, write_csv

STUDIES = ("sweep", "main", "beta", "filter", "n_samples", "falsifier", "budget", "long_sweep", "long")
# the long studies train every method 3x longer (GRPO ~6 min a run here): asked for by name only
ALL_STUDIES = tuple(s for s in STUDIES if s not in ("long_sweep", "long"))
BUDGET_MULTIPLES = (1, 3)  # A*-PO's rollout steps in the budget study, x the config's
MAX_EXTEND = 2  # the lr grid grows by at most this many x3 steps past either end before the edge is accepted
# task -> the overrides that evaluate a run on the task's validation problems (the sweeps' runs)
VALIDATION = {"chains": (("data.chains.heldout", "val"),)}


@dataclasses.dataclass
class Context:
  workdir: str
  task: str
  size: str
  methods: list[str]
  seeds: list[int]
  fresh: bool
  log: Callable[[str], None]
  command: str
  cache_dir: str = ""  # JAX's persistent compilation cache of the runs
  sweep_seeds: tuple[int, ...] = (0,)  # the lr sweeps' seeds, disjoint from `seeds` (evaluation)
  overrides: tuple[tuple[str, object], ...] = ()  # every run's, before a study's own (e.g. train.pack_rows)


def run_study(name: str, ctx: Context) -> None:
  lines = {"sweep": sweep, "main": main_table, "beta": beta, "filter": filtering, "n_samples": n_samples,
           "falsifier": falsifier, "budget": budget, "long_sweep": long_sweep, "long": long_budget}[name](ctx)
  _write_section(ctx, name, lines)


def _write_section(ctx: Context, name: str, lines: list[str]) -> None:
  """Replaces the study's section of <workdir>/comparison.md (the others are kept)."""
  path = os.path.join(ctx.workdir, "comparison.md")
  sections = json.load(open(path + ".json")) if os.path.exists(path + ".json") else {}
  sections[name] = [f"## {name}", "", f"`python experiments/compare.py {ctx.command}`", ""] + lines + [""]
  with open(path + ".json", "w") as f:
    json.dump(sections, f)
  with open(path, "w") as f:
    f.write("\n".join(line for s in STUDIES if s in sections for line in sections[s]) + "\n")
  ctx.log("\n".join(sections[name]))


def _runs(ctx: Context, specs: list[RunSpec]) -> list[cmp.RunSummary]:
  out = []
  for spec in specs:
    run_dir, result = ensure_run(spec, ctx.workdir, ctx.fresh, ctx.log, ctx.cache_dir)
    out.append(summary_of(spec, run_dir, result))
  return out


def _base(ctx: Context, method: str, seed: int = 0, lr_scale: float = 1.0, overrides=()) -> RunSpec:
  return RunSpec(ctx.task, ctx.size, method, seed, lr_scale, tuple(ctx.overrides) + tuple(overrides))


def _table(header: list[str], rows: list[list]) -> list[str]:
  return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
      "| " + " | ".join(str(x) for x in r) + " |" for r in rows]


# ---------------------------------------------------------------------------------------------

def _lr_choice_path(ctx: Context, which: str = "", seeds: tuple[int, ...] | None = None) -> str:
  """Where a sweep's choice is kept: one file per sweep and set of sweep seeds (seed 0 alone: no suffix)."""
  seeds = ctx.sweep_seeds if seeds is None else seeds
  tag = "" if tuple(seeds) == (0,) else "_seeds" + "-".join(str(s) for s in seeds)
  return os.path.join(ctx.workdir, f"lr_choice{which}{tag}_{ctx.task}_{ctx.size}.json")


def _seeds_text(seeds) -> str:
  return f"seed {seeds[0]}" if len(seeds) == 1 else "seeds " + ", ".join(str(s) for s in seeds)


def _load_choice(ctx: Context, which: str) -> tuple[dict[str, float], str]:
  """The sweep's choice on seed 0, updated by the one on `ctx.sweep_seeds` for the runs that sweep covered."""
  choice, how = {}, []
  for seeds in dict.fromkeys([(0,), tuple(ctx.sweep_seeds)]):
    path = _lr_choice_path(ctx, which, seeds)
    if os.path.exists(path):
      got = json.load(open(path))
      choice.update(got)
      how.append(f"{_seeds_text(seeds)} for {len(got)} run(s)")
  return choice, "; ".join(how)


def _sweep_grid(ctx: Context, groups: dict[str, tuple[str, str, list]], which: str) -> tuple[dict, list, list]:
  """Each group (key -> label, method, overrides) at lr {1/3, 1, 3} x its config lr on every sweep seed, the grid
  extended by x3 steps past whichever end is best until the best is interior (at most MAX_EXTEND steps a side);
  the choice by the mean over those seeds of the late accuracy (the last quarter's evaluations) on the task's
  validation problems where it has them (never the test problems the tables report), saved as
  lr_choice<which>[_seeds...]_*.json (merged into the choices already there for other groups)."""
  seeds = list(ctx.sweep_seeds)
  choice, rows, csv_rows = {}, [], []
  for key, (label, method, overrides) in groups.items():
    late_by_scale: dict[float, float] = {}
    overrides = list(overrides) + list(VALIDATION.get(ctx.task, ()))

    def run_scale(scale: float) -> None:
      runs = _runs(ctx, [_base(ctx, method, seed, scale, overrides) for seed in seeds])
      late = [cmp.late_accuracy(r.curve, r.steps) for r in runs]
      late_by_scale[scale] = sum(late) / len(late)
      per_seed = [] if len(seeds) == 1 else [" / ".join(f"{x:.3f}" for x in late)]
      rows.append([label, f"{runs[0].lr:.3g}", f"{scale:.3g}", f"{late_by_scale[scale]:.3f}"] + per_seed
                  + [_pm([r.final_acc for r in runs]), _pm([r.total_s for r in runs], 0)])
      csv_rows.extend({"method": label, "seed": r.seed, "lr": r.lr, "lr_scale": scale, "late_acc": la,
                       "final_acc": r.final_acc, "total_s": r.total_s} for r, la in zip(runs, late))

    for scale in LR_SCALES:
      run_scale(scale)
    for _ in range(2 * MAX_EXTEND):
      best = _best_scale(late_by_scale)
      lo, hi = min(late_by_scale), max(late_by_scale)
      if best not in (lo, hi) or (best == lo and lo <= min(LR_SCALES) / 3 ** MAX_EXTEND) or (
          best == hi and hi >= max(LR_SCALES) * 3 ** MAX_EXTEND):
        break
      run_scale(lo / 3 if best == lo else hi * 3)
    choice[key] = _best_scale(late_by_scale)
  path = _lr_choice_path(ctx, which)
  saved = json.load(open(path)) if os.path.exists(path) else {}
  with open(path, "w") as f:
    json.dump({**saved, **choice}, f)
  return choice, rows, csv_rows


def _best_scale(late_by_scale: dict[float, float]) -> float:
  """The lr multiple with the best late accuracy; of equals, the lowest lr."""
  return max(sorted(late_by_scale), key=late_by_scale.get)


def _pm(values: list[float], digits: int = 3) -> str:
  return cmp.fmt_pm(values, digits) if len(values) > 1 else f"{values[0]:.{digits}f}"


def _sweep_header(ctx: Context, first: str) -> list[str]:
  per_seed = [] if len(ctx.sweep_seeds) == 1 else ["late acc by seed"]
  return [first, "lr", "x config lr", "late acc"] + per_seed + ["final acc", "train s"]


def sweep(ctx: Context) -> list[str]:
  choice, rows, csv_rows = _sweep_grid(ctx, {m: (LABELS[m], m, []) for m in ctx.methods}, "")
  write_csv(os.path.join(ctx.workdir, "sweep.csv"), csv_rows)
  return ([f"lr sweep on {_seeds_text(ctx.sweep_seeds)}: each method's config lr times 1/3, 1, 3, extended by x3 past "
           "a best end until the best is interior; chosen by the mean accuracy on the validation problems "
           f"({'none: the test problems' if ctx.task not in VALIDATION else 'not the test problems'}) of the "
           "evaluations in the last quarter of the rollout steps (over the seeds).", ""]
          + _table(_sweep_header(ctx, "method"), rows) + ["", "chosen: " + ", ".join(
              f"{LABELS[m]} x{s:.3g}" + (" (at the grid's edge)" if _at_edge(csv_rows, LABELS[m], s) else "")
              for m, s in choice.items()),
              "for the task's config (a plain run of each method then gets it): " + ", ".join(
              f"optim.lr_by_algo.{m} = {_base(ctx, m, 0, s).config().optim.lr:.3g}" for m, s in choice.items())])


def _at_edge(csv_rows: list[dict], label: str, scale: float) -> bool:
  """Whether a sweep's choice is its grid's lowest or highest lr multiple (the grid stopped growing)."""
  scales = [r["lr_scale"] for r in csv_rows if r["method"] == label]
  return scale in (min(scales), max(scales))


def chosen_scales(ctx: Context) -> tuple[dict[str, float], str]:
  choice, how = _load_choice(ctx, "")
  if choice:
    return choice, f"the lr sweep's choice ({how})"
  return {m: 1.0 for m in ctx.methods}, "each config's lr (no sweep in this work directory)"


def _seed_specs(ctx: Context, method: str, overrides=(), lr_scale: float | None = None) -> list[RunSpec]:
  """`method` with `overrides`, one run per seed, at `lr_scale` (default: the lr sweep's choice)."""
  if lr_scale is None:
    lr_scale = chosen_scales(ctx)[0].get(method, 1.0)
  return [_base(ctx, method, s, lr_scale, overrides) for s in ctx.seeds]


def _main_specs(ctx: Context) -> dict[str, list[RunSpec]]:
  """The main table's runs: every method at its chosen lr, one per seed."""
  return {m: _seed_specs(ctx, m) for m in ctx.methods}


def main_runs(ctx: Context) -> dict[str, list[cmp.RunSummary]]:
  return {LABELS[m]: _runs(ctx, specs) for m, specs in _main_specs(ctx).items()}


def _target(groups: dict[str, list[cmp.RunSummary]]) -> float:
  """The accuracy every time-to-target is read at: 95% of the best method's mean final accuracy."""
  return 0.95 * max(cmp.mean_std([r.final_acc for r in runs])[0] for runs in groups.values())


def _reference_accuracy(groups: dict[str, list[cmp.RunSummary]]) -> float:
  """pi_ref's held-out accuracy for the plots' dashed line: every run's step-0 evaluation, averaged."""
  return cmp.mean_std([r.curve[0][2] for runs in groups.values() for r in runs])[0]


def _time_to_target(runs: list[cmp.RunSummary], target: float) -> tuple[list[float], str]:
  """Per seed the time to `target` (a whole run's time where never reached) and the table's cell for it."""
  t, missed = cmp.time_to_threshold(runs, target)
  return t, cmp.fmt_pm(t, 0) + (f" ({missed}/{len(runs)} not reached)" if missed else "")


def main_table(ctx: Context) -> list[str]:
  groups = main_runs(ctx)
  _, how = chosen_scales(ctx)
  target = _target(groups)
  rows, csv_rows = [], []
  for label, runs in groups.items():
    t, to_target = _time_to_target(runs, target)
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
  cmp.plot_bands(groups, _reference_accuracy(groups), os.path.join(ctx.workdir, "comparison.png"),
                 f"{ctx.task} ({ctx.size})", metric=TASKS[ctx.task][1])
  a_runs = groups.get("A*-PO")
  ratio_rows = [[label, cmp.paired_ratio(a_runs, runs, target, ("A*-PO", label))] for label, runs in groups.items()
                if a_runs and label != "A*-PO"]
  return ([f"lr: {how}. Target: 95% of the best method's mean final accuracy = {target:.3f}. Seeds: {ctx.seeds}. "
           "Training time: Σ per-step wall times + Stage 1 (A*-PO); a seed that never reaches the target counts its "
           "whole training time (marked). Memory: peak RSS of the run's process, and the compiled per-device bytes "
           "(this backend) of the update step / the scoring forward / the sampler (formula).", ""]
          + _table(["method", "lr", "final acc", "s to target", "Stage-1 share", "train s",
                    "sampling share: median step / mean", "k tokens sampled", "KL seq", "peak RSS MB", "update / score / sample MiB"], rows)
          + ["", "A*-PO time to target ÷ the method's, per seed (mean ± std over the seeds where both reach it):", ""]
          + _table(["method", "A*-PO ÷ method"], ratio_rows))


def _main_target_if_run(ctx: Context) -> float | None:
  """The main table's target when every main run of these seeds is already in the work directory (a
  question study never launches the other methods' runs just for this column)."""
  specs = [sp for specs in _main_specs(ctx).values() for sp in specs]
  if not all(os.path.exists(os.path.join(run_dir_of(sp, ctx.workdir), "result.json")) for sp in specs):
    return None
  return _target(main_runs(ctx))


def _variant_table(ctx: Context, variants: list[tuple[str, list[tuple[str, object]]]]):
  rows, csv_rows = [], []
  target = _main_target_if_run(ctx)
  for label, overrides in variants:
    runs = _runs(ctx, _seed_specs(ctx, "astarpo", overrides))
    t, to_target = _time_to_target(runs, target) if target is not None else ([None] * len(runs), "-")
    rows.append([label, cmp.fmt_pm([r.final_acc for r in runs]), to_target, cmp.fmt_pm([r.total_s for r in runs], 0),
                 cmp.fmt_pm([r.stage1_s for r in runs], 0), cmp.fmt_pm([r.extra["kl_seq"] for r in runs], 3)])
    csv_rows += [{"variant": label, "seed": r.seed, "final_acc": r.final_acc, "time_to_target_s": tt,
                  "total_s": r.total_s, "stage1_s": r.stage1_s, "kl_seq": r.extra["kl_seq"]} for r, tt in zip(runs, t)]
  return rows, csv_rows, target


def _astarpo_value(ctx: Context, field: str):
  section, key = field.split(".")
  return _base(ctx, "astarpo").config()[section][key]


def _variants(ctx: Context, field: str, values) -> list[tuple[str, list]]:
  """(label, overrides) per value; the config's own value gets no override, so the main runs are reused."""
  own = _astarpo_value(ctx, field)
  return [(f"{field}={v}", [] if v == own else [(field, v)]) for v in values]


def _study(ctx: Context, name: str, intro: str, variants) -> list[str]:
  rows, csv_rows, target = _variant_table(ctx, variants)
  write_csv(os.path.join(ctx.workdir, f"{name}.csv"), csv_rows)
  where = (f"s to target: the main table's, {target:.3f}; a seed that never reaches it counts its whole training "
           "time (marked)." if target is not None else "s to target: - (the main table's runs are not in this "
                                                           "work directory).")
  return [intro, where, ""] + _table(["A*-PO with", "final acc", "s to target", "train s (with Stage 1)",
                                      "Stage 1 s", "KL seq"], rows)


def _stronger_beta2(ctx: Context) -> float:
  """beta2 / 5: a regression target (r - V*) / beta2 five times larger, which Adam's normalised steps chase
  further from pi_ref (the beta study's variant, and the budget study's second A*-PO row)."""
  return _astarpo_value(ctx, "algo.beta2") / 5


def beta(ctx: Context) -> list[str]:
  b2, b1, stronger_b2 = _astarpo_value(ctx, "algo.beta2"), _astarpo_value(ctx, "stage1.beta1"), _stronger_beta2(ctx)
  values = list(dict.fromkeys([b2, 0.5, 0.0]))
  # the paper's split: beta1 = 1/2 for V*, beta2 = 1e-3 in the loss (scripts/apo_math.sh)
  split = [("algo.beta2", 1e-3)] + ([] if b1 == 0.5 else [("stage1.beta1", 0.5)])
  stronger = [(f"algo.beta2={stronger_b2:g} (the config's β1)", [("algo.beta2", stronger_b2)])]
  # both changes that helped on their own (docs/comparison.md at 8a436ea, run 5): do they add up?
  combined = [(f"stage1.beta1=0, algo.beta2={stronger_b2:g}",
               ([] if b1 == 0.0 else [("stage1.beta1", 0.0)]) + [("algo.beta2", stronger_b2)])]
  return _study(ctx, "beta", f"β2 = {b2} (the task config's); β1 = β2, the paper's β1 = 1/2, β1 = 0 (V* = the "
                "pass rate), the paper's split β1 = 1/2 with β2 = 1e-3, β2 / 5, and β1 = 0 with β2 / 5.",
                _variants(ctx, "stage1.beta1", values)
                + [("stage1.beta1=0.5, algo.beta2=0.001 (the paper's split)", split)] + stronger + combined)


def filtering(ctx: Context) -> list[str]:
  return _study(ctx, "filter", "Training on every prompt (V* = 0 where Stage 1 saw no success) against dropping "
                "them (stage1.drop_all_fail).", _variants(ctx, "stage1.drop_all_fail", [False, True]))


def n_samples(ctx: Context) -> list[str]:
  return _study(ctx, "n_samples", "Stage 1's N: more samples cost Stage-1 time and sharpen V*.",
                _variants(ctx, "stage1.n_samples", [2, 4, 8, 16]))


def falsifier(ctx: Context) -> list[str]:
  return falsifier_study.run(ctx, main_runs, chosen_scales(ctx)[0])


def budget(ctx: Context) -> list[str]:
  """The main table stops every method at the same number of rollout steps, where A*-PO has spent a fraction
  of the others' time; here A*-PO runs k x the steps, and its time to the main table's target (Stage 1
  included) is set against each method's from the main runs, seed by seed."""
  groups = main_runs(ctx)
  target = _target(groups)
  steps = _astarpo_value(ctx, "train.num_steps")
  rows, csv_rows = [], []

  def row(label: str, runs: list[cmp.RunSummary]) -> None:
    t, to_target = _time_to_target(runs, target)
    rows.append([label, cmp.fmt_pm([r.final_acc for r in runs]), to_target, cmp.fmt_pm([r.total_s for r in runs], 0),
                 cmp.fmt_pm([r.extra["kl_seq"] for r in runs], 3)])
    csv_rows.extend({"run": label, "seed": r.seed, "final_acc": r.final_acc, "time_to_target_s": tt,
                     "total_s": r.total_s, "kl_seq": r.extra["kl_seq"]} for r, tt in zip(runs, t))

  for k in sorted(BUDGET_MULTIPLES):  # k = 1: the main runs themselves (no override, the same specs)
    overrides = _steps_overrides(k * steps) if k > 1 else []
    runs = _runs(ctx, _seed_specs(ctx, "astarpo", overrides))
    row(f"A*-PO, {k * steps} steps", runs)
    longest = runs  # the last multiple's runs: the ratios below
  # the beta study's beta2 / 5, given the same longest budget: does the setting that lifted A*-PO's 50-step
  # accuracy also bring it to the target sooner?
  b2 = _stronger_beta2(ctx)
  stronger = _runs(ctx, _seed_specs(ctx, "astarpo", [("algo.beta2", b2)] + overrides))
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
          + _table(["run", "final acc", "s to target", "train s (with Stage 1)", "KL seq"], rows)
          + ["", f"A*-PO with {max(BUDGET_MULTIPLES) * steps} steps: time to target ÷ the method's (main runs), per "
             "seed (mean ± std over the seeds where both reach it):", ""]
          + _table(["method", "A*-PO ÷ method", f"A*-PO with β2 = {b2:g} ÷ method"], ratios))


def _steps_overrides(num_steps: int) -> list[tuple[str, int]]:
  """A run of `num_steps` rollout steps (one checkpoint, at its end)."""
  return [("train.num_steps", num_steps), ("train.checkpoint_every", num_steps)]


STRONGER = "astarpo_stronger_beta2"  # the long studies' key for A*-PO with beta2 / 5


def _long_groups(ctx: Context) -> dict[str, tuple[str, str, list]]:
  """The long studies' runs, key -> (label, method, overrides): every method at k x the rollout steps, and
  A*-PO with beta2 / 5 as well."""
  k, steps = max(BUDGET_MULTIPLES), _astarpo_value(ctx, "train.num_steps")
  longer = _steps_overrides(k * steps)
  groups = {m: (f"{LABELS[m]}, {k * steps} steps", m, longer) for m in ctx.methods}
  if "astarpo" in ctx.methods:
    b2 = _stronger_beta2(ctx)
    groups[STRONGER] = (f"A*-PO with β2 = {b2:g}, {k * steps} steps", "astarpo", [("algo.beta2", b2)] + longer)
  return groups


def long_sweep(ctx: Context) -> list[str]:
  """The lr sweep again at the long study's steps: a method whose best lr over 50 steps is too timid (or
  too bold) for 150 would be handicapped there. Its choice is what `long` then uses."""
  groups = _long_groups(ctx)
  choice, rows, csv_rows = _sweep_grid(ctx, groups, "_long")
  write_csv(os.path.join(ctx.workdir, "long_sweep.csv"), csv_rows)
  labels = {key: label for key, (label, _, _) in groups.items()}
  short, _ = _short_scales(ctx)
  moved = [labels[key] for key, s in choice.items() if s != short.get(key, 1.0)]
  seed0_path = _lr_choice_path(ctx, "_long", (0,))
  seed0 = json.load(open(seed0_path)) if tuple(ctx.sweep_seeds) != (0,) and os.path.exists(seed0_path) else None
  return ([f"lr sweep at the long study's steps, {_seeds_text(ctx.sweep_seeds)}: config lr times 1/3, 1, 3, chosen by "
           "the mean held-out accuracy of the evaluations in the last quarter of the rollout steps over the seeds "
           "(used by --study=long).", ""]
          + _table(_sweep_header(ctx, "run"), rows)
          + ["", "chosen: " + ", ".join(f"{labels[key]} x{s:.3g}" for key, s in choice.items()),
             "differs from the main sweep's choice: " + (", ".join(moved) if moved else "none")]
          + ([] if seed0 is None else ["differs from seed 0's long choice: " + (", ".join(
              labels[key] for key, s in choice.items() if key in seed0 and s != seed0[key]) or "none")]))


def _short_scales(ctx: Context) -> tuple[dict[str, float], str]:
  """The (50-step) lr sweep's choice by long-study key: A*-PO's for A*-PO with beta2 / 5."""
  scales, how = chosen_scales(ctx)
  return {**scales, STRONGER: scales.get("astarpo", 1.0)}, how


def _long_scales(ctx: Context) -> tuple[dict[str, float], str]:
  """The long sweep's choice for the runs it swept, the lr sweep's for any other."""
  scales, how = _short_scales(ctx)
  choice, long_how = _load_choice(ctx, "_long")
  if not choice:
    return scales, how
  return {**scales, **choice}, f"the long lr sweep's choice ({long_how}; for runs it did not sweep: {how})"


def long_budget(ctx: Context) -> list[str]:
  """The budget study's target is 95% of the others' 50-step accuracy, which they may pass with more steps.
  Here every method trains k x the steps, the target is 95% of the best mean final accuracy among these
  runs, and A*-PO's time to it (config beta2 and beta2 / 5; the budget study's own runs) is set against
  each method's, seed by seed."""
  k, steps = max(BUDGET_MULTIPLES), _astarpo_value(ctx, "train.num_steps")
  scales, how = _long_scales(ctx)
  groups, method_of = {}, {}
  for key, (label, method, overrides) in _long_groups(ctx).items():
    groups[label] = _runs(ctx, _seed_specs(ctx, method, overrides, scales.get(key, 1.0)))
    method_of[label] = LABELS[method]
  target = _target(groups)
  rows, csv_rows = [], []
  for label, runs in groups.items():
    t, to_target = _time_to_target(runs, target)
    late = [cmp.late_accuracy(r.curve, r.steps) for r in runs]
    rows.append([label, f"{runs[0].lr:.3g}", cmp.fmt_pm([r.final_acc for r in runs]), cmp.fmt_pm(late), to_target,
                 cmp.fmt_pm([r.total_s for r in runs], 0), cmp.fmt_pm([r.extra["kl_seq"] for r in runs], 3)])
    csv_rows += [{"run": label, "seed": r.seed, "lr": r.lr, "final_acc": r.final_acc, "late_acc": la,
                  "time_to_target_s": tt, "total_s": r.total_s, "kl_seq": r.extra["kl_seq"]}
                 for r, la, tt in zip(runs, late, t)]
  write_csv(os.path.join(ctx.workdir, "long.csv"), csv_rows)
  cmp.plot_bands(groups, _reference_accuracy(groups), os.path.join(ctx.workdir, "long.png"),
                 f"{ctx.task} ({ctx.size}), {k * steps} steps, seeds {ctx.seeds}", metric=TASKS[ctx.task][1],
                 target=target)
  mine = [label for label in groups if method_of[label] == LABELS["astarpo"]]
  ratios = [[label] + [cmp.paired_ratio(groups[a], runs, target, (LABELS["astarpo"], method_of[label])) for a in mine]
            for label, runs in groups.items() if label not in mine]
  return ([f"Every method at {k * steps} rollout steps ({k}x the main table's); lr: {how}. Target: 95% of the best "
           f"mean final accuracy among these runs = {target:.3f}; a seed that never reaches it counts its whole "
           "training time (marked). late acc: mean of the evaluations in the last quarter of the steps. Seeds: "
           + str(ctx.seeds) + ".", ""]
          + _table(["run", "lr", "final acc", "late acc", "s to target", "train s (with Stage 1)", "KL seq"], rows)
          + ["", "Time to target ÷ the method's, per seed (mean ± std over the seeds where both reach it):", ""]
          + _table(["method"] + [f"{a} ÷ method" for a in mine], ratios))
