"""The chains task: problems and worked solutions checked by Python arithmetic, disjoint splits, the
difficulty knobs, grading by math-verify, the tokenizer, and a tiny run through experiments/main.py."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from astarpo_jax.data import chains, dataset
from tests.test_grading import grade_one

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  from transformers import AutoTokenizer
  return AutoTokenizer.from_pretrained(chains.save_tokenizer(str(tmp_path_factory.mktemp("chains_tok"))))


def _python_value(problem: str) -> int:
  """The problem's value by Python's own precedence rules (exact: "/" only divides exactly)."""
  assert re.fullmatch(r"[0-9+\-*/()]+", problem), problem  # digits, operators and parentheses only
  value = eval(problem.replace("/", "//"))  # noqa: S307
  assert value == eval(problem)  # noqa: S307  the divisions were exact
  return value


def test_gold_is_the_value_of_the_expression_under_usual_precedence():
  cfg = chains.ChainsConfig(min_steps=1, max_steps=12, digits=2, ops="+-*/", max_value=999)
  for row in chains.generate_rows(1000, seed=0, cfg=cfg):
    assert _python_value(row["problem"]) == int(row["answer"])


def _lines(response: str) -> list[str]:
  """The rewritten expressions of a worked solution, in order (the text before the box, split at '=')."""
  return response.split(" \\boxed{")[0].split("=")


def test_worked_solution_reduces_the_leftmost_operation_per_line_down_to_the_boxed_gold():
  assert chains.target_response("(17+25)*3-9") == "42*3-9=126-9=117 \\boxed{117}"
  assert chains.target_response("(17+25)*3-9", boxed=False) == "42*3-9=126-9=117"
  assert chains.target_response("((8-3)*7+3)*2") == "(5*7+3)*2=(35+3)*2=38*2=76 \\boxed{76}"
  cfg = chains.ChainsConfig(min_steps=1, max_steps=14, digits=2, ops="+-*/", max_value=999)
  for row in chains.generate_rows(500, seed=1, cfg=cfg):
    response = chains.target_response(row["problem"])
    lines = _lines(response)
    n_ops = len(re.findall(r"[-+*/]", row["problem"]))
    assert len(lines) == n_ops  # one line per operation
    for k, line in enumerate(lines):  # every line has one operation fewer and the problem's value
      assert len(re.findall(r"[-+*/]", line)) == n_ops - k - 1
      assert _python_value(line) == int(row["answer"])
    assert lines[-1] == row["answer"] and response.endswith(f" \\boxed{{{row['answer']}}}")


def test_generation_is_deterministic_and_train_test_never_share_a_problem():
  assert chains.generate_rows(50, 3) == chains.generate_rows(50, 3)
  assert chains.generate_rows(50, 3) != chains.generate_rows(50, 4)
  train = {r["problem"] for r in chains.generate_rows(4000, 0)}
  test = {r["problem"] for r in chains.generate_rows(500, 0, split="test")}
  assert len(train) == 4000 and len(test) == 500 and not train & test
  assert all(chains.split_of(p) == "test" for p in test)


def test_difficulty_knobs_bound_steps_operands_operations_and_values():
  for cfg in (chains.ChainsConfig(min_steps=3, max_steps=5, digits=1, ops="+-", max_value=99),
              chains.ChainsConfig(min_steps=8, max_steps=8, digits=2, ops="+-*", max_value=500)):
    for row in chains.generate_rows(300, 0, cfg):
      ops, numbers = re.findall(r"[-+*/]", row["problem"]), [int(x) for x in re.findall(r"\d+", row["problem"])]
      assert cfg.min_steps <= len(ops) <= cfg.max_steps and set(ops) <= set(cfg.ops)
      assert all(0 < x < 10 ** cfg.digits for x in numbers)
      assert all(2 <= x <= 9 for op, x in zip(ops, numbers[1:]) if op in "*/")
      firsts = [int(re.match(r"\(*(\d+)", line).group(1)) for line in _lines(chains.target_response(row["problem"]))]
      assert all(0 <= v <= cfg.max_value for v in firsts)  # every intermediate value
  with pytest.raises(ValueError, match="min_steps"):
    chains.ChainsConfig(min_steps=5, max_steps=4)
  with pytest.raises(ValueError, match="ops"):
    chains.ChainsConfig(ops="+^")
  with pytest.raises(ValueError, match="both"):
    chains.ChainsConfig(ops="+*")
  with pytest.raises(ValueError, match="max_value"):
    chains.ChainsConfig(digits=3, max_value=99)


def test_more_steps_give_longer_and_more_varied_responses(tokenizer):
  def lengths(lo, hi):
    cfg = chains.ChainsConfig(min_steps=lo, max_steps=hi)
    return np.array([len(tokenizer(chains.target_response(r["problem"]), add_special_tokens=False)["input_ids"])
                     for r in chains.generate_rows(300, 0, cfg)])
  short, long = lengths(2, 4), lengths(2, 14)
  assert short.max() < 60 and long.mean() > 2 * short.mean()
  assert long.min() < 40 and long.max() > 200  # tens to a few hundred tokens


def test_math_verify_grades_the_gold_one_and_a_wrong_or_unboxed_answer_zero():
  for row in chains.generate_rows(30, 5):
    right = chains.target_response(row["problem"])
    wrong_final = right[:right.rindex("{") + 1] + str(int(row["answer"]) + 1) + "}"
    assert grade_one(right, row["answer"], "math_verify") == 1.0
    assert grade_one(wrong_final, row["answer"], "math_verify") == 0.0
    assert grade_one(chains.target_response(row["problem"], boxed=False), row["answer"], "math_verify") == 0.0


def test_tokenizer_loads_from_its_hf_folder_and_round_trips_prompts_and_solutions(tokenizer):
  assert len(tokenizer) == len(chains.VOCAB) < 32
  assert tokenizer.pad_token == "<pad>" and tokenizer.eos_token == "<eos>"
  ids = tokenizer("\\boxed{7}", add_special_tokens=False)["input_ids"]
  assert tokenizer.convert_ids_to_tokens(ids) == ["\\boxed{", "7", "}"]
  cfg = chains.ChainsConfig(min_steps=1, max_steps=20, digits=2, ops="+-*/", max_value=999)
  for row in chains.generate_rows(300, 2, cfg):
    for text in (dataset.format_prompt(row["problem"], chains.PROMPT_TEMPLATE), chains.target_response(row["problem"])):
      ids = tokenizer(text)["input_ids"]
      assert ids[0] == tokenizer.bos_token_id and tokenizer.unk_token_id not in ids
      assert len(ids) == len(text.replace("\\boxed{", "#")) + 1  # one token per character, BOS first
      assert tokenizer.decode(ids, skip_special_tokens=True) == text
  prompt_ids, response_ids = chains.supervised_pair(tokenizer, "(17+25)*3-9")
  assert response_ids[-1] == tokenizer.eos_token_id
  assert tokenizer.decode(prompt_ids + response_ids, skip_special_tokens=True) == (
      "(17+25)*3-9=42*3-9=126-9=117 \\boxed{117}")


def _task_sets(c):
  """A chains config's warm-start corpus, RL prompts and test problems, as the run loads them."""
  from astarpo_jax import run_inputs
  return (run_inputs.load_set(c, "chains", "warmstart"), run_inputs.load_set(c, "chains", "train")[:c.data.num_train],
          run_inputs.load_set(c, "chains", "test"))


def _operations(examples) -> set[int]:
  return {len(chains.parse_steps(e.problem)[1]) for e in examples}


def test_rl_prompts_are_fresh_and_run_past_the_warm_start_corpus_which_the_config_leaves_as_before():
  from astarpo_jax import run_inputs
  from configs import chains as chains_config
  c = chains_config.get_config("full")
  s = c.data.chains
  corpus, train, test = _task_sets(c)
  eight = chains.ChainsConfig(min_steps=2, max_steps=8, digits=1, ops="+-", max_value=99)
  assert [e.problem for e in corpus] == [r["problem"] for r in chains.generate_rows(s.num_train, 0, eight)]
  assert _operations(corpus) == set(range(2, 9)) and _operations(train) == _operations(test) == set(range(2, 10))
  seen = {e.problem for e in corpus}
  assert len(train) == c.data.num_train and not seen & {e.problem for e in train}
  assert not seen & {e.problem for e in test} and len(test) == s.num_test
  s.fresh_prompts = False  # then the prompts are the generator's first rows, some of them in the corpus
  nine = chains.ChainsConfig(min_steps=2, max_steps=9, digits=1, ops="+-", max_value=99)
  plain = run_inputs.load_set(c, "chains", "train")
  assert [e.problem for e in plain] == [r["problem"] for r in chains.generate_rows(s.num_train, 0, nine)]
  assert seen & {e.problem for e in plain}
  one = chains.ChainsConfig(min_steps=1, max_steps=1, digits=1, ops="+-", max_value=99)  # ~140 train problems
  with pytest.raises(RuntimeError, match="widen the config"):
    chains.fresh_rows(50, 0, one, {r["problem"] for r in chains.generate_rows(100, 0, one)})


def test_long_variant_gives_solutions_of_tens_to_over_two_hundred_tokens_within_its_caps(tokenizer):
  """configs/chains.py:long: prompts and test problems of 2..14 operations, the corpus one shorter and apart;
  every gold solution (EOS included) fits max_new_tokens, and the prompt bucket plus it the model's positions."""
  from astarpo_jax.sampling import sampler
  from configs import chains as chains_config
  c = chains_config.get_config("long")
  corpus, train, test = _task_sets(c)
  assert _operations(corpus) == set(range(2, 14)) and _operations(train) == _operations(test) == set(range(2, 15))
  assert not {e.problem for e in corpus} & {e.problem for e in train + test}
  gold = np.array([len(tokenizer(chains.target_response(e.problem))["input_ids"]) for e in train + test])  # + BOS
  prompts = [len(tokenizer(dataset.format_prompt(e.problem, chains.PROMPT_TEMPLATE))["input_ids"]) for e in train + test]
  assert gold.min() < 20 and gold.max() > 200 and np.median(gold) > 60  # BOS stands for the EOS
  assert gold.max() <= c.sampling.max_new_tokens and max(prompts) <= c.data.max_prompt_tokens
  assert sampler.bucket_length(max(prompts)) + c.sampling.max_new_tokens <= c.model.random.max_position_embeddings


def _main(*args, timeout=600):
  return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "main.py"), *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout, env=dict(os.environ, HF_HUB_OFFLINE="1"))


def test_config_validates_for_every_method():
  from astarpo_jax import methods, run_config
  from configs import chains as chains_config
  for variant in ("full", "long", "quick", "test"):
    for name in methods.names():
      c = chains_config.get_config(variant)
      c.algo.name = name
      run_config.validate_config(c)


def test_tiny_run_through_main_warm_starts_runs_stage1_trains_and_evaluates(tmp_path):
  run = _main("--config=configs/chains.py:test", f"--workdir={tmp_path}")
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.loads((tmp_path / "report.json").read_text())
  assert report["stage1_summary"]["num_prompts"] == 64
  for which in ("reference_eval", "final_eval"):
    assert 0.0 <= report[which]["chains/pass@1"]["accuracy"] <= 1.0
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in rows if "train/sec_step" in r]
  assert len(train) == 2 and all(r["train/response_length"] > 0 for r in train)
  assert (tmp_path / "reference" / "config.json").exists() and (tmp_path / "tokenizer").is_dir()


def test_validation_problems_are_held_out_apart_from_the_test_problems_which_they_leave_as_before():
  """An lr sweep's runs (data.chains.heldout = 'val') are evaluated on problems that are neither training
  prompts, nor warm-start rows, nor the test problems the tables report; the test problems do not move."""
  from configs import chains as chains_config
  c = chains_config.get_config("paper")
  corpus, train, test = _task_sets(c)
  c.data.chains.heldout = "val"
  _, _, val = _task_sets(c)
  assert len(val) == c.data.chains.num_val and len({e.problem for e in val}) == len(val)
  assert not {e.problem for e in val} & {e.problem for e in corpus + train + test}
  assert all(chains.split_of(e.problem) == "test" for e in val)  # the hash split: never a training problem
  s = c.data.chains
  nine = chains.ChainsConfig(min_steps=s.min_steps, max_steps=s.max_steps, digits=1, ops="+-", max_value=99)
  assert [e.problem for e in test] == [r["problem"] for r in chains.generate_rows(s.num_test, 0, nine, "test")]


def test_a_plain_run_of_each_method_gets_the_tasks_lr_for_it_and_an_explicit_lr_wins():
  from astarpo_jax import run_config
  from configs import chains as chains_config
  c = chains_config.get_config("long")
  got = {}
  for name in ("astarpo", "grpo", "ppo", "rebel", "rloo"):
    c.algo.name = name
    run_config.validate_config(c)
    got[name] = run_config.policy_lr(c)
  assert got == {"astarpo": 1e-5, "grpo": 3e-5, "ppo": 1e-5, "rebel": 1e-5, "rloo": 3e-5}  # run 8's, set by hand
  c.optim.lr = 2e-5
  assert run_config.policy_lr(c) == 2e-5
  c.optim.lr, c.optim.lr_by_algo = 0.0, {"grpo": 3e-5}
  c.algo.name = "astarpo"
  with pytest.raises(ValueError, match=r"optim.lr: must be > 0, or 0 with optim.lr_by_algo.astarpo set"):
    run_config.validate_config(c)
