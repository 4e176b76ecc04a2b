"""Device mesh and the rule table from logical axis names to mesh axes.

Params and activations are annotated with logical names (embed, heads, mlp, batch, ...); this table
alone decides how they are split, so the same model code runs replicated on one CPU and FSDP +
tensor parallel on a pod. A dimension whose size the mesh axes do not divide is replicated.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical name -> mesh axes (a tuple: split over their product), or None (replicated)
DEFAULT_RULES: dict[str, tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "embed": ("fsdp",),  # params: FSDP over the model dim
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "head_dim": None,
    "layers": None,
    "norm": None,
    "length": None,
    "act_embed": None,  # activations keep the model dim whole
    "cache_length": None,
}


def resolve_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, int, int]:
  """A (data, fsdp, tensor) shape with its one -1 entry filled from `num_devices` (no devices needed:
  the memory plan and the AOT compile resolve shapes for targets this host does not have)."""
  shape = list(shape)
  if len(shape) != 3:
    raise ValueError(f"mesh shape {shape} must have 3 entries for axes {MESH_AXES}")
  if shape.count(-1) > 1:
    raise ValueError(f"mesh shape {shape}: at most one entry may be -1")
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if num_devices % known:
      raise ValueError(f"mesh shape {shape} does not divide {num_devices} devices")
    shape[shape.index(-1)] = num_devices // known
  if math.prod(shape) != num_devices:
    raise ValueError(f"mesh shape {tuple(shape)} needs {math.prod(shape)} devices, found {num_devices}: set "
                     "mesh.shape to match (e.g. (1, -1, 1))")
  return tuple(shape)


def make_mesh(shape: Sequence[int] = (1, 1, -1), devices=None) -> Mesh:
  """A (data, fsdp, tensor) mesh; one -1 entry takes the devices left over."""
  devices = list(devices if devices is not None else jax.devices())
  return Mesh(np.asarray(devices).reshape(resolve_mesh_shape(shape, len(devices))), MESH_AXES)


def default_sample_shape(train_shape: Sequence[int], backend: str, num_heads: int = 0,
                         num_kv_heads: int = 0) -> tuple[int, int, int]:
  """The sampling mesh when mesh.sample_shape is (): the training mesh, except on TPUs and GPUs, where the
  decode's weights are never split over FSDP (a step would all-gather them): tensor-parallel over the largest t
  that divides the chips and splits the query and KV heads, data-parallel over the rest, (n / t, 1, t). Chosen
  by compiling every (n / t, 1, t) (layouts.choose_sample_layout; docs/tpu.md, "The paged decode"): Qwen2.5-1.5B
  on v5e-8 (4, 1, 2) 2.69 ms a step against 4.84 replicated (8, 1, 1) and 5.96 at the former (1, 4, 2);
  Qwen2.5-7B on v5p-8 (1, 1, 4) 2.78 ms against 3.91 (2, 1, 2) and 6.42 (4, 1, 1); on 8 x H200 (compile-only
  CUDA) 1.5B (4, 1, 2) 2.65 ms against 4.46 (8, 1, 1), 7B (2, 1, 4) 4.74 ms against 7.90 (4, 1, 2). The CPU
  keeps the training mesh."""
  d, f, t = (int(x) for x in train_shape)
  if backend not in ("tpu", "gpu"):
    return (d, f, t)
  n = d * f * t
  tensor = max((k for k in range(1, n + 1) if n % k == 0 and (not num_heads or num_heads % k == 0)
                and (not num_kv_heads or num_kv_heads % k == 0)), default=1)
  return (n // tensor, 1, tensor)


def resolve_sample_shape(sample_shape: Sequence[int] | None, train_shape: Sequence[int], backend: str,
                         num_heads: int = 0, num_kv_heads: int = 0) -> tuple[int, ...]:
  """Config mesh.sample_shape as given, or () -> `default_sample_shape` for `backend`: the one rule the
  run (`sample_mesh`), the TPU compile (aot.sampling_mesh) and the memory plan all use."""
  if sample_shape:
    return tuple(sample_shape)
  return default_sample_shape(train_shape, backend, num_heads, num_kv_heads)


def sample_mesh(shape: Sequence[int] | None, mesh: Mesh, field: str = "mesh.sample_shape",
                backend: str | None = None, num_heads: int = 0, num_kv_heads: int = 0) -> Mesh | None:
  """The mesh the sampling calls run on: `mesh`'s devices, in its order, reshaped to `shape` (one -1
  entry takes the devices left over; () = `default_sample_shape` for the backend). None when that is
  `mesh`'s own shape, so sampling stays on the training mesh. The same device order keeps both meshes
  one device assignment, so params move between them with one resharding copy."""
  shape = resolve_sample_shape(shape, mesh.devices.shape, backend or jax.default_backend(), num_heads, num_kv_heads)
  try:
    if any(not isinstance(s, (int, np.integer)) or (s < 1 and s != -1) for s in shape):
      raise ValueError("entries must be ints >= 1 (or one -1)")
    out = make_mesh(tuple(shape), mesh.devices.flatten())
  except ValueError as e:
    raise ValueError(f"{field}={tuple(shape)}: {e}; give 3 entries (data, fsdp, tensor) whose product is the "
                     f"{mesh.devices.size} devices of the training mesh {tuple(mesh.devices.shape)}, or () to sample "
                     "on the training mesh") from None
  return None if out.devices.shape == mesh.devices.shape else out


def batch_ways(mesh) -> int:
  """Into how many row shards the `batch` rule splits a batch on `mesh` (a Mesh or an AbstractMesh);
  1 without one."""
  if mesh is None or mesh.empty:
    return 1
  return int(np.prod([mesh.shape[a] for a in DEFAULT_RULES["batch"] or () if a in mesh.shape]))


def without_axes(sh: NamedSharding, axes: Sequence[str]) -> NamedSharding:
  """`sh` with the mesh `axes` dropped from its spec: whole over them, split as before over the others. A sharding
  with no mesh axes (an array placed on one device) is whole already and comes back as it is."""
  if not isinstance(sh, NamedSharding):
    return sh
  def keep(entry):
    kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a not in axes)
    return None if not kept else kept[0] if len(kept) == 1 else kept
  return NamedSharding(sh.mesh, PartitionSpec(*(keep(e) for e in sh.spec)))


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int] | None = None,
                    mesh_shape: dict[str, int] | None = None,
                    rules: dict[str, tuple[str, ...] | None] = DEFAULT_RULES) -> PartitionSpec:
  """PartitionSpec for logical axis `names`; a mesh axis is used at most once, and only on a divisible dim."""
  used: set[str] = set()
  out = []
  for i, name in enumerate(names):
    if name is not None and name not in rules:
      raise ValueError(f"logical axis {name!r} has no sharding rule; known: {sorted(rules)}")
    axes = tuple(a for a in (rules.get(name) or ()) if a not in used)
    if mesh_shape is not None:
      axes = tuple(a for a in axes if mesh_shape.get(a, 1) > 1)
      if shape is not None and axes and shape[i] % math.prod(mesh_shape[a] for a in axes):
        axes = ()
    used.update(axes)
    out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*out)


def tree_shardings(mesh: Mesh, axes_tree, shapes_tree, rules=DEFAULT_RULES):
  """NamedShardings for a tree of logical axis tuples and a matching tree of shapes."""
  mesh_shape = dict(mesh.shape)
  is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)  # noqa: E731
  return jax.tree.map(
      lambda names, s: NamedSharding(mesh, logical_to_spec(names, s.shape, mesh_shape, rules)),
      axes_tree, shapes_tree, is_leaf=is_axes)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """Sharding constraint on an activation by logical names; a no-op outside a `jax.set_mesh` context. Inside a
  shard_map the axes it made manual are already per device (x is one device's block): only the others split."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  manual = set(getattr(mesh, "manual_axes", ()))
  shape = {a: 1 if a in manual else n for a, n in mesh.shape.items()}
  return jax.lax.with_sharding_constraint(x, logical_to_spec(names, x.shape, shape))
