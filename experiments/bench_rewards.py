"""Graded responses/s: RewardPool (worker processes) against grading.grade_batch (this process).

  python experiments/bench_rewards.py                       # 10,000 responses, math_verify, all CPUs
  python experiments/bench_rewards.py --n 2000 --workers 2  # smaller

The responses are a realistic mix built from the shared MATH-500, Minerva, AIME24 and AMC23 files:
correct (the reference solution, or reasoning ending in the boxed gold), wrong (the same text with
a random integer, another problem's answer or a fraction of it boxed), no box (the final box
removed) and long (30-60 KB of other solutions before a correct or wrong ending). Both sides grade
the same two batches (different mixes) with the same rules: batch 1 from cold parser caches, batch 2
after it, as in training; the pool's start-up time is shown apart. The load average is printed
since other processes may share the CPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time

from astarpo_jax.rewards import answers, grading
from astarpo_jax.rewards.reward_pool import RewardPool

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data")
MIX = (("correct", 0.40), ("wrong", 0.35), ("no_box", 0.15), ("long", 0.10))


def load_problems(data_dir: str) -> list[tuple[str, str]]:
  """(reference solution text ending in a box, gold answer) for every row of the four sets."""
  out = []

  def rows(name):
    with open(os.path.join(data_dir, name, "test.jsonl")) as f:
      return [json.loads(line) for line in f]

  out += [(r["solution"], r["answer"]) for r in rows("math500")]
  out += [(r["solution"], answers.last_boxed(r["solution"])) for r in rows("minerva_math")]
  for name in ("aime24", "amc23"):
    for r in rows(name):
      gold = str(r["answer"])
      value = int(float(gold)) if float(gold).is_integer() else gold
      out.append((f"{r['problem']}\nWorking through it step by step gives $\\boxed{{{value}}}$.", gold))
  return [(s, g) for s, g in out if g and answers.last_boxed(s)]


def _rebox(solution: str, new: str | None) -> str:
  """`solution` with its last `\\boxed{...}` replaced by `\\boxed{new}`, or unboxed if `new` is None."""
  start = max(solution.rfind("\\boxed"), solution.rfind("\\fbox"))
  content = answers.last_boxed(solution)
  end = solution.find(content, start) + len(content) + 1
  return solution[:start] + (f"\\boxed{{{new}}}" if new is not None else content) + solution[end:]


def _wrong_answer(rng: random.Random, other_gold: str) -> str:
  """A wrong answer as varied as a model's: a random integer, another problem's answer or a fraction of it."""
  u = rng.random()
  if u < 0.5:
    return str(rng.randint(0, 999))
  return other_gold if u < 0.75 else f"\\frac{{{other_gold}}}{{{rng.randint(2, 9)}}}"


def build_mix(problems: list[tuple[str, str]], n: int, seed: int) -> tuple[list[str], list[str], list[str]]:
  """(responses, golds, kinds) of `n` items in the MIX proportions."""
  rng = random.Random(seed)
  kinds = rng.choices([k for k, _ in MIX], weights=[w for _, w in MIX], k=n)
  responses, golds = [], []
  for kind in kinds:
    solution, gold = rng.choice(problems)
    other = _wrong_answer(rng, rng.choice(problems)[1])
    if kind == "correct":
      text = solution
    elif kind == "wrong":
      text = _rebox(solution, other)
    elif kind == "no_box":
      text = _rebox(solution, None)
    else:
      filler, size = [], rng.randint(30_000, 60_000)
      while sum(map(len, filler)) < size:
        filler.append(rng.choice(problems)[0])
      text = "\n\n".join(filler) + "\n\n" + (solution if rng.random() < 0.5 else _rebox(solution, other))
    responses.append(text)
    golds.append(gold)
  return responses, golds, kinds


def _row(mode, workers, seconds, result, n):
  r = result
  return (f"| {mode} | {workers} | {seconds:.1f} | {n / seconds:,.0f} | {r.rewards.mean():.3f} | "
          f"{r.num_timeouts} | {r.num_errors} | {r.num_killed} | {r.num_rejected} | {r.num_no_answer} |")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--n", type=int, default=10_000, help="responses to grade")
  parser.add_argument("--workers", type=int, default=None, help="pool size (default: CPUs available)")
  parser.add_argument("--timeout_s", type=float, default=5.0, help="per-item time limit")
  parser.add_argument("--grader", default="math_verify", choices=grading.MATH_GRADERS)
  parser.add_argument("--chunk_size", type=int, default=None)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--data_dir", default=DATA)
  args = parser.parse_args()

  problems = load_problems(args.data_dir)
  batches = [build_mix(problems, args.n, args.seed + b) for b in range(2)]
  responses, golds, kinds = batches[0]
  mb = sum(map(len, responses)) / 2**20
  counts = {k: kinds.count(k) for k, _ in MIX}
  print(f"2 batches of {args.n} responses ({mb:.1f} MiB each; first: {counts}); grader={args.grader}; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")

  rows, results = [], {}
  t0 = time.perf_counter()
  with RewardPool(num_workers=args.workers, timeout_s=args.timeout_s, chunk_size=args.chunk_size) as pool:
    startup = time.perf_counter() - t0
    for b, (responses, golds, _) in enumerate(batches):
      t0 = time.perf_counter()
      results["pool", b] = pool.grade(responses, golds, args.grader)
      rows.append(_row(f"RewardPool, batch {b + 1}", pool.num_workers, time.perf_counter() - t0,
                       results["pool", b], args.n))

  grading.warm_up()  # as each worker did at start
  grading._mv_parse.cache_clear()  # noqa: SLF001 -- start cold, like the workers
  for b, (responses, golds, _) in enumerate(batches):
    t0 = time.perf_counter()
    results["local", b] = grading.grade_batch(responses, golds, args.grader, timeout_s=args.timeout_s)
    rows.append(_row(f"grade_batch (in-process), batch {b + 1}", 1, time.perf_counter() - t0,
                     results["local", b], args.n))

  print(f"pool start-up (forkserver, imports, warm-up): {startup:.1f} s. Batch 1 starts cold (parser "
        "caches empty); batch 2 is a new mix graded after it, as in training.")
  print("| mode | workers | seconds | responses/s | mean reward | timeouts | errors | killed | rejected "
        "| no answer |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  print("\n".join(rows))
  differ = sum(int((results["pool", b].rewards != results["local", b].rewards).sum()) for b in range(2))
  print(f"rewards differing between pool and in-process: {differ}; load average now {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
  main()
