"""Graders on real data (gold solutions score 1, perturbed answers 0), known traps, hostile input."""
import json
import os
import random
import time
from fractions import Fraction

import pytest
import sympy

from astarpo_jax.rewards import answers, grading
from tests.data_paths import DATA_ROOTS, FIXTURES


def grade_one(response, gold, grader: str = "math_verify", truncated: bool | None = None) -> float:
  """Reward of one response, in-process (grading.grade_batch of one item)."""
  return float(grading.grade_batch([response], [gold], grader, None if truncated is None else [truncated]).rewards[0])


def _rows(name, root=FIXTURES):
  with open(os.path.join(root, name, "test.jsonl")) as f:
    return [json.loads(line) for line in f]


def _boxed(answer):
  return f"Some reasoning first.\nSo the final answer is $\\boxed{{{answer}}}$."


def _distinct_pairs(gold_answers, shift=7):
  """(pred, gold) pairs taking another row's answer, where the two differ as strings and as numbers."""
  out = []
  for i, gold in enumerate(gold_answers):
    pred = gold_answers[(i + shift) % len(gold_answers)]
    a, b = answers.plain_number(pred), answers.plain_number(gold)
    if answers.hendrycks_strip(pred) == answers.hendrycks_strip(gold) or (a is not None and a == b):
      continue
    out.append((pred, gold))
  return out


# --- Real data: gold solutions score 1 -------------------------------------------------------------

@pytest.mark.parametrize("root", DATA_ROOTS)
@pytest.mark.parametrize("grader", ["math_verify", "hendrycks"])
def test_math500_gold_solution_scores_one_against_answer_field(grader, root):
  rows = _rows("math500", root)
  if grader == "math_verify":
    rows = random.Random(0).sample(rows, min(150, len(rows)))
  result = grading.grade_batch([r["solution"] for r in rows], [r["answer"] for r in rows], grader)
  assert result.rewards.shape == (len(rows),) and result.rewards.dtype.name == "float32"
  assert result.rewards.mean() == 1.0, [r["answer"] for r, x in zip(rows, result.rewards) if x != 1]
  assert result.num_errors == result.num_timeouts == result.num_rejected == 0


@pytest.mark.parametrize("root", DATA_ROOTS)
def test_minerva_gold_solution_scores_one_with_math_verify(root):
  rows = _rows("minerva_math", root)
  rows = random.Random(1).sample(rows, min(80, len(rows)))
  golds = [answers.last_boxed(r["solution"]) for r in rows]
  result = grading.grade_batch([r["solution"] for r in rows], golds)
  assert result.rewards.mean() == 1.0 and result.num_errors == 0


@pytest.mark.parametrize("root", DATA_ROOTS)
@pytest.mark.parametrize("name", ["aime24", "amc23"])
@pytest.mark.parametrize("grader", ["math_verify", "hendrycks_lenient"])
def test_competition_integer_answers_match_float_golds(name, grader, root):
  # amc23 golds are floats like 27.0, aime24 golds strings like "025"; a model writes 27, 25. (The
  # official "hendrycks" compares strings: 0 for both, see test_official_graders.py.)
  rows = _rows(name, root)
  preds = [_boxed(int(float(r["answer"]))) for r in rows]
  result = grading.grade_batch(preds, [r["answer"] for r in rows], grader)
  assert result.rewards.mean() == 1.0


@pytest.mark.parametrize("root", DATA_ROOTS)
def test_gsm8k_reference_solutions_score_one_under_both_rules(root):
  # The official flexible rule keeps commas (`1,080` != `1080`): see test_official_graders.py.
  rows = _rows("gsm8k", root)[:400]
  for grader in ("gsm8k_strict", "gsm8k_strict_lenient", "gsm8k_flexible_lenient"):
    result = grading.grade_batch([r["answer"] for r in rows], [r["answer"] for r in rows], grader)
    assert result.rewards.mean() == 1.0, grader


# --- Real data: perturbed answers score 0 ----------------------------------------------------------

@pytest.mark.parametrize("root", DATA_ROOTS)
@pytest.mark.parametrize("grader", ["math_verify", "hendrycks"])
def test_math500_other_rows_answers_score_zero(grader, root):
  pairs = _distinct_pairs([r["answer"] for r in _rows("math500", root)])
  if grader == "math_verify":
    pairs = random.Random(2).sample(pairs, min(150, len(pairs)))
  result = grading.grade_batch([_boxed(p) for p, _ in pairs], [g for _, g in pairs], grader)
  assert result.rewards.sum() == 0, [pair for pair, x in zip(pairs, result.rewards) if x]
  assert result.num_errors == 0


@pytest.mark.parametrize("root", DATA_ROOTS)
def test_numeric_golds_off_by_one_or_extra_digits_score_zero(root):
  golds = [r["answer"] for r in _rows("math500", root) if answers.plain_number(r["answer"]) is not None]
  golds += [str(r["answer"]) for r in _rows("aime24", root)]
  ints = [g for g in golds if g.isdigit() and g != "0"]  # the `200` vs `2` trap
  preds = [str(answers.plain_number(g) + 1) for g in golds] + [g + "00" for g in ints]
  result = grading.grade_batch([_boxed(p) for p in preds], golds + ints)
  enough = 100 if root != FIXTURES else 30
  assert len(golds) > enough and len(ints) > enough and result.rewards.sum() == 0


@pytest.mark.parametrize("root", DATA_ROOTS)
def test_gsm8k_perturbed_final_numbers_score_zero(root):
  rows = _rows("gsm8k", root)[:300]
  golds = [answers.gsm8k_gold(r["answer"]) for r in rows]
  wrong = [r["answer"].rsplit("####", 1)[0] + f"#### {int(float(g)) + 1}" for r, g in zip(rows, golds)]
  for grader in ("gsm8k_strict", "gsm8k_flexible", "gsm8k_strict_lenient", "gsm8k_flexible_lenient"):
    assert grading.grade_batch(wrong, golds, grader).rewards.sum() == 0, grader


# --- GSM8K lenient rules (the official ones: test_official_graders.py) -----------------------------

@pytest.mark.parametrize("response,strict,flexible", [
    ("So she pays 18 dollars.\n#### 18", 1, 1),
    ("#### 18\nWait, maybe 20.", 1, 0),  # strict: the first `#### `; flexible: the last number
    ("The answer is 18.", 0, 1),  # no `####`: strict fails; the trailing period is not part of it
    ("The answer is $18, right?", 0, 1),
    ("#### 1,8", 1, 1),  # commas removed as in the official rule
    ("#### 18.0", 1, 1),  # same value
    ("#### 180", 0, 0),
    ("####18", 0, 1),  # official strict needs the space
    ("", 0, 0),
])
def test_gsm8k_lenient_strict_and_flexible_rules(response, strict, flexible):
  assert grade_one(response, "18", "gsm8k_strict_lenient") == strict
  assert grade_one(response, "18", "gsm8k_flexible_lenient") == flexible


def test_gsm8k_gold_may_be_the_full_reference_answer():
  assert grade_one("#### 1000", "She has 1,000 apples.\n#### 1,000", "gsm8k_strict") == 1


# --- MATH traps ----------------------------------------------------------------------------------

TRAPS = [  # (pred, gold, expected reward under math_verify)
    ("\\frac{1}{2^{99}}", "\\frac{1}{2^{98}}", 0), ("1/2^{99}", "\\frac{1}{2^{99}}", 1),
    ("200", "2", 0), ("2", "200", 0), ("0.5", "\\frac{1}{2}", 1), ("1,000", "1000", 1),
    ("1{,}000", "1000", 1), ("\\dfrac{3}{4}", "\\frac34", 1), ("27", "27.0", 1), ("27.5", "27", 0),
    ("\\{1,2\\}", "\\{2,1\\}", 1), ("\\{1,2\\}", "\\{1,3\\}", 0), ("[1,2)", "[1,2)", 1),
    ("[1,2)", "[1,2]", 0), ("(-\\infty, 3]", "(-\\infty,3]", 1), ("30^\\circ", "30", 1),
    ("30^{\\circ}", "60", 0), ("\\text{(B)}", "\\text{(B)}", 1), ("\\text{(B)}", "\\text{(C)}", 0),
    ("B", "\\text{(B)}", 1), ("x=5", "5", 1), ("\\sqrt{2}/2", "\\frac{\\sqrt2}{2}", 1),
    ("2\\sqrt{2}", "\\sqrt{8}", 1), ("\\pi", "3.14", 0),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", 1),
    ("\\begin{pmatrix} 1 \\\\ 3 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", 0),
]


@pytest.mark.parametrize("pred,gold,expected", TRAPS)
def test_math_verify_known_traps(pred, gold, expected):
  assert grade_one(_boxed(pred), gold) == expected


@pytest.mark.parametrize("pred,gold,expected", [
    ("\\dfrac{3}{4}", "\\frac34", 1), ("0.5", "\\frac{1}{2}", 1), ("k = 5", "5", 1),
    ("5\\text{ cm}", "5", 1), ("3/4", "\\frac{3}{4}", 1), ("\\sqrt3", "\\sqrt{3}", 1),
    ("10^\\circ", "10", 1), ("\\left( 1, 2 \\right)", "(1,2)", 1), ("27", "27.0", 1),
    ("1,000", "1000", 1), ("200", "2", 0), ("\\{1,2\\}", "\\{2,1\\}", 0), ("x/y", "\\frac{x}{y}", 0),
])
def test_hendrycks_lenient_normalisation_cases(pred, gold, expected):
  assert grade_one(_boxed(pred), gold, "hendrycks_lenient") == expected


def test_hendrycks_strip_matches_the_math_repo_rules():
  strip = answers.hendrycks_strip
  assert strip("\\dfrac12") == "\\frac{1}{2}"
  assert strip("\\frac1{72}") == "\\frac{1}{72}"
  assert strip(" .5") == "\\frac{1}{2}" and strip(".25") == "0.25"
  assert strip("0.5") == "\\frac{1}{2}"
  assert strip("x = \\left(3\\right)") == "(3)"
  assert strip("10\\%") == "10"
  assert strip("5 \\text{ inches}") == "5"
  with pytest.raises(ValueError):  # not integers: the original raises and is_equiv compares raw
    strip("x/y")
  assert answers.hendrycks_is_equiv("x/y", "x/y") and not answers.hendrycks_is_equiv("x/y", "y/x")


@pytest.mark.parametrize("grader", list(grading.GRADERS))
def test_truncated_flags_zero_truncated_rows_under_every_grader(grader):
  resp = "So 2 + 16 = 18.\n#### 18" if grader.startswith("gsm8k") else _boxed("\\frac{1}{2}")
  gold = "18" if grader.startswith("gsm8k") else "\\frac{1}{2}"
  result = grading.grade_batch([resp, resp], [gold, gold], grader, truncated=[True, False])
  assert result.rewards.tolist() == [0.0, 1.0] and result.num_truncated == 1 and result.num_no_answer == 0
  assert grading.grade_batch([resp], [gold], grader, truncated=None).rewards.tolist() == [1.0]


def test_last_box_counts_and_fbox_is_accepted():
  assert grade_one("\\boxed{3} no wait \\boxed{4}", "4") == 1
  assert grade_one("\\boxed{4} no wait \\boxed{3}", "4") == 0
  assert grade_one("so \\fbox{4}", "4") == 1


@pytest.mark.parametrize("text,value", [
    ("27.0", 27), ("-1,000", -1000), (".5", Fraction(1, 2)), ("\\dfrac{3}{4}", Fraction(3, 4)),
    ("-\\frac{1}{2}", Fraction(-1, 2)), ("3/4", Fraction(3, 4)), ("30^\\circ", 30), ("\\$5", 5),
    ("2^{10}", None), ("1,2", None), ("10,00", None), ("1e5", None), ("1_000", None),
    ("\\frac{1}{0}", None), ("50\\%", None), ("x", None), ("9" * 5000, None),
])
def test_plain_number_parses_only_plain_numbers(text, value):
  assert answers.plain_number(text) == value


# --- Hostile input ---------------------------------------------------------------------------------

def _code_attacks(marker):
  cmd = f"__import__('os').system('touch {marker}')"
  return [cmd, f"\\text{{{cmd}}}", f"\\operatorname{{eval}}(\"{cmd}\")", f"x_{{{cmd}}}",
          f"exec(\"{cmd}\")", f"(lambda: {cmd})()", f"{cmd}#", f"$${cmd}$$", f"1+{cmd}"]


@pytest.mark.parametrize("grader", list(grading.GRADERS))
def test_code_in_answers_is_never_executed(tmp_path, grader):
  marker = tmp_path / "MARKER"
  attacks = _code_attacks(marker)
  responses = [_boxed(a) for a in attacks] + [f"#### {a}" for a in attacks] + attacks
  result = grading.grade_batch(responses, ["5"] * len(responses), grader, timeout_s=5)
  assert result.rewards.sum() == 0
  assert not marker.exists()


def test_string_eval_tripwire_refuses_code_and_restores_sympy(tmp_path):
  marker = tmp_path / "MARKER"
  with grading.no_string_eval():
    with pytest.raises(grading.UnsafeInput):
      sympy.sympify(f"__import__('os').system('touch {marker}')")
    assert sympy.sympify("12") == 12  # numbers still go through (latex2sympy builds numbers so)
  assert not marker.exists()
  assert sympy.sympify("x + 1") == sympy.Symbol("x") + 1
  with grading.no_string_eval(), grading.no_string_eval():  # nested: restored only by the outer exit
    pass
  assert sympy.sympify("x + 2") == sympy.Symbol("x") + 2


@pytest.mark.parametrize("answer", [
    "9^{9^{9^9}}", "(10^9)!", "10^{10^{10}}", "2^{2^{2^{2^{2^{2}}}}}", "(" * 3000 + "1" + ")" * 3000,
    "{" * 20 + "1" + "}" * 20, "1+" * 5000 + "1",
])
def test_bombs_are_rejected_before_evaluation(answer):
  t0 = time.monotonic()
  result = grading.grade_batch([_boxed(answer)], ["5"], timeout_s=5)
  assert result.rewards[0] == 0 and result.num_rejected == 1
  assert time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("response", [
    "x" * 3_000_000 + "\\boxed{5", "\\boxed{}", "\\boxed{ }", "}" * 10_000 + "\\boxed{", "\\boxed", None,
])
def test_unbalanced_empty_or_huge_responses_score_zero(response):
  result = grading.grade_batch([response], ["5"])
  assert result.rewards[0] == 0 and result.num_no_answer == 1


def test_megabytes_of_text_before_the_answer_are_fine():
  assert grade_one("blah " * 500_000 + "\\boxed{5}", "5") == 1


# --- Input validation --------------------------------------------------------------------------------

def test_bad_batches_raise_clear_errors():
  with pytest.raises(ValueError, match="unknown grader"):
    grading.grade_batch(["a"], ["1"], "nope")
  with pytest.raises(ValueError, match="2 responses but 1 golds"):
    grading.grade_batch(["a", "b"], ["1"])
  with pytest.raises(ValueError, match="truncated"):
    grading.grade_batch(["a"], ["1"], truncated=[True, False])
  with pytest.raises(ValueError, match="gold 1: empty"):
    grading.grade_batch(["a", "b"], ["1", " "])
  with pytest.raises(ValueError, match="gold 0: .*not finite"):
    grading.grade_batch(["a"], [float("nan")])
  with pytest.raises(TypeError, match="response 0"):
    grading.grade_batch([5], ["5"])
