"""Launching the worker processes of the multi-process tests (jax.distributed on localhost)."""
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
