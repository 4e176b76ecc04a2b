"""The optional Weights & Biases sink: offline runs hold what metrics.jsonl holds, reruns resume the run.

W&B runs offline here (no network): its history is read back from the run's .wandb log with wandb's
own reader (`wandb leet inspect --json`), independently of our writer.
"""
import importlib
import json
import math
import subprocess
import sys

import pytest

from astarpo_jax import run_config
from astarpo_jax.infra import metrics


@pytest.fixture()
def offline(tmp_path, monkeypatch):
  """W&B offline, every file it writes under tmp_path."""
  pytest.importorskip("wandb", reason="the W&B sink is optional: pip install -e '.[test]' installs wandb")
  for var, sub in (("WANDB_DIR", "wandb_dir"), ("WANDB_CONFIG_DIR", "wandb_config"), ("WANDB_CACHE_DIR", "wandb_cache"),
                   ("WANDB_DATA_DIR", "wandb_data")):
    (tmp_path / sub).mkdir()
    monkeypatch.setenv(var, str(tmp_path / sub))
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  monkeypatch.delenv("WANDB_API_KEY", raising=False)
  return metrics.WandbSettings(mode="offline", project="test", run_config=json.dumps({"algo": {"beta2": 1e-3}}))


def _records(workdir, run_id):
  """Every record of the offline run's .wandb log(s) in `workdir`, as wandb's own reader prints them."""
  files = sorted((workdir / "wandb").glob(f"offline-run-*/run-{run_id}.wandb"))
  assert files, f"no offline W&B log for run {run_id} under {workdir / 'wandb'}"
  out = []
  for f in files:
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(f)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out.append([json.loads(s) for s in proc.stdout.splitlines() if s.strip()])
  return out


def _history(records):
  """step -> the scalars W&B stored at that step (its own _runtime, _step, _timestamp left out)."""
  rows = {}
  for r in records:
    if r["type"] == "history":
      item = r["history"]["item"]
      rows[int(item["_step"])] = {k: v for k, v in item.items() if not k.startswith("_")}
  return rows


def _jsonl_by_step(workdir):
  by_step = {}
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    m = json.loads(line)
    by_step.setdefault(m.pop("step"), {}).update({k: v for k, v in m.items() if k != "time"})
  return by_step


def _write_steps(writer, steps):
  for s in steps:
    lr = float("nan") if s == 1 else 1e-6  # the loop logs NaN when the optimizer has no schedule state
    writer.write(s, {"loss": 1.0 / (s + 2), "reward_mean": 0.1 * s, "grad_norm": 3.25e-7 * s, "lr": lr}, "train/")
    if s % 2 == 0:  # an evaluation at the same step as the train row
      writer.write(s, {"math500/pass@1": 0.3 + s / 100}, "eval/")


def test_offline_wandb_history_equals_metrics_jsonl(tmp_path, offline):
  workdir = tmp_path / "run"
  w = metrics.MetricsWriter(str(workdir), log=lambda s: None, wandb=offline)
  _write_steps(w, [1, 2, 3, 4])
  w.close()
  run_id = (workdir / metrics.WANDB_ID_FILE).read_text().strip()
  (records,) = _records(workdir, run_id)
  want = _jsonl_by_step(workdir)
  assert sorted(want) == [1, 2, 3, 4] and "eval/math500/pass@1" in want[4] and "train/loss" in want[4]
  got = _history(records)
  assert sorted(got) == sorted(want)
  for step in want:
    assert set(got[step]) == set(want[step]), step
    for k, v in want[step].items():
      if math.isnan(v):  # JSON has no NaN: wandb's reader prints it as the string "NaN"
        assert math.isnan(float(got[step][k])), (step, k)
      else:
        assert got[step][k] == pytest.approx(v, rel=1e-12, abs=0), (step, k)
  run = next(r["run"] for r in records if r["type"] == "run")
  assert run["run_id"] == run_id and run["project"] == "test"
  assert "beta2" in json.dumps(run["config"])  # the run config reaches W&B


def test_a_rerun_in_the_same_workdir_resumes_the_same_wandb_run(tmp_path, offline):
  workdir = tmp_path / "run"
  w = metrics.MetricsWriter(str(workdir), log=lambda s: None, wandb=offline)
  _write_steps(w, [1, 2])
  w.close()
  run_id = (workdir / metrics.WANDB_ID_FILE).read_text().strip()
  logs = []
  w = metrics.MetricsWriter(str(workdir), log=logs.append, wandb=offline)  # as after a kill and a rerun
  _write_steps(w, [3, 4])
  w.close()
  assert (workdir / metrics.WANDB_ID_FILE).read_text().strip() == run_id
  assert any(f"W&B run {run_id}" in s for s in logs)
  first, second = _records(workdir, run_id)  # two offline segments of one run id: `wandb sync` joins them
  for recs in (first, second):
    run = next(r["run"] for r in recs if r["type"] == "run")
    assert run["run_id"] == run_id and run["resume"] is True
  assert sorted(_history(first)) == [1, 2] and sorted(_history(second)) == [3, 4]
  want = _jsonl_by_step(workdir)
  assert {**_history(first), **_history(second)}.keys() == want.keys()


def test_only_the_logging_process_starts_a_wandb_run(tmp_path, offline):
  workdir = tmp_path / "run"
  w = metrics.MetricsWriter(str(workdir), log=lambda s: None, enabled=False, wandb=offline)  # process != 0
  _write_steps(w, [1, 2])
  w.close()
  assert not workdir.exists() or not any(workdir.iterdir())
  assert not any((tmp_path / "wandb_dir").iterdir())


def test_wandb_modes_are_checked_with_the_field_and_the_fix(monkeypatch):
  c = importlib.import_module("configs.qwen1p5b").get_config()
  assert c.wandb.mode == "disabled"
  run_config.validate_config(c)
  c.wandb.mode = "cloud"
  with pytest.raises(ValueError, match=r"config\.wandb\.mode: .*'cloud' is not one of"):
    run_config.validate_config(c)
  c.wandb.mode = "online"
  monkeypatch.setattr(metrics, "installed", lambda module: module != "wandb")  # as without the package
  with pytest.raises(ValueError, match=r"config\.wandb\.mode: .*needs the wandb package.*pip install wandb"):
    run_config.validate_config(c)
  with pytest.raises(ImportError, match="pip install wandb"):
    metrics.WandbSettings(mode="offline")
  c.wandb.mode = "disabled"
  run_config.validate_config(c)  # disabled never needs the package
