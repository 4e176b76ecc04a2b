"""An evaluation's outputs: eval.json, the markdown table, and the plot of pass@k against k.

The table gives each set and metric of the headline grader as mean ± standard error over problems; with a
baseline, beside it the baseline's figure and the paired difference with its 95% paired-bootstrap interval (and
McNemar's p for 0/1 figures). The plot has one axes per sampled set: pass@k (solid) and maj@k (dashed) against k
on a log2 axis, the model and the baseline on the same axes.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence

from astarpo_jax.infra import files


def write_json(path: str, report: dict) -> None:
  files.write_text_atomic(path, json.dumps(report, indent=1, default=str))


def _metric_order(m: str) -> tuple:
  kind, _, k = m.partition("@")
  return ({"pass": 0, "avg": 1, "maj": 2}.get(kind, 3) if kind != "pass" or k != "1" else -1, int(k or 0))


def _fmt(f: dict) -> str:
  return f"{f['mean']:.3f} ± {f['se']:.3f}"


def markdown(results: Sequence[dict], grader: str, model: str, baseline: Sequence[dict] | None = None,
             paired: dict | None = None, baseline_name: str = "") -> str:
  """The figures of `grader` as a markdown table (and the paired differences when a baseline is given)."""
  base = {(r["set"], r["mode"], r["n"]): r for r in baseline or ()}
  head = ["set", "metric", "problems", model]
  if baseline:
    head += [baseline_name or "baseline", "difference [95% CI]", "McNemar p"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for res in results:
    figs = res["graders"].get(grader, {})
    other = base.get((res["set"], res["mode"], res["n"]))
    for m in sorted(figs, key=_metric_order):
      label = f"greedy {m}" if res["mode"] == "greedy" else m
      row = [res["set"], label, str(res["num_problems"]), _fmt(figs[m])]
      if baseline:
        ofig = other["graders"].get(grader, {}).get(m) if other else None
        d = (paired or {}).get(f"{res['set']}/{'greedy ' if res['mode'] == 'greedy' else ''}{m}")
        row += [_fmt(ofig) if ofig else "", f"{d['diff']:+.3f} [{d['ci_lo']:+.3f}, {d['ci_hi']:+.3f}]" if d else "",
                f"{d['mcnemar']['p']:.3g}" if d and "mcnemar" in d else ""]
      lines.append("| " + " | ".join(row) + " |")
  lines.append("")
  lines.append("| set | mode | " + model + " length | truncated" + (f" | {baseline_name or 'baseline'} length | "
                                                                       "truncated" if baseline else "") + " |")
  lines.append("|---|---|---|---|" + ("---|---|" if baseline else ""))
  for res in results:
    row = [res["set"], res["mode"] if res["mode"] == "greedy" else f"n={res['n']}", f"{res['response_length']:.1f}",
           f"{res['truncation_share']:.3f}"]
    other = base.get((res["set"], res["mode"], res["n"]))
    if baseline and other:
      row += [f"{other['response_length']:.1f}", f"{other['truncation_share']:.3f}"]
    lines.append("| " + " | ".join(row) + " |")
  notes = sorted({f"{g}: maj@k {why}" for res in results for g, why in res.get("maj@k", {}).items()})
  return "\n".join(lines + [f"\n{n}" for n in notes]) + "\n"


def plot(path: str, results: Sequence[dict], grader: str, model: str, baseline: Sequence[dict] | None = None,
         baseline_name: str = "baseline") -> bool:
  """pass@k and maj@k against k per sampled set, both models on one axes; False (nothing written) when no set
  was sampled."""
  sampled = [r for r in results if r["mode"] == "sampled"]
  if not sampled:
    return False
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  base = {(r["set"], r["n"]): r for r in baseline or () if r["mode"] == "sampled"}
  fig, axes = plt.subplots(1, len(sampled), figsize=(4.2 * len(sampled), 3.4), squeeze=False)
  for ax, res in zip(axes[0], sampled):
    for who, r, color in ((model, res, "C0"), (baseline_name, base.get((res["set"], res["n"])), "C1")):
      if r is None:
        continue
      figs = r["graders"].get(grader, {})
      for kind, style in (("pass", "-"), ("maj", "--")):
        ks = sorted(int(m.split("@")[1]) for m in figs if m.startswith(f"{kind}@"))
        if ks:
          ax.errorbar(ks, [figs[f"{kind}@{k}"]["mean"] for k in ks], yerr=[figs[f"{kind}@{k}"]["se"] for k in ks],
                      fmt=style + "o", color=color, ms=3, capsize=2, label=f"{who} {kind}@k")
    ax.set_xscale("log", base=2)
    ks = sorted(int(m.split("@")[1]) for m in res["graders"].get(grader, {}) if m.startswith("pass@"))
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("k")
    ax.set_ylabel(f"{grader} accuracy")
    ax.set_title(f"{res['set']} (n={res['n']}, {res['num_problems']} problems)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True
