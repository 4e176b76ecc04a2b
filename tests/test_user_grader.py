"""A user's reward function named by import path: imported by path and by module, run in the reward pool (hangs,
memory blow-ups and exits cost one zero each and are counted), bad values and exceptions reported and counted,
the error-share stop, fractional rewards through the pool into Stage 1's V* file and the A*-PO loss, and the
up-front refusal of a bad path. The functions are in tests/user_rewards.py."""
import importlib
import json
import math
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax.numpy as jnp
import numpy as np
import pytest

from astarpo_jax import experiment, run_config, run_inputs
from astarpo_jax.data import dataset
from astarpo_jax.data.dataset import Prompt
from astarpo_jax.rewards import user_grader
from astarpo_jax.rewards.reward_pool import RewardPool
from astarpo_jax.stage1 import estimate as S
from astarpo_jax.training import losses as L

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # configs/

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BY_PATH = "tests/user_rewards.py:{}"  # relative to the working directory, as a config names it
BY_MODULE = "tests.user_rewards:{}"
TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def pool():
  os.chdir(ROOT)  # the relative path and the module are found from the repository root
  with RewardPool(num_workers=2, timeout_s=TIMEOUT_S, memory_mb=512, preload=(BY_PATH.format("exact"),)) as p:
    yield p


def test_a_function_named_by_path_or_by_module_grades_the_same(pool):
  responses, golds = ["3", "4", " 7", "seven"], [3, 3, 7, 7]
  by_path = pool.grade(responses, golds, grader=BY_PATH.format("exact"))
  by_module = pool.grade(responses, golds, grader=BY_MODULE.format("exact"))
  assert by_path.rewards.tolist() == by_module.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
  assert by_path.num_errors == by_module.num_errors == 0


def test_fractional_rewards_and_extra_fields_reach_the_function_as_loaded(pool):
  rows = [{"q": "a", "a": 10, "scale": 4}, {"q": "b", "a": 10, "scale": 10}, {"q": "c", "a": 6, "numbers": [1, 2, 3]}]
  examples, stats = dataset.examples_from_rows(rows[:2], dataset.Fields("q", "a", "json", extra=("scale",)), "t")
  assert [(e.gold, dict(e.extra)) for e in examples] == [(10, {"scale": 4}), (10, {"scale": 10})]
  targets = [Prompt(e.uid, e.problem, (1,), e.gold, e.problem, e.extra).target for e in examples]
  got = pool.grade(["9", "7"], targets, grader=BY_PATH.format("closeness"))
  assert got.rewards.tolist() == pytest.approx([1 - 1 / 4, 1 - 3 / 10])  # 1 - |answer - gold| / scale
  # A list-valued field arrives as a list; a row without a named field is skipped and counted.
  examples, stats = dataset.examples_from_rows(rows, dataset.Fields("q", "a", "json", extra=("numbers",)), "t")
  assert [e.extra["numbers"] for e in examples] == [[1, 2, 3]] and stats.skipped["missing_extra"] == 2
  target = user_grader.Target(examples[0].gold, examples[0].extra)
  assert pool.grade(["6", "5"], [target, target], grader=BY_PATH.format("uses_numbers")).rewards.tolist() == [1, 0]


def test_truncated_responses_follow_the_eos_rule(pool):
  spec = BY_PATH.format("exact")
  flagged = pool.grade(["3", "3"], [3, 3], grader=spec, truncated=[True, False])
  assert flagged.rewards.tolist() == [0.0, 1.0] and flagged.num_truncated == 1
  assert pool.grade(["3", "3"], [3, 3], grader=spec, truncated=None).rewards.tolist() == [1.0, 1.0]


def test_a_hang_a_memory_blow_up_and_an_exit_each_cost_one_zero_and_are_counted(pool):
  spec = BY_PATH.format("misbehaves")
  responses = ["sleep", "1", "hog", "1", "exit", "1"]
  got = pool.grade(responses, [1] * 6, grader=spec)
  assert got.rewards.tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
  assert got.num_timeouts == 1  # killed at the time limit
  assert got.num_errors == 2  # MemoryError at the worker's address-space cap; the process that called os._exit
  assert got.num_killed == 2  # the hung worker and the exited one, both replaced
  assert "time limit" in got.first_error
  assert pool.grade(["1"], [1], grader=spec).rewards.tolist() == [1.0]  # the pool goes on


@pytest.mark.parametrize("fn,message", [
    ("raises", "KeyError: \"no rule for '1'\""),  # the traceback, in full
    ("too_big", "returned 2.5, outside [0, 1]"),
    ("not_a_number", "returned nan, outside [0, 1]"),
    ("text", "returned builtins.str '1.0', not a number"),
    ("nothing", "returned builtins.NoneType None, not a number"),
])
def test_bad_rewards_and_exceptions_score_zero_with_a_clear_counted_error(pool, fn, message):
  got = pool.grade(["1", "2"], [1, 1], grader=BY_PATH.format(fn))
  assert got.rewards.tolist() == [0.0, 0.0] and got.num_errors == 2 and got.num_killed == 0
  assert message in got.first_error and fn in got.first_error, got.first_error


def test_grader_logs_failures_shows_the_first_in_full_once_and_stops_above_the_error_share(pool):
  lines = []
  grade = run_inputs.Grader(pool, BY_PATH.format("misbehaves"), eos_required=False, max_error_share=0.5,
                            log=lines.append)
  texts = ["hog", "1", "1", "1"]
  for _ in range(2):  # a quarter fails: counted and logged, the run goes on
    out = grade(texts, [1] * 4, [False] * 4)
    assert out.rewards_B.tolist() == [0.0, 1.0, 1.0, 1.0] and out.counts["num_errors"] == 1
  assert sum("1 of 4 responses scored 0 by failures" in line for line in lines) == 2
  assert sum("MemoryError" in line for line in lines) == 1  # the first failure in full, once
  with pytest.raises(RuntimeError, match=r"(?s)3 of 4 responses failed.*max_error_share=0.5.*MemoryError"):
    grade(["hog", "hog", "hog", "1"], [1] * 4, [False] * 4)


def test_builtin_graders_read_the_gold_of_a_target(pool):
  grade = run_inputs.Grader(pool, "math_verify", eos_required=False)
  assert grade(["\\boxed{6}"], [user_grader.Target("6", {"numbers": [1]})], [False]).rewards_B.tolist() == [1.0]


# ---------------------------------------------------------------------------------------------
# Fractional rewards through Stage 1 and the loss.

RESPONSES = {"p/0": ["10", "9", "7", "0"], "p/1": ["10", "10", "9", "8"], "p/2": ["3", "5", "1", "0"]}


def _fixed_draw(grade):
  """Stage 1's draw: prompt p's j-th response is RESPONSES[p][j] (counted per prompt), graded by `grade`."""
  seen = {}

  def draw(prompts, n, key):
    texts = []
    for p in prompts:
      j = seen.get(p.uid, 0)
      texts.append(RESPONSES[p.uid][j:j + n])
      seen[p.uid] = j + n
    flat = [t for ts in texts for t in ts]
    out = grade(flat, [p.target for p in prompts for _ in range(n)], [False] * len(flat))
    return S.Drawn(np.asarray(out.rewards_B).reshape(len(prompts), n), np.zeros((len(prompts), n), bool), texts)
  return draw


def _hand_vstar(rewards, beta1):
  return beta1 * math.log(sum(math.exp(r / beta1) for r in rewards) / len(rewards))


def test_fractional_rewards_go_through_the_pool_into_the_vstar_file_and_the_loss(pool, tmp_path):
  prompts = [Prompt(f"p/{i}", f"q{i}", (i + 1,), 10, extra={"scale": 10}) for i in range(3)]
  grade = run_inputs.Grader(pool, BY_PATH.format("closeness"), eos_required=False)
  table = S.run_stage1(prompts, _fixed_draw(grade), out_dir=str(tmp_path), n_samples=4, beta1=0.5, pass_threshold=0.85,
                       progress=False, log=lambda s: None)
  want = {"p/0": [1.0, 0.9, 0.7, 0.0], "p/1": [1.0, 1.0, 0.9, 0.8], "p/2": [0.3, 0.5, 0.1, 0.0]}  # 1 - |x - 10| / 10
  records = [json.loads(line) for line in open(tmp_path / "stage1" / "vstar.jsonl")]
  for rec in records:
    assert rec["rewards"] == pytest.approx(want[rec["uid"]])
    assert rec["vstar"] == pytest.approx(_hand_vstar(want[rec["uid"]], 0.5), abs=1e-6)
  # Passing at r >= 0.85: 2, 3 and 0 of 4; the third prompt is all_fail although its V* > 0.
  assert [r["num_correct"] for r in records] == [2, 3, 0] and [r["all_fail"] for r in records] == [False, False, True]
  assert table.summary["mean_reward"] == pytest.approx(np.mean([np.mean(v) for v in want.values()]))

  # Stage 2's loss on one response per prompt with those V*: (β2·Σ log π/π_ref − (r − V*))², averaged.
  vstar_P = table.lookup(prompts)
  r_P = np.array([0.7, 0.8, 0.5], np.float32)
  logp_PT = jnp.array([[-1.0, -2.0], [-0.5, -0.5], [-3.0, -1.0]])
  ref_PT = jnp.array([[-1.5, -2.0], [-0.5, -1.0], [-2.0, -2.0]])
  loss, _ = L.astarpo_loss(logp_PT, ref_PT, jnp.ones((3, 2), bool), jnp.asarray(r_P), jnp.asarray(vstar_P),
                           beta2=0.5, entropy_coef=0.0)
  hand = np.mean([(0.5 * lr - (r - _hand_vstar(want[f"p/{i}"], 0.5))) ** 2
                  for i, (lr, r) in enumerate(zip([0.5, 0.5, 0.0], r_P))])
  assert float(loss) == pytest.approx(hand, rel=1e-5)


def test_adaptive_n_stops_early_only_where_every_first_sample_passes_the_threshold(pool, tmp_path):
  prompts = [Prompt(f"p/{i}", f"q{i}", (i + 1,), 10, extra={"scale": 10}) for i in range(3)]
  grade = run_inputs.Grader(pool, BY_PATH.format("closeness"), eos_required=False)
  table = S.run_stage1(prompts, _fixed_draw(grade), out_dir=str(tmp_path), beta1=0.5, pass_threshold=0.85,
                       adaptive=S.AdaptiveConfig(2, 4), progress=False, log=lambda s: None)
  # First two rewards: p/0 1.0, 0.9 (both pass: n stays 2); p/1 1.0, 1.0; p/2 0.3, 0.5 (drawn to 4).
  assert [table.records[p.uid]["n"] for p in prompts] == [2, 2, 4]


def test_a_changed_reward_function_does_not_resume_on_old_vstar(pool, tmp_path):
  c = importlib.import_module("configs.demo").get_config("tiny")
  source = tmp_path / "reward.py"
  source.write_text(open(os.path.join(ROOT, "tests", "user_rewards.py")).read())
  c.reward.stage1_grader = f"{source}:closeness"
  before = experiment.settings(c, run_config.build_method(c))[2]
  prompts = [Prompt(f"p/{i}", f"q{i}", (i + 1,), 10, extra={"scale": 10}) for i in range(3)]
  grade = run_inputs.Grader(pool, c.reward.stage1_grader, eos_required=False)
  run = lambda s1: S.run_stage1(prompts, _fixed_draw(grade), out_dir=str(tmp_path / "run"), n_samples=1,  # noqa: E731
                                reward_id=s1.reward_id, progress=False, log=lambda s: None)
  run(before)
  run(before)  # the same function resumes
  source.write_text(source.read_text().replace("abs(value - gold) / scale", "abs(value - gold) / (2 * scale)"))
  after = experiment.settings(c, run_config.build_method(c))[2]
  assert after.reward_id != before.reward_id and after.reward_id.startswith("closeness sha256:")
  with pytest.raises(ValueError, match="reward: stored .*refusing to mix"):
    run(after)


@pytest.mark.parametrize("field,value,message", [
    ("grader", "tests/no_such_file.py:score", "config.reward.grader: .*no_such_file.py not found"),
    ("grader", "tests/user_rewards.py:no_such_fn", "config.reward.grader: .*defines no 'no_such_fn'"),
    ("stage1_grader", "tests.no_such_module:score", "config.reward.stage1_grader: .*not found on sys.path"),
    ("stage1_grader", "tests/user_rewards.py:not an identifier", "config.reward.stage1_grader: .*neither"),
    ("eval_graders", ("math_verify", "tests/user_rewards.py:nope"), "config.reward.eval_graders: .*defines no 'nope'"),
])
def test_a_bad_reward_path_is_refused_up_front_naming_the_field(field, value, message):
  os.chdir(ROOT)
  c = importlib.import_module("configs.demo").get_config("tiny")
  c.reward[field] = value
  with pytest.raises(ValueError, match=message):
    run_config.validate_config(c)
  c.reward[field] = BY_MODULE.format("exact") if field != "eval_graders" else (BY_PATH.format("exact"),)
  run_config.validate_config(c)  # a good one passes
