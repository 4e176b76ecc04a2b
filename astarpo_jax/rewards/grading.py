"""Graders: reward r in {0, 1} for a model response against a gold answer, as pure in-process functions.

Model text is hostile. It never reaches `sympify`, `parse_expr` or `eval` (they execute code): the
answer is cut out with linear string code (answers.py), capped in length and nesting, compared as a
plain number exactly when it is one, and only then parsed by latex2sympy (an ANTLR parser) through
math-verify's LatexExtractionConfig. Symbolic comparison can still hang or exhaust memory on a crafted
answer (`9^{9^{9^9}}`) inside C code that no signal interrupts, so untrusted batches go through
reward_pool.RewardPool, whose workers are killed and replaced. `grade_batch` here is for small or
trusted batches and benchmarks. The string graders (official and lenient) are linear string code:
`prepare` compares them in the calling process; only "math_verify" items go to workers.

Graders (names for `grader`; each gives 0 or 1):
  official A*-PO rules, the same verdicts as verl/utils/reward_score (see docs/rewards.md):
    "hendrycks"       math.py: the last `\\boxed{}` (its `\\boxed ` and `\\fbox` quirks included), MATH
                      `is_equiv` (string normalisation, no number parsing: `1,200` != `1200`);
    "gsm8k_strict"    gsm8k.py 'strict': the number after the FIRST `#### `, commas removed, == gold string;
    "gsm8k_flexible"  gsm8k.py 'flexible': the last run of `-?[0-9.,]+` (commas, periods kept) == gold string;
  the project's lenient comparisons (only ever a wrong 0 turned into a right 1):
    "hendrycks_lenient"       last `\\boxed{}`/`\\fbox{}`; plain numbers by value, then `is_equiv`;
    "gsm8k_strict_lenient"    first `#### N`; `,` `$` and a trailing `.` dropped; compared by value;
    "gsm8k_flexible_lenient"  the last number with a digit, cleaned the same way; compared by value;
  "math_verify" (default): the last box (or several joined: `\\boxed{1}, \\boxed{2}`), else an anchored
    answer (`final answer is 120`, `Answer: \\[9\\]`, `#### 42`); plain numbers, e-notation and scale
    words (`2.5 billion`) by exact value, else math-verify (numeric, symbolic, sets, intervals, matrices).

The EOS rule is the caller's choice, per call, through `truncated`:
  truncated=None      no EOS rule: every response is graded (official Stage 1; GSM8K Stage 2);
  truncated=[bool]*N  rows with True (no stop token emitted) score 0 under ANY grader and are counted in
                      `num_truncated`; under "hendrycks" the other rows are read as the official Stage 2
                      reads them, followed by the EOS text `<|endoftext|>` (this matters only for its
                      `\\boxed ` rule, whose answer runs to the next `$`). Official MATH Stage 2 and evaluation.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import re
import signal
import threading
from collections.abc import Sequence

import latex2sympy2_extended.latex2sympy2 as _l2s
import math_verify
import math_verify.parser as _mv_parser
import numpy as np
import sympy
import sympy.parsing
import sympy.parsing.sympy_parser as _sympy_parser
import sympy.physics.units  # noqa: F401 -- simplify() imports it lazily, sympifying unit names

from astarpo_jax.rewards import answers

OFFICIAL_GRADERS = ("hendrycks", "gsm8k_strict", "gsm8k_flexible")
LENIENT_GRADERS = ("hendrycks_lenient", "gsm8k_strict_lenient", "gsm8k_flexible_lenient")
MATH_GRADERS = ("math_verify", "hendrycks", "hendrycks_lenient")  # graders of boxed (MATH-style) answers
GRADERS = (*OFFICIAL_GRADERS, "math_verify", *LENIENT_GRADERS)
_STRING_GRADERS = (*OFFICIAL_GRADERS, *LENIENT_GRADERS)  # compared by string code, in the caller's process
MAX_ANSWER_CHARS = 400  # longest gold in MATH-500/Minerva/AIME/AMC is 210 chars
MAX_NESTING = 8  # deepest gold bracket nesting is 4; ANTLR parse time grows exponentially with depth
MAX_DIGITS = 1e5  # a number that large in an answer is a bomb (`9^{9^{9^9}}`, `(10^9)!`), not math

# Per-item status codes, shared with the worker pool.
OK, NO_ANSWER, REJECTED, TIMEOUT, ERROR, TRUNCATED = range(6)

logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns once that we pass timeouts as None


class GradeTimeout(BaseException):
  """The per-item alarm fired. A BaseException so the libraries' `except Exception` cannot swallow it."""


class UnsafeInput(BaseException):
  """A non-numeric string reached sympy's string parser (which evals); raised instead of parsing it."""


class AnswerRejected(Exception):
  """The answer is too long, too deeply nested or denotes an astronomically large number."""


@dataclasses.dataclass(frozen=True)
class GradeResult:
  """Rewards of a batch and what went wrong, so callers can log it instead of guessing."""
  rewards: np.ndarray = dataclasses.field(repr=False)  # [N] float32: in {0, 1}, or [0, 1] from a user function
  num_timeouts: int = 0  # items that hit the time limit (scored 0)
  num_errors: int = 0  # items whose grading raised, or whose worker crashed (scored 0)
  num_killed: int = 0  # worker processes killed (hang) or lost (crash) and replaced
  num_rejected: int = 0  # answers too long, too nested or too large to parse (scored 0)
  num_no_answer: int = 0  # responses with no extractable answer
  num_truncated: int = 0  # rows scored 0 by the EOS rule (truncated flags passed, row truncated)
  first_error: str | None = None  # why the batch's first timed-out or failed item failed (the pool's workers)


def check_grader(grader: str) -> str:
  if grader not in GRADERS:
    raise ValueError(f"unknown grader {grader!r}; choose one of {GRADERS}")
  return grader


# ---------------------------------------------------------------------------------------------------
# Extraction (cheap, linear string code: runs in the parent before anything is sent to a worker).

def gold_answer(grader: str, gold) -> str:
  """The gold answer as a string; a GSM8K `... #### 72` row or a MATH solution with a box is reduced
  (by the official rule under official graders, as the official data preprocessing does)."""
  if isinstance(gold, bool) or not isinstance(gold, (str, int, float)):
    raise TypeError(f"gold must be str, int or float, got {type(gold).__name__}")
  if isinstance(gold, float):
    if not math.isfinite(gold):
      raise ValueError(f"gold answer {gold!r} is not finite")
    gold = str(int(gold)) if gold.is_integer() else repr(gold)
  out = str(gold)
  if grader.startswith("gsm8k") and "####" in out:
    out = answers.official_gsm8k_strict(out) if grader in OFFICIAL_GRADERS else answers.gsm8k_gold(out)
  elif not grader.startswith("gsm8k") and ("\\boxed" in out or "\\fbox" in out):
    official = answers.official_math_answer(out) if grader == "hendrycks" else None
    out = official if official is not None else answers.last_boxed(out)
  if not out or not out.strip():
    raise ValueError(f"empty gold answer (from {str(gold)[:80]!r})")
  return out.strip()


def extract(grader: str, response: str | None, truncated: bool | None = None) -> str | None:
  """The candidate answer in `response` under `grader`'s rule, or None (no answer: reward 0).

  truncated: None = no EOS rule; True = cut off before EOS (None); False = ended with EOS.
  """
  if response is not None and not isinstance(response, str):
    raise TypeError(f"response must be str or None, got {type(response).__name__}")
  if response is None or truncated:
    return None
  if grader == "hendrycks":
    if truncated is False and not response.endswith(answers.EOS_TEXT):
      response += answers.EOS_TEXT  # the official Stage-2 text ends with the decoded EOS token
    return answers.official_math_answer(response)
  if grader == "gsm8k_strict":
    return answers.official_gsm8k_strict(response)
  if grader == "gsm8k_flexible":
    return answers.official_gsm8k_flexible(response)
  if grader == "gsm8k_strict_lenient":
    return answers.gsm8k_strict_answer(response)
  if grader == "gsm8k_flexible_lenient":
    return answers.gsm8k_flexible_answer(response)
  if grader == "hendrycks_lenient":
    out = answers.last_boxed(response)
  else:  # math_verify: boxes first (math-verify's boxed priority), else an anchored answer
    has_box = "\\boxed" in response[-answers.MAX_SCAN_CHARS:] or "\\fbox" in response[-answers.MAX_SCAN_CHARS:]
    out = answers.boxed_answers(response) if has_box else answers.anchored_answer(response)
  return out if out and out.strip() else None


def nesting_depth(text: str) -> int:
  """Deepest bracket nesting of `(`, `[`, `{` in `text`."""
  depth = best = 0
  for c in text:
    if c in "([{":
      depth += 1
      best = max(best, depth)
    elif c in ")]}":
      depth -= 1
  return best


def screen(answer: str) -> str | None:
  """Why `answer` must not be parsed (too long / too nested), or None if it may be."""
  if len(answer) > MAX_ANSWER_CHARS:
    return f"answer longer than {MAX_ANSWER_CHARS} chars"
  if nesting_depth(answer) > MAX_NESTING:
    return f"brackets nested deeper than {MAX_NESTING}"
  return None


def prepare(responses: Sequence[str | None], golds: Sequence, grader: str,
            truncated: Sequence[bool] | None) -> tuple[list[float], list[int], list[tuple[int, str, str]]]:
  """Validate a batch and extract its answers.

  Returns (rewards_N, status_N, jobs): jobs = [(i, pred, gold)] are the items still to compare.
  """
  check_grader(grader)
  n = len(responses)
  if len(golds) != n:
    raise ValueError(f"{n} responses but {len(golds)} golds")
  if truncated is not None and len(truncated) != n:
    raise ValueError(f"{n} responses but {len(truncated)} truncated flags")
  rewards, status, jobs = [0.0] * n, [NO_ANSWER] * n, []
  for i in range(n):
    try:
      gold = gold_answer(grader, golds[i])
    except (TypeError, ValueError) as e:
      raise ValueError(f"gold {i}: {e}") from None
    try:
      pred = extract(grader, responses[i], None if truncated is None else bool(truncated[i]))
    except TypeError as e:
      raise TypeError(f"response {i}: {e}") from None
    if pred is None:
      status[i] = TRUNCATED if truncated is not None and truncated[i] else NO_ANSWER
      continue
    if grader not in OFFICIAL_GRADERS and screen(pred) is not None:  # the official rules have no caps
      status[i] = REJECTED
      continue
    if grader in _STRING_GRADERS:  # string code, linear: compared here, no worker needed
      rewards[i], status[i] = run_job(grader, pred, gold, None)
      continue
    status[i] = OK  # until a worker says otherwise
    jobs.append((i, pred, gold))
  return rewards, status, jobs


def summarize(rewards: list[float], status: list[int], num_killed: int = 0,
              first_error: str | None = None) -> GradeResult:
  return GradeResult(
      rewards=np.asarray(rewards, np.float32),
      num_timeouts=status.count(TIMEOUT), num_errors=status.count(ERROR), num_killed=num_killed,
      num_rejected=status.count(REJECTED), num_no_answer=status.count(NO_ANSWER),
      num_truncated=status.count(TRUNCATED), first_error=first_error)


# ---------------------------------------------------------------------------------------------------
# Comparison (may be slow on hostile input: runs in workers under the pool).

def _numbers_equal(pred: str, gold: str, exact=answers.plain_number) -> bool | None:
  """Exact comparison when both are numbers that `exact` reads, else None (undecided)."""
  a, b = exact(pred), exact(gold)
  return None if a is None or b is None else a == b


def _as_latex(text: str) -> str:
  """`text` for math-verify: an e-notation or scale-word number (`3.3e12`, `5 million`) as its exact
  value, a single unit-like letter glued to a number (`4t`) kept as a variable, not stripped as a unit."""
  value = answers.scaled_number(text)
  if value is not None:
    return str(value.numerator) if value.denominator == 1 else f"\\frac{{{value.numerator}}}{{{value.denominator}}}"
  return _GLUED_UNIT_LETTER.sub(r"{\1}", text)


# math-verify strips these single letters after a number as units (t, h, m, s, ...), so `4t` == 4 and
# `\frac{37}{4} m` == 37/4. Glued to a digit or `}`, the letter is read as a variable instead.
_GLUED_UNIT_LETTER = re.compile(r"(?<=[\d}])([tholcgmsd])\s*$")


_MV_CONFIG = (math_verify.LatexExtractionConfig(boxed_match_priority=0),)  # never ExprExtractionConfig


@functools.lru_cache(maxsize=4096)
def _mv_parse(latex: str) -> tuple:
  """math-verify's parse of one boxed answer: sympy objects plus the normalised string fallback."""
  boxed = "\\boxed{" + latex + "}"
  return tuple(math_verify.parse(boxed, extraction_config=_MV_CONFIG, parsing_timeout=None))


def _digits(e) -> float:
  """Upper bound on the decimal digits of the numbers `e` would evaluate to (inf when astronomical)."""
  try:
    if isinstance(e, sympy.Rational):
      return math.log10(max(abs(e.p), e.q, 1))
    if isinstance(e, sympy.Float):
      return abs(math.log10(abs(float(e)))) if e else 0.0
    if isinstance(e, sympy.Pow):
      base, exp = _digits(e.args[0]), _digits(e.args[1])
      if not e.args[1].is_number:
        return base
      return 0.0 if base == 0 else (math.inf if exp > 300 else 10.0 ** exp * base)
    if isinstance(e, (sympy.factorial, sympy.factorial2, sympy.subfactorial)):
      n = _digits(e.args[0])
      return math.inf if n > 15 else (10.0 ** n) * (n + 1)
    if isinstance(e, sympy.MatrixBase):
      return sum(_digits(x) for x in e)
    if isinstance(e, sympy.Basic):
      return sum(_digits(a) for a in e.args)
  except (OverflowError, ValueError, TypeError):
    return math.inf
  return 0.0


def _exact_mismatch(g, p) -> bool:
  """True when two exact numeric constants differ; math-verify's chopped evalf says 1/2^99 == 1/2^98."""
  if not (isinstance(g, sympy.Expr) and isinstance(p, sympy.Expr)):
    return False
  if g.free_symbols or p.free_symbols or g.has(sympy.Float, sympy.UnevaluatedExpr) or p.has(
      sympy.Float, sympy.UnevaluatedExpr):
    return False  # floats are compared with rounding on purpose; UnevaluatedExpr marks percents
  try:
    diff, scale = abs((g - p).evalf(60)), max(abs(g.evalf(60)), abs(p.evalf(60)))
    return bool(diff > scale * sympy.Float("1e-40", 60))
  except Exception:
    return False


def _false_numeric_equation(p) -> bool:
  """`43 = 42`: an equation between two numbers that differ is a claim, not the answer 42.

  Exact sides must agree to 1e-12 relative; with a decimal on either side 1% is allowed
  (`\\frac{1}{3} = 0.33`, `\\pi = 3.14` are roundings, `4.3 = 4.2` is not).
  """
  if not isinstance(p, sympy.Equality) or p.free_symbols:
    return False
  try:
    diff, scale = abs((p.lhs - p.rhs).evalf(30)), max(abs(p.lhs.evalf(30)), abs(p.rhs.evalf(30)), 1)
    return bool(diff > scale * sympy.Float("1e-2" if p.has(sympy.Float) else "1e-12", 30))
  except Exception:  # noqa: BLE001 -- a comparison that cannot be evaluated is left to verify
    return False


def _math_verify_equal(pred: str, gold: str) -> bool:
  preds, golds = _mv_parse(_as_latex(pred)), _mv_parse(_as_latex(gold))
  for p in preds:
    if _digits(p) > MAX_DIGITS:
      raise AnswerRejected("answer denotes an astronomically large number")
  preds = [p for p in preds if not _false_numeric_equation(p)]
  for g in golds:
    for p in preds:
      # The exact check first: it fixes the chop bug and skips simplify() for most wrong numbers.
      if not _exact_mismatch(g, p) and math_verify.verify(g, p, timeout_seconds=None):
        return True
  return False


def compare(grader: str, pred: str, gold: str) -> float:
  """Reward of extracted answer `pred` against `gold` under `grader`'s comparison."""
  if grader in ("gsm8k_strict", "gsm8k_flexible"):
    same = pred == gold  # the official string equality
  elif grader == "hendrycks":
    same = answers.hendrycks_is_equiv(pred, gold)
  elif grader == "math_verify":
    same = _numbers_equal(pred, gold, answers.exact_value)
    if same is None:
      same = _math_verify_equal(pred, gold)
  else:
    same = _numbers_equal(pred, gold)
    if same is None:
      same = answers.hendrycks_is_equiv(pred, gold) if grader == "hendrycks_lenient" else pred.strip() == gold.strip()
  return 1.0 if same else 0.0


# ---------------------------------------------------------------------------------------------------
# Guards: the string-eval tripwire and the per-item alarm.

# A number or a bare name: nothing that can call, index or import. latex2sympy sends numbers (via
# `sympy.Number`); sympy's own modules sympify names like 'yotta' when first imported.
_SAFE_LITERAL = re.compile(r"\s*(?:[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[A-Za-z][A-Za-z0-9]*)\s*")
_PARSE_EXPR_HOMES = ((_sympy_parser, "parse_expr"), (sympy.parsing, "parse_expr"),
                     (_mv_parser, "parse_expr"), (_l2s, "parse_expr"))


def _numbers_only(parse_expr):
  """Wrap sympy's `parse_expr` (the string path of `sympify`) to refuse anything but a number or a name."""
  def guarded(s, *args, **kwargs):
    if not (isinstance(s, str) and len(s) <= 1000 and _SAFE_LITERAL.fullmatch(s)):
      raise UnsafeInput("refused to parse_expr a string that is neither a number nor a name")
    return parse_expr(s, *args, **kwargs)
  guarded.unguarded = parse_expr
  return guarded


def forbid_string_eval() -> None:
  """Make every `parse_expr` reachable from latex2sympy / math-verify / sympify refuse code.

  latex2sympy only ever passes numeric token text (via `sympy.Number`); this is the tripwire should
  that change. Permanent: used in worker processes; in-process use `no_string_eval()`.
  """
  for module, name in _PARSE_EXPR_HOMES:
    f = getattr(module, name)
    if not hasattr(f, "unguarded"):
      setattr(module, name, _numbers_only(f))


_guard_lock = threading.Lock()
_guard_depth = 0


@contextlib.contextmanager
def no_string_eval():
  """`forbid_string_eval` for the duration of a block (nested or from several threads), then restore sympy."""
  global _guard_depth
  with _guard_lock:
    if _guard_depth == 0:
      forbid_string_eval()
    _guard_depth += 1
  try:
    yield
  finally:
    with _guard_lock:
      _guard_depth -= 1
      if _guard_depth == 0:
        for module, name in _PARSE_EXPR_HOMES:
          f = getattr(module, name)
          setattr(module, name, getattr(f, "unguarded", f))


def _on_alarm(signum, frame):
  raise GradeTimeout()


@contextlib.contextmanager
def time_limit(seconds: float | None):
  """Raise GradeTimeout in this block after `seconds` (SIGALRM; main thread only, else no limit).

  Pure-Python loops (sympy's simplify) are interrupted; a single long C call (a huge integer power)
  is not, which is why the pool also kills workers.
  """
  if not seconds or threading.current_thread() is not threading.main_thread():
    yield
    return
  old = signal.signal(signal.SIGALRM, _on_alarm)
  signal.setitimer(signal.ITIMER_REAL, seconds)
  try:
    yield
  finally:
    try:
      signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
      signal.signal(signal.SIGALRM, old)


def run_job(grader: str, pred: str, gold: str, timeout_s: float | None) -> tuple[float, int]:
  """(reward, status) of one extracted answer; never raises for bad input. Returns floats only."""
  try:
    with time_limit(timeout_s):
      return compare(grader, pred, gold), OK
  except GradeTimeout:
    return 0.0, TIMEOUT
  except AnswerRejected:
    return 0.0, REJECTED
  except (Exception, UnsafeInput):  # noqa: BLE001 -- includes MemoryError and RecursionError
    return 0.0, ERROR


def warm_up() -> None:
  """Build the ANTLR parser's caches once, so the first real item does not pay for it."""
  for pred, gold in (("\\frac{1}{2}", "0.5"), ("(1, \\sqrt{2})", "\\left(1,\\sqrt2\\right)"),
                     ("x^2+1", "1+x^{2}"), ("\\{1,2\\}", "[1, 2)"), ("\\text{(B)}", "B"),
                     ("\\sqrt{2}/2", "\\frac{1}{\\sqrt{2}}")):
    run_job("math_verify", pred, gold, None)


def grade_batch(responses: Sequence[str | None], golds: Sequence, grader: str = "math_verify",
                truncated: Sequence[bool] | None = None, timeout_s: float | None = 5.0) -> GradeResult:
  """Grade a batch in this process: same API and rewards as RewardPool.grade, without process isolation.

  `timeout_s` applies per item through SIGALRM when called from the main thread.
  """
  rewards, status, jobs = prepare(responses, golds, grader, truncated)
  with no_string_eval():
    for i, pred, gold in jobs:
      rewards[i], status[i] = run_job(grader, pred, gold, timeout_s)
  return summarize(rewards, status)
