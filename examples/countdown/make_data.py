"""Writes the countdown example's data: train.jsonl and test.jsonl (a problem, its target, its numbers) and
warmstart.jsonl (the training problems with one worked answer each, for the tiny reference's warm-start).

  python examples/countdown/make_data.py   # the files here were made by this, as it is

A problem is three numbers (1-9) and a target in 0..99 that `a op b op c` reaches with ops among + - *
(usual precedence), the numbers listed in an order that works: "8 2 3:3" (8-2-3). Every such problem is
listed once, one in 8 held out for the test by a hash of its text (256 of them kept). Half the warm-start
answers are boxed (`\\boxed{8-2-3}`), half bare (`8-2-3`, which the reward scores 0): a reference that often
ignores the answer format, as base models do, leaves RL something to fix beside the arithmetic.
"""
import itertools
import json
import os
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
NUM_TEST = 256
BOXED_SHARE = 0.5


def problems() -> dict[str, tuple[list[int], int, list[str]]]:
  """Problem text ("8 2 3:3") -> (numbers, target, every solution a op b op c in that order)."""
  out: dict[str, tuple[list[int], int, list[str]]] = {}
  for nums in itertools.product(range(1, 10), repeat=3):
    for ops in itertools.product("+-*", repeat=2):
      expr = f"{nums[0]}{ops[0]}{nums[1]}{ops[1]}{nums[2]}"
      value = eval(expr)  # noqa: S307 -- our own digits and operators, never model text
      if 0 <= value <= 99:
        out.setdefault(f"{' '.join(map(str, nums))}:{value}", (list(nums), value, []))[2].append(expr)
  return out


def main(seed: int = 0) -> None:
  rng = np.random.default_rng(seed)
  rows = {"train": [], "test": [], "warmstart": []}
  for text, (nums, target, solutions) in problems().items():
    split = "test" if zlib.crc32(text.encode()) % 8 == 0 else "train"
    rows[split].append({"problem": text, "target": target, "numbers": nums})
    if split == "train":
      answer = solutions[rng.integers(len(solutions))]
      rows["warmstart"].append({"problem": text,
                                "response": f"\\boxed{{{answer}}}" if rng.random() < BOXED_SHARE else answer})
  for split, rs in rows.items():
    order = rng.permutation(len(rs))[:NUM_TEST if split == "test" else None]
    with open(os.path.join(HERE, f"{split}.jsonl"), "w") as f:
      f.writelines(json.dumps(rs[i]) + "\n" for i in order)


if __name__ == "__main__":
  main()
