"""The optional Weights & Biases sink: offline runs hold what metrics.jsonl holds, reruns resume the run.

W&B runs offline here (no network): its history is read back from the run's .wandb log with wandb's
own reader (tests/wandb_logs.py), independently of our writer.
"""
import importlib
import json
import math

import pytest

from astarpo_jax import run_config
from astarpo_jax.infra import metrics
from tests.wandb_logs import history, offline_env, records


@pytest.fixture()
def offline(tmp_path, monkeypatch):
  """W&B offline, every file it writes under tmp_path."""
  pytest.importorskip("wandb", reason="the W&B sink is optional: pip install -e '.[test]' installs wandb")
  env = offline_env(tmp_path, {})
  for var, value in env.items():
    monkeypatch.setenv(var, value)
  monkeypatch.delenv("WANDB_API_KEY", raising=False)
  return metrics.WandbSettings(mode="offline", project="test", run_config=json.dumps({"algo": {"beta2": 1e-3}}))


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
  (recs,) = records(workdir, run_id)
  want = _jsonl_by_step(workdir)
  assert sorted(want) == [1, 2, 3, 4] and "eval/math500/pass@1" in want[4] and "train/loss" in want[4]
  got = history(recs)
  assert sorted(got) == sorted(want)
  for step in want:
    assert set(got[step]) == set(want[step]), step
    for k, v in want[step].items():
      if math.isnan(v):  # JSON has no NaN: wandb's reader prints it as the string "NaN"
        assert math.isnan(float(got[step][k])), (step, k)
      else:
        assert got[step][k] == pytest.approx(v, rel=1e-12, abs=0), (step, k)
  run = next(r["run"] for r in recs if r["type"] == "run")
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
  first, second = records(workdir, run_id)  # two offline segments of one run id: `wandb sync` joins them
  for recs in (first, second):
    run = next(r["run"] for r in recs if r["type"] == "run")
    assert run["run_id"] == run_id and run["resume"] is True
  assert sorted(history(first)) == [1, 2] and sorted(history(second)) == [3, 4]
  want = _jsonl_by_step(workdir)
  assert {**history(first), **history(second)}.keys() == want.keys()


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
