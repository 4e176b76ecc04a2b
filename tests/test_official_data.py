"""The official A*-PO Stage-1 data (eval_0..eval_{N-1} columns) imports through experiments/main.py with
the paper preset's defaults: a parquet built the way the official scripts build it, from fixture rows."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from astarpo_jax.data.dataset import Prompt
from astarpo_jax.stage1 import official_data as OD, value_table as VT
from tests.data_paths import FIXTURES
from tests.hf_fixtures import tiny_qwen_checkpoint
from tests.test_stage1 import VSTAR_TABLE_N8, pattern_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."



def _official_gsm8k_rows(raw_rows, k_correct, extra_columns=2):
  """Rows as preprocess/data_preprocess/gsm8k.py writes them (prompt = question + " " + instruction,
  ground truth = the first `#### <number>` with commas removed, extra_info with the raw question) with
  model_generate.py's response_i / eval_i columns: the first k_correct[i] of eval_0..eval_7 are 1.
  `extra_columns` more columns (eval_8, ...) are all 1: a trainer using 8 of them must ignore those."""
  rows = []
  for i, (r, k) in enumerate(zip(raw_rows, k_correct)):
    gold = re.search(r"#### (-?[0-9.,]+)", r["answer"]).group(1).replace(",", "")
    evals = [1.0 if j < k else 0.0 for j in range(8)] + [1.0] * extra_columns
    rows.append({"data_source": "openai/gsm8k",
                 "prompt": [{"role": "user", "content": r["question"] + " " + GSM8K_INSTRUCTION}],
                 "ability": "math", "reward_model": {"style": "rule", "ground_truth": gold},
                 "extra_info": {"split": "train", "index": i, "answer": r["answer"], "question": r["question"]},
                 **{f"response_{j}": f"response {j}" for j in range(len(evals))},
                 **{f"eval_{j}": e for j, e in enumerate(evals)}})
  return rows


def test_first_n_columns_are_used_and_a_short_file_is_refused():
  rows = [{"q": "a", **{f"eval_{j}": float(j < 3) for j in range(8)}, "eval_8": 1.0, "eval_9": 1.0}]
  recs, _ = OD.import_eval_columns(rows, key="q", num_columns=8, log=lambda s: None)
  assert recs["a"]["n"] == 8 and recs["a"]["num_correct"] == 3
  assert recs["a"]["vstar"] == pytest.approx(VSTAR_TABLE_N8[3], abs=5e-5)
  with pytest.raises(ValueError, match="10 eval_i columns, fewer than the 12 asked for"):
    OD.import_eval_columns(rows, key="q", num_columns=12, log=lambda s: None)


def test_official_stage1_parquet_imports_through_main_with_the_gsm8k_preset_defaults(tmp_path):
  with open(os.path.join(FIXTURES, "gsm8k", "train.jsonl")) as f:
    raw = [json.loads(line) for line in f][:18]
  k_correct = [i % 9 for i in range(len(raw))]
  strangers = [{"question": f"A problem not in the training set {i}?", "answer": "x #### 5"} for i in range(2)]
  path = tmp_path / "gsm8k_size_qwen2.5_1.5b_eval.parquet"
  pq.write_table(pa.Table.from_pylist(_official_gsm8k_rows(raw + strangers, k_correct + [8, 8])), path)

  ckpt = tiny_qwen_checkpoint(tmp_path / "model")
  work = tmp_path / "work"
  args = [f"--config={ROOT}/configs/qwen1p5b.py:gsm8k", f"--workdir={work}", "--config.mode=stage1",
          f"--config.model.name_or_path={ckpt}", f"--config.data.data_dir={FIXTURES}", "--config.data.num_train=18",
          f"--config.stage1.eval_columns_file={path}", "--config.reward.num_workers=1"]
  run = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "main.py"), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
  assert run.returncode == 0, run.stderr[-3000:]
  assert "skipped {'unmatched': 2, 'duplicate': 0, 'missing_eval': 0}" in run.stdout, run.stdout[-2000:]
  assert "A problem not in the training set" in run.stdout  # examples of the unmatched rows
  recs = [json.loads(line) for line in (work / "stage1" / "vstar.jsonl").read_text().splitlines()]
  assert len(recs) == 18 and all(r["n"] == 8 for r in recs)  # eval_8 and eval_9 left out
  by_uid = {r["uid"]: r for r in recs}
  got = [by_uid[f"gsm8k_train/{i}"]["vstar"] for i in range(18)]
  np.testing.assert_allclose(got, [VSTAR_TABLE_N8[k] for k in k_correct], atol=5e-5)
  report = json.loads((work / "report.json").read_text())
  assert report["stage1_summary"]["num_prompts"] == 18


def official_rows(problems, evals):
  return [{"data_source": "lighteval/MATH", "prompt": [{"role": "user", "content": q + " Let's think"}],
           "reward_model": {"style": "rule", "ground_truth": "1"},
           "extra_info": {"split": "train", "index": i, "question": q},
           **{f"response_{j}": "..." for j in range(8)}, **{f"eval_{j}": e for j, e in enumerate(ev)}}
          for i, (q, ev) in enumerate(zip(problems, evals))]


def test_eval_columns_import_matches_problems_and_gives_the_same_records(tmp_path):
  problems = ["What is 1+1?", "Solve  x^2=4.\n", "Unknown problem"]
  evals = [[1, 1, 1, 0, 0, 0, 0, 0], [0] * 8, [1] * 8]
  path = str(tmp_path / "train.parquet")
  pq.write_table(pa.Table.from_pylist(official_rows(problems, evals)), path)
  uid_of = {"What is 1+1?": "math/0", "Solve x^2=4.": "math/1"}  # our problems, whitespace-normalised
  out = str(tmp_path / "imported" / "vstar.jsonl")
  recs, stats = OD.import_eval_columns(path, uid_of=uid_of, beta1=0.5, out_path=out, log=lambda s: None)
  assert list(recs) == ["math/0", "math/1"] and stats.skipped["unmatched"] == 1
  assert recs["math/0"]["num_correct"] == 3 and recs["math/0"]["n"] == 8
  assert recs["math/0"]["vstar"] == pytest.approx(VSTAR_TABLE_N8[3], abs=5e-5)
  assert recs["math/1"]["vstar"] == 0.0 and recs["math/1"]["all_fail"]
  assert VT.load_table(out) == recs

  # The same results via run_stage1 give the same V* and counts.
  prompts = [Prompt("math/0", "", (1,), "k:3"), Prompt("math/1", "", (2,), "k:0")]
  res, _ = pattern_run(prompts, tmp_path / "run")
  for uid in recs:
    for field in ("vstar", "num_correct", "n", "rewards", "all_fail"):
      assert res.records[uid][field] == recs[uid][field]


def test_eval_columns_import_from_jsonl_by_index_and_bad_values(tmp_path):
  rows = official_rows(["a", "b"], [[1.0, 0.0], [True, True]])
  path = tmp_path / "rows.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  recs, _ = OD.import_eval_columns(str(path), key="extra_info.index", beta1=0.0, log=lambda s: None)
  assert {u: r["vstar"] for u, r in recs.items()} == {"0": 0.5, "1": 1.0}
  rows[1]["eval_1"] = 0.5
  with pytest.raises(ValueError, match="row 1 has eval value 0.5; eval_i columns must be 0/1"):
    OD.import_eval_columns(rows, key="extra_info.index", log=lambda s: None)
  with pytest.raises(KeyError, match="key field 'problem' not found"):
    OD.import_eval_columns(rows, key="problem", log=lambda s: None)
  with pytest.raises(KeyError, match="no eval_0"):
    OD.import_eval_columns([{"problem": "a"}], key="problem", log=lambda s: None)
