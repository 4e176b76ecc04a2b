"""Run logs: tensorboardX scalars in the work directory, a JSONL copy, and a line of text per step."""
from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping


class MetricsWriter:
  """Writes scalars; only the process that owns the logs (process 0) should create one."""

  def __init__(self, workdir: str, log=print, enabled: bool = True):
    self.enabled = enabled
    self.log = log
    self._tb = None
    self._jsonl = None
    if enabled:
      os.makedirs(workdir, exist_ok=True)
      from tensorboardX import SummaryWriter  # optional at import time, required at run time
      self._tb = SummaryWriter(os.path.join(workdir, "tb"))
      self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")

  def write(self, step: int, scalars: Mapping[str, float], prefix: str = "", text_keys=None) -> None:
    if not self.enabled:
      return
    clean = {f"{prefix}{k}": float(v) for k, v in scalars.items()}
    for k, v in clean.items():
      self._tb.add_scalar(k, v, step)
    self._jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
    self._jsonl.flush()
    keys = text_keys or list(clean)
    self.log(f"[{prefix or 'train/'}step {step}] " + " ".join(
        f"{k.removeprefix(prefix)}={clean[k if k in clean else prefix + k]:.4g}" for k in keys
        if (k if k in clean else prefix + k) in clean))

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
      self._jsonl.close()
