"""First contact is quiet: with libtpu installed (the test extra) and no TPU attached, a command prints none of
libtpu's start-up errors, and the TPU is left out only when no chip is on the PCI bus."""
import os
import subprocess
import sys

from astarpo_jax.infra import platforms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pci(root, vendors) -> str:
  for i, v in enumerate(vendors):
    d = root / f"0000:00:{i:02x}.0"
    d.mkdir(parents=True)
    (d / "vendor").write_text(v + "\n")
  return str(root)


def test_a_google_pci_device_counts_as_a_tpu_and_others_do_not(tmp_path):
  assert not platforms.tpu_chips_visible(_pci(tmp_path / "gpu_host", ["0x8086", "0x10de"]))
  assert platforms.tpu_chips_visible(_pci(tmp_path / "tpu_host", ["0x8086", "0x1ae0"]))


def test_without_a_gpu_the_platforms_are_the_cpu_alone(monkeypatch):
  monkeypatch.setattr(platforms.os.path, "exists", lambda p: False)
  assert platforms.platforms_without_tpu() == "cpu"


def test_a_visible_gpu_with_its_plugin_is_kept_first(monkeypatch):
  monkeypatch.setattr(platforms.os.path, "exists", lambda p: p == "/dev/nvidiactl")
  monkeypatch.setattr(platforms, "_installed", lambda names: names == platforms.CUDA_PLUGINS)
  assert platforms.platforms_without_tpu() == "cuda,cpu"


def test_a_command_without_jax_platforms_prints_no_libtpu_start_up_errors():
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_SKIP_MDS_QUERY")}
  run = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "memory_plan.py"),
                        "--config=configs/demo.py:tiny"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=env)
  assert run.returncode == 0, run.stderr[-2000:]
  assert "peak" in run.stdout
  for marker in ("TPU_WORKER_HOSTNAMES", "TPU accelerator type", "E0000", "libtpu"):
    assert marker not in run.stderr, run.stderr[-2000:]
