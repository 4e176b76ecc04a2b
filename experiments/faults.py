"""Faults tried on a shrunk CPU demo, each rerun with the same command until it finishes, against a run that
nobody interrupted: kill -9 and SIGTERM in every phase, a truncated latest checkpoint, grader workers killed
mid-batch. Prints the table of docs/checkpoints.md.

  python experiments/faults.py --workdir=/tmp/faults

Each fault is injected when a line of the run's output appears (the phase is then in flight). A run is
"the same" when its exported params are byte-identical to the uninterrupted run's and its final evaluation
equal; "logged twice" counts the train steps that metrics.jsonl holds more than once.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--config=configs/demo.py:tiny", "--config.mode=train", "--config.data.num_train=64",
        "--config.train.rollout_batch=16", "--config.train.mini_batch=8", "--config.train.micro_batch=8",
        "--config.train.num_steps=8", "--config.train.checkpoint_every=4", "--config.warmstart.steps=60",
        "--config.data.synthetic.min_terms=2", "--config.data.synthetic.max_terms=2",
        "--config.data.synthetic.num_test=16", "--config.stage1.n_samples=4", "--config.stage1.chunk_prompts=16",
        "--config.export_hf=True"]
# phase -> (the output line after which the fault lands, its occurrence, seconds to wait after it, caches copied);
# runs are --config.mode=train (no reference evaluation) but for the reference evaluation's own trials
PHASES = {
    "warm-start": ("warm-start step 1/", 1, 0.0, ()),
    "reference evaluation": ("data synthetic/test", 2, 0.0, ("reference", "tokenizer")),
    "Stage 1 (chunk 2 of 4)": ("16/64", 1, 0.0, ("reference", "tokenizer")),
    "Stage 2, in step 3": ("[train/step 2]", 1, 0.0, ("reference", "tokenizer", "stage1")),
    "Stage 2, step 4's save": ("[train/step 4]", 1, 0.0, ("reference", "tokenizer", "stage1")),
    "final evaluation": ("[train/step 8]", 1, 0.3, ("reference", "tokenizer", "stage1")),
    "export": ("eval (step 8)", 1, 0.0, ("reference", "tokenizer", "stage1")),
}


def launch(workdir: str, on_line=None) -> tuple[int, str]:
  """main.py in a session of its own; `on_line(text_so_far, pid)` after each read. (exit code, output)."""
  env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
  mode = ["--config.mode=all"] if "reference_evaluation" in workdir else []
  proc = subprocess.Popen([sys.executable, "experiments/main.py", *ARGS, *mode, f"--workdir={workdir}"], cwd=ROOT,
                          env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
  out = b""
  while chunk := proc.stdout.read1(1 << 16):
    out += chunk
    if on_line is not None and on_line(out.decode(errors="replace"), proc.pid):
      on_line = None
  return proc.wait(), out.decode(errors="replace").replace("\r", "\n")


def trigger(marker: str, count: int, delay: float, act):
  def on_line(text, pid):
    if text.count(marker) >= count:
      time.sleep(delay)
      act(pid)
      return True
    return False
  return on_line


def reward_workers(pid: int) -> list[int]:
  """The grader workers of the run `pid`: in its session, forked by its forkserver (not by it)."""
  out = []
  for p in filter(str.isdigit, os.listdir("/proc")):
    try:
      stat = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
      cmd = open(f"/proc/{p}/cmdline").read()
    except OSError:
      continue
    if int(stat[3]) == pid and "forkserver" in cmd and int(stat[1]) != pid:
      out.append(int(p))
  return out


def finish(workdir: str, first: tuple[int, str], limit: int = 4) -> dict:
  """Reruns the same command until it exits 0; what the reruns said."""
  codes, said = [first[0]], []
  if first[0] not in (0, 75, -signal.SIGKILL):
    said.append(next((s.strip() for s in reversed(first[1].splitlines()) if "Error" in s), "?")[:120])
  while codes[-1] != 0 and len(codes) < limit:
    rc, out = launch(workdir)
    codes.append(rc)
    said += [short for s in out.splitlines() if (short := _short(s))]
  return {"codes": codes, "said": said}


def _short(line: str) -> str | None:
  """A rerun's line about what it kept, in a few words."""
  w = line.split()
  if line.startswith("resumed after rollout step"):
    return f"Stage 2 from step {w[4]}"
  if line.startswith("stage1: resuming:"):
    return f"Stage 1 kept {w[2]} of {w[4]} chunks"
  if line.startswith("checkpoint step") and "does not restore" in line:
    return f"step {w[2]} set aside"
  if line.startswith("warm-start step 1/"):
    return "warm-start redone"
  return None


def compare(workdir: str, base: str) -> dict:
  same = os.path.exists(f"{workdir}/export/model.safetensors") and open(
      f"{workdir}/export/model.safetensors", "rb").read() == open(f"{base}/export/model.safetensors", "rb").read()
  def ev(d):
    return json.load(open(f"{d}/report.json"))["final_eval"] if os.path.exists(f"{d}/report.json") else None
  steps = [json.loads(s)["step"] for s in open(f"{workdir}/metrics.jsonl") if "train/loss" in s] \
      if os.path.exists(f"{workdir}/metrics.jsonl") else []
  errors = sum(json.loads(s).get("train/grade_errors", 0) for s in open(f"{workdir}/metrics.jsonl")) \
      if os.path.exists(f"{workdir}/metrics.jsonl") else 0
  evals = [json.loads(s)["step"] for s in open(f"{workdir}/metrics.jsonl") if "eval/" in s] \
      if os.path.exists(f"{workdir}/metrics.jsonl") else []
  twice = sorted(s for s, n in collections.Counter(steps).items() if n > 1)
  twice += [f"eval {s}" for s, n in collections.Counter(evals).items() if n > 1]
  return {"same_params": same, "same_eval": ev(workdir) == ev(base), "logged_twice": twice,
          "grade_errors": errors}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--only", default="", help="run the trials whose name holds this text")
  a = ap.parse_args()
  base = os.path.join(a.workdir, "straight")
  if not os.path.exists(f"{base}/report.json"):
    rc, out = launch(base)
    assert rc == 0, out[-3000:]
  trials = []
  for sig in (signal.SIGKILL, signal.SIGTERM):
    for phase, (marker, count, delay, cached) in PHASES.items():
      trials.append((f"{'kill -9' if sig == signal.SIGKILL else 'SIGTERM'} in {phase}", cached,
                     trigger(marker, count, delay, lambda pid, s=sig: os.kill(pid, s)), None))

  def truncate_latest(workdir):
    ck = f"{workdir}/checkpoints"
    latest = max(int(n) for n in os.listdir(ck) if n.isdigit())
    for dirpath, _, names in os.walk(f"{ck}/{latest}"):
      for n in names:
        if os.path.basename(dirpath) == "d":
          p = os.path.join(dirpath, n)
          os.truncate(p, os.path.getsize(p) // 2)
  trials.append(("latest checkpoint truncated (after SIGTERM in step 6)", PHASES["export"][3],
                 trigger("[train/step 5]", 1, 0.0, lambda pid: os.kill(pid, signal.SIGTERM)), truncate_latest))

  def kill_workers(seconds):
    def act(pid):
      def loop():
        end = time.monotonic() + seconds
        while True:
          for w in reward_workers(pid):
            try:
              os.kill(w, signal.SIGKILL)
            except ProcessLookupError:
              pass
          if time.monotonic() > end:
            return
          time.sleep(0.02)
      threading.Thread(target=loop, daemon=True).start()
    return act
  trials.append(("grader workers kill -9'd once, in step 2", PHASES["export"][3],
                 trigger("[train/step 1]", 1, 0.0, kill_workers(0)), None))
  trials.append(("grader workers kill -9'd for 3 s of Stage 2", PHASES["export"][3],
                 trigger("[train/step 1]", 1, 0.0, kill_workers(3.0)), None))

  rows = []
  for name, cached, on_line, between in trials:
    if a.only and a.only not in name:
      continue
    workdir = os.path.join(a.workdir, name.replace(" ", "_").replace("'", "").replace(",", "").replace("(", "")
                           .replace(")", ""))
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    for c in cached:
      shutil.copytree(os.path.join(base, c), os.path.join(workdir, c))
    t = time.perf_counter()
    first = launch(workdir, on_line)
    if between is not None:
      between(workdir)
    done = finish(workdir, first)
    row = {"fault": name, **done, **compare(workdir, base), "seconds": round(time.perf_counter() - t)}
    print(json.dumps(row), flush=True)
    rows.append(row)
  print("\n| fault | exit codes | what the rerun said | same params / eval | train steps logged twice |")
  print("|---|---|---|---|---|")
  for r in rows:
    said = "; ".join(dict.fromkeys(r["said"])) or "-"
    print(f"| {r['fault']} | {' → '.join(map(str, r['codes']))} | {said} | "
          f"{'yes' if r['same_params'] else 'no'} / {'yes' if r['same_eval'] else 'no'} | "
          f"{', '.join(map(str, r['logged_twice'])) or 'none'} |")


if __name__ == "__main__":
  main()
