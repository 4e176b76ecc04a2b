"""Launching the worker processes of the multi-process tests (jax.distributed on localhost)."""
import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
  """A localhost port nobody listens on now, for the jax.distributed coordinator."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run_workers(argvs: list[list[str]], timeout: float) -> list[str]:
  """Runs `python <argv>` for each argv at the same time; their outputs, or AssertionError with the
  tails of every log when any fails. A hung process is killed rather than left behind."""
  env = dict(os.environ, PYTHONPATH=ROOT)
  procs = [subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for argv in argvs]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=timeout)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  if any(p.returncode for p in procs):
    raise AssertionError("worker failed:\n" + "\n---\n".join(log[-3000:] for log in logs))
  return logs


def run_json_worker(worker: str, timeout: float, env: dict | None = None) -> dict:
  """Runs `python <worker>` (a script that measures on faked devices and prints one JSON line last) and returns
  that line, or AssertionError with its stderr's tail."""
  env = dict(os.environ, JAX_PLATFORMS="cpu") if env is None else env
  proc = subprocess.run([sys.executable, worker], env=env, capture_output=True, text=True, timeout=timeout)
  if proc.returncode:
    raise AssertionError(f"{worker} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])
