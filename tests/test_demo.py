"""The CPU demo end to end (its CI-sized variant): accuracy after A*-PO clearly above the reference's."""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import default_xla_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _main(*args, timeout=1200):
  env = default_xla_env(dict(os.environ, HF_HUB_OFFLINE="1"))  # it trains for minutes: XLA's default level
  return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "main.py"), *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout, env=env)


def test_tiny_demo_improves_held_out_accuracy_by_ten_points(tmp_path):
  run = _main("--config=configs/demo.py:tiny", f"--workdir={tmp_path}")
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.loads((tmp_path / "report.json").read_text())
  ref, final = report["reference_eval"], report["final_eval"]
  for metric in ("synthetic/pass@1", "synthetic/avg@2"):
    assert 0.0 < ref[metric]["accuracy"] < 0.8, (metric, ref[metric])  # the reference solves some, not all
    assert final[metric]["accuracy"] >= ref[metric]["accuracy"] + 0.10, (metric, ref[metric], final[metric])
  s1 = report["stage1_summary"]
  assert s1["num_prompts"] == 256 if "num_prompts" in s1 else True
  assert (tmp_path / "stage1" / "vstar.jsonl").exists()
  assert (tmp_path / "checkpoints").is_dir() and (tmp_path / "tb").is_dir()


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
