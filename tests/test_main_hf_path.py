"""`experiments/main.py` on the real-model path: a local HF checkpoint, the real Qwen tokenizer, GSM8K files."""
import json
import os
import subprocess
import sys

import transformers

from tests.hf_fixtures import tiny_qwen_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from tests.data_paths import FIXTURES as DATA  # noqa: E402


def test_main_runs_stage1_train_eval_export_on_a_local_qwen2_checkpoint(tmp_path):
  ckpt = tiny_qwen_checkpoint(tmp_path / "model")
  tok = transformers.AutoTokenizer.from_pretrained(ckpt)
  work = tmp_path / "work"
  args = [f"--config={ROOT}/configs/qwen1p5b.py:gsm8k", f"--workdir={work}",
          f"--config.model.name_or_path={ckpt}", "--config.model.dtype=float32", "--config.model.ref_param_dtype=float32",
          f"--config.data.data_dir={DATA}", "--config.data.num_train=16", "--config.data.num_test=8",
          "--config.sampling.max_new_tokens=8", "--config.stage1.n_samples=2", "--config.stage1.chunk_prompts=8",
          # 16 prompts, 8 per rollout: 2 rollouts per epoch, and one fewer as the official loop runs
          "--config.train.num_steps=0", "--config.train.epochs=1", "--config.train.rollout_batch=8",
          "--config.train.mini_batch=4",
          "--config.train.micro_batch=2", "--config.train.eval_every=0", "--config.reward.num_workers=1"]
  run = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "main.py"), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=900, env=dict(os.environ, HF_HUB_OFFLINE="1"))
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.loads((work / "report.json").read_text())
  assert set(report["final_eval"]) == {"gsm8k_test/pass@1", "gsm8k_test/pass@1/math_verify"}
  assert "train: 1 epochs of 16 prompts, 8 per rollout: 1 rollout steps" in run.stdout
  train_lines = [json.loads(s) for s in (work / "metrics.jsonl").read_text().splitlines()]
  assert [m["step"] for m in train_lines if "train/loss" in m] == [1]
  assert report["stage1_summary"]["num_prompts"] == 16
  assert len((work / "stage1" / "vstar.jsonl").read_text().splitlines()) == 16
  exported = transformers.AutoModelForCausalLM.from_pretrained(work / "export")
  assert exported.config.vocab_size == len(tok)
  assert transformers.AutoTokenizer.from_pretrained(work / "export").eos_token == tok.eos_token
