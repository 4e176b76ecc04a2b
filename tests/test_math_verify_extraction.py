"""The math_verify grader reads answers where models put them, without reading what is not an answer.

Each category: answers math-verify's own extraction would find (positives, reward 1) and near misses
that are not the stated final answer or not equal to the gold (reward 0), by hand.
"""
import json
import os
import time

import pytest

from astarpo_jax.rewards import answers, grading
from tests.data_paths import DATA_ROOTS
from tests.test_grading import grade_one

CASES = {  # category -> (positives [(response, gold)], near-miss negatives [(response, gold)])
    "final_answer_phrase": ([
        ("Final Answer: The final answer is 120. I hope it is correct.", "120"),
        ("Final Answer: The final answer is $\\frac{3}{4}$. I hope it is correct.", "\\frac34"),
        ("The final answer is 0.75", "\\frac{3}{4}"),
        ("Therefore, the final answer is: $x = 7$.", "7"),
        ("My final answer is \\(2\\sqrt{2}\\).", "\\sqrt{8}"),
        ("so the final answer is -12", "-12"),
        ("The final answer is **42**.", "42"),
        ("The final answer to the question is 1,024.", "1024"),
        ("Final answer: 36", "36"),
        ("Final Answer: The final answer is $(1, 2)$. I hope it is correct.", "(1,2)"),
        ("Putting it together, the final answer is $\\pi$.", "\\pi"),
    ], [
        ("Final Answer: The final answer is 121. I hope it is correct.", "120"),
        ("The final answer is 43 = 42.", "42"),  # an equation is not its right-hand side
        ("The final answer is $43 = 42$.", "42"),
        ("The final answer is 4t.", "4"),
        ("The final answer is $4t$.", "4"),
        ("The final answer is 5 apples and 3 pears.", "5"),
        ("The final answer is 12. Checking: 3 \\times 4 = 12, plus 1 gives 13.", "12"),  # more working after
        ("To get the final answer, we compute 3 + 4 = 7 and then 7 \\times 6 = 42.", "7"),
        ("The final answer is 1200", "120"),
        ("The final answer is 12, 13", "12"),
        ("The final answer is 3 times larger.", "3"),
        ("Final answer: 2e.", "2"),
    ]),
    "hashes_on_math_prompt": ([
        ("so the total is 40 + 2.\n#### 42", "42"),
        ("#### 1,024", "1024"),
        ("#### -7", "-7"),
        ("#### 3/4", "\\frac{3}{4}"),
        ("#### 0.5", "\\frac12"),
        ("#### $\\frac{1}{2}$", "0.5"),
        ("#### 18.", "18"),
        ("#### 5.00", "5"),
        ("####42", "42"),
        ("The total is 18 dollars.\n#### $18", "18"),
        ("#### $2\\sqrt{2}$", "\\sqrt{8}"),
    ], [
        ("#### 41", "42"),
        ("#### 42 apples and 3 pears", "42"),
        ("#### 42\nActually it is 43.", "42"),
        ("#### 4t", "4"),
        ("#### 43 = 42", "42"),
        ("#### 420", "42"),
        ("#### 4.2", "42"),
        ("#### 1,2", "12"),
        ("####", "42"),
        ("# 42", "42"),
        ("#### -42", "42"),
    ]),
    "answer_word": ([
        ("Answer \\[ 9 \\]", "9"),
        ("Answer:\n\\[ \\frac{1}{2} \\]", "0.5"),
        ("So the answer is $12$.", "12"),
        ("The answer is \\(x^2 + 1\\).", "1 + x^2"),
        ("**Answer:** $\\{1, 2\\}$", "\\{2, 1\\}"),
        ("Answer: 36", "36"),
        ("The answer is: 1,000", "1000"),
        ("The answer is $[1, 2)$.", "[1,2)"),
        ("Thus the answer to the problem is 7.", "7"),
        ("The answer is 50%.", "50\\%"),
        ("Thus, the answer is $52_8.$", "52_8"),  # the sentence's period inside the math
        ("Answer: $$\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}$$", "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
    ], [
        ("Answer \\[ 8 \\]", "9"),
        ("The answer is $43 = 42$.", "42"),
        ("The answer is 4t.", "4"),
        ("The answer depends on x: if x = 3 then y = 9.", "9"),
        ("To find the answer, we compute 3 + 4 = 7. Then multiply by 6 to get 42.", "7"),
        ("To find the answer, we compute 3 + 4 = 7. Then multiply by 6 to get 42.", "42"),
        ("The answer is $9$ or $10$.", "9"),
        ("The answer is 9, I think, but maybe 10.", "9"),
        ("The answer is 5. Wait, 2 + 2 = 4, so the answer is wrong.", "5"),
        ("The answer is $\\frac{1}{2}$ of the total 30.", "\\frac{1}{2}"),
        ("What is the answer? It is 7 \\times 6 = 42.", "42"),
    ]),
    "several_boxes": ([
        ("The solutions are $\\boxed{1}$ and $\\boxed{2}$.", "1, 2"),
        ("\\boxed{1}, \\boxed{2}", "1,2"),
        ("\\boxed{2}, \\boxed{1}", "1, 2"),
        ("$x = \\boxed{-3}$ or $x = \\boxed{5}$", "-3, 5"),
        ("\\boxed{\\frac{1}{2}}, \\boxed{3}", "\\frac12, 3"),
        ("\\boxed{1}\\quad\\boxed{2}\\quad\\boxed{3}", "1, 2, 3"),
        ("\\boxed{1}; \\boxed{2}", "1,2"),
        ("\\boxed{-1} \\text{ and } \\boxed{1}", "-1, 1"),
        ("\\boxed{2} and \\boxed{2}", "2"),  # the same box twice is one answer
        ("The roots are \\boxed{3} and \\boxed{4}.", "3, 4"),
        ("\\boxed{1},\\boxed{2},\\boxed{3},\\boxed{4}", "1,2,3,4"),
    ], [
        ("\\boxed{3} no wait \\boxed{4}", "3, 4"),  # not separated by a separator only: the last box
        ("\\boxed{1}, \\boxed{2}", "1"),  # hedging between two answers
        ("\\boxed{1}, \\boxed{2}", "2"),
        ("$\\boxed{3}$ or $\\boxed{4}$", "4"),
        ("\\boxed{1}, \\boxed{3}", "1, 2"),
        ("\\boxed{1}, \\boxed{2}, \\boxed{3}", "1, 2"),
        ("First \\boxed{1}. Then for part b the value changes, and we find \\boxed{2}", "1, 2"),
        ("\\boxed{1} \\boxed{2}", "12"),
        ("\\boxed{5}, \\boxed{}", "5"),
        ("\\boxed{2}, \\boxed{1}", "(1, 2)"),  # an ordered pair is not a set
    ]),
    "box_with_space": ([
        ("\\boxed {42}", "42"),
        ("\\boxed  {42}", "42"),
        ("\\boxed\n{42}", "42"),
        ("\\boxed {\\frac{1}{2}}", "0.5"),
        ("\\boxed {x + 1}", "1 + x"),
        ("$\\boxed {1,000}$", "1000"),
        ("\\boxed {(1, 2)}", "(1,2)"),
        ("\\fbox {7}", "7"),
        ("\\boxed { 3 }", "3"),
        ("\\boxed {\\sqrt{2}}", "\\sqrt2"),
        ("\\boxed 5", "5"),
    ], [
        ("\\boxed {41}", "42"),
        ("\\boxed {42", "42"),
        ("\\boxed {4t}", "4"),
        ("\\boxed {43 = 42}", "42"),
        ("\\boxed {x + 2}", "x + 1"),
        ("\\boxed {420}", "42"),
        ("\\boxed {}", "42"),
        ("\\boxed {4} and later \\boxed {5}", "4"),
        ("\\boxed {\\frac{1}{3}}", "0.5"),
        ("\\boxedx {42}", "42"),
        ("\\boxed {1}, \\boxed {2}", "2"),
    ]),
    "e_notation": ([
        ("\\boxed{3.3e12}", "3.3 \\times 10^{12}"),
        ("\\boxed{3.3 \\times 10^{12}}", "3.3e12"),
        ("\\boxed{3300000000000}", "3.3e12"),
        ("\\boxed{1e-5}", "0.00001"),
        ("\\boxed{1.0e-5}", "1e-5"),
        ("\\boxed{4.5E33}", "4.5e33"),
        ("The final answer is 2.75e11.", "2.75 \\times 10^{11}"),
        ("\\boxed{-2.5e3}", "-2500"),
        ("\\boxed{6.5e-2}", "0.065"),
        ("\\boxed{1.4903e4}", "14903"),
        ("\\boxed{3e8}", "3 \\times 10^8"),
    ], [
        ("\\boxed{3.3e12}", "3.3e13"),
        ("\\boxed{3.3e12}", "3.3"),
        ("\\boxed{3.3e12}", "3.3 \\times 10^{11}"),
        ("\\boxed{2e}", "2"),  # 2e is twice Euler's number
        ("\\boxed{1e5}", "1"),
        ("\\boxed{1e5}", "15"),
        ("\\boxed{3e^{2}}", "300"),
        ("\\boxed{1e-5}", "1e5"),
        ("\\boxed{4.5e33}", "4.6e33"),
        ("\\boxed{e12}", "1e12"),
        ("\\boxed{1e999}", "1"),
    ]),
    "scale_words": ([
        ("\\boxed{5 \\text{ million}}", "5000000"),
        ("\\boxed{5\\text{ million}}", "5,000,000"),
        ("\\boxed{2.5 billion}", "2500000000"),
        ("\\boxed{3 thousand}", "3000"),
        ("The final answer is 2.5 billion.", "2.5 \\times 10^9"),
        ("\\boxed{\\$5 \\text{ million}}", "5000000"),
        ("\\boxed{1.2 \\text{million}}", "1200000"),
        ("\\boxed{4 trillion}", "4 \\times 10^{12}"),
        ("\\boxed{7\\,\\text{thousand}}", "7000"),
        ("\\boxed{3 Thousand}", "3000"),
        ("\\boxed{12 millions}", "12000000"),
        ("\\boxed{5000000}", "5 \\text{ million}"),
    ], [
        ("\\boxed{5 \\text{ million}}", "5"),
        ("\\boxed{2.5 billion}", "2.5"),
        ("\\boxed{3 thousand}", "3"),
        ("\\boxed{3 thousandths}", "3000"),
        ("\\boxed{5 \\text{ million}}", "5000"),
        ("\\boxed{2.5 billion}", "2500000"),
        ("\\boxed{5 millimeters}", "5000000"),
        ("\\boxed{\\text{million}}", "1000000"),
        ("The final answer is 3 thousand apples.", "3000"),
        ("\\boxed{3 thousand}", "300"),
        ("\\boxed{5}", "5 \\text{ million}"),
    ]),
}


def _flat(kind):
  return [pytest.param(r, g, id=f"{cat}-{i}") for cat, cases in CASES.items()
          for i, (r, g) in enumerate(cases[kind])]


def test_every_category_has_ten_positives_and_ten_near_misses():
  for cat, (pos, neg) in CASES.items():
    assert len(pos) >= 10 and len(neg) >= 10, cat


@pytest.mark.parametrize("response,gold", _flat(0))
def test_math_verify_reads_answers_where_models_put_them(response, gold):
  assert grade_one(response, gold, "math_verify") == 1


@pytest.mark.parametrize("response,gold", _flat(1))
def test_math_verify_does_not_read_near_misses(response, gold):
  assert grade_one(response, gold, "math_verify") == 0


def test_anchored_answers_are_screened_and_never_evaluated(tmp_path):
  marker = tmp_path / "MARKER"
  cmd = f"__import__('os').system('touch {marker}')"
  responses = [f"The final answer is ${cmd}$.", f"Answer: \\[{cmd}\\]", f"#### ${cmd}$",
               "The answer is $" + "{" * 20 + "1" + "}" * 20 + "$."]
  result = grading.grade_batch(responses, ["5"] * len(responses), "math_verify", timeout_s=5)
  assert result.rewards.sum() == 0 and result.num_rejected == 1 and not marker.exists()


def test_many_anchors_in_hostile_text_cost_little():
  t0 = time.monotonic()
  assert grade_one("the answer is " * 200_000 + "x", "1", "math_verify") == 0
  assert grade_one("the answer is 1 " * 200_000 + "x", "1", "math_verify") == 0
  assert grade_one("answer 7 " * 100_000 + "The answer is 7.", "7", "math_verify") == 1
  assert time.monotonic() - t0 < 2.0


def _unboxed(solution, content):
  """`solution` with its last `\\boxed{...}` replaced by the bare `content`."""
  start = solution.rfind("\\boxed{")
  end = start + len("\\boxed{") + len(answers.last_boxed(solution)) + 1
  return solution[:start] + content + solution[end:]


@pytest.mark.parametrize("root", DATA_ROOTS)
def test_unboxed_reference_solutions_are_read_right_or_not_at_all(root):
  with open(os.path.join(root, "math500", "test.jsonl")) as f:
    rows = [r for r in map(json.loads, f) if r["solution"].count("\\boxed") == 1 and "\\boxed{" in r["solution"]]
  own = [_unboxed(r["solution"], answers.last_boxed(r["solution"])) for r in rows]
  other = [_unboxed(r["solution"], rows[(i + 7) % len(rows)]["answer"]) for i, r in enumerate(rows)]
  golds = [r["answer"] for r in rows]
  read = [answers.anchored_answer(t) is not None for t in own]
  assert sum(read) >= 2  # "... so the answer is $720$." and the like
  right = grading.grade_batch(own, golds, "math_verify").rewards
  assert sum(right[k] for k in range(len(rows)) if read[k]) >= 0.9 * sum(read)
  distinct = [k for k in range(len(rows)) if grade_one(f"\\boxed{{{rows[(k + 7) % len(rows)]['answer']}}}", golds[k]) == 0]
  assert grading.grade_batch([other[k] for k in distinct], [golds[k] for k in distinct], "math_verify").rewards.sum() == 0


@pytest.mark.parametrize("answer,gold,expected", [
    ("43 = 42", "42", 0), ("4.3 = 4.2", "4.2", 0), ("2 + 2 = 5", "5", 0),
    ("6 \\times 7 = 42", "42", 1), ("\\pi = 3.14", "3.14", 1), ("x = 42", "42", 1), ("42 = 42", "42", 1),
    ("4t", "4", 0), ("4t", "4t", 1), ("2t", "4t", 0), ("5\\text{ m}", "5", 1), ("5 m", "5", 1),
])
def test_numeric_equations_and_glued_letters(answer, gold, expected):
  assert grade_one(f"so $\\boxed{{{answer}}}$", gold, "math_verify") == expected
