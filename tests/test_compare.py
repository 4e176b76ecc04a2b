"""experiments/compare.py end to end on the chains task's CI size: the warm-started reference built once,
A*-PO (with Stage 1) and GRPO run as subprocesses on the same prompts, the main table, its CSV and the plot
written; a second call reuses the runs (cached by their spec and key). The end-to-end test runs a snapshot of the
checkout, so edits made to the training code while it runs (a shared working tree) do not change the key."""
import csv
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _snapshot(workdir) -> str:
  """A copy of the package, configs and scripts under `workdir`/_src (made once): the code the runs' key hashes."""
  src = os.path.join(workdir, "_src")
  if not os.path.exists(src):
    for d in ("astarpo_jax", "configs", "experiments"):
      shutil.copytree(os.path.join(ROOT, d), os.path.join(src, d), ignore=shutil.ignore_patterns("__pycache__"))
  return src


def _compare(workdir, *extra):
  src = _snapshot(workdir)
  cmd = [sys.executable, os.path.join(src, "experiments", "compare.py"), f"--workdir={workdir}", "--task=chains",
         "--size=test", "--methods=astarpo,grpo", "--seeds=1", *extra]
  env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=src)
  return subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True, timeout=900)


def test_compare_runs_the_main_table_of_two_methods_and_reuses_its_runs(tmp_path, monkeypatch):
  from astarpo_jax.comparison import cache_key, runs as runs_lib
  # this process reads the runs as the snapshot's code (its in-process lookups below)
  monkeypatch.setitem(runs_lib._CODE, runs_lib.ROOT, cache_key.code_hash(_snapshot(tmp_path)))
  got = _compare(tmp_path, "--study=main")
  assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
  rows = list(csv.DictReader(open(tmp_path / "main.csv")))
  assert sorted(r["method"] for r in rows) == ["A*-PO", "GRPO"] and {r["seed"] for r in rows} == {"1"}
  for r in rows:
    assert 0.0 <= float(r["final_acc"]) <= 1.0 and float(r["train_s"]) > 0 and int(float(r["tokens"])) > 0
    assert (float(r["stage1_s"]) > 0) == (r["method"] == "A*-PO")  # only A*-PO pays Stage 1
  table = open(tmp_path / "comparison.md").read()
  assert "## main" in table and "| A*-PO |" in table and "| GRPO |" in table and "A*-PO ÷ method" in table
  assert os.path.getsize(tmp_path / "comparison.png") > 0
  runs = sorted(os.listdir(tmp_path / "runs"))
  again = _compare(tmp_path, "--study=main")
  assert again.returncode == 0 and sorted(os.listdir(tmp_path / "runs")) == runs
  assert not any(line.startswith(("astarpo_", "grpo_")) for line in again.stdout.splitlines())  # no run reran
  budget = _compare(tmp_path, "--study=budget")  # A*-PO at 3x the steps; its 1x row is the main run, reused
  assert budget.returncode == 0, budget.stdout[-3000:] + budget.stderr[-3000:]
  new_runs = [line for line in budget.stdout.splitlines() if line.startswith(("astarpo_", "grpo_"))]
  assert [r.split("_")[:5] for r in new_runs] == [["astarpo", "s1", "lr1", "num", "steps6"],
                                                  ["astarpo", "s1", "lr1", "beta20.1", "num"]], new_runs
  rows = list(csv.DictReader(open(tmp_path / "budget.csv")))
  assert [r["run"] for r in rows] == ["A*-PO, 2 steps", "A*-PO, 6 steps", "A*-PO with β2 = 0.1, 6 steps",
                                      "GRPO, 2 steps"]
  main_astarpo = next(r for r in csv.DictReader(open(tmp_path / "main.csv")) if r["method"] == "A*-PO")
  assert float(rows[0]["final_acc"]) == float(main_astarpo["final_acc"])
  assert "## budget" in open(tmp_path / "comparison.md").read()
  # a question study's time-to-target column reads the main table's target from the main runs already there,
  # and launches no other method's run for it (in process: the config variant reuses the main A*-PO run)
  from astarpo_jax.comparison import context as cx, headline, questions
  ctx = cx.Context(str(tmp_path), "chains", "test", ["astarpo", "grpo"], [1], False, lambda s: None, "")
  target = headline.main_target_if_run(ctx)
  main = list(csv.DictReader(open(tmp_path / "main.csv")))
  assert target == 0.95 * max(float(r["final_acc"]) for r in main)
  _, csv_rows, got_target = questions.variant_table(ctx, [("the config", [])])
  assert got_target == target and csv_rows[0]["time_to_target_s"] == float(main_astarpo["time_to_target_s"])
  assert headline.main_target_if_run(dataclasses.replace(ctx, seeds=[2])) is None  # seed 2's main runs: absent
  assert sorted(os.listdir(tmp_path / "runs")) == sorted(runs + [r.split(":")[0] for r in new_runs])
  # the CI-size reference solves no prompt: Stage-1 filtering leaves nothing to train on, a clear error
  filt = _compare(tmp_path, "--study=filter")
  assert filt.returncode != 0
  log = open(next(tmp_path.glob("runs/astarpo_s1_lr1_drop_all_failTrue_*/worker.log"))).read()
  assert "fewer than one rollout batch" in log and "drop_all_fail removed" in log, log[-2000:]
  # --quick (the main table and the falsifier) end to end at this size: the main runs reused, pi_ref's coverage
  # drawn, every final policy evaluated on the prompts it never solved
  quick = _compare(tmp_path, "--quick")
  assert quick.returncode == 0, quick.stdout[-3000:] + quick.stderr[-3000:]
  assert not any(line.startswith(("astarpo_", "grpo_")) for line in quick.stdout.splitlines())  # no run reran
  page = open(tmp_path / "comparison.md").read()
  assert "## falsifier" in page and "| 128 |" in page and "never solved, held-out" in page
  rows = list(csv.DictReader(open(tmp_path / "falsifier.csv")))
  assert {(r["policy"], r["seed"]) for r in rows} == {("A*-PO", "1"), ("GRPO", "1")}
  assert {r["set"].split(" ")[0] for r in rows} <= {"training", "held-out"}
  for r in rows:
    assert 0.0 <= float(r["before"]) <= 1.0 and 0.0 <= float(r["after"]) <= 1.0 and int(r["prompts"]) >= 1


def test_a_run_refuses_a_config_that_does_not_evaluate_the_tasks_metric():
  sys.path.insert(0, ROOT)
  from astarpo_jax.comparison.runs import TASKS, RunSpec
  assert TASKS["chains"][1] == "chains/avg@8"  # the config's data.avg_k below must match it
  assert RunSpec("chains", "test").config().data.avg_k == 8
  with pytest.raises(ValueError, match="avg@8"):
    RunSpec("chains", "test", overrides=(("data.avg_k", 4),)).config()
  with pytest.raises(ValueError, match="avg_k_sets"):
    RunSpec("chains", "test", overrides=(("data.avg_k_sets", ()),)).config()


def test_time_ratio_pairs_seeds_where_both_reach_the_target_and_counts_the_rest():
  from astarpo_jax.comparison import summary as cmp

  def run(seed, curve):  # (seconds, step, accuracy) evaluations; the other fields do not enter the ratio
    return cmp.RunSummary("m", seed, 1e-5, 0.0, curve[-1][0], 10, curve, curve[-1][2], 0, {}, {})
  a = [run(1, [(0, 0, .4), (10, 5, .6)]), run(2, [(0, 0, .4), (30, 5, .5)]), run(3, [(0, 0, .4), (8, 5, .7)])]
  b = [run(1, [(0, 0, .4), (20, 5, .6)]), run(2, [(0, 0, .4), (40, 5, .6)]), run(3, [(0, 0, .4), (40, 5, .7)])]
  # seed 1: 10 / 20; seed 2: A never reaches 0.55 (left out, not its 30 s); seed 3: 8 / 40
  assert cmp.paired_ratio(a, b, 0.55) == "0.35 ± 0.21 (2/3 seeds where both reach it)"  # sample std of 0.5, 0.2
  assert cmp.paired_ratio(a, b, 0.8).startswith("n/a: no seed where both reach it after training (A 0/3, B 0/3)")
  already = [run(s, [(0, 0, .6), (5, 5, .6)]) for s in (1, 2, 3)]  # B at the target before training: no ratio
  assert cmp.paired_ratio(a, already, 0.55).startswith("n/a")
  with pytest.raises(ValueError, match="by seed"):
    cmp.paired_ratio(a[:1], b[1:2], 0.55)


def test_long_study_reads_its_target_from_the_longer_runs_and_pairs_seeds(tmp_path, monkeypatch):
  """Hand-worked: GRPO's mean final 0.66 is the best, so the target is 0.627; GRPO reaches it at 60 s (seed 1)
  and 40 s (seed 2), A*-PO with beta2 / 5 at 20 s in both (ratios 1/3 and 1/2), the config's A*-PO never."""
  sys.path.insert(0, ROOT)
  from astarpo_jax.comparison import budgets, context as cx, questions, summary as cmp
  ctx = cx.Context(str(tmp_path), "chains", "test", ["astarpo", "grpo"], [1, 2], False, lambda s: None, "")
  steps = 3 * cx.astarpo_value(ctx, "train.num_steps")
  evals = {("astarpo", False): {1: [(10, .5)], 2: [(12, .5)]},  # (training seconds, held-out accuracy)
           ("astarpo", True): {1: [(5, .6), (20, .63)], 2: [(5, .58), (20, .63)]},
           ("grpo", False): {1: [(30, .6), (60, .64)], 2: [(40, .63), (60, .68)]}}
  beta2_seen = set()

  def fake_runs(ctx, specs):
    out = []
    for sp in specs:
      over = dict(sp.overrides)
      assert over["train.num_steps"] == steps and over["train.checkpoint_every"] == steps
      if "algo.beta2" in over:
        beta2_seen.add(over["algo.beta2"])
      ev = evals[(sp.method, "algo.beta2" in over)][sp.seed]
      curve = [(0.0, 0, .4)] + [(float(t), steps * (i + 1) // len(ev), a) for i, (t, a) in enumerate(ev)]
      out.append(cmp.RunSummary(sp.method, sp.seed, sp.config().optim.lr, 0.0, curve[-1][0], steps, curve, curve[-1][2], 0, {},
                                {"kl_seq": 0.1}))
    return out
  monkeypatch.setattr(cx, "runs", fake_runs)
  lines = budgets.long_budget(ctx)
  assert "= 0.627" in "\n".join(lines)
  assert beta2_seen == {questions.stronger_beta2(ctx)}
  grpo_row, ratio_row = [line for line in lines if line.startswith("| GRPO")]
  assert "| 50 ± 14 |" in grpo_row  # times to target 60 and 40 s
  assert "n/a: no seed where both reach it after training (A*-PO 0/2, GRPO 2/2)" in ratio_row  # the config's A*-PO
  assert "0.42 ± 0.12 (2/2 seeds where both reach it)" in ratio_row  # beta2 / 5: 20/60 and 20/40
  assert os.path.exists(tmp_path / "long.csv")


def test_long_sweep_chooses_each_runs_lr_by_late_accuracy_and_the_long_study_runs_at_it(tmp_path, monkeypatch):
  """Hand-worked: late accuracies per lr multiple (1/3, 1, 3) of A*-PO 0.50 / 0.45 / 0.10, of A*-PO with
  beta2 / 5 0.40 / 0.50 / 0.50 (a tie: the lower lr) and of GRPO 0.30 / 0.50 / 0.60 (0 past the ends, which
  the grid tries once each) choose x1/3, x1 and x3; without a 50-step sweep in the directory every method's
  earlier choice is x1, so two moved."""
  sys.path.insert(0, ROOT)
  from astarpo_jax.comparison import budgets, context as cx, summary as cmp, sweep as sweeps
  ctx = cx.Context(str(tmp_path), "chains", "test", ["astarpo", "grpo"], [1], False, lambda s: None, "")
  steps = 3 * cx.astarpo_value(ctx, "train.num_steps")
  late = {("astarpo", False): (.5, .45, .1), ("astarpo", True): (.4, .5, .5), ("grpo", False): (.3, .5, .6)}
  ran = []

  def fake_runs(ctx, specs):
    out = []
    for sp in specs:
      key = (sp.method, "algo.beta2" in dict(sp.overrides))
      ran.append((key, sp.seed, sp.lr_scale))
      acc = dict(zip(sweeps.LR_SCALES, late[key])).get(sp.lr_scale, 0.0)  # past the grid's ends: 0
      curve = [(0.0, 0, .4), (10.0, steps - 1, acc), (20.0, steps, acc)]  # both evaluations in the last quarter
      out.append(cmp.RunSummary(sp.method, sp.seed, sp.config().optim.lr, 0.0, 20.0, steps, curve, acc, 0, {}, {"kl_seq": 0.1}))
    return out
  monkeypatch.setattr(cx, "runs", fake_runs)
  lines = "\n".join(budgets.long_sweep(ctx))
  assert sweeps.saved_scales(tmp_path / "lr_choice_long_chains_test.json") == {
      "astarpo": 1 / 3, "grpo": 3.0, budgets.STRONGER: 1.0}
  assert "differs from the main sweep's choice: A*-PO, 150 steps, GRPO, 150 steps".replace("150", str(steps)) in lines
  assert {seed for _, seed, _ in ran} == {0}
  ran.clear()
  lines = "\n".join(budgets.long_budget(ctx))
  assert sorted(ran) == sorted([(("astarpo", False), 1, 1 / 3), (("grpo", False), 1, 3.0), (("astarpo", True), 1, 1.0)])
  assert "lr: the long lr sweep's choice" in lines


def test_a_sweep_over_several_seeds_chooses_by_their_mean_and_the_long_study_runs_at_it(tmp_path, monkeypatch):
  """Hand-worked: A*-PO's late accuracy at lr x1/3, x1, x3 is 0.50 / 0.45 / 0.10 on seed 0 (its choice: x1/3)
  and 0.40 / 0.55 / 0.10 on seed 7, means 0.45 / 0.50 / 0.10: over seeds 0 and 7 it chooses x1. GRPO, swept
  on seed 0 only (x3), keeps that choice. The seed-0 file stays as it was."""
  sys.path.insert(0, ROOT)
  from astarpo_jax.comparison import budgets, context as cx, summary as cmp, sweep as sweeps
  from astarpo_jax.comparison.runs import parse_sweep_seeds
  steps = None
  late = {("astarpo", 0): (.5, .45, .1), ("astarpo", 7): (.4, .55, .1), ("grpo", 0): (.3, .5, .6)}
  ran = []

  def fake_runs(ctx, specs):
    out = []
    for sp in specs:
      ran.append((sp.method, sp.seed, sp.lr_scale))
      acc = dict(zip(sweeps.LR_SCALES, late.get((sp.method, sp.seed), (.5, .5, .5)))).get(sp.lr_scale, 0.0)
      curve = [(0.0, 0, .4), (10.0, steps - 1, acc), (20.0, steps, acc)]
      out.append(cmp.RunSummary(sp.method, sp.seed, sp.config().optim.lr, 0.0, 20.0, steps, curve, acc, 0, {}, {"kl_seq": 0.1}))
    return out
  monkeypatch.setattr(cx, "runs", fake_runs)
  ctx0 = cx.Context(str(tmp_path), "chains", "test", ["grpo"], [1], False, lambda s: None, "")
  steps = 3 * cx.astarpo_value(ctx0, "train.num_steps")
  budgets.long_sweep(ctx0)  # seed 0, GRPO only
  ctx0a = dataclasses.replace(ctx0, methods=["astarpo"])
  monkeypatch.setattr(budgets, "long_groups", lambda ctx: {"astarpo": ("A*-PO", "astarpo", [])}
                      if ctx.methods == ["astarpo"] else {"grpo": ("GRPO", "grpo", [])})
  budgets.long_sweep(ctx0a)  # seed 0, A*-PO: x1/3
  ctx = dataclasses.replace(ctx0a, sweep_seeds=(0, 7))
  ran.clear()
  lines = "\n".join(budgets.long_sweep(ctx))
  assert sorted(ran) == sorted(("astarpo", s, x) for s in (0, 7) for x in sweeps.LR_SCALES)
  assert sweeps.saved_scales(tmp_path / "lr_choice_long_seeds0-7_chains_test.json") == {"astarpo": 1.0}
  assert sweeps.saved_scales(tmp_path / "lr_choice_long_chains_test.json") == {"grpo": 3.0, "astarpo": 1 / 3}
  assert "| A*-PO | 3e-05 | 1 | 0.500 | 0.450 / 0.550 |" in lines  # the test config's lr
  assert "differs from seed 0's long choice: A*-PO" in lines
  scales, how = budgets.long_scales(dataclasses.replace(ctx, methods=["astarpo", "grpo"]))
  assert scales["astarpo"] == 1.0 and scales["grpo"] == 3.0
  assert "seed 0 for 2 run(s); seeds 0, 7 for 1 run(s)" in how
  assert parse_sweep_seeds("0,7,8", [1, 2, 3]) == (0, 7, 8)
  for bad in ("0,1", "0,0", "x", "-1"):
    with pytest.raises(SystemExit):
      parse_sweep_seeds(bad, [1, 2, 3])


def test_the_sweep_extends_its_grid_until_the_best_lr_is_interior_and_runs_on_the_validation_problems(tmp_path,
                                                                                                       monkeypatch):
  """Hand-worked: A*-PO's late accuracy rises as the lr falls down to x1/9 (x1/3 .30, x1 .20, x3 .10, x1/9 .40,
  x1/27 .35): the grid grows by x1/9 and x1/27 and chooses x1/9, interior. GRPO's rises without end (x3^k: .1k
  + .2): the grid stops after two steps past x3 and takes x27, said to be at its edge."""
  sys.path.insert(0, ROOT)
  from astarpo_jax.comparison import context as cx, summary as cmp, sweep as sweeps
  ctx = cx.Context(str(tmp_path), "chains", "test", ["astarpo", "grpo"], [1], False, lambda s: None, "",
                        sweep_seeds=(0, 4))
  steps = cx.astarpo_value(ctx, "train.num_steps")
  late = {"astarpo": {1 / 3: .3, 1.0: .2, 3.0: .1, 1 / 9: .4, 1 / 27: .35},
          "grpo": {1 / 3: .1, 1.0: .2, 3.0: .3, 9.0: .4, 27.0: .5}}
  ran, heldout = [], set()

  def fake_runs(ctx, specs):
    out = []
    for sp in specs:
      ran.append((sp.method, sp.seed, round(sp.lr_scale, 6)))
      heldout.add(sp.config().data.chains.heldout)
      acc = late[sp.method][min(late[sp.method], key=lambda x: abs(x - sp.lr_scale))]
      curve = [(0.0, 0, .4), (10.0, steps, acc)]
      out.append(cmp.RunSummary(sp.method, sp.seed, sp.config().optim.lr, 0.0, 20.0, steps, curve, acc, 0, {}, {"kl_seq": 0.1}))
    return out
  monkeypatch.setattr(cx, "runs", fake_runs)
  lines = "\n".join(sweeps.sweep(ctx))
  choice = sweeps.saved_scales(tmp_path / "lr_choice_seeds0-4_chains_test.json")
  assert choice == pytest.approx({"astarpo": 1 / 9, "grpo": 27.0})
  assert sorted(ran) == sorted([("astarpo", s, round(x, 6)) for s in (0, 4) for x in late["astarpo"]]
                               + [("grpo", s, round(x, 6)) for s in (0, 4) for x in late["grpo"]])
  assert heldout == {"val"}  # the sweep never reads the test problems
  assert "GRPO x27 (at the grid's edge)" in lines and "A*-PO x0.111," in lines
  assert "optim.lr_by_algo.astarpo = 3.33e-06" in lines  # the test variant's 3e-5 x 1/9


def test_pack_rows_flag_sets_every_runs_config_and_keeps_its_runs_apart(tmp_path):
  sys.path.insert(0, ROOT)
  from astarpo_jax.comparison import context as cx
  ctx = cx.Context(str(tmp_path), "chains", "test", ["astarpo"], [1], False, lambda s: None, "")
  packed = dataclasses.replace(ctx, overrides=(("train.pack_rows", True),))
  padded = dataclasses.replace(ctx, overrides=(("train.pack_rows", False),))
  plain, spec = cx.base(padded, "astarpo", 1), cx.base(packed, "astarpo", 1, overrides=(("algo.beta2", 0.1),))
  assert not plain.config().train.pack_rows and spec.config().train.pack_rows and spec.config().algo.beta2 == 0.1
  assert spec.name.startswith("astarpo_s1_lr1_pack_rowsTrue_beta20.1_") and plain.name != spec.name


def test_sampling_share_of_a_step_is_the_median_steps_so_compile_steps_do_not_lower_it():
  """Hand-worked: steps 2..5 sample 1 s of 4 (share 0.25) except step 4, which compiles its update (1 of 11 s);
  step 1 (the first compile) is left out. The mean phases (sample 1, ref 1, update 15 / 4) give 4 / 23 of a
  step; the median step's share is 0.25."""
  from astarpo_jax.comparison import summary as cmp

  def row(step, sample, update):
    return {"step": step, "train/sec_step": sample + 1 + update, "train/sec_sample": sample, "train/sec_ref": 1.0,
            "train/sec_update": update, "train/response_length": 10.0}
  rows = [row(1, 9.0, 30.0), row(2, 1.0, 2.0), row(3, 1.0, 2.0), row(4, 1.0, 9.0), row(5, 1.0, 2.0)]
  run = cmp.summarize("A*-PO", 1, 1e-5, {"times_s": {}, "reference_acc": 0.4, "final_acc": 0.5}, rows, [],
                      "chains/avg@8", 2)
  assert run.phase_s["sample"] == 1.0 and run.phase_s["update"] == 15.0 / 4
  assert abs(run.phase_s["sample"] / sum(run.phase_s.values()) - 4 / 23) < 1e-12
  assert run.sample_share_median == 0.25


def test_equal_time_gives_astarpo_grpos_whole_run_time_in_whole_epochs_and_reads_its_accuracy_at_that_time(
    tmp_path, monkeypatch):
  """Hand-worked, the CI size (64 prompts, 16 per rollout: 4 steps an epoch; the main runs 2 steps): A*-PO's main
  runs take 1 s a step after a 3 s Stage 1, GRPO's whole runs 30 and 40 s, so A*-PO gets 35 s: (35 - 3) / 1 = 32
  steps, 8 epochs. Its longer runs evaluate every 8 steps; seed 1 at 1 s a step reaches step 32 at 35 s (0.60),
  seed 2 at 1.2 s a step is at step 24 by then (0.55), against GRPO's finals 0.58 and 0.62; the curves of
  the longer runs and GRPO's are plotted with the main target."""
  sys.path.insert(0, ROOT)
  from astarpo_jax.comparison import budgets, context as cx, summary as cmp
  ctx = cx.Context(str(tmp_path), "chains", "test", ["astarpo", "grpo"], [1, 2], False, lambda s: None, "")
  grpo_total, grpo_final, s_per_step = {1: 30.0, 2: 40.0}, {1: .58, 2: .62}, {1: 1.0, 2: 1.2}
  longer_steps = []

  def fake_runs(ctx, specs):
    out = []
    for sp in specs:
      steps = dict(sp.overrides).get("train.num_steps", 2)
      if sp.method == "grpo":
        curve = [(0.0, 0, .4), (grpo_total[sp.seed], 2, grpo_final[sp.seed])]
        out.append(cmp.RunSummary("GRPO", sp.seed, 1e-5, 0.0, grpo_total[sp.seed], 2, curve, curve[-1][2], 0, {},
                                  {"kl_seq": 0.2}))
        continue
      per = 1.0 if steps == 2 else s_per_step[sp.seed]
      if steps != 2:
        longer_steps.append(steps)
      curve = [(3.0, 0, .4)] + [(3.0 + per * k, k, .4 + .05 * k / 8) for k in range(8, steps + 1, 8)]
      out.append(cmp.RunSummary("A*-PO", sp.seed, 1e-5, 3.0, per * steps, steps, curve, curve[-1][2], 0, {},
                                {"kl_seq": 0.1}))
    return out
  monkeypatch.setattr(cx, "runs", fake_runs)
  lines = "\n".join(budgets.equal_time(ctx))
  assert longer_steps == [32, 32]
  assert "fit 32 rollout steps (8 epochs over the same prompts)" in lines
  assert "0.575 ± 0.035 (step 32, 24)" in lines  # accuracies at 35 s: 0.60 and 0.55
  assert "+0.020, -0.070 (mean -0.025)" in lines
  # the main target, 95% of GRPO's mean final 0.60 = 0.570: the longer runs pass it at step 32 (35 s and 41.4 s),
  # GRPO's at their ends (30 and 40 s); the main A*-PO runs (0.40) never, counting their whole 5 s
  assert "s to the main target (0.570)" in lines
  assert "| 38 ± 5 |" in lines and "| 35 ± 7 |" in lines and "5 ± 0 (2/2 not reached)" in lines
  assert (tmp_path / "equal_time.png").exists()
  rows = list(csv.DictReader(open(tmp_path / "equal_time.csv")))
  assert [float(r["acc_at_budget"]) for r in rows] == pytest.approx([.6, .55])


def test_coverage_counts_a_prompt_never_solved_at_n_from_its_first_n_samples_and_bounds_its_vstar_gap():
  """Hand-worked: four prompts of 128 samples, first passing at sample 0, 20, 100 and never: never solved at
  N = 8, 32, 128 are 3/4, 2/4, 1/4. A prompt never solved in 128 has p < 3/128 at 95%, so with beta1 = 1/2 its
  V* = 0 is at most 0.5 ln(1 + 3/128 (e^2 - 1)) = 0.0698 low; with beta1 = 0 (V* = p) at most 3/128."""
  import numpy as np

  from astarpo_jax.comparison import falsifier
  passed = np.zeros((4, 128), bool)
  passed[0, 0] = passed[1, 20] = passed[2, 100] = True
  assert [falsifier.never_solved_share(passed, n) for n in (8, 32, 128)] == [.75, .5, .25]
  assert falsifier.vstar_gap_bound(128, 0.5) == pytest.approx(0.0698, abs=1e-4)
  assert falsifier.vstar_gap_bound(128, 0.0) == pytest.approx(3 / 128)


def test_the_beta_study_runs_each_pair_once_and_the_filtered_run_keeps_the_steps_not_the_epochs():
  """At the paper protocol's beta1 = 1/2, beta2 = 1e-3 the paper's split is the config itself (one run, no
  override), beta1 = beta2 = 1e-3 and beta2 / 5 = 2e-4 differ. The filtered run takes the config's 100 rollout
  steps over the prompts it keeps: as many updates as the unfiltered run (no step override), more epochs."""
  sys.path.insert(0, ROOT)
  from astarpo_jax.comparison import context as cx, questions
  pairs = [(x1, x2) for _, x1, x2 in questions.beta_pairs(0.5, 1e-3)]
  assert pairs == [(.5, 1e-3), (1e-3, 1e-3), (0.0, 1e-3), (.5, .5), (.5, 2e-4)]
  ctx = cx.Context("/nonexistent", "chains", "paper", ["astarpo"], [1], False, lambda s: None, "")
  assert questions.filter_overrides(ctx, 32, True) == [("stage1.drop_all_fail", True), ("stage1.n_samples", 32)]
  assert questions.filter_overrides(ctx, 8, True) == [("stage1.drop_all_fail", True)]
  assert questions.filter_overrides(ctx, 8, False) == []  # the config's N, every prompt: the main run


def test_a_saved_lr_choice_is_reread_against_the_config_so_writing_it_there_does_not_apply_it_twice(tmp_path):
  """A sweep at a config lr of 9e-5 chose x1/3 (3e-5); the CI-size config holds 3e-5 for A*-PO, so the choice now
  reads as x1, not x1/3 again; one made at today's config lr keeps its multiple; a bare multiple (an older file)
  is read as it is."""
  sys.path.insert(0, ROOT)
  from astarpo_jax.comparison import context as cx, sweep as sweeps
  ctx = cx.Context(str(tmp_path), "chains", "test", ["astarpo", "grpo"], [1], False, lambda s: None, "")
  assert cx.base(ctx, "astarpo").config().optim.lr == pytest.approx(3e-5)
  with open(sweeps.lr_choice_path(ctx, ""), "w") as f:
    json.dump({"astarpo": {"lr_scale": 1 / 3, "lr": 3e-5, "method": "astarpo"},
               "grpo": {"lr_scale": 3.0, "lr": 9e-5, "method": "grpo"}, "rloo": 3.0}, f)
  scales, _ = sweeps.chosen_scales(ctx)
  assert scales == pytest.approx({"astarpo": 1.0, "grpo": 3.0, "rloo": 3.0})


def test_a_finished_run_is_reused_under_a_new_config_lr_when_its_recorded_lr_is_the_same(tmp_path, monkeypatch):
  """The CI-size config gives A*-PO 3e-5. A run done as x3 of an earlier 1e-5 recorded lr 3e-5: the spec at x1 of
  today's config is that run (no subprocess); one that recorded 1e-5, or none, or other overrides, is not."""
  sys.path.insert(0, ROOT)
  from astarpo_jax.comparison import cache_key, runs as runs_lib
  spec = runs_lib.RunSpec("chains", "test", "astarpo", 1, 1.0, (("train.pack_rows", True),))
  assert spec.config().optim.lr == pytest.approx(3e-5)
  ref = tmp_path / "reference_chains_test" / "reference"
  ref.mkdir(parents=True)
  (ref / "config.json").write_text("{}")
  (ref / "model.safetensors").write_bytes(b"weights")
  key = runs_lib.key_now(spec, str(tmp_path))
  new_dir = str(tmp_path / "runs" / f"{spec.name}_{cache_key.short(key)}")

  def finished(name: str, lr_scale: float, lr: float | None, overrides=(("train.pack_rows", True),)) -> str:
    d = tmp_path / "runs" / name
    d.mkdir(parents=True)
    done = {"spec": {"task": "chains", "size": "test", "method": "astarpo", "seed": 1, "lr_scale": lr_scale,
                     "overrides": [list(o) for o in overrides]}, "key": key}
    if lr is not None:
      done["lr"] = lr
    (d / "result.json").write_text(json.dumps(done))
    return str(d)

  assert runs_lib.run_dir_of(spec, str(tmp_path)) == new_dir  # nothing done yet
  finished("astarpo_s1_lr1_old", 1.0, None)  # before the lr was recorded
  finished("astarpo_s1_lr3_at1e-5", 3.0, 1e-5)  # x3 of 3.33e-6: 1e-5, not this spec's lr
  finished("astarpo_s1_lr3_other", 3.0, 3e-5, overrides=(("train.pack_rows", False),))
  assert runs_lib.run_dir_of(spec, str(tmp_path)) == new_dir
  same = finished("astarpo_s1_lr3_same", 3.0, 3e-5)
  assert runs_lib.run_dir_of(spec, str(tmp_path)) == same

  def no_run(*a, **k):
    raise AssertionError("a run was started")
  monkeypatch.setattr(runs_lib.subprocess, "call", no_run)
  run_dir, result = runs_lib.ensure_run(spec, str(tmp_path), False, lambda s: None)
  assert run_dir == same and result["lr"] == pytest.approx(3e-5)
