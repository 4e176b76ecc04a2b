"""The worked example of a task of one's own (examples/countdown/): its reward on hand-worked cases, and the whole
run at CI size (a tiny random model warm-started on the example's file, its reward function by path in the reward
pool) gaining ten points of held-out reward on two seeds."""
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import default_xla_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "countdown")


def _reward():
  spec = importlib.util.spec_from_file_location("countdown_reward", os.path.join(EXAMPLE, "reward.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.score


@pytest.mark.parametrize("response,want", [
    ("\\boxed{3*5+7}", 1.0),  # 3 * 5 + 7 = 22, each number once
    ("\\boxed{(7+3)*5-28}", 0.0),  # reaches 22 with a number not given
    ("\\boxed{7+5*3}", 1.0),  # another order of the same numbers
    ("\\boxed{3+5+7}", 0.1),  # the right numbers, 15: the format credit
    ("\\boxed{3*5}", 0.0),  # a number left out
    ("3*5+7", 0.0),  # right, but not in the answer box
    ("\\boxed{3*5+7", 0.0),  # an unclosed box
    ("\\boxed{__import__('os').system('true')}", 0.0),  # code is never run: characters refused first
    ("\\boxed{" + "(" * 30 + "3*5+7" + ")" * 30 + "}", 0.0),  # longer than the 40 characters allowed
    ("\\boxed{3**5+7}", 0.0),  # a power is not an allowed operation
])
def test_countdown_reward_on_hand_worked_cases(response, want):
  assert _reward()(response, 22, [3, 5, 7]) == want


def _run(workdir, seed):
  env = default_xla_env(dict(os.environ, HF_HUB_OFFLINE="1"))  # it trains: XLA's default level
  t0 = time.monotonic()
  run = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "main.py"),
                        f"--config={os.path.join(EXAMPLE, 'config.py')}", f"--workdir={workdir}", f"--config.seed={seed}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
  return run, time.monotonic() - t0


@pytest.mark.parametrize("seed", [0, 1])
def test_countdown_example_gains_ten_points_of_held_out_reward(tmp_path, seed):
  run, seconds = _run(tmp_path, seed)
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.loads((tmp_path / "report.json").read_text())
  ref, final = report["reference_eval"], report["final_eval"]
  key = next(k for k in ref if k.endswith("test.jsonl/pass@1"))  # the mean reward of greedy answers
  print(f"seed {seed}: held-out reward {ref[key]['accuracy']:.3f} -> {final[key]['accuracy']:.3f} in {seconds:.0f} s")
  assert 0.05 < ref[key]["accuracy"] < 0.6, ref[key]  # the reference earns some reward, not all
  assert final[key]["accuracy"] >= ref[key]["accuracy"] + 0.10, (ref[key], final[key])
  # Fractional rewards reached Stage 1's file: the format credit 0.1 beside 0 and 1.
  rewards = {r for line in (tmp_path / "stage1" / "vstar.jsonl").read_text().splitlines()
             for r in json.loads(line)["rewards"]}
  assert rewards >= {0.0, 1.0} and any(abs(r - 0.1) < 1e-6 for r in rewards), sorted(rewards)[:10]
