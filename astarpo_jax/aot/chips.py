"""Accelerator slices to compile for without owning them: chip figures and compile-only topologies.

libtpu (the `tpu` / `test` extras) describes any TPU topology on a machine without a TPU:
`jax.experimental.topologies.get_topology_desc` returns compile-only devices, and a program
lowered for a mesh over them compiles with the real TPU compiler (memory_analysis() is the device's,
an out-of-memory is the chip's). Every figure below is from the vendor's page named beside it.

Slice names count what Google's accelerator types count: TensorCores for v4 / v5p (two per chip,
one JAX device per chip: megacore), chips for v5e / v6e. Multi-host topologies give devices of
several processes (4 chips per host, as Cloud TPU VMs), so a pod slice compiles as a pod run does.
`device_spec` reads the same names (and A100s) for the memory plan: devices and usable bytes per device.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import re

from astarpo_jax.infra import platforms


@dataclasses.dataclass(frozen=True)
class ChipSpec:
  """Per-chip figures for roofline times; bf16 dense peak, HBM and interconnect bandwidth in bytes/s.

  `ici_bandwidth` is what one chip moves in a ring collective along one mesh axis: both directions of one
  link (TPU: ICI, each way per link x 2) or, on GPUs, NVLink's one-way bandwidth (the vendors' 900 GB/s is
  the two-direction total). A collective also costs a fixed latency: `hop_latency_s` per ring step on TPU
  ICI, `collective_latency_s` per NCCL collective on GPUs; `collective_latency` gives it."""
  kind: str
  hbm_bytes: int
  peak_flops: float
  hbm_bandwidth: float
  ici_bandwidth: float  # bytes/s one chip moves in a ring collective (see above and each entry's note)
  source: str
  note: str = ""
  links: int = 0  # interconnect links per chip (TPU torus neighbours; GPU: NVLink links)
  link_bandwidth: float = 0.0  # bytes/s one link carries each way
  hop_latency_s: float = 0.0  # TPU: per ring step
  collective_latency_s: float = 0.0  # GPU: per collective

  def collective_latency(self, hops: int) -> float:
    """Seconds a collective costs beyond its bytes: a ring over `hops` + 1 chips on TPU, one NCCL call on GPU."""
    return self.collective_latency_s + self.hop_latency_s * hops


def chip_of_device(device_kind: str) -> str | None:
  """The CHIPS entry of a JAX device's `device_kind` ("NVIDIA H100 80GB HBM3", "TPU v5 lite", "TPU v5p", ...);
  None where the table has no such chip (a CPU)."""
  kind = device_kind.lower()
  for key, words in (("h200", ("h200",)), ("h100", ("h100",)), ("v5e", ("v5 lite", "v5e", "v5litepod")),
                     ("v6e", ("v6 lite", "v6e")), ("v5p", ("v5p", "tpu v5")), ("v4", ("tpu v4",))):
    if any(w in kind for w in words):
      return key
  return None


GB = 10**9
GiB = 1 << 30
# A GPU's memory as the device reports it (cudaDeviceProp.totalGlobalMem), recorded in XLA's GPU target
# specs (openxla/xla, xla/backends/gpu/target_config/specs/{h100_sxm,h200,a100_sxm_80,a100_sxm_40}.txtpb,
# device_memory_size). The vendors' "80 GB" / "141 GB" are GiB-sized parts: 141 x 10^9 bytes would be 7% low.
GPU_DEVICE_MEMORY = {"h100": 84942979072, "h200": 151397597184, "a100-80": 85100068864, "a100-40": 42331013120}
# ICI per link and direction, links per chip and the per-hop latency: "How to Scale Your Model", part 2 ("How to
# think about TPUs", https://jax-ml.github.io/scaling-book/tpus/): one-way ICI bandwidth per link 4.5e10 B/s
# (v4p, v5e) and 9e10 B/s (v5p, v6e); 3D tori (v4, v5p: 6 neighbours) and 2D (v5e, v6e: 4); ~1 us per hop.
# NVLink 4 on H100/H200: 18 links, 900 GB/s in both directions together, 450 GB/s each way
# (https://www.nvidia.com/en-us/data-center/nvlink/). An NCCL collective inside one node: ~10 us at small sizes
# (NVIDIA nccl-tests all_reduce_perf latency on 8 x H100; an order of magnitude, not a measurement here).
TPU_HOP_S, NCCL_CALL_S = 1e-6, 10e-6
CHIPS: dict[str, ChipSpec] = {
    # https://cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16, 32 GiB HBM2 at 1200 GBps.
    "v4": ChipSpec("v4", 32 * GiB, 275e12, 1200 * GB, 2 * 45 * GB, "https://cloud.google.com/tpu/docs/v4",
                   "ICI: scaling book, 4.5e10 B/s per link each way, both ways of one axis", 6, 45 * GB, TPU_HOP_S),
    # https://cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GiB HBM2 at 819 GBps.
    "v5e": ChipSpec("v5e", 16 * GiB, 197e12, 819 * GB, 2 * 45 * GB, "https://cloud.google.com/tpu/docs/v5e",
                    "ICI: scaling book, 4.5e10 B/s per link each way, both ways of one axis", 4, 45 * GB, TPU_HOP_S),
    # https://cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 95 GiB HBM2e at 2765 GBps.
    "v5p": ChipSpec("v5p", 95 * GiB, 459e12, 2765 * GB, 2 * 90 * GB, "https://cloud.google.com/tpu/docs/v5p",
                    "ICI: scaling book, 9e10 B/s per link each way, both ways of one axis", 6, 90 * GB, TPU_HOP_S),
    # https://cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 32 GiB HBM at 1640 GBps.
    "v6e": ChipSpec("v6e", 32 * GiB, 918e12, 1640 * GB, 2 * 90 * GB, "https://cloud.google.com/tpu/docs/v6e",
                    "ICI: scaling book, 9e10 B/s per link each way, both ways of one axis", 4, 90 * GB, TPU_HOP_S),
    # https://www.nvidia.com/en-us/data-center/h100/ (SXM): 989 TFLOP/s dense bf16 (1979 with sparsity), "80 GB"
    # HBM3 at 3.35 TB/s; NVLink 900 GB/s is both directions: 450 GB/s each way. Memory: what the device reports.
    "h100": ChipSpec("h100", GPU_DEVICE_MEMORY["h100"], 989e12, 3350 * GB, 450 * GB,
                     "https://www.nvidia.com/en-us/data-center/h100/", "NVLink 450 GB/s each way", 18, 25 * GB,
                     0.0, NCCL_CALL_S),
    # https://www.nvidia.com/en-us/data-center/h200/ (SXM): 989 TFLOP/s dense bf16, "141 GB" HBM3e at 4.8 TB/s,
    # NVLink 900 GB/s (both directions). Memory: what the device reports (above).
    "h200": ChipSpec("h200", GPU_DEVICE_MEMORY["h200"], 989e12, 4800 * GB, 450 * GB,
                     "https://www.nvidia.com/en-us/data-center/h200/", "NVLink 450 GB/s each way", 18, 25 * GB,
                     0.0, NCCL_CALL_S),
}
MEGACORE = ("v4", "v5p")  # two TensorCores per chip, one JAX device per chip

# The HBM a program may use on one JAX device, as the TPU compiler states it: the "available HBM" of its
# out-of-memory error for a compile-only device (libtpu with jax 0.10.2; megacore on v4 / v5p), read
# back by tests/test_aot.py. The runtime keeps the rest; v5p's pages say 95 GiB, its compiler offers more.
TPU_AVAILABLE_HBM = {"v4": int(30.75 * GiB), "v5e": int(15.75 * GiB), "v5p": int(95.74 * GiB),
                     "v6e": int(31.25 * GiB)}
GPU_MEM_FRACTION = 0.75  # XLA_PYTHON_CLIENT_MEM_FRACTION unless set: what JAX lets XLA allocate on a GPU


def usable_hbm_bytes(kind: str, hbm_bytes: int, gpu_mem_fraction: float = GPU_MEM_FRACTION) -> int:
  """The bytes one device's phases may peak at: the TPU compiler's figure, or a GPU's memory times the
  fraction JAX's allocator is given (pass the run's own when it sets XLA_PYTHON_CLIENT_MEM_FRACTION)."""
  if kind in TPU_AVAILABLE_HBM:
    return TPU_AVAILABLE_HBM[kind]
  return int(hbm_bytes * gpu_mem_fraction)


@dataclasses.dataclass(frozen=True)
class SliceSpec:
  """A TPU slice (or GPU host) as JAX sees it: chip kind, topology, devices and processes."""
  name: str  # v5e-8, v4-32, h200x8
  chip: ChipSpec
  topology: str  # get_topology_desc's topology_name, e.g. "v5e:2x4"
  num_devices: int
  host_bounds: tuple[int, int, int] | None = None  # chips_per_host_bounds; None = the library's (2, 2, 1)

  @property
  def num_hosts(self) -> int:
    per_host = math.prod(self.host_bounds) if self.host_bounds else 4
    return max(1, self.num_devices // per_host) if self.chip.kind not in ("h100", "h200") else 1


# chips -> slice shape, as in Google's v4 / v5p (3D) and v5e / v6e (2D) configuration tables.
_SHAPES_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8), 256: (4, 8, 8)}
_SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}


def slice_spec(name: str) -> SliceSpec:
  """'v5e-8', 'v4-8' (4 chips), 'v5p-16', 'v6e-32', a topology 'v5e:2x4' / 'v4:2x2x4', or 'h200x8'."""
  raw = name.strip().lower()
  gpu = re.fullmatch(r"(h100|h200)(?:x(\d+))?", raw)
  if gpu:
    n = int(gpu.group(2) or 1)
    if n < 1:
      raise ValueError(f"{name}: at least one GPU")
    return SliceSpec(raw, CHIPS[gpu.group(1)], f"1x1x{n}", n)
  topo = re.fullmatch(r"(v4|v5e|v5p|v5|v6e):(\d+(?:x\d+)+)", raw)
  named = re.fullmatch(r"(v4|v5e|v5litepod|v5p|v6e)-(\d+)", raw)
  if topo:
    kind = {"v5": "v5p"}.get(topo.group(1), topo.group(1))
    dims = tuple(int(d) for d in topo.group(2).split("x"))
    chips = math.prod(dims)
  elif named:
    kind = {"v5litepod": "v5e"}.get(named.group(1), named.group(1))
    cores = int(named.group(2))
    if kind in MEGACORE and cores % 2:
      raise ValueError(f"{name}: {kind} slice names count TensorCores (2 per chip); {cores} is odd")
    chips = cores // 2 if kind in MEGACORE else cores
    shapes = _SHAPES_3D if kind in MEGACORE else _SHAPES_2D
    if chips not in shapes:
      raise ValueError(f"{name}: no {kind} slice of {chips} chips in the tables (chips: {sorted(shapes)})")
    dims = shapes[chips]
  else:
    raise ValueError(f"unknown slice {name!r}: use v4-8, v5e-8, v5p-8, v6e-8 (or -16, -32, ...), a topology "
                     "like v5e:2x4 or v4:2x2x4, or h200x8")
  topology = f"{kind}:{'x'.join(map(str, dims))}"
  # An 8-chip v5e / v6e slice is one host (Google's tables); the library's default would split it in two. A
  # one-chip slice (v5litepod-1, Colab's TPU) is a host of one chip: libtpu refuses 1x1 under its default 2x2x1.
  bounds = (2, 4, 1) if kind in ("v5e", "v6e") and chips == 8 else (1, 1, 1) if chips == 1 else None
  label = named.group(0) if named else f"{kind}-{chips * (2 if kind in MEGACORE else 1)}"
  return SliceSpec(label, CHIPS[kind], topology, chips, bounds)


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """A slice as the memory plan sees it: how many JAX devices it exposes and the memory of each."""
  name: str
  num_devices: int
  bytes_per_device: int
  usable_bytes: int  # what XLA may allocate on one device
  note: str = ""

  @property
  def usable_fraction(self) -> float:
    return self.usable_bytes / self.bytes_per_device


def device_spec(name: str, gpu_mem_fraction: float = GPU_MEM_FRACTION) -> DeviceSpec:
  """A TPU slice as `slice_spec` reads it ('v4-8' = 4 devices, 'v5e-8', 'v5e:2x4', ...) or GPUs: 'h200',
  'h100x8', 'a100-80x4', 'a100-40' (a100 = a100-40). On GPUs JAX lets XLA allocate
  XLA_PYTHON_CLIENT_MEM_FRACTION of the memory (0.75 unless set): pass the fraction the run will use."""
  if not 0 < gpu_mem_fraction <= 1:
    raise ValueError(f"gpu_mem_fraction={gpu_mem_fraction}: must be in (0, 1]")
  raw = name.strip().lower()
  a100 = re.fullmatch(r"(a100-80|a100-40|a100)(?:x(\d+))?", raw)  # no compile target: memory only
  if a100:
    kind, count = {"a100": "a100-40"}.get(a100.group(1), a100.group(1)), int(a100.group(2) or 1)
    if count < 1:
      raise ValueError(f"{name}: at least one GPU")
    memory, note = GPU_DEVICE_MEMORY[kind], f"{kind}: {GPU_DEVICE_MEMORY[kind] / GiB:.1f} GiB, XLA's target spec"
  else:  # TPU slices and H100 / H200 hosts, as the compile path reads them
    try:
      spec = slice_spec(raw)
    except ValueError as e:
      raise ValueError(f"unknown device {name!r}: {e}; or a GPU like h200, h100x8, a100-80x4, a100-40") from None
    kind, count, memory = spec.chip.kind, spec.num_devices, spec.chip.hbm_bytes
    note = f"{spec.name} ({spec.topology}): {memory / GiB:.1f} GiB HBM per chip, {spec.chip.source}"
  return DeviceSpec(name, count, memory, usable_hbm_bytes(kind, memory, gpu_mem_fraction), note)


def device_memory_bytes(device=None) -> int | None:
  """The allocator limit XLA reports for `device` (TPU, GPU), or None where it reports none (CPU)."""
  import jax
  device = device or jax.devices()[0]
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


# Device values of XLA's GPU target specs (openxla/xla, xla/backends/gpu/target_config/specs/h100_sxm.txtpb
# and h200.txtpb), the fields jaxlib 0.10.2's GpuTargetConfigProto reads; the rest of each spec is left out.
# H100's 3352.32 GB/s is NVIDIA's "3.35 TB/s" (CHIPS above, which the rooflines use) unrounded: one figure.
GPU_TARGETS = {
    "h100": dict(memory_bandwidth=3352320000000, device_memory_size=GPU_DEVICE_MEMORY["h100"],
                 name="NVIDIA H100 80GB HBM3"),
    "h200": dict(memory_bandwidth=4800000000000, device_memory_size=GPU_DEVICE_MEMORY["h200"],
                 name="NVIDIA H200 141GB HBM3e"),
}


def gpu_target_config(kind: str) -> str:
  """A GpuTargetConfigProto (text format) for a Hopper GPU: what XLA needs to compile without one."""
  t = GPU_TARGETS[kind]
  info = dict(threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=49152,
              shared_memory_per_core=233472, threads_per_core_limit=2048, core_count=132, fpus_per_core=128,
              block_dim_limit_x=2147483647, block_dim_limit_y=65535, block_dim_limit_z=65535,
              memory_bandwidth=t["memory_bandwidth"], l2_cache_size=52428800, clock_rate_ghz=1.98,
              device_memory_size=t["device_memory_size"], shared_memory_per_block_optin=232448,
              registers_per_core_limit=65536, registers_per_block_limit=65536)
  fields = "\n".join(f"  {k}: {v}" for k, v in info.items())
  return (f"gpu_device_info {{\n{fields}\n  cuda_compute_capability {{ major: 9 }}\n}}\n"
          f'platform_name: "CUDA"\ndnn_version_info {{ major: 9 minor: 10 patch: 0 }}\n'
          f'device_description_str: "{t["name"]}"\n')


@functools.lru_cache(maxsize=None)
def topology_devices(name: str) -> tuple:
  """Compile-only devices of a slice (needs libtpu for TPUs); a clear error where it is missing."""
  spec = slice_spec(name)
  if spec.chip.kind not in ("h100", "h200"):  # libtpu's start-up env, before it loads (no start-up errors)
    # (compile-only use touches no chip, so several processes may load libtpu at once: its lockfile
    # /tmp/libtpu_lockfile otherwise refuses a second one)
    platforms.quiet_compile_only_libtpu(platforms.accelerator_type(spec.chip.kind, spec.num_devices))
  from jax.experimental import topologies
  if spec.chip.kind in ("h100", "h200"):  # needs the CUDA plugin (jax[cuda12]), not a GPU
    try:
      return tuple(topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(spec.chip.kind),
                                                topology=f"1x1x{spec.num_devices}").devices)
    except Exception as e:  # noqa: BLE001  say which install is missing
      raise RuntimeError(f"{name}: no compile-only CUDA devices ({type(e).__name__}: {str(e)[:300]}); install "
                         "jax[cuda12] matching the installed jax") from e
  if not libtpu_available():
    raise RuntimeError("compiling for a TPU slice needs libtpu: pip install -e '.[tpu]' (or the test extra), "
                       "pinned to the installed jax")
  kwargs = {"chip_config_name": "megacore"} if spec.chip.kind in MEGACORE else {}
  if spec.host_bounds:
    kwargs["chips_per_host_bounds"] = spec.host_bounds
  devices = topologies.get_topology_desc(topology_name=spec.topology, platform="tpu", **kwargs).devices
  if len(devices) != spec.num_devices:
    raise RuntimeError(f"{name}: topology {spec.topology} gave {len(devices)} devices, expected {spec.num_devices}")
  return tuple(devices)


def libtpu_available() -> bool:
  return importlib.util.find_spec("libtpu") is not None
