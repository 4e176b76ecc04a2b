"""experiments/bench_step.py at its smoke size: with EOS disabled every response runs to the cap and the
reference and the update read only sampled columns; with stop ids, responses end early, the forwards
still read the longest response's bucket, and a step that brings a new bucket is not timed; `--pack`'s
packed reference and update give the padded ones' log-probs and loss."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(*extra):
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_step.py"), "--quick", "--model=chains", *extra]
  got = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                       timeout=600)
  assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
  m = re.search(r"responses: mean ([0-9.]+) tokens \((\d+) stop ids\), max (\d+); the reference and the update "
                r"ran over \[([0-9, ]+)\] response columns \((\d+)% of them sampled\); (\d+) warm-up", got.stdout)
  assert m, got.stdout
  timed = int(re.search(r"median of (\d+) timed steps", got.stdout).group(1))
  gaps = re.search(r"gaps: loss ([0-9.e+-]+), reference log-prob ([0-9.e+-]+)", got.stdout)
  if "--pack" in extra:
    assert gaps, got.stdout
    assert float(gaps.group(1)) < 1e-4 and float(gaps.group(2)) < 1e-4  # the packed A/B computes the same step
  return float(m.group(1)), int(m.group(2)), int(m.group(3)), [int(w) for w in m.group(4).split(",")], \
      int(m.group(5)), int(m.group(6)), timed


def test_bench_step_without_stop_ids_samples_every_response_to_the_cap():
  mean, stops, longest, widths, sampled, warmups, timed = _bench("--steps=1")
  assert (mean, stops, longest, widths, sampled, warmups, timed) == (32.0, 0, 32, [32], 100, 1, 1)  # --quick: cap 32


def test_bench_step_with_stop_ids_ends_responses_early_but_the_forwards_read_the_bucket():
  mean, stops, longest, widths, sampled, warmups, timed = _bench("--steps=2", "--mean_length=8", "--pack")
  assert stops == 32  # 256 ids / 8
  assert 1 <= mean < 32 and set(widths) <= {16, 32} and sampled < 100
  assert timed == 2 and warmups >= len(set(widths))  # each width a timed step ran at was compiled by an untimed one
