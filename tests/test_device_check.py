"""experiments/device_check.py, the prepared run for a lent GPU, here on the CPU at tiny shapes so it does not rot:
every part runs in its own process and writes its JSON, a part past its timeout costs only itself, and the dry
run prints what the device run would measure without running it."""
import json
import os
import subprocess
import sys

import pytest

from astarpo_jax.aot import chips

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "experiments", "device_check.py")
sys.path.insert(0, os.path.join(ROOT, "experiments"))


def _run(*args, timeout=600):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout)


def _json(out, part):
  with open(os.path.join(out, f"{part}.json")) as f:
    return json.load(f)


def test_tiny_run_writes_every_parts_json_with_measured_phases_mix_and_tests(tmp_path):
  import bench_sampler  # the mix's definition
  proc = _run("--tiny", f"--out={tmp_path}")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert sorted(os.listdir(tmp_path)) == sorted(f"{p}.{e}" for p in ("env", "measure", "mix", "tests")
                                                for e in ("json", "log"))  # <= 8 files: what the tool brings back
  for part in ("env", "measure", "mix", "tests"):
    status = _json(tmp_path, part)["status"]
    assert status["returncode"] == 0 and not status["timed_out"], (part, status)

  assert _json(tmp_path, "env")["backend"] == "cpu"

  measured = {p["phase"]: p for p in _json(tmp_path, "measure")["phases"]}
  decodes = [f"rollout_decode@{s}/{layout}" for layout in ("paged", "dense") for s in (4, 8)]
  assert list(measured) == ["reference", "astarpo_update", "stage1_prefill"] + decodes
  peak = chips.CHIPS["h200"].peak_flops
  for p in measured.values():
    assert p["measured_s"] > 0 and p["roofline_s"] == max(p["compute_s"], p["hbm_s"], p["ici_s"]) > 0
    assert p["mfu"] == pytest.approx(p["useful_flops"] / (p["measured_s"] * peak))
    assert p["tokens_per_s"] == pytest.approx(p["tokens"] / p["measured_s"])
  for label in decodes:  # a decode segment in which every slot decoded exactly --decode_steps tokens, timed per step
    d, slots = measured[label], int(label.split("@")[1].split("/")[0])
    assert d["per"] == "step" and d["decode_steps"] == [4] and d["tokens"] == d["slots"] == slots
  for layout in ("paged", "dense"):
    assert measured[f"rollout_decode@8/{layout}"]["useful_flops"] == pytest.approx(
        2 * measured[f"rollout_decode@4/{layout}"]["useful_flops"])
  assert measured["astarpo_update"]["tokens"] == 8 * (32 + 24)  # mini-batch rows x (P + R) of the tiny overrides

  mix = _json(tmp_path, "mix")
  budgets = bench_sampler.mix_budgets(16, 32)
  mean = int(round(budgets.mean()))
  assert mix["systems"]["continuous"]["tokens"] == int(budgets.sum())
  assert mix["systems"][f"fixed length {mean}"]["tokens"] == 16 * mean
  assert all(s["tokens_per_s"] > 0 and s["ms_per_step"] for s in mix["systems"].values())

  tests = _json(tmp_path, "tests")
  assert (tests["passed"], tests["failed"], tests["errors"]) == (2, 0, 0)  # an HF parity case and a loss
  assert "| rollout_decode@8/dense |" in proc.stdout and "2 passed" in proc.stdout  # the tool's output tail has them


def test_a_part_past_its_timeout_is_stopped_and_recorded_and_the_run_fails(tmp_path):
  proc = _run(f"--out={tmp_path}", "--parts=env", "--timeouts=env:0.2", timeout=120)
  assert proc.returncode == 1
  status = _json(tmp_path, "env")["status"]
  # the part may exit 0 after its interrupt (it writes what it has): the timeout alone fails the run
  assert status["timed_out"] and status["timeout_s"] == 0.2 and status["seconds"] < 20


def test_tests_record_reads_the_verbose_lines_when_pytest_was_killed_before_its_xml(tmp_path):
  import device_check
  log = tmp_path / "tests.log"
  log.write_text("[gw0] [ 10%] PASSED tests/test_a.py::test_x\n[gw1] [ 20%] FAILED tests/test_b.py::test_y[1]\n"
                 "tests/test_c.py::test_z SKIPPED (no GPU)\ntests/test_c.py::test_w PASSED  [ 50%]\n"
                 "FAILED tests/test_b.py::test_y[1] - AssertionError\n")  # the short summary repeats it
  r = device_check.tests_record(str(tmp_path), str(log))
  assert (r["passed"], r["failed"], r["skipped"], r["from_log"]) == (2, 1, 1, True)
  assert r["failures"] == [{"test": "tests/test_b.py::test_y[1]"}]


def test_dry_run_prints_the_device_runs_phases_shapes_and_floors_and_runs_nothing(tmp_path):
  import device_check

  from astarpo_jax.aot import projection
  from astarpo_jax.model import hf, known_models
  proc = _run("--dry_run", f"--out={tmp_path}", timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert os.listdir(tmp_path) == []
  out = proc.stdout
  assert "measure_step.py --config=configs/qwen1p5b.py --chip=h200 --decode_slots=64,256" in out
  assert "JAX_DEFAULT_MATMUL_PRECISION=highest" in out and "tests/test_model_parity.py" in out
  cfg = hf.config_from_hf(known_models.HF_CONFIGS["Qwen/Qwen2.5-1.5B"])
  update = 128 * 3 * projection.forward_flops(cfg, 1280, projection.causal_pairs(1280), 1024)
  ideal_ms = update / chips.CHIPS["h200"].peak_flops * 1e3
  assert f"| astarpo_update | {128 * 1280} | {update / 1e12:.3g} | {ideal_ms:.3g} |" in out
  for slots in (64, 256):
    assert f"| rollout_decode@{slots}/paged | {slots} |" in out
  assert "[mix] 256 rows of 64-token prompts, cap 512" in out
  assert device_check.DEVICE_COMMAND in out


def test_the_device_command_is_the_one_docs_tpu_md_gives_and_fits_the_tool():
  import device_check
  doc = open(os.path.join(ROOT, "docs", "tpu.md"), encoding="utf-8").read()
  assert device_check.DEVICE_COMMAND in doc.splitlines()
  assert len(device_check.DEVICE_COMMAND) <= 2000 and "--target /tmp/site .whl/*.whl" in device_check.DEVICE_COMMAND
  assert f"`timeout_s={device_check.DEVICE_TIMEOUT_S}`" in doc and sum(device_check.TIMEOUTS.values()) <= 300


def test_the_measured_chip_is_the_device_the_env_part_found_and_h200_only_where_the_table_has_none(tmp_path):
  import device_check
  for devices, chip in ((["gpu:NVIDIA H100 80GB HBM3"], "h100"), (["gpu:NVIDIA H200"], "h200"),
                        (["tpu:TPU v5 lite"] * 8, "v5e"), (["cpu:cpu"], "h200"), ([], "h200")):
    with open(tmp_path / "env.json", "w") as f:
      json.dump({"devices": devices}, f)
    found, why = device_check.chip_found(str(tmp_path))
    assert found == chip and found in chips.CHIPS, (devices, why)
    assert why.startswith(chip) and ("the device found" in why) == (devices not in ([], ["cpu:cpu"])), why
