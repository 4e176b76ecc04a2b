"""Work directories on a bucket: Stage 1 files, metrics and the report go through etils.epath.

There is no bucket here: `epath.testing.mock_epath` serves gs:// paths from the local disk (as
relative paths under the test's working directory) and records every file epath opens, so the
tests prove that writes to a gs:// work directory are routed through epath (which uses gcsfs or
tf.io.gfile for real buckets), not that a real bucket accepts them. Also the one-process
behaviour of the multi-process helpers.
"""
import json
import os

import numpy as np
import pytest
from etils.epath import testing as epath_testing

from astarpo_jax import experiment
from astarpo_jax.infra import files, metrics, multihost
from astarpo_jax.stage1 import estimate as S, value_table as VT
from tests.test_stage1 import PatternGen, as_draw, make_prompts, pattern_grade


@pytest.fixture
def bucket(tmp_path, monkeypatch):
  """Opened gs:// paths, recorded; their files live under tmp_path/'gs:'."""
  monkeypatch.chdir(tmp_path)
  opened = []

  def record(open_fn, path, mode):
    opened.append((str(path), mode))
    return open_fn(path, mode)
  with epath_testing.mock_epath(open=record):
    yield opened


def test_stage1_on_a_bucket_writes_and_resumes_through_epath(bucket, tmp_path):
  prompts = make_prompts(["k:1", "k:0", "k:3", "k:2", "k:4"])
  gen = PatternGen({p.ids: p.gold for p in prompts})
  res = S.run_stage1(prompts, as_draw(gen, pattern_grade), out_dir="gs://bucket/run", n_samples=4, chunk_prompts=2,
                     progress=False, log=lambda s: None)
  assert res.path == "gs://bucket/run/stage1/vstar.jsonl"
  written = {p for p, mode in bucket if "w" in mode}
  assert {"gs://bucket/run/stage1/meta.json", "gs://bucket/run/stage1/vstar.jsonl",
          "gs://bucket/run/stage1/summary.json", "gs://bucket/run/stage1/chunks/chunk_00002.jsonl"} <= written
  assert not [p for p in written if ".tmp." in p]  # one upload per object, no temp files on a bucket
  assert [r["num_correct"] for r in VT.load_table("gs://bucket/run/stage1/vstar.jsonl").values()] == [1, 0, 3, 2, 4]
  local = tmp_path / "gs:" / "bucket" / "run" / "stage1" / "chunks" / "chunk_00001.jsonl"
  local.unlink()  # lose one chunk: the rerun reads the other two from the bucket and redoes this one
  logs = []
  again = S.run_stage1(prompts, as_draw(PatternGen({p.ids: p.gold for p in prompts}), pattern_grade),
                       out_dir="gs://bucket/run", n_samples=4, chunk_prompts=2, progress=False, log=logs.append)
  assert "stage1: resuming: 2 of 3 chunks (3 prompts) already done" in logs
  assert again.records["p/2"]["num_correct"] == 3 and again.records == res.records


def test_metrics_on_a_bucket_go_to_jsonl_and_say_when_tensorboard_is_skipped(bucket, tmp_path):
  logs = []
  w = metrics.MetricsWriter("gs://bucket/run", log=logs.append)
  w.write(1, {"loss": 0.5})
  w.write(2, {"loss": 0.25})
  w.close()
  lines = [json.loads(s) for s in (tmp_path / "gs:" / "bucket" / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [(m["step"], m["loss"]) for m in lines] == [(1, 0.5), (2, 0.25)]
  assert ("gs://bucket/run/metrics.jsonl", "w") in bucket
  if not metrics.installed("google.cloud.storage"):
    assert any("TensorBoard logs skipped for gs://bucket/run" in s and "google.cloud.storage" in s for s in logs)
    assert not (tmp_path / "gs:" / "bucket" / "run" / "tb").exists()
  # A rerun appends to the same object instead of replacing it.
  w = metrics.MetricsWriter("gs://bucket/run", log=logs.append)
  w.write(3, {"loss": 0.125})
  assert len((tmp_path / "gs:" / "bucket" / "run" / "metrics.jsonl").read_text().splitlines()) == 3


def test_an_unknown_scheme_skips_tensorboard_with_its_reason():
  assert metrics.tensorboard_supported("/tmp/run") is None
  assert "cannot write to az:// paths" in metrics.tensorboard_supported("az://c/run")


def test_report_and_workdir_on_a_bucket(bucket, tmp_path):
  assert files.abspath("gs://bucket/run") == "gs://bucket/run"
  assert files.abspath("run") == os.path.join(os.getcwd(), "run")
  files.path("gs://bucket/run").mkdir(parents=True, exist_ok=True)
  experiment.write_report("gs://bucket/run", {"times_s": {"setup": 1.0}}, log=lambda s: None)
  assert json.loads((tmp_path / "gs:" / "bucket" / "run" / "report.json").read_text()) == {"times_s": {"setup": 1.0}}
  assert ("gs://bucket/run/report.json", "w") in bucket


def test_one_process_helpers_are_the_identity():
  rows = np.array([2, 0, 1])
  np.testing.assert_array_equal(multihost.gather_rows(np.array([20, 0, 10]), rows, 3), [0, 10, 20])
  assert multihost.gather_texts(["c", "a", "b"], rows, 3) == ["a", "b", "c"]
  np.testing.assert_array_equal(multihost.process_rows(5, None), np.arange(5))
  assert multihost.broadcast_json({"a": [1]}) == {"a": [1]}
  x = np.arange(6).reshape(3, 2)
  assert multihost.from_host(x, None) is x
