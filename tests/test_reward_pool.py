"""The worker pool: same rewards as in-process, hangs and crashes killed and counted, pool keeps working."""
import contextlib
import json
import os
import random
import signal
import threading
import time

import pytest

from astarpo_jax.rewards import grading
from astarpo_jax.rewards.reward_pool import RewardPool
from tests.data_paths import FIXTURES

DATA = os.path.join(FIXTURES, "math500", "test.jsonl")
TIMEOUT_S = 2.0
# Both run far past any time limit. The first is pure-Python sympy work, the second a single C-level
# integer power (10^7)^(10^7), which no signal interrupts: only killing the worker ends it.
SLOW_PYTHON = "\\boxed{\\prod_{k=1}^{10^{8}} k}"
SLOW_C = "\\boxed{\\sum_{k=10^{7}}^{10^{7}} k^{k}}"


@pytest.fixture(scope="module")
def pool():
  with RewardPool(num_workers=2, timeout_s=TIMEOUT_S, memory_mb=512, chunk_size=8) as p:
    yield p


def _math500(n, seed=0):
  with open(DATA) as f:
    rows = [json.loads(line) for line in f]
  return random.Random(seed).sample(rows, n)


def test_pool_rewards_equal_in_process_rewards_on_real_data(pool):
  rows = _math500(60)
  others = rows[1:] + rows[:1]
  responses = ([r["solution"] for r in rows[:30]]  # correct
               + [f"so \\boxed{{{o['answer']}}}" for o in others[30:]]  # another row's answer
               + ["no box here"] * 5)
  golds = [r["answer"] for r in rows] + ["1"] * 5
  got = pool.grade(responses, golds)
  want = grading.grade_batch(responses, golds)
  assert got.rewards.tolist() == want.rewards.tolist()
  assert got.rewards[:30].mean() == 1.0 and got.num_no_answer == 5
  assert got.num_killed == got.num_timeouts == got.num_errors == 0


def test_all_graders_work_through_the_pool(pool):
  cases = {"gsm8k_strict": ("#### 1,000", "1000"), "gsm8k_flexible": ("it is 1000", "1000"),
           "hendrycks": ("\\boxed{\\dfrac{1}{2}}", "\\frac12"),
           "math_verify": ("\\boxed{\\{2,1\\}}", "\\{1,2\\}"),
           "gsm8k_strict_lenient": ("#### 1,000.", "1000"), "gsm8k_flexible_lenient": ("it is 1,000.", "1000"),
           "hendrycks_lenient": ("\\boxed{1,000}", "1000")}
  assert set(cases) == set(grading.GRADERS)
  for grader, (response, gold) in cases.items():
    assert pool.grade([response], [gold], grader).rewards.tolist() == [1.0], grader
    truncated = pool.grade([response, response], [gold, gold], grader, truncated=[True, False])
    assert truncated.rewards.tolist() == [0.0, 1.0] and truncated.num_truncated == 1, grader


def test_hostile_items_score_zero_within_the_limit_and_pool_keeps_working(pool, tmp_path):
  marker = tmp_path / "MARKER"
  hostile = [
      f"\\boxed{{__import__('os').system('touch {marker}')}}",
      f"\\boxed{{\\text{{__import__('os').system('touch {marker}')}}}}",
      SLOW_PYTHON, SLOW_C,
      "\\boxed{9^{9^{9^9}}}", "\\boxed{(10^9)!}",
      "\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}",
      "y" * 3_000_000 + "\\boxed{5",  # megabytes, unbalanced
      "\\boxed{}",
  ]
  t0 = time.monotonic()
  result = pool.grade(hostile + ["\\boxed{5}"], ["5"] * (len(hostile) + 1))
  elapsed = time.monotonic() - t0
  assert result.rewards.tolist() == [0.0] * len(hostile) + [1.0]
  # SLOW_C always runs into the time limit; SLOW_PYTHON either does too or, sometimes, hits the worker's
  # memory cap first, which math-verify swallows and scores 0: both end within the limit, scored 0.
  assert result.num_timeouts in (1, 2) and result.num_killed == result.num_timeouts
  assert result.num_rejected == 3 and result.num_no_answer == 2
  assert elapsed < 2 * TIMEOUT_S + 10  # two kills (possibly in parallel), restarts, the rest
  assert not marker.exists()
  assert pool.grade(["\\boxed{\\frac{3}{6}}"], ["0.5"]).rewards.tolist() == [1.0]


def test_a_hang_costs_only_its_own_item_not_its_chunk(pool):
  responses = [f"\\boxed{{{k}}}" for k in range(12)]  # gold k for item k; all in one chunk of 8+4
  responses[1] = SLOW_C
  result = pool.grade(responses, [str(k) for k in range(12)])
  assert result.rewards.tolist() == [1.0, 0.0] + [1.0] * 10
  assert result.num_timeouts == 1 and result.num_killed == 1


def test_workers_run_under_an_address_space_limit(pool):
  if not os.path.exists(f"/proc/{os.getpid()}/limits"):
    pytest.skip("needs /proc")
  pool.wait_ready()  # workers replaced by earlier tests may still be starting
  for pid in pool.worker_pids:
    with open(f"/proc/{pid}/limits") as f:
      line = next(l for l in f if l.startswith("Max address space"))
    soft = line.split()[3]
    assert soft != "unlimited" and int(soft) < 4 * 2**30, line


def _parent_and_state(pid):
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return int(fields[1]), fields[0]


def test_a_notice_to_the_whole_process_group_leaves_the_workers_grading(pool):
  """Slurm, `timeout` and a container stop signal the whole process group: the workers and the server they
  fork from ignore it, so the step the parent finishes gets real rewards (the parent closes them itself)."""
  if not os.path.exists(f"/proc/{os.getpid()}/stat"):
    pytest.skip("needs /proc")
  pool.wait_ready()
  pids = pool.worker_pids
  server = sorted({_parent_and_state(pid)[0] for pid in pids} - {os.getpid()})
  assert server, "the workers should be forked by the forkserver, not by this process"

  def notice():
    for pid in pids + server:
      for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(ProcessLookupError):  # one that died of it is caught below
          os.kill(pid, sig)
  rows = _math500(60, seed=1)
  responses, golds = [r["solution"] for r in rows], [r["answer"] for r in rows]
  threading.Timer(0.2, notice).start()  # in the middle of the batch
  got = pool.grade(responses, golds)
  notice()
  time.sleep(0.5)
  assert got.rewards.tolist() == grading.grade_batch(responses, golds).rewards.tolist()
  assert got.num_killed == got.num_errors == 0 and pool.worker_pids == pids
  assert all(_parent_and_state(pid)[1] not in "ZX" for pid in pids + server)  # none died of it
  assert pool.grade(["\\boxed{7}"], ["7"]).rewards.tolist() == [1.0]


def test_a_worker_that_dies_mid_item_is_replaced_and_its_item_counted():
  with RewardPool(num_workers=1, timeout_s=60, memory_mb=512) as pool:
    pid = pool.worker_pids[0]
    killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    result = pool.grade([SLOW_PYTHON, "\\boxed{7}"], ["5", "7"])
    killer.join()
    assert time.monotonic() - t0 < 30  # not the 60 s limit: the death is noticed at once
    assert result.rewards.tolist() == [0.0, 1.0]
    assert result.num_errors == 1 and result.num_killed == 1
    assert pool.worker_pids[0] != pid


def test_a_worker_that_died_while_idle_is_replaced_on_the_next_batch():
  with RewardPool(num_workers=1, timeout_s=TIMEOUT_S, memory_mb=512) as pool:
    pid = pool.worker_pids[0]
    os.kill(pid, signal.SIGKILL)
    pool._workers[0].proc.join(10)  # noqa: SLF001 -- make sure it is gone before sending
    result = pool.grade(["\\boxed{7}", "\\boxed{8}"], ["7", "7"])
    assert result.rewards.tolist() == [1.0, 0.0] and result.num_killed == 1
    assert pool.worker_pids[0] != pid


def test_bad_pool_arguments_raise_clear_errors():
  with pytest.raises(ValueError, match="never 'fork'"):
    RewardPool(num_workers=1, mp_context="fork")
  with pytest.raises(ValueError, match="timeout_s"):
    RewardPool(num_workers=1, timeout_s=0)
  with pytest.raises(ValueError, match="num_workers"):
    RewardPool(num_workers=0)


def test_closed_pool_refuses_work():
  p = RewardPool(num_workers=1, timeout_s=TIMEOUT_S)
  p.close()
  p.close()  # idempotent
  with pytest.raises(RuntimeError, match="closed"):
    p.grade(["\\boxed{1}"], ["1"])
