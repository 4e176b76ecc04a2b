"""The lr sweeps: each method (or study group) at lr multiples {1/3, 1, 3} of its config lr, the grid grown past a
best end until the best is interior, chosen on the task's validation problems over the sweep seeds, and the choice
kept in the work directory for the tables' runs."""
from __future__ import annotations

import json
import math
import os

from astarpo_jax.comparison import context as cx, summary as cmp
from astarpo_jax.comparison.context import Context
from astarpo_jax.comparison.runs import LABELS, LR_SCALES, write_csv

MAX_EXTEND = 2  # the lr grid grows by at most this many x3 steps past either end before the edge is accepted
# task -> the overrides that evaluate a run on the task's validation problems (the sweeps' runs)
VALIDATION = {"chains": (("data.chains.heldout", "val"),)}


def lr_choice_path(ctx: Context, which: str = "", seeds: tuple[int, ...] | None = None) -> str:
  """Where a sweep's choice is kept: one file per sweep and set of sweep seeds (seed 0 alone: no suffix)."""
  seeds = ctx.sweep_seeds if seeds is None else seeds
  tag = "" if tuple(seeds) == (0,) else "_seeds" + "-".join(str(s) for s in seeds)
  return os.path.join(ctx.workdir, f"lr_choice{which}{tag}_{ctx.task}_{ctx.size}.json")


def load_choice(ctx: Context, which: str) -> tuple[dict[str, float], str]:
  """The sweep's choice on seed 0, updated by the one on `ctx.sweep_seeds` for the runs that sweep covered, as lr
  multiples of each method's config lr today: a choice saved with its lr is re-read against the config, so
  writing the chosen lr into the task's config (optim.lr_by_algo) does not apply the multiple twice."""
  choice, how = {}, []
  for seeds in dict.fromkeys([(0,), tuple(ctx.sweep_seeds)]):
    path = lr_choice_path(ctx, which, seeds)
    if os.path.exists(path):
      got = json.load(open(path))
      choice.update({key: _scale_now(ctx, v) for key, v in got.items()})
      how.append(f"{cx.seeds_text(seeds)} for {len(got)} run(s)")
  return choice, "; ".join(how)


def _scale_now(ctx: Context, saved) -> float:
  """A saved choice as a multiple of its method's config lr: {"lr_scale", "lr", "method"}, or a bare multiple
  (files written before the lr was kept)."""
  if not isinstance(saved, dict):
    return float(saved)
  now = cx.base(ctx, saved["method"]).config().optim.lr
  return saved["lr_scale"] if math.isclose(saved["lr"], saved["lr_scale"] * now, rel_tol=1e-6) else round(saved["lr"] / now, 9)


def saved_scales(path: str) -> dict[str, float]:
  """The lr multiples in a choice file, as chosen (relative to the config lr of the sweep's time)."""
  return {k: v["lr_scale"] if isinstance(v, dict) else float(v) for k, v in json.load(open(path)).items()}


def chosen_scales(ctx: Context) -> tuple[dict[str, float], str]:
  """Each method's lr multiple for the tables: the sweep's choice where this work directory has one."""
  choice, how = load_choice(ctx, "")
  if choice:
    return choice, f"the lr sweep's choice ({how})"
  return {m: 1.0 for m in ctx.methods}, "each config's lr (no sweep in this work directory)"


def sweep_grid(ctx: Context, groups: dict[str, tuple[str, str, list]], which: str) -> tuple[dict, list, list]:
  """Each group (key -> label, method, overrides) at lr {1/3, 1, 3} x its config lr on every sweep seed, the grid
  extended by x3 steps past whichever end is best until the best is interior (at most MAX_EXTEND steps a side);
  the choice by the mean over those seeds of the late accuracy (the last quarter's evaluations) on the task's
  validation problems where it has them (never the test problems the tables report), saved as
  lr_choice<which>[_seeds...]_*.json (merged into the choices already there for other groups)."""
  seeds = list(ctx.sweep_seeds)
  choice, saved_lr, rows, csv_rows = {}, {}, [], []
  for key, (label, method, overrides) in groups.items():
    late_by_scale: dict[float, float] = {}
    lr_of: dict[float, float] = {}
    overrides = list(overrides) + list(VALIDATION.get(ctx.task, ()))

    def run_scale(scale: float) -> None:
      runs = cx.runs(ctx, [cx.base(ctx, method, seed, scale, overrides) for seed in seeds])
      late = [cmp.late_accuracy(r.curve, r.steps) for r in runs]
      late_by_scale[scale], lr_of[scale] = sum(late) / len(late), runs[0].lr
      per_seed = [] if len(seeds) == 1 else [" / ".join(f"{x:.3f}" for x in late)]
      rows.append([label, f"{runs[0].lr:.3g}", f"{scale:.3g}", f"{late_by_scale[scale]:.3f}"] + per_seed
                  + [cx.pm([r.final_acc for r in runs]), cx.pm([r.total_s for r in runs], 0)])
      csv_rows.extend({"method": label, "seed": r.seed, "lr": r.lr, "lr_scale": scale, "late_acc": la,
                       "final_acc": r.final_acc, "total_s": r.total_s} for r, la in zip(runs, late))

    for scale in LR_SCALES:
      run_scale(scale)
    for _ in range(2 * MAX_EXTEND):
      best = best_scale(late_by_scale)
      lo, hi = min(late_by_scale), max(late_by_scale)
      if best not in (lo, hi) or (best == lo and lo <= min(LR_SCALES) / 3 ** MAX_EXTEND) or (
          best == hi and hi >= max(LR_SCALES) * 3 ** MAX_EXTEND):
        break
      run_scale(lo / 3 if best == lo else hi * 3)
    choice[key] = best_scale(late_by_scale)
    saved_lr[key] = {"lr_scale": choice[key], "lr": lr_of[choice[key]], "method": method}
  path = lr_choice_path(ctx, which)
  saved = json.load(open(path)) if os.path.exists(path) else {}
  with open(path, "w") as f:
    json.dump({**saved, **saved_lr}, f)
  return choice, rows, csv_rows


def best_scale(late_by_scale: dict[float, float]) -> float:
  """The lr multiple with the best late accuracy; of equals, the lowest lr."""
  return max(sorted(late_by_scale), key=late_by_scale.get)


def at_edge(csv_rows: list[dict], label: str, scale: float) -> bool:
  """Whether a sweep's choice is its grid's lowest or highest lr multiple (the grid stopped growing)."""
  scales = [r["lr_scale"] for r in csv_rows if r["method"] == label]
  return scale in (min(scales), max(scales))


def sweep_header(ctx: Context, first: str) -> list[str]:
  per_seed = [] if len(ctx.sweep_seeds) == 1 else ["late acc by seed"]
  return [first, "lr", "x config lr", "late acc"] + per_seed + ["final acc", "train s"]


def sweep(ctx: Context) -> list[str]:
  choice, rows, csv_rows = sweep_grid(ctx, {m: (LABELS[m], m, []) for m in ctx.methods}, "")
  write_csv(os.path.join(ctx.workdir, "sweep.csv"), csv_rows)
  return ([f"lr sweep on {cx.seeds_text(ctx.sweep_seeds)}: each method's config lr times 1/3, 1, 3, extended by x3 "
           "past a best end until the best is interior; chosen by the mean accuracy on the validation problems "
           f"({'none: the test problems' if ctx.task not in VALIDATION else 'not the test problems'}) of the "
           "evaluations in the last quarter of the rollout steps (over the seeds).", ""]
          + cx.table(sweep_header(ctx, "method"), rows) + ["", "chosen: " + ", ".join(
              f"{LABELS[m]} x{s:.3g}" + (" (at the grid's edge)" if at_edge(csv_rows, LABELS[m], s) else "")
              for m, s in choice.items()),
              "for the task's config (a plain run of each method then gets it): " + ", ".join(
              f"optim.lr_by_algo.{m} = {cx.base(ctx, m, 0, s).config().optim.lr:.3g}" for m, s in choice.items())])
