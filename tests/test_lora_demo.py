"""The CPU demo with a LoRA adapter on the frozen reference (configs/demo.py:tiny_lora) clears the full
fine-tuning demo's bar (tests/test_demo.py): held-out pass@1 and avg@2 up >= 0.10 over pi_ref; the run exports
the merged HF folder and the PEFT adapter when asked; experiments/evaluate.py on the run's checkpoint (its
adapter) gives the run's own final evaluation."""
import json

from tests.test_demo import _main
from tests.test_evaluate_command import _py


def test_tiny_lora_demo_improves_held_out_accuracy_by_ten_points(tmp_path):
  run = _main("--config=configs/demo.py:tiny_lora", f"--workdir={tmp_path}", "--config.export_hf=True")
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.loads((tmp_path / "report.json").read_text())
  ref, final = report["reference_eval"], report["final_eval"]
  for metric in ("synthetic/pass@1", "synthetic/avg@2"):
    assert 0.0 < ref[metric]["accuracy"] < 0.8, (metric, ref[metric])
    assert final[metric]["accuracy"] >= ref[metric]["accuracy"] + 0.10, (metric, ref[metric], final[metric])
  assert report["config"]["model"]["lora"]["rank"] > 0
  assert (tmp_path / "export" / "config.json").exists()  # the adapter merged: transformers / vLLM
  peft_cfg = json.loads((tmp_path / "export_peft" / "adapter_config.json").read_text())
  assert peft_cfg["peft_type"] == "LORA" and peft_cfg["r"] == report["config"]["model"]["lora"]["rank"]
  assert (tmp_path / "export_peft" / "adapter_model.safetensors").exists()
  ev_dir = tmp_path / "ev"
  r = _py("evaluate.py", f"--model={tmp_path}", f"--out={ev_dir}")
  assert r.returncode == 0, r.stderr[-3000:]
  assert json.loads((ev_dir / "eval.json").read_text())["run_report_rows"] == final
