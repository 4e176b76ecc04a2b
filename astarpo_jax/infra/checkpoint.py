"""Training checkpoints: the train state pytree plus a small JSON dict of host state, via Orbax.

Each step folder holds two items: `state` (params, optimizer state, step, PRNG key: any pytree of
arrays and scalars, typed PRNG keys included) and `host` (data iterator position, metrics: JSON).
Orbax writes a step into `<step>.orbax-checkpoint-tmp*` and renames it when complete, so a save cut
short by a crash or preemption is never listed and a rerun resumes from the last complete step.
Saves are asynchronous: `save` returns once the arrays are copied off the device, so the caller may
donate or delete them at once; the files are written in the background.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers

from astarpo_jax.infra import multihost

STATE, HOST = "state", "host"  # item names inside each step folder
_MAX_LISTED = 6  # paths listed per kind of mismatch


class CheckpointMismatch(ValueError):
  """The saved tree is not the run's (other leaves or shapes): a config change, not a damaged file."""


def _is_float_leaf(x) -> bool:
  if isinstance(x, (float, complex)):
    return True
  dtype = getattr(x, "dtype", None)
  return dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and \
      jnp.issubdtype(dtype, jnp.inexact)


@jax.jit
def _leaves_finite(leaves: list[jax.Array]) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def all_finite(tree) -> bool:
  """True when every float leaf of `tree` is finite (one jitted reduction; ints, keys skipped)."""
  leaves = [x for x in jax.tree.leaves(tree) if _is_float_leaf(x)]
  return bool(_leaves_finite(leaves)) if leaves else True


def abstract_state(shapes, shardings):
  """`shapes` (e.g. `jax.eval_shape(init)`) as ShapeDtypeStructs that carry `shardings`.

  `shardings` is a tree like `shapes`, or one sharding for every leaf. Leaves without a shape
  (a Python int step) are kept as they are: Orbax restores them as saved.
  """
  def attach(shape, sharding):
    if not hasattr(shape, "shape"):
      return shape
    return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding)
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda s: attach(s, shardings), shapes)
  return jax.tree.map(attach, shapes, shardings)


def _plain_json(host_state: Mapping[str, Any]) -> dict[str, Any]:
  """`host_state` as plain JSON types; numpy / jax scalars become Python numbers."""
  if not isinstance(host_state, Mapping):
    raise TypeError(f"host_state must be a dict, got {type(host_state).__name__}")

  def scalar(x):
    if isinstance(x, (np.generic, np.ndarray, jax.Array)) and np.ndim(x) == 0:
      return np.asarray(x).item()
    raise TypeError(f"host_state holds {x!r} of type {type(x).__name__}, which is not JSON; "
                    "store plain ints, floats, strings, lists and dicts")
  return json.loads(json.dumps(dict(host_state), default=scalar))


def _listing(items: list[str]) -> str:
  more = f" (+{len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
  return ", ".join(items[:_MAX_LISTED]) + more


def _stored_shape(x) -> tuple[int, ...] | None:
  """Shape Orbax stores for an abstract leaf: a typed PRNG key is stored as its uint32 key data."""
  if not hasattr(x, "shape"):
    return None
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return tuple(jax.eval_shape(jax.random.key_data, x).shape)
  return tuple(x.shape)


class Checkpointer:
  """Keeps the last `keep` checkpoints of a run in `directory`; saves every `save_every` steps.

  read_only: for a process that only restores (an evaluator next to a running trainer): it never
  writes and leaves unfinished saves alone. A writer deletes leftover `*.orbax-checkpoint-tmp*`
  folders of earlier interrupted runs when it opens the directory.
  """

  def __init__(self, directory: str | os.PathLike, *, keep: int = 3, save_every: int = 1,
               async_save: bool = True, read_only: bool = False):
    if int(keep) < 1:
      raise ValueError(f"keep={keep}: must keep at least 1 checkpoint")
    if int(save_every) < 1:
      raise ValueError(f"save_every={save_every}: must be a positive number of steps")
    directory = os.fspath(directory)
    if "://" not in directory:  # Orbax wants absolute local paths; leave gs:// etc. alone
      directory = os.path.abspath(directory)
    self.directory = epath.Path(directory)
    options = ocp.CheckpointManagerOptions(
        create=False,  # made by the first save, so restoring from a wrong path creates nothing
        read_only=read_only,
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=not read_only,
        save_decision_policy=checkpoint_managers.FixedIntervalPolicy(int(save_every)),
        preservation_policy=checkpoint_managers.LatestN(int(keep)),
    )
    self._read_only = read_only
    # Registering each item's handler lets a fresh process read step metadata before any save.
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item, save_args, restore_args in ((STATE, ocp.args.StandardSave, ocp.args.StandardRestore),
                                          (HOST, ocp.args.JsonSave, ocp.args.JsonRestore)):
      registry.add(item, save_args)
      registry.add(item, restore_args)
    self._mngr = ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)

  def all_steps(self) -> list[int]:
    """Steps held in the directory, ascending (a writer's own save in flight is included)."""
    if self._read_only:
      self._mngr.reload()  # a reader polls a directory that another process writes
    return sorted(self._mngr.all_steps())

  def latest_step(self) -> int | None:
    """The newest step, or None when the directory holds no complete checkpoint."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def save(self, step: int, state, host_state: Mapping[str, Any] | None = None, *,
           force: bool = False) -> bool:
    """Saves if `step` is a multiple of `save_every` (any step with `force`); True if it did.

    Refuses a state with a non-finite float (FloatingPointError), so the last good checkpoint
    stays the latest, and a step below the latest saved one (a run restarted from an older step
    would otherwise mix two histories in one directory). A step equal to the latest is a no-op.
    """
    if self._read_only:
      raise ValueError(f"Checkpointer for {self.directory} is read_only; it cannot save")
    step = int(step)
    latest = self.latest_step()
    if latest is not None and step <= latest:
      if step == latest:
        return False  # e.g. the final save of a run that resumed at its last step
      raise ValueError(f"{self.directory} already holds step {latest} > step {step}; resume from "
                       "the latest step or save this run into a new directory")
    if not force and not self._mngr.should_save(step):
      return False
    if not all_finite(state):
      raise FloatingPointError(f"step {step}: the state holds a NaN or Inf; not saved, so the "
                               f"latest checkpoint in {self.directory} stays step {latest}")
    host = _plain_json(host_state or {})
    self._mngr.save(step, force=True, args=ocp.args.Composite(
        **{STATE: ocp.args.StandardSave(state), HOST: ocp.args.JsonSave(host)}))
    return True

  def restore(self, abstract_state, step: int | None = None) -> tuple[Any, dict[str, Any]]:
    """(state, host_state) of `step` (default: the latest complete one).

    `abstract_state` is the state's tree of `jax.ShapeDtypeStruct`s with shardings (see
    `abstract_state`): arrays are read straight into that sharding and cast to that dtype.
    """
    self.wait()
    steps = self.all_steps()
    if not steps:
      what = "is empty" if self.directory.exists() else "does not exist"
      raise FileNotFoundError(f"no complete checkpoint to restore: {self.directory} {what}")
    step = steps[-1] if step is None else int(step)
    if step not in steps:
      raise FileNotFoundError(f"no checkpoint of step {step} in {self.directory}; "
                              f"it holds steps {steps}")
    self._check_matches(abstract_state, step)
    try:
      restored = self._mngr.restore(step, args=ocp.args.Composite(
          **{STATE: ocp.args.StandardRestore(abstract_state), HOST: ocp.args.JsonRestore()}))
    except ValueError as e:
      raise ValueError(f"cannot restore step {step} of {self.directory}: {e}") from e
    return restored[STATE], dict(restored[HOST] or {})

  def _check_matches(self, abstract_state, step: int) -> None:
    """Raises a ValueError naming the leaves where `abstract_state` and the saved tree disagree."""
    saved = ocp.tree.to_flat_dict(self._mngr.item_metadata(step)[STATE].tree)
    wanted = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(abstract_state))
    name = "/".join
    missing = [name(k) for k in wanted if k not in saved]
    extra = [name(k) for k in saved if k not in wanted]
    shapes = []
    for k in wanted.keys() & saved.keys():
      shape, saved_shape = _stored_shape(wanted[k]), getattr(saved[k], "shape", None)
      if shape is not None and saved_shape is not None and tuple(saved_shape) != shape:
        shapes.append(f"{name(k)} saved {tuple(saved_shape)} vs wanted {shape}")
    problems = [f"{label}: {_listing(items)}" for label, items in (
        ("not in the checkpoint", missing), ("only in the checkpoint", extra),
        ("shape differs", sorted(shapes))) if items]
    if problems:
      raise CheckpointMismatch(f"checkpoint step {step} in {self.directory} does not match "
                       "abstract_state; " + "; ".join(problems))

  def set_aside(self, step: int) -> str:
    """Renames the folder of `step` (a complete save whose files were damaged since, e.g. truncated) to
    `<step>.damaged`, so it is no longer listed and the step can be saved again; returns the new path. Process 0
    renames; every process must call it (they wait for the rename)."""
    self.wait()
    src, dst = self.directory / str(int(step)), self.directory / f"{int(step)}.damaged"
    if jax.process_index() == 0:
      if dst.exists():
        dst.rmtree()  # an older damaged copy of the same step
      src.rename(dst)
    multihost.barrier(f"checkpoint_set_aside_{int(step)}")
    self._mngr.reload()
    return str(dst)

  def wait(self) -> None:
    """Blocks until the saves in flight (and the start-up cleanup of unfinished ones) are done."""
    self._mngr.wait_until_finished()
    # Orbax awaits its tmp-folder cleanup only at the next save; a run that only restores must not
    # exit while the cleanup thread still runs. Private hook, hence the guard.
    getattr(self._mngr, "_maybe_await_cleanup_tmp_directory", lambda: None)()

  def close(self) -> None:
    """Waits for pending work and releases Orbax's threads."""
    self.wait()
    self._mngr.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def to_saveable(state: dict) -> dict:
  """Each optimizer state as a flat dict of its leaves (Orbax trees cannot hold optax's empty tuples).

  Every `*opt_state` key of a train state (the policy's, a critic's) becomes `*opt_leaves`.
  """
  out = {}
  for k, v in state.items():
    if k.endswith("opt_state"):
      out[k.replace("opt_state", "opt_leaves")] = {f"{i:04d}": x for i, x in enumerate(jax.tree.leaves(v))}
    else:
      out[k] = v
  return out


def from_saveable(saved: dict, like: dict) -> dict:
  """Inverse of `to_saveable`, with the optimizer tree structures taken from `like`."""
  out = {}
  for k, v in like.items():
    if k.endswith("opt_state"):
      leaves_dict = saved[k.replace("opt_state", "opt_leaves")]
      out[k] = jax.tree.unflatten(jax.tree.structure(v), [leaves_dict[i] for i in sorted(leaves_dict)])
    else:
      out[k] = saved[k]
  return out


def restore_latest_good(ckpt: Checkpointer, like: dict, log=print) -> tuple[dict, dict] | None:
  """`restore_train_state` of the newest checkpoint that restores, or None when none is left. One whose tree
  matches but whose files do not read (truncated, corrupted) is set aside and the one before it tried, said in
  the log; a tree that does not match (CheckpointMismatch: another config) is raised. Every process gets the
  same answer: a step that fails to restore on any of them is set aside on all."""
  while (step := ckpt.latest_step()) is not None:
    failed = None
    try:
      restored = restore_train_state(ckpt, like, step)
    except CheckpointMismatch:
      raise
    except Exception as e:  # noqa: BLE001 -- any read failure of a matching tree is damage to that step's files
      failed = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    if not multihost.process_sum(np.float32(failed is not None)) > 0:
      return restored
    where = ckpt.set_aside(step)
    log(f"checkpoint step {step} does not restore ({failed or 'on another process'}): set aside as {where}; "
        "trying the one before")
  return None


def restore_train_state(ckpt: Checkpointer, like: dict, step: int | None = None) -> tuple[dict, dict]:
  """(train state, host state) of checkpoint `step` (default the latest), restored into the tree
  structure, dtypes and shardings of the freshly initialised state `like`."""
  saved = to_saveable(like)
  restored, host = ckpt.restore(abstract_state(jax.eval_shape(lambda: saved), jax.tree.map(lambda x: x.sharding, saved)),
                                step=step)
  return from_saveable(restored, like), host
