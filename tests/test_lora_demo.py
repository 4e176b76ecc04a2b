"""The CPU demo with a LoRA adapter on the frozen reference (configs/demo.py:tiny_lora: the full fine-tuning demo's
reference and Stage 1, shared with tests/test_demo.py through conftest.demo_shared) clears the full fine-tuning demo's
bar: held-out pass@1 and avg@2 up >= 0.10 over pi_ref, and exports the merged HF folder and the PEFT adapter. experiments/evaluate.py on a
LoRA run's checkpoint (its adapter, merged into the base) gives the run's own final evaluation: checked on a run cut
to seconds (tests/test_evaluate_command.py's), so the demo is trained and evaluated once."""
import json

from tests.test_demo import assert_clears_the_bar, run_on_shared
from tests.test_evaluate_command import RUN, _py


def test_tiny_lora_demo_improves_held_out_accuracy_by_ten_points(tmp_path, demo_shared):
  run = run_on_shared(demo_shared, tmp_path, "--config=configs/demo.py:tiny_lora", "--config.export_hf=True",
                      timeout=2400)
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.loads((tmp_path / "report.json").read_text())
  assert_clears_the_bar(report)
  assert report["config"]["model"]["lora"]["rank"] > 0
  assert (tmp_path / "export" / "config.json").exists()  # the adapter merged: transformers / vLLM
  peft_cfg = json.loads((tmp_path / "export_peft" / "adapter_config.json").read_text())
  assert peft_cfg["peft_type"] == "LORA" and peft_cfg["r"] == report["config"]["model"]["lora"]["rank"]
  assert (tmp_path / "export_peft" / "adapter_model.safetensors").exists()


def test_evaluate_command_on_a_lora_run_gives_its_report(tmp_path):
  lora_run = [a for a in RUN if not a.startswith(("--config=", "--config.export_hf"))]
  r = _py("main.py", "--config=configs/demo.py:tiny_lora", *lora_run, f"--workdir={tmp_path}", timeout=1800)
  assert r.returncode == 0, r.stderr[-3000:]
  final = json.loads((tmp_path / "report.json").read_text())["final_eval"]
  assert not (tmp_path / "export").exists()  # the run's checkpoint (its adapter) is what is evaluated
  r = _py("evaluate.py", f"--model={tmp_path}", f"--out={tmp_path / 'ev'}", timeout=1800)
  assert r.returncode == 0, r.stderr[-3000:]
  ev = json.loads((tmp_path / "ev" / "eval.json").read_text())
  assert ev["model"]["kind"] == "run" and ev["model"]["step"] == 2
  assert ev["run_report_rows"] == final
