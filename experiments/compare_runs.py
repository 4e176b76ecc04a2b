"""Are two runs the same? Compares two work directories of experiments/main.py: every logged number of
metrics.jsonl (timings left out), the exported params (export/*.safetensors) and the evaluations in
report.json. Used to check that a refactoring left a recorded run unchanged, bit for bit.

  python experiments/compare_runs.py GOLDEN_WORKDIR NEW_WORKDIR [--tolerance 1e-6]

Exits 1 when a number differs by more than the tolerance (relative, at least absolute for small ones),
a params tensor at all, or an evaluation; the differing metric keys are printed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

TIMING = ("sec_", "tokens_per_sec")


def metric_rows(workdir: str) -> list[dict]:
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8")]
  return [{k: v for k, v in r.items() if k != "time" and not any(t in k.split("/")[-1] for t in TIMING)}
          for r in rows]


def exported_params(workdir: str) -> dict[str, np.ndarray]:
  from safetensors.numpy import load_file
  folder = os.path.join(workdir, "export")
  out: dict[str, np.ndarray] = {}
  for name in sorted(os.listdir(folder)):
    if name.endswith(".safetensors"):
      out.update(load_file(os.path.join(folder, name)))
  return out


def compare_metrics(a: list[dict], b: list[dict], tol: float) -> tuple[float, set, set]:
  """(largest relative difference, keys that differ by more than tol, keys in only one run)."""
  if len(a) != len(b):
    raise SystemExit(f"metrics.jsonl: {len(a)} rows vs {len(b)}")
  worst, differ, only = 0.0, set(), set()
  for ra, rb in zip(a, b):
    only |= set(ra) ^ set(rb)
    for k in set(ra) & set(rb):
      va, vb = ra[k], rb[k]
      if isinstance(va, (int, float)) and isinstance(vb, (int, float)):
        d = abs(va - vb) / max(1.0, abs(va))
        worst = max(worst, d)
        if d > tol:
          differ.add(k)
      elif va != vb:
        differ.add(k)
  return worst, differ, only


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("golden")
  ap.add_argument("new")
  ap.add_argument("--tolerance", type=float, default=0.0)
  args = ap.parse_args()
  worst, differ, only = compare_metrics(metric_rows(args.golden), metric_rows(args.new), args.tolerance)
  print(f"metrics: worst relative difference {worst:.3g}; differing keys {sorted(differ)}; in one run only {sorted(only)}")
  pa, pb = exported_params(args.golden), exported_params(args.new)
  if set(pa) != set(pb):
    print(f"params: different tensors {sorted(set(pa) ^ set(pb))}")
    return 1
  params_diff = max(float(np.max(np.abs(pa[k].astype(np.float64) - pb[k].astype(np.float64)))) for k in pa)
  print(f"params: {len(pa)} tensors, largest absolute difference {params_diff:.3g}")
  reports = [json.load(open(os.path.join(d, "report.json"), encoding="utf-8")) for d in (args.golden, args.new)]
  evals_equal = True
  for which in ("reference_eval", "final_eval"):
    got = [{k: v["accuracy"] for k, v in r.get(which, {}).items()} for r in reports]
    shared = set(got[0]) & set(got[1])
    same = all(got[0][k] == got[1][k] for k in shared)
    evals_equal &= same
    print(f"{which}: {got[0]} vs {got[1]} ({'equal' if same else 'DIFFERENT'} on the {len(shared)} shared)")
  return 0 if not differ and params_diff == 0 and evals_equal else 1


if __name__ == "__main__":
  sys.exit(main())
