"""The official A*-PO graders: verdicts worked out by hand from verl/utils/reward_score/math.py and gsm8k.py.

Stage defaults (official code paths):
  MATH Stage 1   "hendrycks", truncated=None   compute_score_preprocessing(response)       no EOS rule
  MATH Stage 2   "hendrycks", truncated=flags  compute_score(prompt + response [+ EOS])     truncated: 0
  GSM8K Stage 1  "gsm8k_flexible", None        compute_score(response, method='flexible')
  GSM8K Stage 2  "gsm8k_strict", None          compute_score(prompt + response, 'strict')  no EOS rule
"""
import json
import os

import pytest

from astarpo_jax.rewards import answers, grading
from tests.data_paths import DATA_ROOTS
from tests.test_grading import grade_one


def _math(response, gold, stage, truncated=False):
  flags = None if stage == 1 else [truncated]
  return float(grading.grade_batch([response], [gold], "hendrycks", truncated=flags).rewards[0])


# (response, gold, Stage 1, Stage 2 when the response ended with EOS)
MATH_CASES = [
    ("So $x = \\boxed{5}$.", "5", 1, 1),
    ("The answer is 5.", "5", 0, 0),  # no box: nothing extracted
    ("\\boxed{3} no wait \\boxed{4}", "4", 1, 1),  # the last box counts
    ("\\boxed{3} no wait \\boxed{4}", "3", 0, 0),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1, 1),
    # `"\boxed " in string`: the text after the last "\boxed " up to the first "$" ...
    ("so \\boxed 5$.", "5", 1, 1),
    # ... or to the end: in Stage 2 the end is the decoded EOS, so the answer is "5<|endoftext|>"
    ("so \\boxed 5", "5", 1, 0),
    # `\boxed {42}` has "\boxed " too: the answer is "{42}", whose braces strip_string keeps
    ("\\boxed {42}", "42", 0, 0),
    # the space form wins over a later braced box: answer "3 and later \boxed{4}"
    ("x \\boxed 3 and later \\boxed{4}", "4", 0, 0),
    ("so \\fbox{5}", "5", 0, 0),  # remove_boxed asserts a "\boxed{" prefix: raises, scored 0
    ("\\boxed\n{5}", "5", 0, 0),  # brace counting finds "{5}", but the span starts "\boxed\n": assert
    ("\\boxed{5", "5", 0, 0),  # unbalanced: no span
    ("\\boxed{}", "5", 0, 0),
    # is_equiv compares normalised strings, never values:
    ("\\boxed{1,200}", "1200", 0, 0),
    ("\\boxed{\\$1,200}", "1200", 0, 0),  # `\$` is stripped, the comma is not
    ("\\boxed{\\$1,200}", "1,200", 1, 1),
    ("\\boxed{18.00}", "18", 0, 0),
    ("\\boxed{27}", "27.0", 0, 0),  # AMC23's float gold
    ("\\boxed{25}", "025", 0, 0),  # AIME24's zero-padded gold
    ("\\boxed{0.375}", "\\frac{3}{8}", 0, 0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1, 1),  # the one decimal strip_string rewrites
    ("\\boxed{\\dfrac{1}{2}}", "\\frac12", 1, 1),  # dfrac -> frac, \frac12 -> \frac{1}{2}
    ("\\boxed{3/4}", "\\frac{3}{4}", 1, 1),  # fix_a_slash_b on integers
    ("\\boxed{x = 5}", "5", 1, 1),  # "x " is at most 2 chars before the only "="
    ("\\boxed{5\\text{ cm}}", "5", 1, 1),  # remove_right_units
    ("\\boxed{10\\%}", "10", 1, 1),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 0, 0),
    ("\\boxed{x/y}", "x/y", 1, 1),  # int('x') raises: is_equiv compares the raw strings
]


@pytest.mark.parametrize("response,gold,stage1,stage2", MATH_CASES)
def test_math_official_verdicts_in_stage1_and_stage2(response, gold, stage1, stage2):
  assert _math(response, gold, stage=1) == stage1
  assert _math(response, gold, stage=2) == stage2


@pytest.mark.parametrize("response,gold", [(r, g) for r, g, _, _ in MATH_CASES])
def test_math_stage2_scores_truncated_responses_zero(response, gold):
  assert _math(response, gold, stage=2, truncated=True) == 0  # no "<|endoftext|>" at the end


def test_math_stage2_text_already_ending_with_eos_is_read_once():
  assert _math("so \\boxed 5$" + answers.EOS_TEXT, "5", stage=2) == 1


# (response, gold, Stage 1 flexible, Stage 2 strict)
GSM8K_CASES = [
    ("So she pays 18 dollars.\n#### 18", "18", 1, 1),
    ("#### 18\nWait, maybe 20.", "18", 0, 1),  # flexible: "20."; strict: the first "#### "
    ("The answer is 18.", "18", 0, 0),  # flexible keeps the period: "18." != "18"
    ("The answer is 18", "18", 1, 0),
    ("It costs $18, right?", "18", 0, 0),  # flexible: "18," (the comma is part of the run)
    ("The answer: 18 .", "18", 1, 0),  # a lone "." is skipped
    ("#### 1,234", "1234", 0, 1),  # strict drops commas, flexible does not
    ("The total is 1,000 apples", "1000", 0, 0),
    ("#### $5", "5", 1, 0),  # "#### $" is no strict match; flexible finds "5"
    ("#### 5\n#### 6", "5", 0, 1),  # re.search: the first "#### " counts
    ("#### 5\n#### 6", "6", 1, 0),
    ("#### 5.", "5", 0, 0),
    ("#### 5.00", "5", 0, 0),
    ("#### 18.0", "18", 0, 0),
    ("#### -3", "-3", 1, 1),
    ("####18", "18", 1, 0),  # strict needs "#### " with the space
    ("so 5 - 3 = 2\n#### 2", "2", 1, 1),
    ("between 18-20", "18", 0, 0),  # flexible: the last run is "-20"
    (". . .", "18", 0, 0),  # every run is ".": flexible returns "."
    ("", "18", 0, 0),
]


@pytest.mark.parametrize("response,gold,flexible,strict", GSM8K_CASES)
def test_gsm8k_official_verdicts_stage1_flexible_and_stage2_strict(response, gold, flexible, strict):
  assert grade_one(response, gold, "gsm8k_flexible") == flexible
  assert grade_one(response, gold, "gsm8k_strict") == strict


def test_gsm8k_reference_answer_as_gold_is_reduced_by_the_official_rule():
  gold = "She has 1,000 apples.\n#### 1,000"  # the preprocessing keeps "1000"
  assert grading.gold_answer("gsm8k_strict", gold) == "1000"
  assert grade_one("#### 1,000", gold, "gsm8k_strict") == 1
  assert grade_one("so 1,000", gold, "gsm8k_flexible") == 0


def test_official_graders_ignore_truncation_unless_flags_are_passed():
  # Stage 1 and GSM8K Stage 2 have no EOS rule: the caller passes truncated=None.
  assert grading.grade_batch(["\\boxed{5}"], ["5"], "hendrycks").rewards.tolist() == [1.0]
  assert grading.grade_batch(["#### 5"], ["5"], "gsm8k_strict").rewards.tolist() == [1.0]


@pytest.mark.parametrize("root", DATA_ROOTS)
def test_official_flexible_rule_misses_exactly_the_references_with_commas(root):
  refs = []
  for split in ("train", "test"):
    with open(os.path.join(root, "gsm8k", f"{split}.jsonl")) as f:
      refs += [json.loads(line)["answer"] for line in f][:1000]
  result = grading.grade_batch(refs, refs, "gsm8k_flexible")
  with_comma = [("," in r.rsplit("####", 1)[1]) for r in refs]
  assert any(with_comma)
  assert result.rewards.tolist() == [0.0 if c else 1.0 for c in with_comma]
  assert grading.grade_batch(refs, refs, "gsm8k_strict").rewards.mean() == 1.0
