"""Answer extraction from model text and gold solutions: pure string code, no parsing or eval.

Everything here runs on hostile model output, so it is linear-time string scanning with caps.
"""
from __future__ import annotations

import re

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
