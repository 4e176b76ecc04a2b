"""The CPU demo end to end (its CI-sized variant): accuracy after A*-PO clearly above the reference's. The
warm-started pi_ref and Stage 1's V* are built once per session (conftest.demo_shared: `main.py --config.mode=stage1`
on the same config) and each demo test trains its own method from them."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import default_xla_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _main(*args, timeout=1200, env=None):
  env = env or default_xla_env(dict(os.environ, HF_HUB_OFFLINE="1"))  # it trains for minutes: XLA's default level
  return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "main.py"), *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout, env=env)


def run_on_shared(shared, workdir, *args, timeout=1200):
  """main.py in `workdir` from the session's warm-started reference (copied in) and its Stage-1 V* file."""
  shutil.copytree(shared.reference, workdir / "reference")
  return _main(*args, f"--workdir={workdir}", f"--config.stage1.vstar_file={shared.vstar_file}", timeout=timeout,
               env=shared.env)


def assert_clears_the_bar(report):
  """Held-out pass@1 and avg@2 up >= 0.10 over pi_ref, which solves some problems but not all."""
  ref, final = report["reference_eval"], report["final_eval"]
  for metric in ("synthetic/pass@1", "synthetic/avg@2"):
    assert 0.0 < ref[metric]["accuracy"] < 0.8, (metric, ref[metric])
    assert final[metric]["accuracy"] >= ref[metric]["accuracy"] + 0.10, (metric, ref[metric], final[metric])


def test_tiny_demo_improves_held_out_accuracy_by_ten_points(tmp_path, demo_shared):
  run = run_on_shared(demo_shared, tmp_path, "--config=configs/demo.py:tiny")
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.loads((tmp_path / "report.json").read_text())
  assert_clears_the_bar(report)
  assert report["stage1_summary"]["num_prompts"] == 256  # the shared Stage 1 covers every training prompt
  assert (tmp_path / "checkpoints").is_dir() and (tmp_path / "tb").is_dir()


@pytest.mark.parametrize("override,message", [
    ("--config.warmstart.steps=300", "warmstart.steps: 400 cached, 300 now"),
    ("--config.model.random.num_layers=3", "model.random.num_layers: 2 cached, 3 now"),
    ("--config.data.synthetic.unboxed_fraction=0.25", "data.synthetic.unboxed_fraction: 0.5 cached, 0.25 now"),
    (None, "without warmstart.json"),
])
def test_a_cached_reference_built_with_other_settings_is_refused(tmp_path, demo_shared, override, message):
  shutil.copytree(demo_shared.reference, tmp_path / "reference")
  if override is None:  # a reference that does not say what it was built from
    (tmp_path / "reference" / "warmstart.json").unlink()
  run = _main("--config=configs/demo.py:tiny", f"--workdir={tmp_path}", *([override] if override else []),
              timeout=300)
  assert run.returncode != 0
  assert message in run.stderr, run.stderr[-2000:]
  assert not (tmp_path / "report.json").exists()


@pytest.mark.parametrize("override,message", [
    ("--config.algo.beta2=0", "config.algo.beta2: must be > 0"),
    ("--config.train.micro_batch=48", "config.train.micro_batch: mini_batch=64 is not divisible by micro_batch=48"),
    ("--config.algo.no_such_field=1", "no_such_field"),
])
def test_bad_config_is_refused_up_front_naming_the_field(tmp_path, override, message):
  run = _main("--config=configs/demo.py:tiny", f"--workdir={tmp_path}", override, timeout=300)
  assert run.returncode != 0
  assert message in run.stderr, run.stderr[-2000:]
  assert not (tmp_path / "reference").exists()  # nothing was built before the check
