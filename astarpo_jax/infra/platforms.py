"""Which JAX platforms a process tries: all of them, except a TPU that is not there.

The test extra installs libtpu (the compiler behind the ahead-of-time TPU compiles), and JAX then starts
libtpu on every machine, which prints start-up errors where no TPU is attached ("unexpected worker
hostname", "could not determine TPU accelerator type"). `skip_absent_tpu` leaves the TPU out of the
platforms JAX tries when no TPU chip is on the PCI bus, and changes nothing else: a GPU machine still
uses its GPU, a TPU VM its TPU, and a JAX_PLATFORMS the user set is kept.

Compiling for a TPU slice on such a machine loads libtpu anyway (compile-only topologies), and libtpu then looks
for the TPU VM it is not on: its metadata server, its worker hostnames, its accelerator type, each a start-up
error on stderr. `quiet_compile_only_libtpu` gives it those values (this host, the slice compiled for) before
it loads.
"""
from __future__ import annotations

import glob
import importlib.util
import os

GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips' PCI vendor id (what JAX's own hardware check reads)
NVIDIA_DEVICES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")
ROCM_PLUGINS = ("jax_rocm7_plugin", "jax_rocm60_plugin")


def tpu_chips_visible(sysfs: str = "/sys/bus/pci/devices") -> bool:
  """True when a Google PCI device (a TPU chip) is attached."""
  for vendor in glob.glob(os.path.join(sysfs, "*", "vendor")):
    try:
      if open(vendor).read().strip() == GOOGLE_PCI_VENDOR:
        return True
    except OSError:
      continue
  return False


def _installed(names) -> bool:
  return any(importlib.util.find_spec(n) is not None for n in names)


def is_gpu(platform: str) -> bool:
  """Whether a backend or device platform name is NVIDIA's ("gpu" as JAX reports it, "cuda" as it is asked for)."""
  return platform in ("gpu", "cuda")


def platforms_without_tpu() -> str:
  """The platforms JAX would find on this machine, the TPU left out: a visible GPU with its plugin, then the CPU."""
  found = []
  if any(os.path.exists(d) for d in NVIDIA_DEVICES) and _installed(CUDA_PLUGINS):
    found.append("cuda")
  if os.path.exists("/dev/kfd") and _installed(ROCM_PLUGINS):
    found.append("rocm")
  return ",".join(found + ["cpu"])


def skip_absent_tpu() -> str | None:
  """Sets jax_platforms to the platforms but the TPU when libtpu is installed, no TPU chip is attached and
  nobody chose the platforms (JAX_PLATFORMS or jax.config); returns what it set, or None."""
  if os.environ.get("JAX_PLATFORMS") or importlib.util.find_spec("libtpu") is None or tpu_chips_visible():
    return None
  import jax
  if jax.config.jax_platforms:
    return None
  chosen = platforms_without_tpu()
  jax.config.update("jax_platforms", chosen)
  return chosen


def accelerator_type(kind: str, chips: int) -> str:
  """Cloud TPU's name for a slice of `chips` chips of `kind` (v4 / v5p count TensorCores, two a chip; v5e is
  "v5litepod"), as the TPU_ACCELERATOR_TYPE of a TPU VM holds it."""
  if kind in ("v4", "v5p"):
    return f"{kind}-{2 * chips}"
  return f"{'v5litepod' if kind == 'v5e' else kind}-{chips}"


def quiet_compile_only_libtpu(accel_type: str) -> dict:
  """Environment libtpu reads at load, for compile-only use where no TPU is attached: no metadata server query
  (TPU_SKIP_MDS_QUERY), this host as its one worker (TPU_WORKER_HOSTNAMES: else "unexpected worker hostname"),
  the accelerator type compiled for (else "Failed to find host bounds"; an explicit topology's devices do not
  change with it), and several processes may load it. A value already set is kept; a machine with a TPU
  attached is left alone. Returns what it set (call before libtpu loads)."""
  if tpu_chips_visible():
    return {}
  wanted = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": accel_type,
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
  chosen = {k: v for k, v in wanted.items() if k not in os.environ}
  os.environ.update(chosen)
  return chosen
