"""The comparison's answer read on load-free axes (issue 52): A*-PO against GRPO by rollout steps, sampled responses,
sampled tokens and process CPU seconds; the per-step cost ratio at which A*-PO breaks even; plateaus and ties;
A*-PO with k samples a prompt; five seeds with tests by seed and by problem; the paper's KL beside the sequence KL.

  axes     time to each target on the four axes, the break-even ratio, the plateaus and their tie (long runs:
           A*-PO 756 steps = run 9's equal-time count, GRPO 300 = 75 epochs, A*-PO with k = 8 at 100)
  seeds    A*-PO and GRPO at 25 epochs over the evaluation seeds: final and late accuracy, π_ref under each seed's
           key, Welch / paired / tie by seed, the paired analysis per problem, the training KL beside the sequence KL
  samples  the lr sweep of A*-PO with k = 8 (the main sweep's rule and seeds); its choice is what axes uses
Wall seconds are reported beside, never as an axis: this machine is shared, so only CPU seconds, steps and samples
are free of load.
"""
from __future__ import annotations

import math
import os
import statistics

from astarpo_jax.comparison import context as cx, stats, summary as cmp
from astarpo_jax.comparison.context import Context
from astarpo_jax.comparison.headline import seed_specs
from astarpo_jax.comparison.runs import LABELS, TASKS, ensure_run, write_csv
from astarpo_jax.comparison.sweep import load_choice, sweep_grid, sweep_header

LONG_ASTARPO, LONG_GRPO, K_SAMPLES = 756, 300, 8
TARGETS = (0.45, 0.47, 0.494, 0.51)  # 0.494: run 9's (95% of GRPO's 25-epoch mean)
PAPER_RATIO = "0.46-0.55 (the paper, 4 x H100)"
PROJECTED_RATIO = "0.12-0.20 at the roofline, 0.14-0.24 modeled (docs/tpu.md 0b, compile-only projections)"
AXES = ("steps", "responses", "tokens", "cpu_s", "wall_s")


def run_axes(run_dir: str, result: dict) -> dict[str, list[float]]:
  """A run's evaluations on every axis: rollout step, sampled responses and tokens (Stage 1's included),
  process CPU seconds (Stage 1's included) and wall seconds, with the accuracy; step 0 is π_ref's."""
  train, evals = cmp.read_metrics(run_dir)
  stage1 = bool(result.get("needs_stage1"))
  s1 = result.get("stage1_summary") or {}
  at = {"responses": float(s1.get("num_samples", 0)) if stage1 else 0.0,
        "tokens": float(result.get("stage1_tokens", 0)) if stage1 else 0.0,
        "cpu_s": float(result.get("cpu_s", {}).get("stage1", 0.0)) if stage1 else 0.0,
        "wall_s": float(result["times_s"].get("stage1", 0.0)) if stage1 else 0.0}
  cum = {0: dict(at)}
  for m in train:
    at["responses"] += result["rows_per_step"]
    at["tokens"] += m["train/response_length"] * result["rows_per_step"]
    at["cpu_s"] += m.get("train/cpu_step", float("nan"))
    at["wall_s"] += m["train/sec_step"]
    cum[m["step"]] = dict(at)
  metric = "eval/" + TASKS[result["spec"]["task"]][1]
  out = {a: [] for a in AXES + ("acc",)}
  for step, acc in [(0, result["reference_acc"])] + [(e["step"], e[metric]) for e in evals if metric in e]:
    if step in cum:
      out["steps"].append(step)
      out["acc"].append(acc)
      for a in AXES[1:]:
        out[a].append(cum[step][a])
  # the paper's KL, one estimator for every method: the k1 token mean of log π − log π_ref on the training
  # rollouts (A*-PO's train/kl; a baseline's train/kl is its loss's k3 term, its k1 is train/kl_old_ref)
  kl_key = "train/kl_old_ref" if train and "train/kl_old_ref" in train[0] else "train/kl"
  # a step's cost: the median over steps 2..N (a step meeting a new shape compiles inside it), CPU and wall
  steady = train[1:] or train
  out_step = {a: statistics.median(m.get(k, math.nan) for m in steady) if steady else math.nan
              for a, k in (("cpu_s", "train/cpu_step"), ("wall_s", "train/sec_step"))}
  out["kl_train_late"] = [m[kl_key] for m in train if m["step"] > 0.75 * len(train)]
  out["step_median"] = out_step
  return out


def group_runs(ctx: Context, specs) -> list[tuple[cmp.RunSummary, dict, dict]]:
  """(summary, result, axes) of each run, launched unless cached."""
  from astarpo_jax.comparison.runs import summary_of
  out = []
  for spec in specs:
    run_dir, result = ensure_run(spec, ctx.workdir, ctx.fresh, ctx.log, ctx.cache_dir, ctx.code_id)
    out.append((summary_of(spec, run_dir, result), result, run_axes(run_dir, result)))
  return out


def k_scale(ctx: Context) -> float:
  """A*-PO with k samples' lr multiple: its sweep's choice, else A*-PO's own."""
  choice, _ = load_choice(ctx, "_k8")
  return choice.get("astarpo_k8", load_choice(ctx, "")[0].get("astarpo", 1.0))


def long_groups(ctx: Context) -> dict[str, list]:
  """The axes study's runs by label (the last is the GRPO the break-even ratio is read against)."""
  return {
      f"A*-PO, {LONG_ASTARPO} steps": seed_specs(ctx, "astarpo", cx.steps_overrides(LONG_ASTARPO)),
      f"A*-PO k = {K_SAMPLES}, 100 steps": seed_specs(ctx, "astarpo", [("algo.group_size", K_SAMPLES)], k_scale(ctx)),
      f"GRPO, {LONG_GRPO} steps": seed_specs(ctx, "grpo", cx.steps_overrides(LONG_GRPO)),
  }


def available_groups(ctx: Context) -> tuple[dict[str, list], list[str]]:
  """The axes study's groups with their runs, and the labels left pending: reprinting another code's results
  (ctx.code_id) reads only the groups whose runs are all there, with GRPO's main (100-step) runs as a stand-in
  for its long ones; otherwise every group runs."""
  from astarpo_jax.comparison.runs import _code_hash, run_dir_of
  wanted = dict(long_groups(ctx))
  if not ctx.code_id or ctx.code_id == _code_hash():
    return {label: group_runs(ctx, specs) for label, specs in wanted.items()}, []
  wanted["GRPO, 100 steps (25 epochs)"] = seed_specs(ctx, "grpo")
  done = {label: specs for label, specs in wanted.items() if all(
      os.path.exists(os.path.join(run_dir_of(sp, ctx.workdir, ctx.code_id), "result.json")) for sp in specs)}
  grpo = [label for label in done if label.startswith("GRPO")][:1]
  order = [label for label in done if not label.startswith("GRPO")] + grpo
  return {label: group_runs(ctx, done[label]) for label in order}, [label for label in wanted if label not in done]


def _finite_or(values: list[float], other: list[float]) -> tuple[list[float], str]:
  """`values` (CPU seconds) where all are finite, else `other` (wall seconds: results before cpu_step was kept)."""
  return (values, "CPU") if all(math.isfinite(v) for v in values) else (other, "wall")


def _reach_cell(values: list[float | None], digits: int = 0) -> str:
  if any(v is not None and not math.isfinite(v) for v in values):
    return "not recorded"
  hit = [v for v in values if v is not None]
  if not hit:
    return f"not reached (0/{len(values)})"
  return cmp.fmt_pm(hit, digits) + ("" if len(hit) == len(values) else f" ({len(hit)}/{len(values)})")


def axes(ctx: Context) -> list[str]:
  groups, pending = available_groups(ctx)
  rows, csv_rows, reach = [], [], {}
  for label, runs in groups.items():
    for target in TARGETS:
      cells = {}
      for a in AXES:
        cells[a] = [stats.first_reach(ax[a], ax["acc"], target) for _, _, ax in runs]
      reach[label, target] = cells
      scale = {"responses": 1e3, "tokens": 1e6}
      rows.append([label, f"{target:.3f}"] + [
          _reach_cell([None if v is None else v / scale.get(a, 1) for v in cells[a]], 2 if a in scale else 0)
          for a in AXES])
      csv_rows += [{"run": label, "seed": s.seed, "target": target, **{a: cells[a][i] for a in AXES}}
                   for i, (s, _, _) in enumerate(runs)]
  write_csv(os.path.join(ctx.workdir, "axes.csv"), csv_rows)
  a_label, g_label = next(iter(groups)), list(groups)[-1]
  per_step, clock = {}, "CPU"
  for label, runs in groups.items():
    vals, how = _finite_or([ax["step_median"]["cpu_s"] for _, _, ax in runs],
                           [ax["step_median"]["wall_s"] for _, _, ax in runs])
    per_step[label] = cmp.mean_std(vals)[0]
    clock = "wall" if how == "wall" else clock
  key = "cpu_s" if clock == "CPU" else "wall_s"
  stage1 = cmp.mean_std([ax[key][0] for _, _, ax in groups[a_label]])[0]
  s1_in_g = stage1 / per_step[g_label]
  be_rows = []
  for target in TARGETS:
    a_st, g_st = reach[a_label, target]["steps"], reach[g_label, target]["steps"]
    if None in a_st or None in g_st:
      be_rows.append([f"{target:.3f}", _reach_cell(a_st), _reach_cell(g_st), "n/a (a seed never reaches it)", "-"])
      continue
    a_mean, g_mean = sum(a_st) / len(a_st), sum(g_st) / len(g_st)
    be_rows.append([f"{target:.3f}", f"{a_mean:.0f}", f"{g_mean:.0f}", f"{stats.break_even_ratio(a_mean, g_mean):.2f}",
                    f"{stats.break_even_ratio(a_mean, g_mean, s1_in_g):.2f}"])
  measured = per_step[a_label] / per_step[g_label]
  plot_axes(groups, os.path.join(ctx.workdir, "axes.png"), clock)
  plateau_rows, plateaus = [], {}
  for label, runs in groups.items():
    ps = [stats.plateau(ax["steps"], ax["acc"]) for _, _, ax in runs]
    plateaus[label] = ps
    plateau_rows.append([label, cx.pm([p.mean for p in ps]), cx.pm([p.slope_per_100 for p in ps]),
                         cx.pm([p.slope_se for p in ps]), f"{sum(p.flat() for p in ps)}/{len(ps)}",
                         cx.pm([sum(ax["kl_train_late"]) / len(ax["kl_train_late"]) for _, _, ax in runs], 4),
                         cx.pm([s.extra["kl_seq"] for s, _, _ in runs])])
  ties = []
  for label in groups:
    if label != g_label and len(plateaus[label]) > 1:
      diffs = [a.mean - g.mean for a, g in zip(plateaus[label], plateaus[g_label], strict=True)]
      ties.append(f"- {label} − {g_label}, plateau by seed: " + stats.tie(diffs).text(("A*-PO", "GRPO")))
      last = max(max(ax["steps"]) for _, _, ax in groups[label])
      if last < min(max(ax["steps"]) for _, _, ax in groups[g_label]):  # a shorter run: GRPO at its steps too
        at = [stats.plateau(ax["steps"], ax["acc"], last_step=last) for _, _, ax in groups[g_label]]
        diffs = [a.mean - g.mean for a, g in zip(plateaus[label], at, strict=True)]
        ties.append(f"- {label} − {g_label} read at step {last} (GRPO's window {cx.pm([g.mean for g in at])}, the "
                    "same rollout steps): " + stats.tie(diffs).text(("A*-PO", "GRPO")))
  seeds = cx.seeds_text(ctx.seeds)
  return ([f"Time to each target on four axes ({seeds}; mean ± std over the seeds that reach it; responses in "
           "thousands, tokens in millions, Stage 1's samples and CPU included for A*-PO). CPU s: this process's "
           "user + system seconds (load-free but for cache effects); wall s: inflated by the shared machine's load, "
           "shown for reference only.", ""]
          + cx.table(["run", "target", "steps", "k responses", "M tokens", "CPU s", "wall s"], rows)
          + ["", f"Break-even: {a_label} reaches the target sooner than {g_label} only while its per-step cost is "
             "below GRPO steps ÷ A*-PO steps; with Stage 1 counted as "
             f"{s1_in_g:.1f} GRPO steps (its {clock} seconds ÷ GRPO's median step). Measured here: {measured:.2f} "
             f"({clock} seconds of the median step{', under each run' + chr(39) + 's load' if clock == 'wall' else ''}"
             "); beside "
             f"it {PAPER_RATIO} and {PROJECTED_RATIO}.", ""]
          + cx.table(["target", "A*-PO steps", "GRPO steps", "break-even ratio", "with Stage 1"], be_rows)
          + ["", f"Plateaus: the evaluations in the last quarter of each run's steps, their mean and least-squares "
             f"slope per 100 steps (± its standard error); flat: |slope| < 2 se or < {stats.TIE_MARGIN} per 100 "
             f"steps. Tie: the 90% t-interval of the difference inside ±{stats.TIE_MARGIN}. train KL: the paper's "
             "(k1 token mean of log π − log π_ref on the training rollouts, last quarter's mean; GRPO's k3 loss "
             "term is not it) beside the sequence KL on test prompts.", ""]
          + cx.table(["run", "plateau acc", "slope / 100 steps", "slope se", "flat", "train KL", "KL seq"],
                     plateau_rows)
          + [""] + ties + ([] if not pending else ["", "Pending (not run under this code yet): " + ", ".join(pending)]))


def plot_axes(groups: dict[str, list], path: str, clock: str, targets=TARGETS) -> None:
  """Held-out accuracy against rollout steps, sampled responses and `clock` seconds: per run the mean over seeds at
  each evaluation (mean x), a ±1 std band; dotted lines at the targets."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  key = "cpu_s" if clock == "CPU" else "wall_s"
  panels = [("steps", "rollout steps", 1), ("responses", "sampled responses (thousands)", 1e3),
            (key, f"{clock} seconds", 1)]
  fig, axs = plt.subplots(1, 3, figsize=(13, 4), sharey=True)
  for ax_, (axis, name, scale) in zip(axs, panels):
    for label, runs in groups.items():
      n = min(len(a["acc"]) for _, _, a in runs)
      xs = [cmp.mean_std([a[axis][i] / scale for _, _, a in runs])[0] for i in range(n)]
      acc = [cmp.mean_std([a["acc"][i] for _, _, a in runs]) for i in range(n)]
      line, = ax_.plot(xs, [m for m, _ in acc], lw=1.2, label=f"{label} ({len(runs)} seeds)")
      ax_.fill_between(xs, [m - s for m, s in acc], [m + s for m, s in acc], color=line.get_color(), alpha=0.2)
    for t in targets:
      ax_.axhline(t, color="black", lw=0.5, ls=":")
    ax_.set_xlabel(name)
    ax_.grid(alpha=0.3)
  axs[0].set_ylabel("held-out avg@8")
  axs[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def seeds_study(ctx: Context) -> list[str]:
  """A*-PO and GRPO at 25 epochs over every evaluation seed, tested by seed and by problem."""
  groups = {m: group_runs(ctx, seed_specs(ctx, m)) for m in ("astarpo", "grpo")}
  a, g = groups["astarpo"], groups["grpo"]
  rows, csv_rows = [], []
  for m, runs in groups.items():
    late = [cmp.late_accuracy(s.curve, s.steps) for s, _, _ in runs]
    kl_train = [sum(ax["kl_train_late"]) / len(ax["kl_train_late"]) for _, _, ax in runs]
    rows.append([LABELS[m], " / ".join(f"{s.final_acc:.3f}" for s, _, _ in runs),
                 cx.pm([s.final_acc for s, _, _ in runs]),
                 cx.pm(late), " / ".join(f"{r['reference_acc']:.3f}" for _, r, _ in runs), cx.pm(kl_train, 4),
                 cx.pm([s.extra["kl_seq"] for s, _, _ in runs])])
    csv_rows += [{"method": LABELS[m], "seed": s.seed, "final_acc": s.final_acc, "late_acc": la,
                  "reference_acc": r["reference_acc"], "kl_train_late": kt, "kl_seq": s.extra["kl_seq"]}
                 for (s, r, _), la, kt in zip(runs, late, kl_train)]
  write_csv(os.path.join(ctx.workdir, "seeds.csv"), csv_rows)
  final = {m: [s.final_acc for s, _, _ in runs] for m, runs in groups.items()}
  late = {m: [cmp.late_accuracy(s.curve, s.steps) for s, _, _ in runs] for m, runs in groups.items()}
  tests = []
  for name, vals in (("final", final), ("late-window mean", late)):
    diffs = [x - y for x, y in zip(vals["astarpo"], vals["grpo"], strict=True)]
    tests.append(f"- {name}: A*-PO − GRPO by seed " + stats.tie(diffs).text(("A*-PO", "GRPO"))
                 + f"; Welch p = {stats.welch_p(vals['astarpo'], vals['grpo']):.3f}, paired by seed p = "
                 f"{stats.paired_p(vals['astarpo'], vals['grpo']):.3f}")
  k = 8
  if all("final_per_problem" in r for _, r, _ in a + g):
    ra = stats.per_problem_rates([r["final_per_problem"] for _, r, _ in a], k)
    rg = stats.per_problem_rates([r["final_per_problem"] for _, r, _ in g], k)
    ref = stats.per_problem_rates([r["reference_per_problem"] for _, r, _ in a + g], k)
    higher, lower, equal = stats.problem_counts(ra, rg)
    tests.append(f"- per problem ({len(ra)} problems x {k} samples x {len(a)} seeds, the same problems): "
                 "A*-PO − GRPO "
                 + stats.tie([x - y for x, y in zip(ra, rg)]).text(("A*-PO", "GRPO"))
                 + f"; paired p = {stats.paired_p(ra, rg):.3f}; A*-PO higher on {higher}, lower on {lower}, equal on "
                 f"{equal}; π_ref's rate over all seeds' keys {sum(ref) / len(ref):.3f}")
  else:
    tests.append("- per problem: n/a (results written before per-problem sums were kept)")
  return ([f"A*-PO and GRPO at 25 epochs, {cx.seeds_text(ctx.seeds)}. late: the mean of the last quarter's "
           "evaluations; π_ref: its avg@8 under each seed's evaluation key; train KL: the paper's (k1 token mean of "
           "log π − log π_ref on the training rollouts, last quarter). Tie: the 90% interval inside "
           f"±{stats.TIE_MARGIN}.", ""]
          + cx.table(["method", "final by seed", "final", "late", "π_ref by seed", "train KL", "KL seq"], rows)
          + [""] + tests)


def samples(ctx: Context) -> list[str]:
  """A*-PO with k = 8 samples a prompt, its lr swept by the main sweep's rule on the sweep seeds."""
  group = {"astarpo_k8": (f"A*-PO k = {K_SAMPLES}", "astarpo", [("algo.group_size", K_SAMPLES)])}
  choice, rows, csv_rows = sweep_grid(ctx, group, "_k8")
  write_csv(os.path.join(ctx.workdir, "samples_sweep.csv"), csv_rows)
  return ([f"lr sweep of A*-PO with k = {K_SAMPLES} on {cx.seeds_text(ctx.sweep_seeds)} (validation problems, late "
           "accuracy, the main sweep's grid and rule).", ""] + cx.table(sweep_header(ctx, "run"), rows)
          + ["", f"chosen: x{choice['astarpo_k8']:.3g} of A*-PO's config lr (used by --study=axes)"])
