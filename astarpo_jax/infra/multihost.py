"""Per-process shares of global arrays, for runs of several JAX processes (multi-host).

In a multi-process run every process executes the same jitted programs on global arrays, but
host work (decoding, grading, writing files) must touch only the rows a process holds. The
helpers here map between the two: which rows of a batch-sharded [B, ...] array this process
holds, a global array built from them, those rows read back as numpy, and the few host values
every process must agree on (gathered with `process_allgather`). With one process each helper
is the identity (or a plain `jnp.asarray`), so single-process code pays nothing for them.
Files (work directories that may be buckets) are files.py's concern.
"""
from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from astarpo_jax.infra import sharding as sharding_lib


def row_sharding(mesh: jax.sharding.Mesh | None) -> NamedSharding | None:
  """Sharding of a [B, ...] batch array: rows split over the mesh axes of the `batch` rule."""
  if mesh is None:
    return None
  return NamedSharding(mesh, PartitionSpec(sharding_lib.DEFAULT_RULES["batch"] or None))


def resolve_mesh(mesh: jax.sharding.Mesh | None, params=None) -> jax.sharding.Mesh | None:
  """`mesh`, else the mesh `params` are sharded over; several processes need one (arrays span them)."""
  if mesh is None and params is not None:
    mesh = next((x.sharding.mesh for x in jax.tree.leaves(params)
                 if isinstance(getattr(x, "sharding", None), NamedSharding)), None)
  if jax.process_count() > 1 and mesh is None:
    raise ValueError(f"{jax.process_count()} JAX processes but no mesh: pass mesh= (a mesh over all "
                     "processes' devices, e.g. sharding.make_mesh) so arrays can span the processes")
  return mesh


def process_rows(num_rows: int, sharding: jax.sharding.Sharding | None) -> np.ndarray:
  """Sorted indices of the rows of a [num_rows, ...] array with `sharding` held by this process's devices."""
  if sharding is None or jax.process_count() == 1:
    return np.arange(num_rows)
  held = set()
  for idx in sharding.addressable_devices_indices_map((num_rows,)).values():
    held.update(range(num_rows)[idx[0]])
  return np.asarray(sorted(held), np.int64)


def owned_rows(num_rows: int, sharding: jax.sharding.Sharding | None) -> np.ndarray:
  """Bool [len(process_rows)]: this process is the lowest-numbered one holding the row.

  Rows replicated over processes (a batch not split over every device) are held by several;
  sums over rows count each row once by taking only the owned ones.
  """
  mine = process_rows(num_rows, sharding)
  if sharding is None or jax.process_count() == 1:
    return np.ones(len(mine), bool)
  first = np.full(num_rows, np.iinfo(np.int64).max)
  for dev, idx in sharding.devices_indices_map((num_rows,)).items():
    rows = np.arange(num_rows)[idx[0]]
    first[rows] = np.minimum(first[rows], dev.process_index)
  return first[mine] == jax.process_index()


def global_rows(local: np.ndarray, rows: np.ndarray, num_rows: int,
                sharding: jax.sharding.Sharding | None) -> jax.Array:
  """The global [num_rows, ...] array whose rows `rows` (this process's, see `process_rows`) are `local`."""
  local = np.asarray(local)
  if sharding is None:
    if len(rows) != num_rows:
      raise ValueError(f"global_rows: {len(rows)} of {num_rows} rows and no sharding to place them with")
    return jnp.asarray(local)
  pos = np.full(num_rows, -1, np.int64)
  pos[rows] = np.arange(len(rows))

  def shard(idx):
    want = np.arange(num_rows)[idx[0]]
    if (pos[want] < 0).any():
      raise ValueError(f"process {jax.process_index()} has no data for rows {want[pos[want] < 0][:8].tolist()}")
    return local[pos[want]][(slice(None),) + tuple(idx[1:])]
  return jax.make_array_from_callback((num_rows,) + local.shape[1:], sharding, shard)


def local_rows(x: jax.Array, rows: np.ndarray) -> np.ndarray:
  """Rows `rows` of the global array `x` as numpy, read from this process's shards (no communication)."""
  if x.is_fully_addressable:
    host = np.asarray(x)
    return host if len(rows) == len(host) and np.array_equal(rows, np.arange(len(host))) else host[rows]
  out = np.empty((len(rows),) + x.shape[1:], x.dtype)
  filled = np.zeros(len(rows), bool)
  pos = np.full(x.shape[0], -1, np.int64)
  pos[rows] = np.arange(len(rows))
  for s in x.addressable_shards:
    have = np.arange(x.shape[0])[s.index[0]]
    sel = pos[have] >= 0
    if sel.any() and all(i == slice(None) or (i.start in (None, 0) and i.stop in (None, d))
                         for i, d in zip(s.index[1:], x.shape[1:])):
      out[pos[have[sel]]] = np.asarray(s.data)[sel]
      filled[pos[have[sel]]] = True
  if not filled.all():
    raise ValueError(f"local_rows: process {jax.process_index()} holds no whole row for "
                     f"{np.asarray(rows)[~filled][:8].tolist()} (sharding {x.sharding}); reshard with `to_rows` first")
  return out


def to_rows(x: jax.Array, sharding: jax.sharding.Sharding | None) -> jax.Array:
  """`x` resharded to `sharding` (a no-op when it already is, or without a sharding)."""
  if sharding is None or x.sharding.is_equivalent_to(sharding, x.ndim):
    return x
  return jax.jit(lambda a: a, out_shardings=sharding)(x)


def gather_rows(local: np.ndarray, rows: np.ndarray, num_rows: int) -> np.ndarray:
  """The full [num_rows, ...] host array from every process's rows (rows held twice must agree)."""
  local = np.asarray(local)
  if jax.process_count() == 1:
    out = np.zeros((num_rows,) + local.shape[1:], local.dtype)
    out[rows] = local
    return out
  # int32 / float32 on the wire: JAX without x64 would narrow 64-bit values anyway
  k_max = int(np.max(multihost_utils.process_allgather(np.int32(len(rows)))))
  pad = k_max - len(rows)
  rows_p = np.concatenate([np.asarray(rows, np.int32), np.full(pad, -1, np.int32)])
  vals_p = np.concatenate([local, np.zeros((pad,) + local.shape[1:], local.dtype)])
  all_rows = np.asarray(multihost_utils.process_allgather(rows_p)).reshape(-1)
  all_vals = np.asarray(multihost_utils.process_allgather(vals_p)).reshape((-1,) + local.shape[1:])
  keep = all_rows >= 0
  out = np.zeros((num_rows,) + local.shape[1:], local.dtype)
  seen = np.zeros(num_rows, bool)
  out[all_rows[keep]] = all_vals[keep]
  seen[all_rows[keep]] = True
  if not seen.all():
    raise ValueError(f"gather_rows: no process sent rows {np.flatnonzero(~seen)[:8].tolist()}")
  return out


def gather_texts(texts: list[str], rows: np.ndarray, num_rows: int) -> list[str]:
  """The full list of num_rows strings from every process's `texts` at `rows` (as UTF-8 bytes)."""
  if jax.process_count() == 1:
    out = [""] * num_rows
    for r, t in zip(rows, texts):
      out[r] = t
    return out
  data = [t.encode("utf-8") for t in texts]
  width = int(np.max(multihost_utils.process_allgather(np.int32(max([len(d) for d in data], default=0)))))
  buf = np.zeros((len(data), max(width, 1)), np.uint8)
  for i, d in enumerate(data):
    buf[i, :len(d)] = np.frombuffer(d, np.uint8)
  lens = gather_rows(np.array([len(d) for d in data], np.int32), rows, num_rows)
  full = gather_rows(buf, rows, num_rows)
  return [bytes(full[i, :lens[i]]).decode("utf-8") for i in range(num_rows)]


def from_host(x: np.ndarray, sharding: jax.sharding.Sharding | None):
  """A global array from a host value every process holds (each places only its shards); with one
  process the value itself, so single-process code keeps passing numpy to jit."""
  if jax.process_count() == 1:
    return x
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def to_host(x: jax.Array) -> np.ndarray:
  """The whole of a global array on every process (an all-gather when it spans processes)."""
  if x.is_fully_addressable:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def process_sum(x) -> np.ndarray:
  """Elementwise sum of a small host value over all processes."""
  x = np.asarray(x, np.float32)
  if jax.process_count() == 1:
    return x
  return np.asarray(multihost_utils.process_allgather(x)).reshape((jax.process_count(),) + x.shape).sum(0)


def broadcast_json(obj: Any) -> Any:
  """Process 0's JSON-serialisable `obj`, on every process (others may pass anything)."""
  if jax.process_count() == 1:
    return obj
  data = np.frombuffer(json.dumps(obj).encode("utf-8"), np.uint8) if jax.process_index() == 0 else np.zeros(0, np.uint8)
  n = int(multihost_utils.broadcast_one_to_all(np.int32(len(data))))
  buf = np.zeros(max(n, 1), np.uint8)
  buf[:len(data)] = data
  buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
  return json.loads(bytes(buf[:n]).decode("utf-8"))


def barrier(name: str) -> None:
  """All processes wait here (a no-op with one)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)
