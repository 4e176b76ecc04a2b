"""Calibration of the chains task (configs/chains.py): the figures docs/chains.md records.

  flock /work/cpu.lock python experiments/calibrate_chains.py --config=configs/chains.py --workdir=/tmp/chains_cal
  python experiments/calibrate_chains.py --config=configs/chains.py:quick --workdir=/tmp/chains_cal_q --grpo_steps=3

Measures, on the config's warm-started reference and training prompts:
- the reference's response lengths (tokens, EOS included) over Stage 1's N samples per training prompt;
- the pass-count histogram over training prompts under N (and the share with zero passes), the pass rate
  by chain length, and the reference's held-out greedy pass@1;
- the split of one rollout step's wall time into sampling / grading / log-prob forwards / update, for
  A*-PO and GRPO (the loop's sec_* metrics, means over steps 2.. since the first step compiles);
- held-out accuracy and the training reward over the config's A*-PO rollout steps.
Writes calibration.json in the work directory and prints a summary. A*-PO runs in workdir/astarpo,
GRPO in workdir/grpo from a copy of the same reference; rerunning resumes both (delete to redo).
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # configs/ and the package

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from astarpo_jax import experiment as run_setup  # noqa: E402
from astarpo_jax.data import chains  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/chains.py", "A chains config (configs/chains.py[:variant]).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Work directory (A*-PO in ./astarpo, GRPO in ./grpo).")
_GRPO_STEPS = flags.DEFINE_integer("grpo_steps", 5, "GRPO rollout steps to time (0: skip GRPO).")
flags.mark_flags_as_required(["workdir"])

PHASES = ("sample", "grade", "ref", "old_logp", "values", "update")
LENGTH_BINS = (0, 32, 64, 96, 128, 160, 192, 224, 256, 10**9)


def _commit() -> str:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    out = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    return out.stdout.strip() + ("+dirty" if dirty else "")
  except OSError:
    return "unknown"


def _num_steps(problem: str) -> int:
  return len(chains.parse_steps(problem)[1])


def reference_figures(setup, table) -> dict:
  """Response lengths (tokens), pass counts, pass rate by chain length from Stage 1's kept responses."""
  tok = setup.tokenizer
  records = [table.records[p.uid] for p in setup.train_prompts]
  lengths, steps_of = [], []
  for p, rec in zip(setup.train_prompts, records):
    for text, cut in zip(rec["responses"], rec["truncated"]):
      lengths.append(len(tok(text, add_special_tokens=False)["input_ids"]) + (0 if cut else 1))  # + EOS
    steps_of.append(_num_steps(p.problem))
  L, k = np.array(lengths), np.array([r["num_correct"] for r in records])
  n, steps_of = records[0]["n"], np.array(steps_of)
  by_steps = {}
  for lo in range(0, int(steps_of.max()) + 1, 5):
    sel = (steps_of >= lo) & (steps_of < lo + 5)
    if sel.any():
      by_steps[f"{lo}-{lo + 4}"] = {"prompts": int(sel.sum()), "pass_rate": float(k[sel].mean() / n),
                                    "zero_share": float((k[sel] == 0).mean())}
  return {
      "n_samples": n, "num_prompts": len(records), "pass_count_hist": np.bincount(k, minlength=n + 1).tolist(),
      "zero_pass_share": float((k == 0).mean()), "all_pass_share": float((k == n).mean()),
      "mean_pass_rate": float(k.mean() / n), "pass_by_chain_steps": by_steps,
      "length": {"mean": float(L.mean()), "min": int(L.min()), "max": int(L.max()),
                 **{f"p{q}": float(np.percentile(L, q)) for q in (10, 25, 50, 75, 90)},
                 "hist_edges": list(LENGTH_BINS[:-1]), "hist": np.histogram(L, LENGTH_BINS)[0].tolist()},
  }


def read_metrics(workdir: str, metric: str) -> tuple[list[dict], list[tuple[int, float]]]:
  train, curve = [], []
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      m = json.loads(line)
      if "train/sec_step" in m:
        train.append(m)
      elif f"eval/{metric}" in m:
        curve.append((m["step"], m[f"eval/{metric}"]))
  return train, curve


def step_split(train: list[dict]) -> dict:
  """Mean seconds per rollout step and per phase over steps 2.. (the first also compiles), and shares."""
  steady = train[1:] or train
  step = float(np.mean([m["train/sec_step"] for m in steady]))
  out = {"steps_averaged": len(steady), "sec_step": step, "first_step_s": train[0]["train/sec_step"]}
  for p in PHASES:
    out[f"sec_{p}"] = float(np.mean([m.get(f"train/sec_{p}", 0.0) for m in steady]))
  out["sec_other"] = step - sum(out[f"sec_{p}"] for p in PHASES)
  out["share"] = {p: out[f"sec_{p}"] / step for p in PHASES + ("other",)}
  out["response_length_mean"] = float(np.mean([m["train/response_length"] for m in steady]))
  return out


def run_method(c, workdir: str, reference_dir: str | None, log) -> tuple[dict, object]:
  """Stage 1 (A*-PO only) and training of config `c` in `workdir`; returns phase times and the setup/table."""
  os.makedirs(workdir, exist_ok=True)
  if reference_dir and not os.path.exists(os.path.join(workdir, "reference")):
    shutil.copytree(reference_dir, os.path.join(workdir, "reference"))
  times, t = {}, time.perf_counter()
  setup = run_setup.build(c, workdir, log=log)
  times.update(setup.times)
  times["setup"] = time.perf_counter() - t - sum(setup.times.values())
  with setup, jax.set_mesh(setup.mesh):
    out = {}
    if c.algo.name == "astarpo":
      t = time.perf_counter()
      out["reference_eval"] = run_setup.evaluate_all(setup, setup.ref_params, label="reference", log=log)
      times["eval_reference"] = time.perf_counter() - t
    t = time.perf_counter()
    table = run_setup.run_stage1(setup, workdir, log=log)
    times["stage1"] = time.perf_counter() - t
    t = time.perf_counter()
    result = run_setup.run_training(setup, table, workdir, log=log)
    times["train"] = time.perf_counter() - t
    times["train_evals"] = result.eval_seconds
    out["final_eval"] = result.last_eval
  out["times_s"] = times
  return out, (setup, table)


def main(argv):
  del argv
  c = _CONFIG.value
  c.stage1.keep_responses = True  # the length distribution of the reference's responses
  run_setup.validate_config(c)
  workdir = os.path.abspath(_WORKDIR.value)
  say = run_setup.printer()
  metric = f"{c.data.test_sets[0]}/pass@1"
  report = {"command": " ".join(sys.argv), "commit": _commit(), "loadavg_start": os.getloadavg(),
            "config": json.loads(c.to_json_best_effort())}
  t0 = time.perf_counter()
  astarpo, (setup, table) = run_method(c, os.path.join(workdir, "astarpo"), None, say)
  report["reference"] = reference_figures(setup, table)
  report["astarpo"] = astarpo
  train, curve = read_metrics(os.path.join(workdir, "astarpo"), metric)
  report["astarpo"]["step_split"] = step_split(train)
  report["astarpo"]["curve"] = [(0, astarpo["reference_eval"][metric]["accuracy"])] + curve
  report["astarpo"]["reward_by_step"] = [m["train/reward_mean"] for m in train]
  if _GRPO_STEPS.value:
    g = copy.deepcopy(c)
    g.algo.name, g.train.num_steps, g.train.eval_every = "grpo", _GRPO_STEPS.value, 0
    g.stage1.keep_responses = False
    report["grpo"], _ = run_method(g, os.path.join(workdir, "grpo"), os.path.join(workdir, "astarpo", "reference"), say)
    report["grpo"]["step_split"] = step_split(read_metrics(os.path.join(workdir, "grpo"), metric)[0])
  report["wall_s"] = time.perf_counter() - t0
  report["loadavg_end"] = os.getloadavg()
  with open(os.path.join(workdir, "calibration.json"), "w") as f:
    json.dump(report, f, indent=2, default=str)
  say(summary(report))


def summary(r: dict) -> str:
  ref, lines = r["reference"], []
  L = ref["length"]
  lines.append(f"commit {r['commit']}, load {r['loadavg_start'][0]:.2f} -> {r['loadavg_end'][0]:.2f}, "
               f"wall {r['wall_s']:.0f}s: {r['command']}")
  lines.append(f"reference response tokens: mean {L['mean']:.0f}, min {L['min']}, p10 {L['p10']:.0f}, "
               f"p50 {L['p50']:.0f}, p90 {L['p90']:.0f}, max {L['max']}; hist {L['hist']} (edges {L['hist_edges']})")
  lines.append(f"pass counts under N={ref['n_samples']} over {ref['num_prompts']} training prompts: "
               f"{ref['pass_count_hist']}; zero-pass share {ref['zero_pass_share']:.3f}, all-pass "
               f"{ref['all_pass_share']:.3f}, mean pass rate {ref['mean_pass_rate']:.3f}")
  lines.append("pass rate by chain steps: " + ", ".join(
      f"{k}: {v['pass_rate']:.2f} (zero {v['zero_share']:.2f}, {v['prompts']})" for k, v in ref["pass_by_chain_steps"].items()))
  for name in ("astarpo", "grpo"):
    if name in r:
      s = r[name]["step_split"]
      lines.append(f"{name} step {s['sec_step']:.2f}s (mean of {s['steps_averaged']}; first {s['first_step_s']:.1f}s): "
                   + ", ".join(f"{p} {100 * v:.0f}%" for p, v in s["share"].items() if v)
                   + f"; response length {s['response_length_mean']:.0f}; phase times "
                   + ", ".join(f"{k} {v:.0f}s" for k, v in r[name]["times_s"].items()))
  lines.append("A*-PO held-out greedy pass@1 by step: " + ", ".join(f"{s}: {a:.3f}" for s, a in r["astarpo"]["curve"]))
  rw = r["astarpo"]["reward_by_step"]
  lines.append("A*-PO training reward by step: " + " ".join(f"{x:.2f}" for x in rw))
  return "\n".join(lines)


if __name__ == "__main__":
  logging.set_verbosity(logging.WARNING)
  app.run(main)
