"""Stage 1 and Stage 2 in two JAX processes (CPU, gloo, a (1, 2, 2) mesh across them) give what one
process gives: the same V* files, the same logged metrics, the same final parameters after a resume.

tests/multihost_worker.py runs the same commands in two joined processes and, at the same time, in
one plain single-device process; this file compares their outputs.
"""
import json
import os

import numpy as np
import pytest

from tests.worker_processes import free_port, run_workers

WORKER = os.path.join(os.path.dirname(__file__), "multihost_worker.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  multi, single = str(tmp_path_factory.mktemp("two_processes")), str(tmp_path_factory.mktemp("one_process"))
  port = str(free_port())
  run_workers([[WORKER, str(i), "2", port, multi] for i in range(2)] + [[WORKER, "0", "1", "-", single]],
              timeout=1500)  # two processes + one, each a whole run (A*-PO, PPO): minutes under load
  return multi, single


def _lines(path):
  with open(path) as f:
    return [json.loads(s) for s in f.read().splitlines()]


def test_stage1_files_of_two_processes_equal_one_process(runs):
  multi, single = runs
  for name in ("vstar.jsonl", "summary.json", "meta.json", "chunks/chunk_00000.jsonl", "chunks/chunk_00001.jsonl",
               "chunks/chunk_00002.jsonl"):
    with open(os.path.join(multi, "s1", "stage1", name)) as a, open(os.path.join(single, "s1", "stage1", name)) as b:
      assert a.read() == b.read(), name
  recs = _lines(os.path.join(multi, "s1", "stage1", "vstar.jsonl"))
  assert len(recs) == 12 and {r["n"] for r in recs} == {2, 4}  # adaptive N: both rounds ran
  assert all(len(r["responses"]) == r["n"] for r in recs)  # texts gathered from both processes
  assert len({t for r in recs for t in r["responses"]}) > 12  # real, varied samples
  assert not [f for f in os.listdir(os.path.join(multi, "s1", "stage1", "chunks")) if ".tmp." in f]


def test_stage1_with_rows_on_every_process_grades_each_row_once_and_writes_the_same_file(runs):
  multi, single = runs
  with open(os.path.join(multi, "s1_tensor", "stage1", "vstar.jsonl")) as a, \
       open(os.path.join(single, "s1", "stage1", "vstar.jsonl")) as b:
    assert a.read() == b.read()
  graded = [next(s for s in json.load(open(os.path.join(multi, f"log_{pid}.json"))) if s.startswith("graded rows"))
            for pid in (0, 1)]
  n = sum(r["n"] for r in _lines(os.path.join(single, "s1", "stage1", "vstar.jsonl")))
  assert graded == [f"graded rows on a tensor-only mesh: {n}", "graded rows on a tensor-only mesh: 0"]


def test_both_processes_resume_stage1_from_the_chunks_process_0_found(runs):
  multi, _ = runs
  for pid in (0, 1):
    logs = json.load(open(os.path.join(multi, f"log_{pid}.json")))
    assert "stage1: resuming: 2 of 3 chunks (7 prompts) already done" in logs, pid


def test_stage2_metrics_are_global_and_written_once(runs):
  multi, single = runs
  got, want = _lines(os.path.join(multi, "s2", "metrics.jsonl")), _lines(os.path.join(single, "s2", "metrics.jsonl"))
  assert [m["step"] for m in got] == [m["step"] for m in want] == [1, 1, 2, 2]  # train + eval; process 1 wrote none
  for g, w in zip(got, want):
    for k in ("train/reward_mean", "train/response_length", "train/truncation_rate", "train/vstar_mean",
              "train/grade_errors", "train/loss", "train/kl", "eval/accuracy", "eval/response_length"):
      if k in w:
        assert g[k] == pytest.approx(w[k], rel=1e-4, abs=1e-6), (g["step"], k)
  assert got[0]["train/grade_errors"] == 8  # every row graded once: counts summed over the two processes
  assert 0 < got[2]["train/reward_mean"] < 1


def test_stage2_in_two_processes_with_a_resume_reaches_the_one_process_params(runs):
  multi, single = runs
  got, want = dict(np.load(os.path.join(multi, "result.npz"))), dict(np.load(os.path.join(single, "result.npz")))
  assert {k for k in got if not k.startswith("sample_mesh_")} == set(want)
  for name in want:
    np.testing.assert_allclose(got[name], want[name], atol=1e-5, err_msg=name)
  logs = json.load(open(os.path.join(multi, "log_0.json")))
  assert any(s.startswith("resumed after rollout step 1") for s in logs)
  assert sorted(os.listdir(os.path.join(multi, "s2", "checkpoints"))) == ["1", "2"]


def test_sampling_on_a_mesh_of_its_own_across_processes_gives_the_one_process_run(runs):
  """mesh.sample_shape (2, 1, 2) under a (1, 2, 2) training mesh: rows split over the processes while
  sampling, the params copied there and back; Stage 1's file and one A*-PO step equal one process's."""
  multi, single = runs
  with open(os.path.join(multi, "s1_sample_mesh", "stage1", "vstar.jsonl")) as a, \
       open(os.path.join(single, "s1", "stage1", "vstar.jsonl")) as b:
    assert a.read() == b.read()
  got, want = dict(np.load(os.path.join(multi, "result.npz"))), dict(np.load(os.path.join(single, "result.npz")))
  names = [k for k in want if k.startswith("step1:")]
  assert names
  for name in names:
    np.testing.assert_allclose(got["sample_mesh_" + name], want[name], atol=1e-5, err_msg=name)
  assert any(not np.array_equal(want[n], want[n.split(":", 1)[1]]) for n in names)  # step 2 moved the params
  m_got = _lines(os.path.join(multi, "s2_sample_mesh", "metrics.jsonl"))
  m_want = _lines(os.path.join(single, "s2", "metrics.jsonl"))
  assert m_got[0]["train/reward_mean"] == pytest.approx(m_want[0]["train/reward_mean"], abs=1e-6)


def test_ppo_baseline_in_two_processes_reaches_the_one_process_params(runs):
  multi, single = runs
  got, want = dict(np.load(os.path.join(multi, "result.npz"))), dict(np.load(os.path.join(single, "result.npz")))
  ppo = [k for k in want if k.startswith("ppo:")]
  assert ppo and set(ppo) <= set(got)
  for name in ppo:
    np.testing.assert_allclose(got[name], want[name], atol=1e-5, err_msg=name)
  assert sorted(os.listdir(os.path.join(multi, "ppo", "checkpoints"))) == ["1", "2"]
  m_got, m_want = _lines(os.path.join(multi, "ppo", "metrics.jsonl")), _lines(os.path.join(single, "ppo", "metrics.jsonl"))
  assert [m["step"] for m in m_got] == [1, 2]
  for g, w in zip(m_got, m_want):
    for k in ("train/reward_mean", "train/loss", "train/value_mean", "train/kl_old_ref"):
      assert g[k] == pytest.approx(w[k], rel=1e-4, abs=1e-6), (g["step"], k)
  assert m_want[1]["train/grad_norm"] > 0
