"""Answer extraction from model text and gold solutions: pure string code, no parsing or eval.

Everything here runs on hostile model output, so it is linear-time string scanning with caps.
"""
from __future__ import annotations

import re
from fractions import Fraction

MAX_SCAN_CHARS = 20_000  # only the tail of a response is searched for the final answer

_BOX_CMDS = ("\\boxed", "\\fbox")


def last_boxed(text: str | None) -> str | None:
  """Content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in `text`, else None.

  Braces are matched by counting; an unbalanced box yields None.
  """
  if not text:
    return None
  text = text[-MAX_SCAN_CHARS:]
  start = max(text.rfind(cmd) for cmd in _BOX_CMDS)
  if start < 0:
    return None
  cmd = "\\boxed" if text.startswith("\\boxed", start) else "\\fbox"
  i = start + len(cmd)
  if text.startswith(" ", i):  # `\boxed 5` form: the token up to the next space or `$`
    m = re.match(r" ([^\s$]+)", text[i:])
    return m.group(1) if m else None
  if not text.startswith("{", i):
    return None
  depth = 0
  for j in range(i, len(text)):
    c = text[j]
    if c == "{":
      depth += 1
    elif c == "}":
      depth -= 1
      if depth == 0:
        return text[i + 1:j]
  return None


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


# GSM8K: the official A*-PO rules (verl `gsm8k.py`). Strict: the first `#### <number>`; flexible: the
# last number anywhere (its Stage 1). Two documented fixes, each only turning a wrong 0 into a right 1:
# commas, `$` and a trailing sentence period are removed from the number (the official flexible rule
# kept them, so "72." or "1,000" never matched), and candidates without a digit ("," ".") are skipped.
_GSM8K_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_GSM8K_NUMBER = re.compile(r"-?[0-9.,]+")


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


def plain_number(text: str | None) -> Fraction | None:
  """Exact value of `text` if it is a plain number: `-1,000`, `27.0`, `.5`, `\\dfrac{3}{4}`, `3/4`, `30°`.

  Anything else (symbols, percents, units, tuples, `2^{10}`) gives None and goes to a symbolic grader.
  """
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
  if not s or len(s) > MAX_NUMBER_CHARS:
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
