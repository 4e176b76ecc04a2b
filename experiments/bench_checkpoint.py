"""Checkpoint import into shardings: load time and peak memory of two safetensors readers.

"own" is `hf.load_hf`: safetensors files memory-mapped by the project's reader, each param's layout
transform applied to the lazy view, each device's shard sliced from it (`make_array_from_callback`).
"safetensors" is the contender it was chosen over (docs/checkpoints.md), kept here to re-measure:
the `safetensors` package's `safe_open(..., framework="numpy")` + `get_slice`, reading for each
device the box of each HF tensor that holds its shard, then viewing that box in our layout.

Writes a random bf16 checkpoint of the Qwen2.5-1.5B shape (hidden 1536, intermediate 8960, 28 layers,
12 heads, 2 kv heads, vocab 151936, tied; ~3.1 GB in 2 files with an index, as HF ships it), then
loads it into an FSDP mesh (1, 8, 1) of 8 faked CPU devices, each load in a fresh process, the
readers interleaved (A B B A ...), with the files' page cache dropped first (--cache=cold) or left
warm by a previous read (--cache=warm).

  flock /work/cpu.lock python experiments/bench_checkpoint.py --dir=/tmp/bench_ckpt --repeats=3 --cleanup
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time

from astarpo_jax.model.config import ModelConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

READERS = ("own", "safetensors")
QWEN_1P5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
                 num_kv_heads=2, head_dim=128, tie_embeddings=True, rope_theta=1e6, max_position_embeddings=32768)


def write_checkpoint(out_dir: str, seed: int = 0) -> None:
  """Random bf16 params of the Qwen2.5-1.5B shape, written with hf.save_hf in 2 shards plus the index."""
  import ml_dtypes
  import numpy as np

  from astarpo_jax.model import decoder, hf
  cfg = ModelConfig(**QWEN_1P5B, param_dtype="bfloat16", dtype="bfloat16")
  _, abstract = decoder.abstract_params(cfg)
  rng = np.random.default_rng(seed)

  def fill(spec):
    out = np.empty(spec.shape, ml_dtypes.bfloat16)
    for i in range(spec.shape[0] if len(spec.shape) > 2 else 1):  # a layer at a time: small fp32 temporaries
      part = out[i] if len(spec.shape) > 2 else out
      part[...] = (0.02 * rng.standard_normal(part.shape, np.float32)).astype(ml_dtypes.bfloat16)
    return out

  import jax
  params = jax.tree.map(fill, abstract)
  total = sum(p.nbytes for p in jax.tree.leaves(params))
  hf.save_hf(cfg, params, out_dir, dtype="bfloat16", max_shard_bytes=int(0.6 * total))  # 2 files


def _hf_box(to_ours, hf_shape, index):
  """The box of the HF tensor that holds `to_ours(w)[index]`, and how to view that box as it.

  `to_ours` (reshapes and transposes: an affine map of coordinates) is applied to broadcast
  coordinate grids, one per HF axis, which cost no memory; their strides give the step of every HF
  coordinate along every axis of the shard. Returns (box, take) with take(block) -> the shard.
  """
  import numpy as np
  steps, first = [], []
  for a, n in enumerate(hf_shape):
    grid = np.arange(n, dtype=np.int64).reshape([n if b == a else 1 for b in range(len(hf_shape))])
    c = to_ours(np.broadcast_to(grid, hf_shape))[index]
    assert np.may_share_memory(c, grid) and all(st >= 0 for st in c.strides), "not an affine view"
    steps.append([st // grid.itemsize for st in c.strides])
    first.append(int(c.flat[0]) if c.size else 0)
  shape = c.shape
  box = tuple(slice(f, f + sum((m - 1) * k for m, k in zip(shape, ks)) + 1) for f, ks in zip(first, steps))

  def take(block):
    strides = [sum(ks[j] * block.strides[a] for a, ks in enumerate(steps)) for j in range(len(shape))]
    return np.lib.stride_tricks.as_strided(block, shape, strides, writeable=False)

  return box, take


def load_sliced(ckpt_dir: str, shardings):
  """The contender: each device's shard read with safetensors' get_slice (one box per HF tensor)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from safetensors import safe_open

  from astarpo_jax.model import decoder, hf
  cfg = hf.load_hf_config(ckpt_dir, dtype="bfloat16", param_dtype="bfloat16")
  handles = {}
  for path in hf._weight_files(ckpt_dir):
    f = safe_open(path, framework="numpy")
    handles.update({name: f for name in f.keys()})
  _, abstract = decoder.abstract_params(cfg)
  params = {}
  for path, (pattern, to_ours, to_hf) in hf._hf_layout(cfg).items():
    spec = hf._get(abstract, path)
    stacked = path[0] == "layers"
    hf_shape = jax.eval_shape(to_hf, jax.ShapeDtypeStruct(spec.shape[1:] if stacked else spec.shape, jnp.float32)).shape

    def build(index, pattern=pattern, to_ours=to_ours, hf_shape=hf_shape, stacked=stacked, num=spec.shape[0]):
      layer_ids = range(num)[index[0]] if stacked else [None]
      box, take = _hf_box(to_ours, hf_shape, index[1:] if stacked else index)
      parts = [take(handles[pattern.format(i)].get_slice(pattern.format(i))[box]) for i in layer_ids]
      return np.stack(parts).astype(spec.dtype, copy=False) if stacked else np.asarray(parts[0], dtype=spec.dtype)

    hf._set(params, path, jax.make_array_from_callback(spec.shape, hf._get(shardings, path), build))
  return params


def _status_kb(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  return 0


def child(ckpt_dir: str, reader: str) -> None:
  """One load in this process (8 faked devices); prints a JSON line of seconds and memory."""
  import jax

  from astarpo_jax.infra import sharding
  from astarpo_jax.model import hf
  assert jax.device_count() == 8, jax.device_count()
  cfg = hf.load_hf_config(ckpt_dir, dtype="bfloat16", param_dtype="bfloat16")
  mesh = sharding.make_mesh((1, 8, 1))
  shardings = sharding.param_shardings(cfg, mesh)
  base = {k: _status_kb(k) for k in ("VmRSS", "RssAnon", "RssFile")}
  peaks = dict(base)
  stop = threading.Event()

  def sample():  # the kernel keeps a high-water mark of RSS only; anon and file pages are sampled
    while not stop.wait(0.02):
      for k in peaks:
        peaks[k] = max(peaks[k], _status_kb(k))

  sampler = threading.Thread(target=sample, daemon=True)
  sampler.start()
  t = time.perf_counter()
  if reader == "own":
    _, params = hf.load_hf(ckpt_dir, dtype="bfloat16", param_dtype="bfloat16", shardings=shardings)
  else:
    params = load_sliced(ckpt_dir, shardings)
  jax.block_until_ready(params)
  seconds = time.perf_counter() - t
  stop.set()
  sampler.join()
  nbytes = sum(p.nbytes for p in jax.tree.leaves(params))
  check = {k: float(jax.numpy.abs(params["layers"][k].astype("float32")).sum()) for k in ("w_down", "wq", "bk")}
  check["embed"] = float(jax.numpy.abs(params["embed"].astype("float32")).sum())
  print(json.dumps({"reader": reader, "seconds": seconds, "param_gb": nbytes / 1e9,
                    "ru_maxrss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
                    "vmhwm_gb": _status_kb("VmHWM") / 1e6, "rss_before_gb": base["VmRSS"] / 1e6,
                    "peak_anon_gb": peaks["RssAnon"] / 1e6, "peak_file_gb": peaks["RssFile"] / 1e6, "check": check}))


def drop_page_cache(ckpt_dir: str) -> None:
  """Evicts the checkpoint's files from the page cache (clean pages), so the next read is from disk."""
  for name in os.listdir(ckpt_dir):
    fd = os.open(os.path.join(ckpt_dir, name), os.O_RDONLY)
    try:
      os.fsync(fd)
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def run_child(ckpt_dir: str, reader: str) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
  proc = subprocess.run([sys.executable, __file__, "--child", reader, "--dir", ckpt_dir], env=env,
                        capture_output=True, text=True)
  if proc.returncode:
    raise RuntimeError(f"{reader} load failed:\n{proc.stderr[-3000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--dir", default="/tmp/astarpo_bench_ckpt")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--cache", choices=("cold", "warm", "both"), default="both")
  ap.add_argument("--cleanup", action="store_true", help="delete the checkpoint afterwards")
  ap.add_argument("--child", choices=READERS, help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.child:
    child(args.dir, args.child)
    return
  if not os.path.exists(os.path.join(args.dir, "model.safetensors.index.json")):
    t = time.perf_counter()
    write_checkpoint(args.dir)
    print(f"wrote {args.dir} in {time.perf_counter() - t:.0f} s", flush=True)
  sizes = sum(os.path.getsize(os.path.join(args.dir, n)) for n in os.listdir(args.dir))
  print(f"checkpoint: {sizes / 1e9:.2f} GB in {sorted(os.listdir(args.dir))}")
  print(f"loadavg before: {open('/proc/loadavg').read().strip()}", flush=True)
  caches = ("cold", "warm") if args.cache == "both" else (args.cache,)
  results: dict[tuple[str, str], list[dict]] = {(c, r): [] for c in caches for r in READERS}
  try:
    for rep in range(args.repeats):
      order = READERS if rep % 2 == 0 else READERS[::-1]
      for cache in caches:
        for reader in order:
          if cache == "cold":
            drop_page_cache(args.dir)
          else:
            run_child(args.dir, reader)  # a read that warms the cache (not counted)
          r = run_child(args.dir, reader)
          results[(cache, reader)].append(r)
          print(f"  rep {rep} {cache:4s} {reader:11s} {r['seconds']:6.1f} s  ru_maxrss {r['ru_maxrss_gb']:.2f} GB  "
                f"peak anon {r['peak_anon_gb']:.2f} GB  peak file {r['peak_file_gb']:.2f} GB", flush=True)
  finally:
    print(f"loadavg after: {open('/proc/loadavg').read().strip()}")
    if args.cleanup:
      shutil.rmtree(args.dir, ignore_errors=True)
      print(f"deleted {args.dir}")
  checks = {json.dumps(r["check"], sort_keys=True) for rs in results.values() for r in rs}
  print(f"\nevery load gave the same params (abs sums of embed, w_down, wq, bk): {len(checks) == 1}")
  print("\n| cache | reader | median load s | median ru_maxrss GB | median peak anon GB | median peak file GB |")
  print("|---|---|---|---|---|---|")
  for (cache, reader), rs in results.items():
    med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
    print(f"| {cache} | {reader} | {med('seconds'):.1f} | {med('ru_maxrss_gb'):.2f} | {med('peak_anon_gb'):.2f} | "
          f"{med('peak_file_gb'):.2f} |")
  for cache in caches:
    a, b = (statistics.median(r["seconds"] for r in results[(cache, x)]) for x in READERS)
    print(f"{cache}: time ratio {READERS[1]}/{READERS[0]} = {b / a:.2f}")


if __name__ == "__main__":
  main()
