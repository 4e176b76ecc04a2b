"""W&B offline runs in tests: the environment that keeps every file W&B writes under a test's folder, and the
history read back from a run's .wandb logs with wandb's own reader (`wandb leet inspect --json`),
independently of our writer."""
import json
import os
import subprocess
import sys

ENV_DIRS = (("WANDB_DIR", "wandb_dir"), ("WANDB_CONFIG_DIR", "wandb_config"), ("WANDB_CACHE_DIR", "wandb_cache"),
            ("WANDB_DATA_DIR", "wandb_data"))


def offline_env(tmp_path, env=None) -> dict:
  """`env` (default os.environ) with W&B offline, silent, keyless, its folders made under `tmp_path`."""
  out = dict(os.environ if env is None else env, WANDB_MODE="offline", WANDB_SILENT="true")
  out.pop("WANDB_API_KEY", None)
  for var, sub in ENV_DIRS:
    (tmp_path / sub).mkdir(exist_ok=True)
    out[var] = str(tmp_path / sub)
  return out


def records(workdir, run_id):
  """Every record of the offline run's .wandb log(s) in `workdir`, one list per segment, as wandb prints them."""
  files = sorted((workdir / "wandb").glob(f"offline-run-*/run-{run_id}.wandb"))
  assert files, f"no offline W&B log for run {run_id} under {workdir / 'wandb'}"
  out = []
  for f in files:
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(f)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out.append([json.loads(s) for s in proc.stdout.splitlines() if s.strip()])
  return out


def history(segment_records):
  """step -> the scalars W&B stored at that step (its own _runtime, _step, _timestamp left out)."""
  rows = {}
  for r in segment_records:
    if r["type"] == "history":
      item = r["history"]["item"]
      rows[int(item["_step"])] = {k: v for k, v in item.items() if not k.startswith("_")}
  return rows


def wandb_history(workdir) -> list[dict]:
  """The history of each segment of the W&B run whose id the work directory keeps, oldest first."""
  from astarpo_jax.infra import metrics
  run_id = (workdir / metrics.WANDB_ID_FILE).read_text().strip()
  return [history(r) for r in records(workdir, run_id)]
