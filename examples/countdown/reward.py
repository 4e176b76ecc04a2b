"""Countdown's reward: reach the target with the given numbers, each used once, with + - * and parentheses.

  score(response, gold, numbers) -> 1.0  the last \\boxed{...} holds an expression that uses exactly `numbers`
                                         and equals `gold` (the target)
                                    0.1  a boxed expression of exactly `numbers` that misses the target
                                    0.0  anything else: no box, other numbers, not an expression
The response is model text, so it is never eval'd: the boxed text is checked for length and characters,
parsed by `ast.parse` (which runs nothing), and only integer constants, + - * and parentheses are evaluated.
"""
import ast

BOX = "\\boxed{"
ALLOWED = set("0123456789+-*() ")
MAX_CHARS = 40
OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def _value(node, used):
  """The value of a parsed +, -, * expression over integer constants, recording the constants in `used`."""
  if isinstance(node, ast.Constant) and type(node.value) is int:
    used.append(node.value)
    return node.value
  if isinstance(node, ast.BinOp) and type(node.op) in OPS:
    return OPS[type(node.op)](_value(node.left, used), _value(node.right, used))
  raise ValueError(f"not allowed: {type(node).__name__}")


def boxed(response):
  """The text of the last \\boxed{...} ending the response, or None."""
  start = response.rfind(BOX)
  end = response.rfind("}")
  return response[start + len(BOX):end] if 0 <= start < end else None


def score(response, gold, numbers):
  expr = boxed(response.strip())
  if not expr or len(expr) > MAX_CHARS or not set(expr) <= ALLOWED:
    return 0.0
  try:
    used = []
    value = _value(ast.parse(expr.strip(), mode="eval").body, used)
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    return 0.0
  if sorted(used) != sorted(numbers):
    return 0.0
  return 1.0 if value == gold else 0.1
