"""A pool of grading processes that survives hostile model text.

Answers are extracted in the parent (linear string code, grading.prepare); the string graders are
compared there too, and only math_verify's short extracted answers and golds go to a worker. A user's
reward function (user_grader.py, `grader="path/to/file.py:fn"`) gets the raw responses, golds and extra
fields in the workers, under the same limits. Workers are started with "forkserver" (or "spawn"), never "fork":
the parent is a JAX process with threads and device state. Each worker runs under an address-space
limit and grades items one by one, reporting each result as soon as it has it, so the parent knows
which item a worker is on. A worker that spends more than `timeout_s` on one item, or dies, is killed
and replaced; that item scores 0 and is counted, and the rest of its chunk goes back in the queue. Each
failed item carries a message (a traceback, a bad value, the time limit, the exit code); the batch's first
is `GradeResult.first_error`.
There is no in-worker alarm: a library interrupted mid-update could leave its caches corrupt, and a
long C call (a huge integer power) would not see it anyway. Workers send back floats, never sympy objects.

  with RewardPool(num_workers=8, timeout_s=5.0) as pool:
    result = pool.grade(responses, golds, grader="math_verify")   # result.rewards: [N] float32
"""
from __future__ import annotations

import collections
import dataclasses
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import resource
import signal
import time
from collections.abc import Sequence

from astarpo_jax.rewards import grading, user_grader

_READY = "ready"


def _address_space_now() -> int | None:
  """This process's virtual memory size in bytes (Linux), or None where /proc is not available."""
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    return None


def _limit_memory(memory_mb: int) -> None:
  """Cap the address space at what is mapped now plus `memory_mb`, so a blow-up is a MemoryError."""
  now = _address_space_now()
  if now is None:
    return
  _, hard = resource.getrlimit(resource.RLIMIT_AS)
  soft = now + memory_mb * 2**20
  if hard != resource.RLIM_INFINITY:
    soft = min(soft, hard)
  resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _worker_main(conn, memory_mb: int, preload: tuple[str, ...] = (), warm_up: bool = True) -> None:
  """Worker loop: receive (grader, [(i, pred, gold), ...]) or, for a user function, (spec, [(i, response, gold,
  extra), ...]); send (i, reward, status, message or None) per item. User functions named in `preload` are
  imported before the memory cap, the others on first use."""
  for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C and preemption notices are the parent's business: it
    signal.signal(sig, signal.SIG_IGN)  # finishes its step with our rewards, then closes us
  grading.forbid_string_eval()
  if warm_up:
    grading.warm_up()
  user_fns = {spec: user_grader.import_or_error(spec) for spec in preload}
  _limit_memory(memory_mb)
  conn.send((_READY, os.getpid()))
  while True:
    try:
      msg = conn.recv()
    except (EOFError, OSError):  # the parent is gone
      return
    if msg is None:
      return
    grader, items = msg
    if user_grader.is_spec(grader):
      if grader not in user_fns:
        user_fns[grader] = user_grader.import_or_error(grader)
      for i, response, gold, extra in items:
        conn.send((i, *user_grader.run(user_fns[grader], grader, response, gold, extra)))
      continue
    for i, pred, gold in items:
      reward, status = grading.run_job(grader, pred, gold, timeout_s=None)
      conn.send((i, float(reward), int(status), None))


class _Worker:
  """One worker process with its pipe and the items it holds, in the order it grades them."""

  def __init__(self, ctx, memory_mb: int, preload: tuple[str, ...] = (), warm_up: bool = True):
    self.conn, child = ctx.Pipe(duplex=True)
    self.proc = ctx.Process(target=_worker_main, args=(child, memory_mb, preload, warm_up), daemon=True,
                            name="astarpo-reward-worker")
    self.proc.start()
    child.close()
    self.ready = False
    self.items: collections.deque = collections.deque()  # [(i, pred, gold)] sent, not yet answered
    self.since = time.monotonic()  # start, or the last progress on the current item

  def send(self, grader: str, chunk: list) -> None:
    self.conn.send((grader, chunk))  # OSError if the worker died while idle
    self.items.extend(chunk)
    self.since = time.monotonic()

  def kill(self) -> None:
    if self.proc.is_alive():
      self.proc.kill()
    self.proc.join(timeout=10)
    self.conn.close()


@dataclasses.dataclass
class _Batch:
  """One `grade` call's results so far and its chunks not yet sent."""
  rewards: list
  status: list
  pending: collections.deque
  killed: int = 0
  messages: dict = dataclasses.field(default_factory=dict)  # item -> why it failed


class RewardPool:
  """Grades batches of responses in worker processes with a per-item time limit and a memory cap.

  Args:
    num_workers: processes to run (default: CPUs available to this process, at most 16).
    timeout_s: seconds one item may take before its worker is killed; the item scores 0.
    memory_mb: address space each worker may add after start-up (RLIMIT_AS); beyond it, MemoryError.
    chunk_size: items sent to a worker at once (default: spread each batch over ~4 chunks per worker).
    mp_context: "forkserver" (default: fast restarts, grading modules preloaded) or "spawn".
    start_timeout_s: seconds a new worker may take to import and warm up before it counts as failed.
    preload: user reward functions (user_grader specs) each worker imports at start-up, outside the time
      limit and the memory cap; one not named here is imported on first use, within its item's time limit.
    warm_up: build math-verify's parser caches at start-up (~2 s a worker), so that its first item does not pay
      for them; False for a pool that grades no math_verify items (a user function's run).
  """

  def __init__(self, num_workers: int | None = None, timeout_s: float = 5.0, memory_mb: int = 2048,
               chunk_size: int | None = None, mp_context: str = "forkserver",
               start_timeout_s: float = 120.0, preload: tuple[str, ...] = (), warm_up: bool = True):
    if mp_context not in ("forkserver", "spawn"):
      raise ValueError(f"mp_context must be 'forkserver' or 'spawn' (never 'fork' in a JAX process), "
                       f"got {mp_context!r}")
    if num_workers is None:
      cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
      num_workers = min(16, cpus)
    if num_workers < 1:
      raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if not timeout_s > 0:
      raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if memory_mb < 64:
      raise ValueError(f"memory_mb must be >= 64, got {memory_mb}")
    if chunk_size is not None and chunk_size < 1:
      raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    self.num_workers, self.timeout_s, self.memory_mb = num_workers, float(timeout_s), memory_mb
    self.chunk_size, self.start_timeout_s = chunk_size, float(start_timeout_s)
    self.preload = tuple(str(user_grader.parse(s)) for s in preload)  # relative paths made absolute
    self.warm_up = warm_up
    self._ctx = mp.get_context(mp_context)
    if mp_context == "forkserver":  # workers fork from a server that has imported sympy once, ignoring SIGTERM
      self._ctx.set_forkserver_preload(["__main__", "astarpo_jax.rewards._forkserver_signals",
                                        "astarpo_jax.rewards.grading"])
    self._workers: list[_Worker] = []
    self.total_killed = 0
    try:
      self._workers = [_Worker(self._ctx, memory_mb, self.preload, warm_up) for _ in range(num_workers)]
      self.wait_ready()
    except BaseException:
      self.close()
      raise

  def __enter__(self) -> RewardPool:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    """Stop all workers (politely, then by force). Idempotent."""
    for w in self._workers:
      try:
        w.conn.send(None)
      except (OSError, ValueError):
        pass
    deadline = time.monotonic() + 2.0
    for w in self._workers:
      w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
      w.kill()
    self._workers = []

  @property
  def worker_pids(self) -> list[int]:
    return [w.proc.pid for w in self._workers]

  def wait_ready(self) -> None:
    """Block until every worker has started (fail loudly if one cannot)."""
    while not all(w.ready for w in self._workers):
      waiting = [w for w in self._workers if not w.ready]
      left = min(w.since for w in waiting) + self.start_timeout_s - time.monotonic()
      if left <= 0:
        raise RuntimeError(f"reward worker did not start within {self.start_timeout_s:.0f} s "
                           "(is the main module import-safe, with `if __name__ == '__main__':`?)")
      for conn in mp.connection.wait([w.conn for w in waiting], timeout=left):
        w = next(w for w in waiting if w.conn is conn)
        try:
          msg = conn.recv()
        except (EOFError, OSError):
          raise RuntimeError(f"reward worker exited during start-up (exit code {w.proc.exitcode})") from None
        w.ready = msg[0] == _READY

  def _replace(self, w: _Worker) -> None:
    idx = self._workers.index(w)
    w.kill()
    self.total_killed += 1
    self._workers[idx] = _Worker(self._ctx, self.memory_mb, self.preload, self.warm_up)

  def grade(self, responses: Sequence[str | None], golds: Sequence, grader: str = "math_verify",
            truncated: Sequence[bool] | None = None) -> grading.GradeResult:
    """Rewards for `responses` against `golds`: in {0, 1} under a built-in grader (same rules as
    grading.grade_batch), in [0, 1] under a user function (`grader` a user_grader spec; a gold may be a
    user_grader.Target carrying the row's extra fields).

    truncated: None = no EOS rule; flags = rows flagged True score 0 under any grader (`num_truncated`),
    and "hendrycks" reads the others as ending with the EOS text (the official Stage-2 rule).
    """
    if not self._workers:
      raise RuntimeError("RewardPool is closed")
    user = user_grader.is_spec(grader)
    if user:
      grader = str(user_grader.parse(grader))  # the workers' cache key: a relative path made absolute
      rewards, status, jobs = user_grader.prepare(responses, golds, truncated)
    else:
      rewards, status, jobs = grading.prepare(responses, golds, grader, truncated)
    for w in list(self._workers):
      if w.items:  # left over from an interrupted call: its answers would land in this batch
        self._replace(w)
    if not user:  # same gold (N samples of a prompt) -> same worker's cache
      jobs.sort(key=lambda job: (job[2], job[1]))
    size = self.chunk_size or max(1, min(64, math.ceil(len(jobs) / (4 * self.num_workers))))
    batch = _Batch(rewards, status, collections.deque(jobs[k:k + size] for k in range(0, len(jobs), size)))
    while batch.pending or any(w.items for w in self._workers):
      self._dispatch(batch, grader)
      watched = [w for w in self._workers if w.items or not w.ready]
      if not watched:
        continue
      limits = [w.since + (self.timeout_s if w.ready else self.start_timeout_s) for w in watched]
      ready = mp.connection.wait([w.conn for w in watched], timeout=max(0.0, min(limits) - time.monotonic()))
      for w in [w for w in watched if w.conn in ready]:
        self._receive(batch, w)
      self._expire(batch)
    first = batch.messages[min(batch.messages)] if batch.messages else None
    return grading.summarize(batch.rewards, batch.status, num_killed=batch.killed, first_error=first)

  def _lose(self, batch: _Batch, w: _Worker, why: int) -> None:
    """The worker hung or died on its first held item: that item scores 0 (`why`), the rest go back."""
    i = w.items.popleft()[0] if w.items else None
    if w.items:
      batch.pending.appendleft(list(w.items))
      w.items.clear()
    self._replace(w)  # kills it first: its exit code is known after
    batch.killed += 1
    if i is not None:
      batch.rewards[i], batch.status[i] = 0.0, why
      batch.messages[i] = (f"item {i}: grading ran past the time limit ({self.timeout_s:g} s, reward.timeout_s); "
                           "its worker was killed and replaced" if why == grading.TIMEOUT else
                           f"item {i}: the worker died while grading it (exit code {w.proc.exitcode}; a crash, "
                           "os._exit or the memory cap); it was replaced")

  def _dispatch(self, batch: _Batch, grader: str) -> None:
    """A chunk to every idle, started worker."""
    for w in list(self._workers):
      if w.ready and not w.items and batch.pending:
        chunk = batch.pending.popleft()
        try:
          w.send(grader, chunk)
        except OSError:
          batch.pending.appendleft(chunk)
          self._lose(batch, w, grading.ERROR)

  def _receive(self, batch: _Batch, w: _Worker) -> None:
    """Everything `w` has sent: its start-up signal, or answers in the order its items were sent."""
    try:
      while w.conn.poll():
        msg = w.conn.recv()
        if msg[0] == _READY:
          w.ready, w.since = True, time.monotonic()
          continue
        i, reward, st, why = msg
        if not w.items or w.items[0][0] != i:
          raise RuntimeError(f"reward worker answered item {i} out of order")
        w.items.popleft()
        batch.rewards[i], batch.status[i] = reward, st
        if why is not None:
          batch.messages[i] = why
        w.since = time.monotonic()
    except (EOFError, OSError):
      if not w.ready:
        raise RuntimeError(f"reward worker exited during start-up (exit code {w.proc.exitcode})") from None
      self._lose(batch, w, grading.ERROR)

  def _expire(self, batch: _Batch) -> None:
    """Kills a worker past the time limit on its current item; refuses one that never started."""
    now = time.monotonic()
    for w in list(self._workers):
      if w.items and w.ready and now - w.since > self.timeout_s:
        self._lose(batch, w, grading.TIMEOUT)
      elif not w.ready and now - w.since > self.start_timeout_s:
        raise RuntimeError(f"reward worker did not start within {self.start_timeout_s:.0f} s")
