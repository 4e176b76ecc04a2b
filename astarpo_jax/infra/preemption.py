"""Preemption notices: SIGTERM or SIGINT ends a run at the next step boundary, saved, with exit code 75.

Spot and preemptible TPU VMs, GKE and Slurm send SIGTERM and kill the process tens of seconds later. While a
`Watch` is installed (`with Watch(grace_s) as watch:`), what a notice does depends on the phase:
  - inside `watch.finishing(...)` (the Stage-2 steps, the Stage-1 chunks) it only sets a flag: the unit of work
    in flight finishes, the loop asks `watch.stop_requested()` at its boundary (every process gets the same
    answer: each one's flag is gathered, so all save the same step), saves, and raises `Preempted`;
  - anywhere else (setup, warm-start, evaluation, export) it raises `Preempted` at once: those phases are
    redone by the next run.
experiments/main.py turns `Preempted` into EXIT_CODE, which a launcher's retry loop reads; rerunning the same
command resumes. Past `grace_s` seconds after the notice, a unit that has not finished is given up: the
process exits with EXIT_CODE without saving it, and the next run resumes from the last complete checkpoint
(or chunk). A second notice exits at once, the same way. Exits of both kinds may cut a save short; Orbax
lists a step only once its save is complete, so such a save is discarded, never half listed.

Messages written while a notice is handled go to stderr with os.write: a signal handler that prints through
Python's buffered streams can land inside another print of the same thread and fail.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

import jax
import numpy as np

from astarpo_jax.infra import multihost

EXIT_CODE = 75  # sysexits.h EX_TEMPFAIL: a temporary failure; rerun the same command to resume
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(BaseException):
  """A notice ended the run; the same command resumes it. A BaseException, as KeyboardInterrupt, so that
  `except Exception` in a library on the way up does not swallow it."""


def _stderr(msg: str) -> None:
  try:
    os.write(2, (msg.rstrip("\n") + "\n").encode("utf-8", "replace"))
  except OSError:
    pass


class Watch:
  """SIGTERM / SIGINT handlers for one run (see the module docstring). Not entered, it never stops anything:
  library code takes a Watch and needs no branch for runs without one."""

  def __init__(self, grace_s: float = 25.0, exit_fn: Callable[[int], None] = os._exit):
    if not grace_s >= 0:
      raise ValueError(f"preemption grace_s={grace_s!r}: must be >= 0 seconds (0 = no limit)")
    self.grace_s = float(grace_s)
    self.received: str | None = None  # the first notice's signal name
    self.resume_point = "its last checkpoint"  # what the next run resumes from, said when the grace runs out
    self._exit = exit_fn
    self._unit: str | None = None  # the unit of work being finished; None: notices raise at once
    self._raised = False
    self._timer: threading.Timer | None = None
    self._previous: dict | None = None

  @property
  def installed(self) -> bool:
    return self._previous is not None

  def __enter__(self) -> Watch:
    self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
    return self

  def __exit__(self, *exc) -> None:
    self.disarm()
    for s, handler in (self._previous or {}).items():
      signal.signal(s, handler)
    self._previous = None

  def _handle(self, signum, frame) -> None:
    name = signal.Signals(signum).name
    if self.received is not None:
      _stderr(f"preemption: a second notice ({name}): exiting now with code {EXIT_CODE}, without saving; the "
              f"same command resumes from {self.resume_point}")
      self._exit(EXIT_CODE)
      return
    self.received = name
    if self.grace_s > 0:
      self._timer = threading.Timer(self.grace_s, self._grace_over)
      self._timer.daemon = True
      self._timer.start()
    if self._unit is None:
      self._raised = True
      raise Preempted(f"{name} received; the phase it interrupted is redone when the same command runs again")
    limit = f"at most {self.grace_s:g} s" if self.grace_s else "no time limit"
    _stderr(f"preemption: {name} received: finishing {self._unit} ({limit}), then saving it; a second notice "
            "exits at once")

  def _grace_over(self) -> None:
    _stderr(f"preemption: {self._unit or 'the run'} did not finish within the grace period of {self.grace_s:g} s "
            f"after {self.received}: exiting with code {EXIT_CODE} without saving it; the same command resumes "
            f"from {self.resume_point}")
    self._exit(EXIT_CODE)

  def disarm(self) -> None:
    """The save is complete: the grace period no longer applies (a second notice still exits at once)."""
    if self._timer is not None:
      self._timer.cancel()
      self._timer = None

  def stop_requested(self) -> bool:
    """At a boundary every process reaches: whether any process has received a notice (the same answer on
    all of them, from one gather of each one's flag). Always False for a Watch not installed."""
    if not self.installed:
      return False
    mine = self.received is not None
    return bool(multihost.process_sum(np.float32(mine)) > 0) if jax.process_count() > 1 else mine

  def preempted(self, what: str) -> Preempted:
    """The exception a loop raises after saving at a boundary where `stop_requested()` was True."""
    self._raised = True
    cause = self.received or "a notice on another process"
    return Preempted(f"{cause}: {what}")

  @contextlib.contextmanager
  def finishing(self, unit: str) -> Iterator[None]:
    """Notices within the block wait for the loop's boundaries (`stop_requested`); `unit` names what finishes.
    One more boundary when the block ends normally (every process reaches it): a notice that came after the
    loop's last boundary ends the run there, what follows the block being redone by the next run."""
    outer, self._unit = self._unit, unit
    try:
      yield
      if not self._raised and self.stop_requested():
        raise self.preempted(f"received after the last {unit}; what follows is redone when the same command "
                             "runs again")
    finally:
      self._unit = outer

