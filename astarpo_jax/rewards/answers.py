"""Answer extraction from model text and gold solutions: pure string code, no parsing or eval.

Everything here runs on hostile model output, so it is linear-time string scanning with caps.
Three families of rules:
  - official A*-PO (`official_math_answer`, `official_gsm8k_strict`, `official_gsm8k_flexible`):
    the same answers as verl's reward_score/math.py and gsm8k.py, uncapped like them;
  - the project's lenient rules (`last_boxed`, `gsm8k_strict_answer`, `gsm8k_flexible_answer`,
    `plain_number`);
  - the `math_verify` grader's wider reading (`boxed_answers`, `anchored_answer`, `scaled_number`).
"""
from __future__ import annotations

import re
from fractions import Fraction

MAX_SCAN_CHARS = 20_000  # only the tail of a response is searched for the final answer (lenient rules)

_BRACES = re.compile(r"[{}]")
_SPACE_TOKEN = re.compile(r" ([^\s$]+)")


def _box_at(text: str, start: int) -> tuple[str, int] | None:
  """(content, end) of the box whose command starts at `start`, else None if unbalanced.

  `\\boxed{..}` and `\\boxed {..}` by brace counting; `\\boxed 5` as the token up to a space or `$`.
  """
  i = start + (6 if text.startswith("\\boxed", start) else 5)
  j = i
  while j < len(text) and text[j] in " \t\n":
    j += 1
  if j < len(text) and text[j] == "{":
    depth = 0
    for m in _BRACES.finditer(text, j):
      depth += 1 if m.group() == "{" else -1
      if depth == 0:
        return text[j + 1:m.start()], m.end()
    return None
  m = _SPACE_TOKEN.match(text, i)
  return (m.group(1), m.end()) if m else None


def _last_box_start(text: str, end: int) -> int:
  return max(text.rfind("\\boxed", 0, end), text.rfind("\\fbox", 0, end))


def last_boxed(text: str | None) -> str | None:
  """Content of the last `\\boxed{...}` (or `\\fbox{...}`, `\\boxed {...}`, `\\boxed 5`) in `text`, else None.

  Braces are matched by counting; an unbalanced box yields None.
  """
  if not text:
    return None
  text = text[-MAX_SCAN_CHARS:]
  start = _last_box_start(text, len(text))
  box = _box_at(text, start) if start >= 0 else None
  return box[0] if box else None


# Separators that make several boxes one multi-part answer (`\boxed{1}, \boxed{2}`, `$x = \boxed{1}$ or $x = ...`).
_BOX_SEPARATOR = re.compile(
    r"(?:[\s$,;]|\\q?quad|\\text\{\s*(?:and|or)\s*\}|\b(?:and|or)\b|\b[A-Za-z](?:_\{?\w\}?)?\s*=)*")
MAX_BOXES = 6  # math-verify joins at most 6 boxes


def boxed_answers(text: str | None) -> str | None:
  """The last box's content; boxes right before it, separated only by commas, `and`/`or`, spaces
  or `$`, are joined with ", " into one multi-part answer (as math-verify reads them). None: no box."""
  if not text:
    return None
  text = text[-MAX_SCAN_CHARS:]
  parts: list[str] = []
  limit = len(text)
  while len(parts) < MAX_BOXES:
    start = _last_box_start(text, limit)
    box = _box_at(text, start) if start >= 0 else None
    if box is None or not box[0].strip():
      if not parts:
        return None
      break
    content, end = box
    if parts and (end > limit or not _BOX_SEPARATOR.fullmatch(text, end, limit)):
      break
    if not parts or parts[-1] != content:  # `\boxed{4} \boxed{4}` is one answer
      parts.append(content)
    limit = start
  return ", ".join(reversed(parts))


# ---------------------------------------------------------------------------------------------------
# The official A*-PO rules (verl/utils/reward_score/math.py, gsm8k.py), written anew with their verdicts.

EOS_TEXT = "<|endoftext|>"  # Qwen2.5's EOS as decoded text; official Stage 2 needs it at the end


def official_math_answer(text: str) -> str | None:
  """The answer the official MATH rule reads, or None where it scores 0 whatever the gold.

  If `\\boxed ` (with a space) occurs anywhere: the text after its last occurrence up to the first
  `$` (to the end of the text if none). Else the last `\\boxed` (without one, the last `\\fbox`)
  with braces counted from the command on; kept only if that span reads `\\boxed{...}`: an `\\fbox{}`
  or `\\boxed\n{}` fails the official `remove_boxed` assertion, which its try/except scores 0.
  """
  if "\\boxed " in text:
    return text.rsplit("\\boxed ", 1)[1].split("$", 1)[0]
  idx = text.rfind("\\boxed")
  if idx < 0:
    idx = text.rfind("\\fbox")
    if idx < 0:
      return None
  depth = 0
  for m in _BRACES.finditer(text, idx):
    if m.group() == "{":
      depth += 1
    else:
      depth -= 1
      if depth == 0:
        return text[idx + 7:m.start()] if text.startswith("\\boxed{", idx) else None
  return None


_GSM8K_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_GSM8K_NUMBER = re.compile(r"-?[0-9.,]+")


def official_gsm8k_strict(text: str) -> str | None:
  """Official strict rule: the number after the FIRST `#### `, commas (and `$`) removed; else None."""
  m = _GSM8K_STRICT.search(text)
  return m.group(1).replace(",", "").replace("$", "") if m else None


def official_gsm8k_flexible(text: str) -> str | None:
  """Official flexible rule: the last run of `-?[0-9.,]+` that is not "." (commas and periods kept,
  so `1,000` and `18.` never equal `1000`, `18`); "." if every run is "."; None if there is none."""
  last, seen = None, False
  for m in _GSM8K_NUMBER.finditer(text):
    seen = True
    if m.group() != ".":
      last = m.group()
  return last if last is not None else ("." if seen else None)


# ---------------------------------------------------------------------------------------------------
# The project's lenient GSM8K rules.

_GSM8K_GOLD = re.compile(r"####\s*(.+?)\s*$", re.S)


def gsm8k_gold(answer: str | None) -> str | None:
  """Gold answer of a GSM8K row: the text after `#### `, with thousands commas and `$` removed."""
  if not answer:
    return None
  m = _GSM8K_GOLD.search(answer)
  if not m:
    return None
  out = m.group(1).replace(",", "").replace("$", "").strip()
  return out or None


# Lenient versions of the official GSM8K rules (same places), each difference only turning a wrong 0
# into a right 1: commas, `$` and a trailing sentence period are removed from the number, candidates
# without a digit ("," ".") are skipped, and numbers are then compared by value (grading.compare).


def _clean_gsm8k_number(s: str) -> str | None:
  s = s.replace(",", "").replace("$", "").rstrip(".")
  return s if any(c.isdigit() for c in s) else None


def gsm8k_strict_answer(text: str | None) -> str | None:
  """The number after the first `#### ` in `text` (official strict rule), cleaned; None if absent."""
  if not text:
    return None
  m = _GSM8K_STRICT.search(text)  # literal prefix: a linear scan even over megabytes
  return _clean_gsm8k_number(m.group(1)) if m else None


def gsm8k_flexible_answer(text: str | None) -> str | None:
  """The last number in `text` (official flexible rule, searched in the last MAX_SCAN_CHARS), cleaned."""
  if not text:
    return None
  for cand in reversed(_GSM8K_NUMBER.findall(text[-MAX_SCAN_CHARS:])):
    out = _clean_gsm8k_number(cand)
    if out is not None:
      return out
  return None


# Plain numbers: integers, decimals, thousands separators, simple fractions. Compared exactly (as
# Fractions) before anything symbolic, so `27.0` == `27`, `0.5` == `\frac{1}{2}`, `200` != `2`.
_NUM_NOISE = ("\\!", "\\,", "\\;", "\\:", "\\ ", "~", "\\$", "$", "{,}", "\\left", "\\right")
_DEGREES = ("^{\\circ}", "^\\circ", "\\circ", "°")
_DECIMAL = re.compile(r"\d+(?:\.\d*)?|\.\d+")
_THOUSANDS = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_FRAC = re.compile(r"\\[dt]?frac(?:\{([-+]?[\d.]+)\}|(\d))(?:\{([-+]?[\d.]+)\}|(\d))")
_SLASH = re.compile(r"([\d.]+)/([\d.]+)")
MAX_NUMBER_CHARS = 64


def _decimal(s: str) -> Fraction | None:
  sign = -1 if s[:1] == "-" else 1
  s = s.lstrip("+-")
  if _THOUSANDS.fullmatch(s):
    s = s.replace(",", "")
  return sign * Fraction(s) if _DECIMAL.fullmatch(s) else None


def _squeeze(text: str | None) -> str | None:
  """`text` without spacing, `$`, `\\left`/`\\right`, outer braces and a trailing degree sign; None if long."""
  if not text or len(text) > 4 * MAX_NUMBER_CHARS:
    return None
  s = text
  for noise in _NUM_NOISE:
    s = s.replace(noise, "")
  s = "".join(s.split()).replace("−", "-")
  while len(s) > 2 and s[0] == "{" and s[-1] == "}" and "{" not in s[1:-1]:
    s = s[1:-1]
  for deg in _DEGREES:
    if s.endswith(deg):
      s = s[:-len(deg)]
      break
  return s if s and len(s) <= MAX_NUMBER_CHARS else None


def plain_number(text: str | None) -> Fraction | None:
  """Exact value of `text` if it is a plain number: `-1,000`, `27.0`, `.5`, `\\dfrac{3}{4}`, `3/4`, `30°`.

  Anything else (symbols, percents, units, tuples, `2^{10}`) gives None and goes to a symbolic grader.
  """
  s = _squeeze(text)
  if s is None:
    return None
  sign = 1
  if s[0] in "+-":
    sign, s = (-1 if s[0] == "-" else 1), s[1:]
    if not s or s[0] in "+-":
      return None
  m = _FRAC.fullmatch(s) or _SLASH.fullmatch(s)
  if m:
    num, den = [g for g in m.groups() if g is not None]
    num, den = _decimal(num), _decimal(den)
    if num is None or not den:
      return None
    return sign * num / den
  val = _decimal(s)
  return None if val is None else sign * val


# E-notation and scale words, as the math_verify grader reads them (math-verify itself reads `3.3e12`
# as 3.3*e*12 and `5 \text{ million}` as 5). The exponent has at most 3 digits: no bombs.
_SCALE_EXP = {"thousand": 3, "million": 6, "billion": 9, "trillion": 12}
_SCALE_WORD = r"(?i:(thousand|million|billion|trillion))s?"
_SCALED = re.compile(r"([-+]?)(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d*)?|\.\d+)(?:[eE]([-+]?\d{1,3}))?"
                     r"(?:\\(?:text|mbox|mathrm|textrm)\{" + _SCALE_WORD + r"\}|" + _SCALE_WORD + r")?")


def scaled_number(text: str | None) -> Fraction | None:
  """Exact value of a number in e-notation (`3.3e12`, `1e-5`) or with a scale word (`5 million`,
  `2.5\\text{ billion}`, `3 thousand`); None for anything else, plain numbers included."""
  s = _squeeze(text)
  m = _SCALED.fullmatch(s) if s else None
  if not m or (m.group(3) is None and m.group(4) is None and m.group(5) is None):
    return None
  word = (m.group(4) or m.group(5) or "").lower()
  exp = int(m.group(3) or 0) + _SCALE_EXP.get(word, 0)
  value = _decimal(m.group(2)) * Fraction(10) ** exp
  return -value if m.group(1) == "-" else value


def exact_value(text: str | None) -> Fraction | None:
  """`plain_number`, else `scaled_number`."""
  value = plain_number(text)
  return value if value is not None else scaled_number(text)


# Answers outside a box, for the math_verify grader: after an anchor (`answer`, `final answer ... is`,
# `####`, in math-verify's spirit) a LaTeX environment or a plain number that ends the sentence and
# after which the response has no more mathematics (no digit, `$`, `\[` or `\(`): a number in the
# middle of reasoning, `43 = 42`, `4t` or `5 apples` is not read.
_ANCHOR = re.compile(r"(?i:\banswer\b)|####")
_AFTER_ANSWER_WORD = re.compile(r"(?i:[^\n\d$\\=#]{0,100}?\bis\b)?[ \t*:=]*\n?[ \t*]*")
_AFTER_HASHES = re.compile(r"[ \t]*")
_NUMBER = (r"[-−]?(?:\\?\$)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?(?:[eE][-+]?\d{1,3})?"
           r"(?:[ \t]?(?:\\?%|percent\b))?(?:[ \t]+" + _SCALE_WORD + r"\b)?")
_VALUE = re.compile(
    r"\$\$(?P<dd>[^$]{1,400}?)\$\$|\$(?P<d>[^$\n]{1,400}?)\$|\\\[(?P<br>.{1,400}?)\\\]|\\\((?P<pa>.{1,400}?)\\\)"
    r"|(?:[A-Za-z][ \t]*=[ \t]*)?(?P<num>" + _NUMBER + r")(?![\w^_=+/(\[{\\-]|\*(?!\*)|[.,]\d)", re.S)
_SENTENCE_END = re.compile(r"[ \t]*(?:\*\*)?[ \t]*(?:[.!;](?=\s|\Z)|\n|\Z)")
_MATH_MARKS = ("$", "\\[", "\\(", *"0123456789")


def anchored_answer(text: str | None) -> str | None:
  """The answer after the last anchor that states one (see above), as LaTeX; None if there is none."""
  if not text:
    return None
  text = text[-MAX_SCAN_CHARS:]
  last_math = max(text.rfind(mark) for mark in _MATH_MARKS)
  if last_math < 0:
    return None
  for anchor in reversed(list(_ANCHOR.finditer(text))):
    if anchor.end() + 1000 < last_math:  # too far left for its answer to be the last mathematics
      break
    lead = (_AFTER_HASHES if anchor.group() == "####" else _AFTER_ANSWER_WORD).match(text, anchor.end())
    value = _VALUE.match(text, lead.end())
    end = value and _SENTENCE_END.match(text, value.end())
    if end and end.end() > last_math:
      num = value.group("num")
      if num is None:
        latex = next(v for v in value.group("dd", "d", "br", "pa") if v is not None)
        return latex.strip().rstrip(".,;").strip() or None  # `$52_8.$`: the sentence's period
      num = num.replace("−", "-").replace("percent", "%")
      return num.replace("\\%", "%").replace("%", "\\%")
  return None


# Hendrycks MATH normalisation (`strip_string` / `is_equiv` of the MATH repo, as used by the official
# A*-PO `math.py`), rewritten with the same behaviour, including where the original raises: `is_equiv`
# then falls back to comparing the raw strings.
def _fix_fracs(s: str) -> str:
  """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{72}` -> `\\frac{1}{72}`."""
  head, *rest = s.split("\\frac")
  out = [head]
  for sub in rest:
    out.append("\\frac")
    if sub[0] == "{":  # IndexError on a bare trailing `\frac`, as in the original
      out.append(sub)
    elif len(sub) < 2:
      return s
    elif sub[1] != "{":
      out.append("{" + sub[0] + "}{" + sub[1] + "}" + sub[2:])
    else:
      out.append("{" + sub[0] + "}" + sub[1:])
  return "".join(out)


def _fix_a_slash_b(s: str) -> str:
  """`3/4` -> `\\frac{3}{4}` for integers; ValueError (as the original) when a side is not an integer."""
  parts = s.split("/")
  if len(parts) != 2:
    return s
  a, b = int(parts[0]), int(parts[1])
  return "\\frac{" + str(a) + "}{" + str(b) + "}" if s == f"{a}/{b}" else s


def _fix_sqrt(s: str) -> str:
  """`\\sqrt3` -> `\\sqrt{3}`."""
  head, *rest = s.split("\\sqrt")
  return head + "".join("\\sqrt" + (sub if sub[0] == "{" else "{" + sub[0] + "}" + sub[1:]) for sub in rest)


def hendrycks_strip(s: str) -> str:
  """The MATH repo's `strip_string`: drop spacing, `\\left`, degrees, `\\$`, right units, `\\%`; fix fracs."""
  s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
  s = s.replace("tfrac", "frac").replace("dfrac", "frac")
  s = s.replace("\\left", "").replace("\\right", "")
  s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
  if "\\text{ " in s:  # units on the right; the original asserts there is exactly one
    parts = s.split("\\text{ ")
    if len(parts) != 2:
      raise ValueError("more than one `\\text{ ` unit")
    s = parts[0]
  s = s.replace("\\%", "")
  s = s.replace(" .", " 0.").replace("{.", "{0.")
  if not s:
    return s
  if s[0] == ".":
    s = "0" + s
  parts = s.split("=")
  if len(parts) == 2 and len(parts[0]) <= 2:  # `k = 5` -> `5`
    s = parts[1]
  s = _fix_fracs(_fix_sqrt(s).replace(" ", ""))
  if s == "0.5":
    s = "\\frac{1}{2}"
  return _fix_a_slash_b(s)


def hendrycks_is_equiv(a: str | None, b: str | None) -> bool:
  """The MATH repo's `is_equiv`: equal after `hendrycks_strip`, or raw-equal if stripping raises."""
  if a is None or b is None:
    return a is None and b is None
  try:
    return hendrycks_strip(a) == hendrycks_strip(b)
  except Exception:  # the original's fallback, kept for fidelity
    return a == b
