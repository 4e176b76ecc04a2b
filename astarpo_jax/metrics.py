"""Run logs: tensorboardX scalars in the work directory, a JSONL copy, and a line of text per step.

The work directory may be a bucket (gs://...): the JSONL goes through etils.epath (appended by
rewriting the object, since object stores cannot append), and tensorboardX writes there only when
its client library for that store is installed; otherwise TensorBoard is skipped with a log line.
"""
from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Mapping

from astarpo_jax import files

# tensorboardX's own remote writers and the client library each one needs
_TB_REMOTE = {"gs://": "google.cloud.storage", "s3://": "boto3"}


def installed(module: str) -> bool:
  """Whether `module` (dotted) can be imported, without importing it."""
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # a missing parent package
    return False


def tensorboard_supported(workdir: str) -> str | None:
  """None if tensorboardX can write under `workdir`, else why not."""
  if not files.is_remote(workdir):
    return None
  scheme = workdir[:workdir.index("://") + 3]
  need = _TB_REMOTE.get(scheme)
  if need is None:
    return f"tensorboardX cannot write to {scheme} paths"
  if not installed(need):
    return f"tensorboardX needs the {need} package for {scheme} paths and it is not installed"
  return None


class MetricsWriter:
  """Writes scalars; only the process that owns the logs (process 0) should create one enabled."""

  def __init__(self, workdir: str, log=print, enabled: bool = True):
    self.enabled = enabled
    self.log = log
    self._tb = None
    self._jsonl = None
    self._remote_jsonl = None  # (path, text so far) for a bucket work directory
    if enabled:
      files.path(workdir).mkdir(parents=True, exist_ok=True)
      why_not = tensorboard_supported(workdir)
      if why_not is None:
        from tensorboardX import SummaryWriter  # optional at import time, required at run time
        self._tb = SummaryWriter(os.path.join(workdir, "tb"))
      else:
        log(f"metrics: TensorBoard logs skipped for {workdir}: {why_not}; metrics.jsonl is still written")
      jsonl = os.path.join(workdir, "metrics.jsonl")
      if files.is_remote(workdir):
        p = files.path(jsonl)
        self._remote_jsonl = (jsonl, p.read_text(encoding="utf-8") if p.exists() else "")
      else:
        self._jsonl = open(jsonl, "a", encoding="utf-8")

  def write(self, step: int, scalars: Mapping[str, float], prefix: str = "", text_keys=None) -> None:
    if not self.enabled:
      return
    clean = {f"{prefix}{k}": float(v) for k, v in scalars.items()}
    if self._tb is not None:
      for k, v in clean.items():
        self._tb.add_scalar(k, v, step)
    line = json.dumps({"step": step, "time": time.time(), **clean}) + "\n"
    if self._jsonl is not None:
      self._jsonl.write(line)
      self._jsonl.flush()
    else:
      path, text = self._remote_jsonl
      self._remote_jsonl = (path, text + line)
      files.path(path).write_text(text + line, encoding="utf-8")
    keys = text_keys or list(clean)
    self.log(f"[{prefix or 'train/'}step {step}] " + " ".join(
        f"{k.removeprefix(prefix)}={clean[k if k in clean else prefix + k]:.4g}" for k in keys
        if (k if k in clean else prefix + k) in clean))

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if self._jsonl is not None:
      self._jsonl.close()
      self._jsonl = None
