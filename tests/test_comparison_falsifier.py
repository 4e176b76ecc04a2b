"""The falsifier's selection and normalisation (astarpo_jax/comparison/falsifier.py), hand-worked."""
import math

import numpy as np
import pytest

from astarpo_jax.comparison import falsifier


def test_never_solved_in_128_takes_prompts_that_fail_the_first_32_and_the_96_drawn_after():
  """Held-out passes as coverage() builds them: 32 samples each, 96 more only where the 32 all failed (the rest
  padded with passes). Prompt a passes at sample 3, b at sample 40 (in the extra 96), c never, d never: the
  never-solved-in-128 set is c, d; at N = 32 it is b, c, d; a limit keeps the first ones in order."""
  full = np.ones((4, 128), bool)
  full[:, :32] = False
  full[0, 3] = True
  full[1:, 32:] = False
  full[1, 40] = True
  prompts = ["a", "b", "c", "d"]
  assert falsifier.never_solved(prompts, full, 128, 10) == ["c", "d"]
  assert falsifier.never_solved(prompts, full, 32, 10) == ["b", "c", "d"]
  assert falsifier.never_solved(prompts, full, 128, 1) == ["c"]
  assert falsifier.never_solved_share(full, 128) == 0.5


def test_a_gain_is_normalised_by_the_policys_overall_gain():
  # +0.02 on the never-solved prompts by a policy that gained +0.10 overall: a fifth of its gain there
  assert falsifier.normalised(0.02, 0.10) == pytest.approx(0.2)
  assert math.isnan(falsifier.normalised(0.02, 0.0)) and math.isnan(falsifier.normalised(0.02, -0.01))


def test_policies_rerun_a_main_run_without_its_export_and_leave_out_an_extra_group_without_one(tmp_path, monkeypatch):
  """A run cache restored without exports: a main run is rerun under its key (fresh) to export its policy; an extra
  group (never launched by the falsifier) whose run has no export is left out, named in the log."""
  import json
  import os

  from astarpo_jax.comparison import context as cx
  from astarpo_jax.comparison.runs import RunSpec
  calls, logs = [], []

  def fake_ensure(spec, workdir, fresh, log, cache_dir="", code_id=""):
    run_dir = os.path.join(workdir, f"{spec.method}_{spec.seed}_{spec.overrides}")
    os.makedirs(run_dir, exist_ok=True)
    calls.append((spec.method, spec.seed, fresh))
    if fresh:
      os.makedirs(os.path.join(run_dir, "export"), exist_ok=True)
      open(os.path.join(run_dir, "export", "config.json"), "w").write(json.dumps({}))
    return run_dir, {"final_acc": 0.5, "reference_acc": 0.3}

  monkeypatch.setattr(falsifier, "ensure_run", fake_ensure)
  monkeypatch.setattr(falsifier, "run_dir_of", lambda sp, w, c="": str(tmp_path))  # its result.json: below
  open(tmp_path / "result.json", "w").write("{}")
  ctx = cx.Context(str(tmp_path), "chains", "paper", ["astarpo"], [1], False, logs.append, "")
  extra = {"A*-PO, 756 steps": [RunSpec("chains", "paper", "astarpo", 1, 1.0, (("train.num_steps", 756),))]}
  out = falsifier.policies(ctx, {}, extra)
  assert list(out) == ["A*-PO"] and out["A*-PO"][0][0] == 1 and out["A*-PO"][0][2] == pytest.approx(0.2)
  assert calls == [("astarpo", 1, False), ("astarpo", 1, True), ("astarpo", 1, False)]
  assert any("A*-PO, 756 steps left out" in line for line in logs)
