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


LIBTPU_NOISE = ("Failed to find host bounds", "unexpected worker hostname", "E0000", "Source Location Trace",
                "Logging before InitGoogle", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE")


def test_the_readmes_tpu_compile_command_prints_no_libtpu_start_up_errors_with_or_without_jax_platforms():
  """README's `python experiments/aot.py --config=configs/qwen1p5b.py --topology=v5e:2x4` loads libtpu for its
  compile-only devices on a machine without a TPU; its cheapest phase, with and without JAX_PLATFORMS=cpu."""
  import pytest
  if not platforms.importlib.util.find_spec("libtpu"):
    pytest.skip("compiling for a TPU needs libtpu (the tpu/test extra)")
  clean = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_PLATFORMS", "TPU_"))}
  for env in (clean, dict(clean, JAX_PLATFORMS="cpu")):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "aot.py"), "--config=configs/qwen1p5b.py",
                          "--topology=v5e:2x4", "--phases=stage1_reshard"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| stage1_reshard |" in run.stdout
    for marker in LIBTPU_NOISE:
      assert marker not in run.stderr, (env.get("JAX_PLATFORMS"), run.stderr[-2000:])
