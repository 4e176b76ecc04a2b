"""The comparison's falsifier study: how much of the task does pi_ref cover, and does A*-PO improve less than the
baselines on the prompts pi_ref never solves? (Its V* is 0 there: the regression target is the bare reward, and
the method's no-exploration argument does not cover them.)

Coverage: pi_ref's samples at temperature 1 (Stage 1's draw): N = 128 on the training prompts; on a held-out pool
(the test problems and HELDOUT_EXTRA x as many drawn past the validation ones) 32 each, and 96 more for those none
of the 32 solved, so one draw gives the never-solved shares at N = 8, 32 and 128. For a prompt never solved in N
samples, p < 3/N at 95% (the rule of three), so its V* = 0 is at most beta1 * ln(1 + 3/N (e^(1/beta1) - 1)) below
the true one.
Falsifier: on the prompts never solved in 128 samples (training ones, and up to HELDOUT_MAX held-out ones; fewer
than MIN_PROMPTS is said), avg@8 of pi_ref and of each policy (the main runs', and the long and k-sample runs'
where the work directory has them), its gain, and the gain divided by the policy's overall gain on the test set
(final - pi_ref's avg@8 under the run's key): a method that learns less everywhere is not singled out.
"""
from __future__ import annotations

import math
import os
import shutil

import numpy as np

from astarpo_jax.comparison import summary as cmp
from astarpo_jax.comparison.runs import LABELS, RunSpec, _code_hash, ensure_run, reference_dir, run_dir_of, write_csv

N_REF, N_COVER, COVER_AT, K, MIN_PROMPTS, MAX_PROMPTS = 32, 128, (8, 32, 128), 8, 50, 96
HELDOUT_MAX = 100  # held-out never-solved prompts evaluated
HELDOUT_EXTRA = 31  # chains: x the test problems past the validation ones (a pool of 3,200: ~58 never solved in 128)


def _pool_config(c) -> tuple[object, int, int]:
  """(config, the table's number of test problems, validation problems after them): for chains, one test set of
  the test problems, the validation problems and HELDOUT_EXTRA x num_test more (the validation ones are left
  out later)."""
  if "chains" not in c.data:
    return c, 0, 0
  ch = c.data.chains
  num_test, num_val = int(ch.num_test), int(ch.get("num_val", 0))
  ch.heldout, ch.num_test = "test", num_test + num_val + HELDOUT_EXTRA * num_test
  c.data.num_test = 0
  return c, num_test, num_val


def pass_matrix(setup, prompts, n: int, work: str, seed: int) -> np.ndarray:
  """[P, n] bool: pi_ref's n samples of each prompt (Stage 1's draw at its temperature), passed or not."""
  from astarpo_jax.stage1 import estimate
  draw = estimate.rollout_draw(setup.cfg, setup.ref_params, setup.scfg, setup.tokenizer, setup.graders.stage1,
                               setup.loop.sample_max_batch, setup.mesh)
  table = estimate.run_stage1(prompts, draw, out_dir=work, n_samples=n, beta1=0.5, chunk_prompts=64, seed=seed,
                              pass_threshold=setup.pass_threshold, log=lambda s: None, progress=False)
  return np.array([[r >= setup.pass_threshold for r in table.records[p.uid]["rewards"]] for p in prompts], bool)


def never_solved_share(passed_PN: np.ndarray, n: int) -> float:
  """The share of prompts none of whose first n samples passed."""
  return float((~passed_PN[:, :n].any(axis=1)).mean())


def vstar_gap_bound(n: int, beta1: float) -> float:
  """How far below the true V* the estimate 0 of a prompt never solved in n samples can be, at 95%: p < 3/n."""
  return beta1 * math.log1p(min(3 / n, 1.0) * math.expm1(1 / beta1)) if beta1 > 0 else min(3 / n, 1.0)


def coverage(ctx, spec: RunSpec):
  """(setup, training passes [P, N_COVER], held-out pool, held-out passes [Q, N_COVER] where the first N_REF
  failed, else [Q, N_REF] padded with passes): the draws live in a directory named by the training code."""
  from astarpo_jax import experiment
  work = os.path.join(ctx.workdir, f"falsifier_{ctx.task}_{ctx.size}_{_code_hash()[:6]}")
  if not os.path.exists(os.path.join(work, "reference")):
    shutil.copytree(os.path.join(reference_dir(ctx.workdir, ctx.task, ctx.size, ctx.log), "reference"),
                    os.path.join(work, "reference"))
  c, num_test, num_val = _pool_config(spec.config())
  setup = experiment.build(c, work, log=lambda s: None)
  train = pass_matrix(setup, setup.train_prompts, N_COVER, os.path.join(work, f"train_n{N_COVER}"), 1000)
  pool = next(iter(setup.test_sets.values()))
  heldout = pool[:num_test] + pool[num_test + num_val:] if num_val else pool
  first = pass_matrix(setup, heldout, N_REF, os.path.join(work, f"heldout{len(heldout)}_n{N_REF}"), 1001)
  unsolved = [i for i, row in enumerate(first) if not row.any()]
  full = np.concatenate([first, np.ones((len(heldout), N_COVER - N_REF), bool)], axis=1)
  if unsolved:
    more = pass_matrix(setup, [heldout[i] for i in unsolved], N_COVER - N_REF,
                       os.path.join(work, f"heldout{len(heldout)}_more{N_COVER - N_REF}"), 1002)
    full[unsolved, N_REF:] = more
  return setup, train, heldout, full


def never_solved(prompts, passed_PN: np.ndarray, n: int, limit: int) -> list:
  """The first `limit` prompts none of whose first n samples passed."""
  return [p for p, row in zip(prompts, passed_PN) if not row[:n].any()][:limit]


def avg_at_k(setup, params, prompts) -> float:
  import jax

  from astarpo_jax.training import evaluate
  return evaluate.evaluate(setup.cfg, params, prompts, setup.tokenizer, setup.graders.eval[0][1], setup.scfg,
                           jax.random.key(11), k=K)["accuracy"]


def _coverage_lines(train_PN: np.ndarray, heldout_PN: np.ndarray, beta1: float) -> list[str]:
  rows = []
  for n in COVER_AT:
    held = f"{never_solved_share(heldout_PN, n):.3f}" if n <= heldout_PN.shape[1] else "-"
    rows.append(f"| {n} | {never_solved_share(train_PN, n):.3f} | {held} | {3 / n:.3f} "
                f"| {vstar_gap_bound(n, beta1):.3f} |")
  return ([f"π_ref's coverage: the share of the {len(train_PN)} training prompts (and of {len(heldout_PN)} held-out "
           "ones) none of whose first N samples passed; for such a prompt p < 3/N at 95%, and its V* = 0 is at most "
           f"the last column below the true V* (β1 = {beta1:g}).", "",
           "| N | never solved, training | never solved, held-out | p bound (95%) | V* gap bound |",
           "|---|---|---|---|---|"]
          + rows + [""])


def policies(ctx, scales: dict[str, float], extra_groups: dict[str, list[RunSpec]]) -> dict[str, list[tuple]]:
  """label -> [(seed, export dir, overall gain)]: the main runs (launched if missing) and every extra group whose
  runs are all in the work directory (never launched here)."""
  out = {}
  groups = {LABELS[m]: [RunSpec(ctx.task, ctx.size, m, s, scales.get(m, 1.0), tuple(ctx.overrides)) for s in ctx.seeds]
            for m in ctx.methods}
  for label, specs in extra_groups.items():
    if all(os.path.exists(os.path.join(run_dir_of(sp, ctx.workdir, ctx.code_id), "result.json")) for sp in specs):
      groups[label] = specs
  for label, specs in groups.items():
    rows = []
    for spec in specs:
      run_dir, result = ensure_run(spec, ctx.workdir, False, ctx.log, ctx.cache_dir, ctx.code_id)
      export = os.path.join(run_dir, "export")
      if not os.path.exists(os.path.join(export, "config.json")):  # a run cache restored without its exports
        if label in extra_groups:
          ctx.log(f"falsifier: {label} left out: {spec.name} has no exported policy (rerun that group to add it)")
          break
        if ctx.code_id and ctx.code_id != _code_hash():
          raise FileNotFoundError(f"{export}: {spec.name}'s final policy is not there (a run cache restored without "
                                  f"the runs' exports), and this checkout cannot rerun code {ctx.code_id}")
        ctx.log(f"falsifier: {spec.name} has no exported policy: rerun under the same key to export it")
        run_dir, result = ensure_run(spec, ctx.workdir, True, ctx.log, ctx.cache_dir, "")
        export = os.path.join(run_dir, "export")
      rows.append((spec.seed, export, result["final_acc"] - result["reference_acc"]))
    else:
      out[label] = rows
  return out


def normalised(gain: float, overall: float) -> float:
  """A gain on the never-solved prompts as a share of the policy's overall gain (nan where that is <= 0)."""
  return gain / overall if overall > 0 else math.nan


def run(ctx, main_runs, scales: dict[str, float], extra_groups: dict[str, list[RunSpec]] | None = None) -> list[str]:
  """`main_runs(ctx)` makes sure every main run exists; `scales`: each method's lr multiple (the sweep's choice);
  `extra_groups`: label -> specs of other policies to evaluate where their runs are done."""
  import jax

  from astarpo_jax.model import hf
  main_runs(ctx)  # make sure every final policy exists
  setup, train_PN, heldout, heldout_PN = coverage(ctx, RunSpec(ctx.task, ctx.size))
  beta1 = float(RunSpec(ctx.task, ctx.size).config().stage1.beta1)
  lines = _coverage_lines(train_PN, heldout_PN, beta1)
  sets = [(f"training prompts never solved in {N_COVER}", never_solved(setup.train_prompts, train_PN, N_COVER,
                                                                        MAX_PROMPTS)),
          (f"held-out prompts never solved in {N_COVER}", never_solved(heldout, heldout_PN, N_COVER, HELDOUT_MAX))]
  csv_rows = []
  with setup, jax.set_mesh(setup.mesh):
    pols = policies(ctx, scales, extra_groups or {})
    for name, prompts in sets:
      if not prompts:
        lines += [f"{name}: none, nothing to test on.", ""]
        continue
      before = avg_at_k(setup, setup.ref_params, prompts)
      rows = []
      for label, runs in pols.items():
        after, norm = [], []
        for seed, export, overall in runs:
          _, params = hf.load_hf(export, dtype=setup.cfg.dtype, param_dtype=setup.cfg.param_dtype)
          after.append(avg_at_k(setup, params, prompts))
          norm.append(normalised(after[-1] - before, overall))
          csv_rows.append({"set": name, "policy": label, "seed": seed, "prompts": len(prompts), "before": before,
                           "after": after[-1], "overall_gain": overall, "normalised_gain": norm[-1]})
        finite = [x for x in norm if math.isfinite(x)]
        rows.append(f"| {label} | {before:.3f} | {cmp.fmt_pm(after)} | {cmp.fmt_pm([a - before for a in after])} "
                    f"| {cmp.fmt_pm(finite, 2) if finite else 'n/a'} |")
      note = "" if len(prompts) >= MIN_PROMPTS else f" (fewer than the {MIN_PROMPTS} wanted: read with care)"
      lines += ([f"{len(prompts)} {name}{note}: avg@{K} before (π_ref) and after training, per policy, over its "
                 "seeds; normalised: the gain ÷ the policy's overall gain on the test set.", "",
                 "| policy | before | after | gain | gain ÷ overall gain |", "|---|---|---|---|---|"] + rows + [""])
  if csv_rows:
    write_csv(os.path.join(ctx.workdir, "falsifier.csv"), csv_rows)
  return lines
