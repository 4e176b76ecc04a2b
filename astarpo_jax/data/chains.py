"""Chains: a synthetic multi-step arithmetic task with long, variable worked solutions (offline).

A problem is a chain of binary operations on small integers, evaluated left to right and written with
the fewest parentheses that keep the usual precedence. Its worked solution rewrites the expression
once per operation, reducing the leftmost one, until one number is left, then boxes it:

  (17+25)*3-9=   ->   42*3-9=126-9=117 \\boxed{117}

Each step is local (compute the first operation, copy the rest of the line), so a small decoder learns
the format, yet it makes an error per step with some probability and long chains are rarely solved.
The response grows with the square of the number of steps (about 2 characters per remaining step per
line with one-digit operands), so `min_steps`..`max_steps` sets a wide length spread, and with `digits`,
`ops` and `max_value` the difficulty. Every intermediate value stays in [0, max_value] and divisions are
exact, so the gold is an integer (graded by math-verify on the last \\boxed{}). Problems split
train/test by a hash of their text, as in synthetic.py. Rows go through `dataset.examples_from_rows`, the
same path as real data sets.
"""
from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from astarpo_jax.data import dataset, synthetic

PROMPT_TEMPLATE = "{problem}="
FIELDS = dataset.Fields("problem", "answer")
BOX = synthetic.BOX
CHARS = tuple("0123456789+-*/()= }")
VOCAB = synthetic.SPECIALS + CHARS + (BOX,)
TEST_BUCKETS = 8  # one problem in 8 (by hash of its text) belongs to the test split
OPS = "+-*/"


@dataclasses.dataclass(frozen=True)
class ChainsConfig:
  """Difficulty: steps per problem (uniform in [min_steps, max_steps]), the digits of + and - operands
  (* and / take one digit, 2..9), the operations used, and the bound on every intermediate value."""
  min_steps: int = 2
  max_steps: int = 20
  digits: int = 2
  ops: str = "+-*"
  max_value: int = 999

  def __post_init__(self):
    if not 1 <= self.min_steps <= self.max_steps <= 64:
      raise ValueError(f"need 1 <= min_steps <= max_steps <= 64, got {self.min_steps}, {self.max_steps}")
    if not 1 <= self.digits <= 3:
      raise ValueError(f"digits must be in [1, 3], got {self.digits}")
    if not self.ops or any(o not in OPS for o in self.ops) or len(set(self.ops)) != len(self.ops):
      raise ValueError(f"ops must be distinct characters of {OPS!r}, got {self.ops!r}")
    if "+" not in self.ops or "-" not in self.ops:
      raise ValueError(f"ops={self.ops!r} needs both '+' and '-': with one of them a chain can reach 0 or "
                       "max_value and find no step that stays in range")
    if not 10 ** self.digits - 1 <= self.max_value <= 10 ** 6:
      raise ValueError(f"max_value must be in [{10 ** self.digits - 1}, 1e6] (room for a {self.digits}-digit "
                       f"operand), got {self.max_value}")


def split_of(problem: str) -> str:
  """"test" for a fixed 1/TEST_BUCKETS of problems (by hash), else "train": splits never overlap."""
  return "test" if zlib.crc32(problem.encode()) % TEST_BUCKETS == 0 else "train"


def _apply(value: int, op: str, operand: int) -> int:
  if op == "+":
    return value + operand
  if op == "-":
    return value - operand
  if op == "*":
    return value * operand
  return value // operand  # exact: operands of "/" are drawn among the divisors


def _draw_step(rng: np.random.Generator, value: int, cfg: ChainsConfig) -> tuple[str, int]:
  """One (op, operand) that keeps the result in [0, max_value] (and "/" exact): a "+" or a "-" of 1 always
  fits, so the draws end (a bound guards against an endless loop all the same)."""
  for _ in range(100_000):
    op = cfg.ops[int(rng.integers(len(cfg.ops)))]
    if op in "+-":
      operand = int(rng.integers(1, 10 ** cfg.digits))
    elif op == "*":
      operand = int(rng.integers(2, 10))
    else:
      divisors = [d for d in range(2, 10) if value % d == 0 and value > 0]
      if not divisors:
        continue
      operand = divisors[int(rng.integers(len(divisors)))]
    if 0 <= _apply(value, op, operand) <= cfg.max_value:
      return op, operand
  raise RuntimeError(f"no step from {value} stays in [0, {cfg.max_value}] for {cfg}")


def render(value: int, steps: list[tuple[str, int]]) -> str:
  """The chain `value op1 x1 op2 x2 ...` (left to right) with the fewest parentheses: a product or quotient
  wraps what precedes it only when that ends in a top-level sum or difference."""
  text, low = str(value), False  # low: the text so far ends in a top-level + or - term
  for op, operand in steps:
    if op in "*/" and low:
      text = f"({text})"
    text, low = f"{text}{op}{operand}", op in "+-"
  return text


def sample_problem(rng: np.random.Generator, cfg: ChainsConfig) -> tuple[str, str]:
  """One (problem, answer), e.g. ("(17+25)*3-9", "117")."""
  value = first = int(rng.integers(1, 10 ** cfg.digits))
  steps = []
  for _ in range(int(rng.integers(cfg.min_steps, cfg.max_steps + 1))):
    op, operand = _draw_step(rng, value, cfg)
    steps.append((op, operand))
    value = _apply(value, op, operand)
  return render(first, steps), str(value)


def parse_steps(problem: str) -> tuple[int, list[tuple[str, int]]]:
  """The first number and the (op, operand) steps of a problem: its parentheses only group to the left."""
  bare = problem.replace("(", "").replace(")", "")
  numbers = [int(n) for n in bare.replace("+", " ").replace("-", " ").replace("*", " ").replace("/", " ").split()]
  ops = [ch for ch in bare if ch in OPS]
  if len(numbers) != len(ops) + 1 or render(numbers[0], list(zip(ops, numbers[1:]))) != problem:
    raise ValueError(f"not a chains problem: {problem!r}")
  return numbers[0], list(zip(ops, numbers[1:]))


def target_response(problem: str, boxed: bool = True) -> str:
  """The worked solution (text after the prompt's `=`), without EOS: the expression with its leftmost
  operation done, again and again (`42*3-9=126-9=117`), then the answer boxed, or with boxed=False
  left bare (right, but scored 0 by a grader that reads the last \\boxed{})."""
  value, steps = parse_steps(problem)
  lines = []
  for i, (op, operand) in enumerate(steps):
    value = _apply(value, op, operand)
    lines.append(render(value, steps[i + 1:]))
  return "=".join(lines) + (f" {BOX}{value}}}" if boxed else "")


def generate_rows(n: int, seed: int, cfg: ChainsConfig = ChainsConfig(), split: str = "train"
                  ) -> list[dict[str, str]]:
  """`n` distinct rows {"problem", "answer"} of `split`, a pure function of (n, seed, cfg, split)."""
  if split not in ("train", "test"):
    raise ValueError(f"split must be 'train' or 'test', got {split!r}")
  rng = np.random.default_rng([seed, 0 if split == "train" else 1])
  rows, seen, tries = [], set(), 0
  while len(rows) < n:
    tries += 1
    if tries > 100 * (n + 10):
      raise RuntimeError(f"could not draw {n} distinct {split} problems for {cfg}: widen the config")
    problem, answer = sample_problem(rng, cfg)
    if problem not in seen and split_of(problem) == split:
      seen.add(problem)
      rows.append({"problem": problem, "answer": answer})
  return rows


def fresh_rows(n: int, seed: int, cfg: ChainsConfig, exclude: set[str], split: str = "train") -> list[dict[str, str]]:
  """The first `n` rows of `split` whose problems are not in `exclude` (a warm-start corpus): RL prompts the
  reference never saw in its supervised data, as a base model's RL prompts are not its fine-tuning set."""
  # n + |exclude| distinct rows hold at least n outside `exclude` (generate_rows says when the config is too narrow)
  return [r for r in generate_rows(n + len(exclude), seed, cfg, split) if r["problem"] not in exclude][:n]


def task_rows(split: str, seed: int, cfg: ChainsConfig, n: int, *, corpus_cfg: ChainsConfig | None = None,
              fresh: bool = False, num_test: int = 0) -> list[dict[str, str]]:
  """One set of the task, `n` rows. "warmstart": the reference's supervised corpus, drawn with `corpus_cfg`
  (default `cfg`); "train": the RL prompts, drawn with `cfg`, none of the corpus's problems when `fresh`;
  "test": held-out rows of `cfg` (never in a train-split corpus: the hash split); "val": the held-out rows
  drawn after the first `num_test` test rows (an lr is chosen on them, never on the problems a table reports)."""
  if split == "val":
    return generate_rows(num_test + n, seed, cfg, "test")[num_test:]
  if split == "warmstart":
    return generate_rows(n, seed, corpus_cfg or cfg)
  if split == "train" and fresh:
    return fresh_rows(n, seed, cfg, {r["problem"] for r in task_rows("warmstart", seed, cfg, n, corpus_cfg=corpus_cfg)})
  return generate_rows(n, seed, cfg, split)


def supervised_pair(tokenizer, problem: str, boxed: bool = True) -> tuple[list[int], list[int]]:
  """(prompt ids with BOS, target response ids ending in EOS) for the supervised warm start."""
  prompt = tokenizer(dataset.format_prompt(problem, PROMPT_TEMPLATE))["input_ids"]
  response = tokenizer(target_response(problem, boxed), add_special_tokens=False)["input_ids"]
  return list(prompt), list(response) + [tokenizer.eos_token_id]


def build_tokenizer():
  """The character tokenizer of this task's VOCAB (`\\boxed{` one token), in HF format."""
  return synthetic.build_tokenizer(VOCAB)


def save_tokenizer(directory: str) -> str:
  """Writes the tokenizer so `AutoTokenizer.from_pretrained(directory)` loads it."""
  return synthetic.save_tokenizer(directory, VOCAB)
