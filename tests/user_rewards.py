"""Reward functions a user might write, good and broken, for tests/test_user_grader.py (named by path or module)."""
import os
import time


def exact(response, gold, **extra):
  """1 when the response is the gold written out, else 0."""
  return 1.0 if response.strip() == str(gold) else 0.0


def closeness(response, gold, scale=10):
  """A fractional reward: 1 - |answer - gold| / scale, floored at 0; 0 for a response that is not an integer."""
  try:
    value = int(response.strip())
  except ValueError:
    return 0.0
  return max(0.0, 1.0 - abs(value - gold) / scale)


def misbehaves(response, gold, **extra):
  """Hangs, blows the memory cap or exits the process when the response says so; else `exact`."""
  if response == "sleep":
    time.sleep(600)
  if response == "hog":
    blocks = [bytearray(2**30) for _ in range(64)]  # 64 GiB: past any worker's memory cap
    return float(len(blocks))
  if response == "exit":
    os._exit(3)
  return exact(response, gold)


def raises(response, gold, **extra):
  raise KeyError(f"no rule for {response!r}")


def too_big(response, gold, **extra):
  return 2.5


def not_a_number(response, gold, **extra):
  return float("nan")


def text(response, gold, **extra):
  return "1.0"


def nothing(response, gold, **extra):
  return None


def uses_numbers(response, gold, numbers, **extra):
  """Extra fields arrive as keywords: 1 when the response names the sum of `numbers` and it is the gold."""
  return 1.0 if response.strip() == str(sum(numbers)) == str(gold) else 0.0
