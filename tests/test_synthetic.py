"""Synthetic sums: correct targets, disjoint splits, short sequences, an HF-loadable tokenizer."""
import json
import re

import pytest

from astarpo_jax.data import dataset, synthetic
from astarpo_jax.rewards.answers import last_boxed

HARD = synthetic.SyntheticConfig(min_terms=3, max_terms=3, max_digits=2)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  from transformers import AutoTokenizer
  directory = synthetic.save_tokenizer(str(tmp_path_factory.mktemp("synthetic_tok")))
  return AutoTokenizer.from_pretrained(directory)


def test_gold_is_the_sum_and_target_box_equals_gold():
  examples, stats = synthetic.load_synthetic(500, seed=0)
  assert stats.kept == 500
  for ex in examples:
    assert re.fullmatch(r"\d{1,2}(\+\d{1,2}){1,2}", ex.problem)
    assert int(ex.gold) == eval(ex.problem)  # digits and '+' only, checked above
    assert last_boxed(synthetic.target_response(ex.problem)) == ex.gold


def test_worked_steps_are_true_equations_ending_in_the_box():
  assert synthetic.target_response("12+34+5") == "46+5=51 \\boxed{51}"
  assert synthetic.target_response("12+34") == "\\boxed{46}"
  assert synthetic.target_response("12+34+5", worked_step=False) == "\\boxed{51}"
  for ex in synthetic.load_synthetic(200, seed=1, cfg=synthetic.SyntheticConfig(max_terms=4))[0]:
    response = synthetic.target_response(ex.problem)
    steps = re.findall(r"(\d+)\+(\d+)=(\d+) ", response)
    assert len(steps) == ex.problem.count("+") - 1
    assert all(int(a) + int(b) == int(c) for a, b, c in steps)


def test_generation_is_deterministic_and_train_test_never_share_a_problem():
  assert synthetic.generate_rows(50, 3) == synthetic.generate_rows(50, 3)
  assert synthetic.generate_rows(50, 3) != synthetic.generate_rows(50, 4)
  train = {r["problem"] for r in synthetic.generate_rows(3000, 0)}
  test = {r["problem"] for r in synthetic.generate_rows(400, 0, split="test")}
  assert len(test) > 300 and not train & test


def test_difficulty_knobs_bound_terms_and_digits():
  easy = synthetic.SyntheticConfig(min_terms=2, max_terms=2, max_digits=1)
  for row in synthetic.generate_rows(200, 0, easy):
    assert re.fullmatch(r"\d\+\d", row["problem"])
  with pytest.raises(ValueError, match="min_terms"):
    synthetic.SyntheticConfig(min_terms=1)
  with pytest.raises(ValueError, match="max_digits"):
    synthetic.SyntheticConfig(max_digits=4)


def test_tokenizer_loads_from_hf_dir_with_small_vocab_pad_eos_and_one_box_token(tokenizer):
  from transformers import PreTrainedTokenizerFast
  assert isinstance(tokenizer, PreTrainedTokenizerFast)
  assert len(tokenizer) < 64
  assert tokenizer.pad_token == "<pad>" and tokenizer.eos_token == "<eos>"
  assert len({tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id}) == 3
  ids = tokenizer("\\boxed{7}", add_special_tokens=False)["input_ids"]
  assert tokenizer.convert_ids_to_tokens(ids) == ["\\boxed{", "7", "}"]


def test_tokenizer_round_trips_every_prompt_and_target_exactly(tokenizer):
  examples = synthetic.load_synthetic(1000, seed=2, cfg=synthetic.SyntheticConfig(max_terms=4,
                                                                                  max_digits=3))[0]
  for ex in examples:
    for text in (dataset.format_prompt(ex.problem, synthetic.PROMPT_TEMPLATE),
                 synthetic.target_response(ex.problem)):
      ids = tokenizer(text)["input_ids"]
      assert ids[0] == tokenizer.bos_token_id and tokenizer.unk_token_id not in ids
      assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_prompts_and_targets_stay_under_24_tokens_for_default_and_three_term_configs(tokenizer):
  for cfg in (synthetic.SyntheticConfig(), HARD):
    problems = [ex.problem for ex in synthetic.load_synthetic(500, seed=0, cfg=cfg)[0]]
    for problem in problems + ["99+99+99"]:  # the longest three-term, two-digit problem
      prompt_ids, response_ids = synthetic.supervised_pair(tokenizer, problem)
      assert len(prompt_ids) < 24 and len(response_ids) < 24
      assert response_ids[-1] == tokenizer.eos_token_id


def test_supervised_pair_decodes_to_prompt_then_correct_response(tokenizer):
  prompt_ids, response_ids = synthetic.supervised_pair(tokenizer, "7+15+30")
  assert tokenizer.decode(prompt_ids + response_ids, skip_special_tokens=True) == (
      "7+15+30=22+30=52 \\boxed{52}")


def test_synthetic_rows_load_through_the_generic_local_loader(tmp_path, tokenizer):
  rows = synthetic.generate_rows(40, seed=9)
  path = str(tmp_path / "synthetic.jsonl")
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
  from_file, stats = dataset.load_examples(path, synthetic.FIELDS, name="synthetic_train")
  assert stats.kept == 40
  assert from_file == synthetic.load_synthetic(40, seed=9)[0]
  prompts, pstats = dataset.build_prompts(from_file, tokenizer, template=synthetic.PROMPT_TEMPLATE)
  assert pstats.too_long == 0
  assert prompts[0].text == rows[0]["problem"] + "="
