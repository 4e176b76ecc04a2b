"""Run logs: tensorboardX scalars in the work directory, a JSONL copy, a line of text per step, and
optionally a Weights & Biases run.

The work directory may be a bucket (gs://...): the JSONL goes through etils.epath (appended by
rewriting the object, since object stores cannot append), and tensorboardX writes there only when
its client library for that store is installed; otherwise TensorBoard is skipped with a log line.
W&B (not a required dependency) gets the same scalars at the same steps; its run id is kept in
the work directory, so a rerun there resumes the same W&B run.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import secrets
import time
from collections.abc import Mapping

from astarpo_jax.infra import files

# tensorboardX's own remote writers and the client library each one needs
_TB_REMOTE = {"gs://": "google.cloud.storage", "s3://": "boto3"}
WANDB_MODES = ("disabled", "online", "offline")
WANDB_ID_FILE = "wandb_run_id"  # in the work directory: the W&B run a rerun there resumes


@dataclasses.dataclass(frozen=True)
class WandbSettings:
  """Where a W&B run goes; mode 'disabled' (the default) never imports wandb."""
  mode: str = "disabled"  # disabled | online | offline (offline: synced later with `wandb sync`)
  project: str = "astarpo_jax"
  entity: str | None = None  # None: the API key's default entity
  name: str | None = None  # None: W&B picks a name
  run_config: str | None = None  # the run's config as JSON, shown as the W&B run config

  def __post_init__(self):
    if self.mode not in WANDB_MODES:
      raise ValueError(f"wandb mode {self.mode!r} is not one of {WANDB_MODES}")
    if self.mode != "disabled" and not installed("wandb"):
      raise ImportError(f"wandb mode {self.mode!r} needs the wandb package, which is not installed: "
                        "pip install wandb (or pip install -e '.[wandb]'), or set the mode to 'disabled'")


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

  def __init__(self, workdir: str, log=print, enabled: bool = True, wandb: WandbSettings | None = None):
    self.enabled = enabled
    self.log = log
    self._tb = None
    self._wandb = None
    self._jsonl = None
    self._remote_jsonl = None  # (path, text so far) for a bucket work directory
    self._logged: set[tuple[int, str]] = set()  # (step, prefix) of every row in metrics.jsonl
    if enabled:
      files.path(workdir).mkdir(parents=True, exist_ok=True)
      why_not = tensorboard_supported(workdir)
      if why_not is None:
        from tensorboardX import SummaryWriter  # optional at import time, required at run time
        self._tb = SummaryWriter(os.path.join(workdir, "tb"))
      else:
        log(f"metrics: TensorBoard logs skipped for {workdir}: {why_not}; metrics.jsonl is still written")
      jsonl = os.path.join(workdir, "metrics.jsonl")
      p = files.path(jsonl)
      earlier = p.read_text(encoding="utf-8") if p.exists() else ""
      self._logged = _logged_rows(earlier)
      if files.is_remote(workdir):
        self._remote_jsonl = (jsonl, earlier)
      else:
        self._jsonl = open(jsonl, "a", encoding="utf-8")
      if wandb is not None and wandb.mode != "disabled":
        self._wandb = start_wandb(workdir, wandb, log)

  def write(self, step: int, scalars: Mapping[str, float], prefix: str = "", text_keys=None) -> None:
    if not self.enabled:
      return
    clean = {f"{prefix}{k}": float(v) for k, v in scalars.items()}
    self._logged.add((int(step), prefix))
    if self._tb is not None:
      for k, v in clean.items():
        self._tb.add_scalar(k, v, step)
    if self._wandb is not None:  # a second write at the same step (eval/ after train/) joins the same row
      self._wandb.log(clean, step=step)
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

  def logged(self, step: int, prefix: str) -> bool:
    """Whether metrics.jsonl (this run's or an earlier run's in the work directory) has a `prefix` row at `step`."""
    return (int(step), prefix) in self._logged

  def flush(self) -> None:
    """TensorBoard's buffered events to disk (tensorboardX flushes every 2 minutes on its own; metrics.jsonl
    is flushed at every line and W&B's service process writes as it receives)."""
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if self._jsonl is not None:
      self._jsonl.close()
      self._jsonl = None
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None


def _logged_rows(text: str) -> set[tuple[int, str]]:
  """(step, prefix) of each row of a metrics.jsonl text; a line cut short by a kill is skipped."""
  out = set()
  for line in text.splitlines():
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      continue
    out |= {(int(row["step"]), k.split("/", 1)[0] + "/") for k in row if "/" in k}
  return out


def start_wandb(workdir: str, settings: WandbSettings, log=print):
  """A W&B run that resumes the one whose id is stored in `workdir` (a new id is stored otherwise).

  Its local files go to `workdir`/wandb (for a bucket work directory, to wandb's default folder,
  as W&B writes local files only).
  """
  import wandb  # optional: WandbSettings refused a mode other than 'disabled' without it
  id_path = files.path(os.path.join(workdir, WANDB_ID_FILE))
  run_id = id_path.read_text(encoding="utf-8").strip() if id_path.exists() else ""
  if not run_id:
    run_id = secrets.token_hex(4)  # 8 lowercase characters, like W&B's own ids
    id_path.write_text(run_id + "\n", encoding="utf-8")
  run = wandb.init(project=settings.project, entity=settings.entity, name=settings.name, id=run_id,
                   resume="allow", mode=settings.mode,
                   dir=None if files.is_remote(workdir) else workdir,
                   config=json.loads(settings.run_config) if settings.run_config else None)
  log(f"metrics: W&B run {run_id} ({settings.mode}, project {settings.project})")
  return run
