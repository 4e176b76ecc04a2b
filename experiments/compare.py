"""A*-PO against GRPO, PPO and REBEL on the CPU demo task: time, memory, held-out accuracy, KL to pi_ref.

  python experiments/compare.py --workdir=/tmp/astarpo_compare           # the full comparison (~15 min, 2 cores)
  python experiments/compare.py --workdir=/tmp/astarpo_compare_q --quick # a smaller smoke run (~5 min)

All four methods start from one warm-started reference (built once, then copied into each method's
work directory), train on the same prompts in the same order (same seed, same prompts per step,
same number of steps), at the same learning rate, and are evaluated the same way. Each method runs
in its own subprocess, so its peak RSS is its own. The budget rule: every method visits the same
prompts; A*-PO samples 1 response per visit plus Stage 1's N per training prompt once, GRPO G per
visit, PPO 1, REBEL 2.

Writes comparison.md, comparison.csv and comparison.png in the work directory. A method whose
result.json exists from a run with the same settings is not run again (--fresh reruns all).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # configs/ and the package

METHODS = ("astarpo", "grpo", "ppo", "rebel")
LABELS = {"astarpo": "A*-PO", "grpo": "GRPO", "ppo": "PPO", "rebel": "REBEL"}
METRIC = "synthetic/pass@1"  # held-out greedy accuracy
PHASES = ("sample", "grade", "ref", "values", "update")


def comparison_config(method: str, quick: bool):
  """configs/demo.py with the comparison's settings; everything but the method is the same for all."""
  from configs import demo
  c = demo.get_config("full")
  c.algo.name = method
  c.data.avg_k_sets = ()  # greedy pass@1 only: the curves need many cheap evaluations
  c.train.num_steps = 10 if quick else 40
  c.train.eval_every = 2  # the demo task is learnt within ~10 steps: a fine-grained curve
  c.train.checkpoint_every = c.train.num_steps  # one save at the end: checkpoint I/O is not what is compared
  c.export_hf = False
  if quick:
    c.data.num_train = 512
    c.data.synthetic.num_test = 100
  # The same lr family for all: the demo's policy lr; PPO's critic at 10x (verl's 1e-5 vs 1e-6).
  c.algo.value_lr = 10 * c.optim.lr
  return c


def peak_rss_mb() -> float:
  """Peak resident set size of this process so far (Linux reports KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def cpu_seconds() -> float:
  """User + system CPU time of this process, all threads: less sensitive than wall time to other
  jobs sharing the cores (the reward workers are separate processes and not counted)."""
  t = os.times()
  return t.user + t.system


# ---------------------------------------------------------------------------------------------
# Worker: one method (or the reference) in this process.

def kl_to_reference(cfg, params, ref_params, prompts, tokenizer, grade, scfg, key, k: int = 4) -> dict:
  """KL(pi ‖ pi_ref) on held-out prompts: the mean over k sampled responses per prompt of
  Σ_t log pi(y_t)/pi_ref(y_t) (the sequence-level k1 estimate), both log-probs from a full forward."""
  import jax.numpy as jnp
  import numpy as np
  from astarpo_jax import rollout as rollout_lib
  from astarpo_jax import scoring
  rows = [p for p in prompts for _ in range(k)]
  ro = rollout_lib.rollout(cfg, params, [p.ids for p in rows], [p.gold for p in rows], key, scfg, tokenizer, grade)
  tokens, mask, resp = rollout_lib.trim_response(ro)
  lp = lambda p: np.asarray(scoring.logprobs(cfg, p, jnp.asarray(tokens), jnp.asarray(mask),  # noqa: E731
                                             prompt_len=ro.prompt_len), np.float64)
  diff = np.where(resp, lp(params) - lp(ref_params), 0.0)
  return {"kl_seq": float(diff.sum(-1).mean()), "kl_token": float(diff.sum() / max(resp.sum(), 1)),
          "num_samples": len(rows)}


def run_worker(role: str, workdir: str, quick: bool) -> None:
  import jax
  from astarpo_jax import experiment
  c = comparison_config("astarpo" if role == "reference" else role, quick)
  experiment.validate_config(c)
  out: dict = {"role": role, "settings": settings_key(quick), "times_s": {}, "cpu_s": {},
               "loadavg_start": os.getloadavg()[0]}
  t = time.perf_counter()
  setup = experiment.build(c, workdir)
  out["times_s"]["setup"] = time.perf_counter() - t
  out["times_s"].update(setup.times)
  out["rss_after_setup_mb"] = peak_rss_mb()
  with setup, jax.set_mesh(setup.mesh):
    if role == "reference":
      out["eval"] = experiment.evaluate_all(setup, setup.ref_params, label="reference")
    else:
      t, cp = time.perf_counter(), cpu_seconds()
      table = experiment.run_stage1(setup, workdir)
      out["times_s"]["stage1"] = time.perf_counter() - t
      out["cpu_s"]["stage1"] = cpu_seconds() - cp
      t, cp = time.perf_counter(), cpu_seconds()
      result = experiment.run_training(setup, table, workdir)
      params, out["eval"] = result.params, result.last_eval
      out["times_s"]["stage2_process"] = time.perf_counter() - t  # training + evaluations + compiles + saves
      out["cpu_s"]["stage2_process"] = cpu_seconds() - cp
      # Evaluations during training are the same work for every method: timed apart by the loop.
      out["times_s"]["evals"], out["cpu_s"]["evals"] = result.eval_seconds, result.eval_cpu_seconds
      out["rss_after_training_mb"] = peak_rss_mb()
      test = next(iter(setup.test_sets.values()))
      out["kl"] = kl_to_reference(setup.cfg, params, setup.ref_params, test, setup.tokenizer, setup.graders.eval[0][1],
                                  setup.scfg, jax.random.key(c.seed + 7))
  out["rss_peak_mb"] = peak_rss_mb()
  out["loadavg_end"] = os.getloadavg()[0]
  out["config"] = json.loads(c.to_json_best_effort())
  with open(os.path.join(workdir, "result.json"), "w") as f:
    json.dump(out, f, indent=2, default=str)


# ---------------------------------------------------------------------------------------------
# Driver: the reference once, each method in a subprocess, then the table and the plot.

def settings_key(quick: bool) -> str:
  return "quick" if quick else "full"


def _spawn(role: str, workdir: str, quick: bool, log) -> float:
  os.makedirs(workdir, exist_ok=True)
  cmd = [sys.executable, os.path.abspath(__file__), f"--worker={role}", f"--workdir={workdir}"]
  cmd += ["--quick"] if quick else []
  t = time.perf_counter()
  with open(os.path.join(workdir, "worker.log"), "w") as logf:
    rc = subprocess.call(cmd, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT,
                         env=dict(os.environ, HF_HUB_OFFLINE="1", TQDM_DISABLE="1"))
  if rc != 0:
    raise RuntimeError(f"{role} failed (exit {rc}); see {workdir}/worker.log")
  seconds = time.perf_counter() - t
  log(f"{role}: done in {seconds:.0f}s")
  return seconds


def _cached(workdir: str, quick: bool) -> dict | None:
  path = os.path.join(workdir, "result.json")
  if os.path.exists(path):
    with open(path) as f:
      res = json.load(f)
    if res.get("settings") == settings_key(quick):
      return res
  return None


def _read_metrics(workdir: str) -> tuple[list[dict], list[dict]]:
  train_rows, eval_rows = [], []
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      m = json.loads(line)
      (train_rows if "train/sec_step" in m else eval_rows).append(m)
  return train_rows, eval_rows


def summarize(method: str, res: dict, ref_acc: float, train_rows: list[dict], eval_rows: list[dict], c) -> dict:
  """One table row plus the accuracy-vs-time curve of a method.

  Training time is the sum of the loop's per-step wall times (sampling, grading, reference and
  critic forwards, updates; not evaluation, checkpoints or logging) plus A*-PO's Stage 1.
  """
  stage1_s = res["times_s"]["stage1"] if method == "astarpo" else 0.0
  secs = [m["train/sec_step"] for m in train_rows]
  cum, t = {}, stage1_s
  for m in train_rows:
    t += m["train/sec_step"]
    cum[m["step"]] = t
  steady = train_rows[1:] or train_rows  # the first step also compiles
  phase = {p: sum(m.get(f"train/sec_{p}", 0.0) for m in steady) / len(steady) for p in PHASES}
  curve = [(0.0, 0, ref_acc)] + ([(stage1_s, 0, ref_acc)] if stage1_s else [])
  curve += [(cum[m["step"]], m["step"], m[f"eval/{METRIC}"]) for m in eval_rows if f"eval/{METRIC}" in m]
  G = c.algo.group_size or {"astarpo": 1, "grpo": 8, "ppo": 1, "rebel": 2}[method]
  visits = c.train.num_steps * c.train.rollout_batch
  cpu = res["cpu_s"]
  return {
      "method": LABELS[method], "steps": len(train_rows), "prompt_visits": visits,
      "responses_sampled": visits * G + (len_train(c) * c.stage1.n_samples if method == "astarpo" else 0),
      "stage1_s": stage1_s, "stage2_train_s": sum(secs), "total_train_s": stage1_s + sum(secs),
      "train_cpu_s": cpu["stage1"] + cpu["stage2_process"] - cpu["evals"],
      "s_per_step": sum(m["train/sec_step"] for m in steady) / len(steady),
      **{f"s_per_step_{p}": phase[p] for p in PHASES}, "first_step_s": secs[0] if secs else 0.0,
      "peak_rss_mb": res["rss_after_training_mb"], "rss_after_setup_mb": res["rss_after_setup_mb"],
      "final_acc": res["eval"][METRIC]["accuracy"], "kl_seq": res["kl"]["kl_seq"], "kl_token": res["kl"]["kl_token"],
      "load_start": res["loadavg_start"], "load_end": res["loadavg_end"], "curve": curve,
  }


def len_train(c) -> int:
  return c.data.num_train or c.data.synthetic.num_train


def time_to_reach(curve, target: float) -> float | None:
  """The training time of the first evaluation at or above `target` (None if never)."""
  return next((t for t, _, acc in curve if acc >= target), None)


def _fmt(v) -> str:
  if v is None:
    return "—"
  if isinstance(v, float):
    return f"{v:.3f}" if abs(v) < 1 else f"{v:.2f}" if abs(v) < 10 else f"{v:.0f}"
  return str(v)


def _table(rows: list[dict], cols: list[tuple[str, str]]) -> list[str]:
  out = ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)]
  return out + ["| " + " | ".join(_fmt(r[k]) for _, k in cols) + " |" for r in rows]


def write_outputs(rows: list[dict], ref_acc: float, out_dir: str, command: str, log) -> None:
  """comparison.csv (every number), comparison.md (two tables and the time ratios), comparison.png."""
  target = min(r["final_acc"] for r in rows)
  a = next((r for r in rows if r["method"] == "A*-PO"), None)
  for r in rows:
    r["time_to_target_s"] = time_to_reach(r["curve"], target)
    if a:
      r["astarpo_time_ratio"] = a["total_train_s"] / r["total_train_s"]
      r["astarpo_stage2_ratio"] = a["stage2_train_s"] / r["stage2_train_s"]
      r["astarpo_cpu_ratio"] = a["train_cpu_s"] / r["train_cpu_s"]
      r["astarpo_step_ratio"] = a["s_per_step"] / r["s_per_step"]
  cols = [k for k in rows[0] if k != "curve"]
  with open(os.path.join(out_dir, "comparison.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
  time_cols = [("method", "method"), ("responses sampled", "responses_sampled"), ("Stage 1 s", "stage1_s"),
               ("Stage 2 s", "stage2_train_s"), ("total s", "total_train_s"), ("CPU s", "train_cpu_s"),
               ("s/step", "s_per_step"), ("sample", "s_per_step_sample"), ("grade", "s_per_step_grade"),
               ("ref fwd", "s_per_step_ref"), ("critic fwd+GAE", "s_per_step_values"),
               ("update", "s_per_step_update"), ("1st step (compile) s", "first_step_s"),
               ("peak RSS MB", "peak_rss_mb"), ("load avg start", "load_start"), ("load avg end", "load_end")]
  out_cols = [("method", "method"), ("held-out acc", "final_acc"), (f"s to acc ≥ {target:.3f}", "time_to_target_s"),
              ("KL(π‖π_ref) per seq", "kl_seq"), ("per token", "kl_token")]
  if a:
    out_cols += [("A*-PO total s ÷ this", "astarpo_time_ratio"), ("Stage 2 s ÷", "astarpo_stage2_ratio"),
                 ("s/step ÷", "astarpo_step_ratio"), ("CPU s ÷", "astarpo_cpu_ratio")]
  md = [f"Command: `{command}`", "", f"Reference (warm-started π_ref) held-out accuracy: {ref_acc:.3f}", "",
        "Time and memory (s/step and its phases: mean over steps 2..N; total: all steps, Stage 1 included):", ""]
  md += _table(rows, time_cols) + ["", "Outcome:", ""] + _table(rows, out_cols)
  with open(os.path.join(out_dir, "comparison.md"), "w") as f:
    f.write("\n".join(md) + "\n")
  log("\n".join(md))
  _plot(rows, ref_acc, os.path.join(out_dir, "comparison.png"))


def _plot(rows: list[dict], ref_acc: float, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4))
  for r in rows:
    t, s, acc = zip(*r["curve"])
    ax_t.plot(t, acc, marker="o", ms=3, label=r["method"])
    ax_s.plot(s, acc, marker="o", ms=3, label=r["method"])
  for ax, xl in ((ax_t, "training wall-clock s (A*-PO includes Stage 1)"), (ax_s, "rollout step")):
    ax.axhline(ref_acc, color="gray", lw=0.8, ls="--")
    ax.set_xlabel(xl)
    ax.set_ylabel("held-out greedy accuracy")
    ax.grid(alpha=0.3)
  ax_t.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--quick", action="store_true", help="fewer steps and prompts (a smoke run)")
  ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
  ap.add_argument("--fresh", action="store_true", help="rerun every method even if its result exists")
  ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
  args = ap.parse_args()
  workdir = os.path.abspath(args.workdir)
  if args.worker:
    run_worker(args.worker, workdir, args.quick)
    return
  methods = [m for m in args.methods.split(",") if m]
  bad = [m for m in methods if m not in METHODS]
  if bad:
    raise SystemExit(f"--methods: unknown {bad}; choose from {METHODS}")
  log = lambda s: print(s, flush=True)  # noqa: E731
  os.makedirs(workdir, exist_ok=True)
  t0 = time.perf_counter()
  ref_dir = os.path.join(workdir, "reference_run")
  if args.fresh or _cached(ref_dir, args.quick) is None:
    shutil.rmtree(ref_dir, ignore_errors=True)
    _spawn("reference", ref_dir, args.quick, log)
  ref = _cached(ref_dir, args.quick)
  ref_acc = ref["eval"][METRIC]["accuracy"]
  rows = []
  for m in methods:
    mdir = os.path.join(workdir, m)
    res = None if args.fresh else _cached(mdir, args.quick)
    if res is None:
      shutil.rmtree(mdir, ignore_errors=True)  # a fresh run: resumed timings would not be comparable
      shutil.copytree(os.path.join(ref_dir, "reference"), os.path.join(mdir, "reference"))
      _spawn(m, mdir, args.quick, log)
      res = _cached(mdir, args.quick)
    rows.append(summarize(m, res, ref_acc, *_read_metrics(mdir), comparison_config(m, args.quick)))
  command = "python experiments/compare.py --workdir=" + args.workdir + (" --quick" if args.quick else "")
  write_outputs(rows, ref_acc, workdir, command, log)
  log(f"compare: {time.perf_counter() - t0:.0f}s in all; outputs in {workdir}")


if __name__ == "__main__":
  main()
