"""Orbax training checkpoints: exact round trips, pruning, resume past unfinished saves, errors."""
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from astarpo_jax.infra import checkpoint
from astarpo_jax.infra.checkpoint import Checkpointer, all_finite
from astarpo_jax.infra.sharding import make_mesh

CPU0 = jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _train_state(seed: int = 0):
  """Params (f32 + bf16), AdamW state after one real update, step, typed keys of two impls."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  params = {"embed": {"w_VD": jax.random.normal(k1, (5, 4))},
            "norm": jax.random.normal(k2, (4,)).astype(jnp.bfloat16)}
  opt = optax.adamw(1e-2)
  opt_state = opt.init(params)
  grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.5, params)
  updates, opt_state = opt.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  return {"params": params, "opt_state": opt_state, "step": jnp.asarray(seed + 1, jnp.int32),
          "key": jax.random.fold_in(jax.random.key(seed), 7),
          "rbg_key": jax.random.key(seed, impl="rbg")}


def _abstract(state, sharding=CPU0):
  return checkpoint.abstract_state(jax.eval_shape(lambda: state), sharding)


def _assert_trees_equal(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype
    if jax.dtypes.issubdtype(w.dtype, jax.dtypes.prng_key):
      assert jax.random.key_impl(g) == jax.random.key_impl(w)
      g, w = jax.random.key_data(g), jax.random.key_data(w)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _step_folders(directory):
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def test_round_trip_restores_params_adamw_state_step_keys_and_host_dict_exactly(tmp_path):
  state = _train_state(3)
  host = {"iterator": {"seed": 0, "epoch": 2, "batch": 5, "num_items": 64, "global_batch_size": 8},
          "metrics": {"reward": 0.25, "loss": -1.5}}
  with Checkpointer(tmp_path / "run") as ckpt:
    assert ckpt.save(4, state, host)
  with Checkpointer(tmp_path / "run") as ckpt:  # a fresh process would open it like this
    restored, restored_host = ckpt.restore(_abstract(state))
  _assert_trees_equal(restored, state)
  assert isinstance(restored["opt_state"][0], optax.ScaleByAdamState)
  assert int(restored["opt_state"][0].count) == 1
  assert restored_host == host
  # The restored key draws the same numbers as the original.
  np.testing.assert_array_equal(jax.random.uniform(restored["key"], (3,)),
                                jax.random.uniform(state["key"], (3,)))


def test_save_every_writes_multiples_only_and_force_writes_any_step(tmp_path):
  state = _train_state()
  with Checkpointer(tmp_path, keep=10, save_every=3) as ckpt:
    issued = [s for s in range(1, 8) if ckpt.save(s, state)]
    assert ckpt.save(8, state, force=True)
    ckpt.wait()
    assert issued == [3, 6]
    assert ckpt.all_steps() == _step_folders(tmp_path) == [3, 6, 8]


def test_only_the_last_keep_checkpoints_stay_on_disk(tmp_path):
  state = _train_state()
  with Checkpointer(tmp_path, keep=2) as ckpt:
    for step in range(1, 6):
      ckpt.save(step, state, {"step": step})
    ckpt.wait()
    assert ckpt.all_steps() == [4, 5]
  assert _step_folders(tmp_path) == [4, 5]


def test_latest_step_follows_saves_and_survives_reopening(tmp_path):
  state = _train_state()
  with Checkpointer(tmp_path, keep=3) as ckpt:
    assert ckpt.latest_step() is None
    for step in (10, 20, 30, 40):
      ckpt.save(step, state)
      assert ckpt.latest_step() == step
  with Checkpointer(tmp_path, keep=3) as ckpt:
    assert ckpt.latest_step() == 40
    assert ckpt.all_steps() == [20, 30, 40]
    _, host = ckpt.restore(_abstract(state), step=20)
    assert host == {}


@pytest.mark.parametrize("tmp_name",
                         ["3.orbax-checkpoint-tmp", "3.orbax-checkpoint-tmp-1700000000"])
def test_resume_skips_an_unfinished_save_and_the_writer_removes_it(tmp_path, tmp_name):
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, _train_state(1), {"step": 1})
    ckpt.save(2, _train_state(2), {"step": 2})
  # A save of step 3 cut short: Orbax writes into "<step>.orbax-checkpoint-tmp*" and renames on
  # completion. Its contents are even complete here; only the missing rename marks it unfinished.
  leftover = tmp_path / tmp_name
  shutil.copytree(tmp_path / "2", leftover)

  with Checkpointer(tmp_path, read_only=True) as reader:
    assert reader.latest_step() == 2
    state, host = reader.restore(_abstract(_train_state()))
  assert leftover.exists()  # a reader leaves other processes' saves alone
  _assert_trees_equal(state, _train_state(2))
  assert host == {"step": 2}

  with Checkpointer(tmp_path) as writer:
    assert writer.latest_step() == 2
    writer.wait()
    assert not leftover.exists()
    assert writer.save(3, _train_state(3))  # the step of the lost save can be written again
    writer.wait()
    _assert_trees_equal(writer.restore(_abstract(_train_state()))[0], _train_state(3))


def test_a_latest_checkpoint_truncated_after_its_save_is_set_aside_and_the_one_before_restored(tmp_path):
  with Checkpointer(tmp_path) as ckpt:
    for step in (1, 2):
      ckpt.save(step, checkpoint.to_saveable(_train_state(step)), {"step": step})
  data = [p for p in (tmp_path / "2").rglob("*") if p.is_file() and p.parent.name == "d"]  # the arrays' bytes
  assert data
  for p in data:  # as a disk that filled up, or a copy cut short, would leave them
    with open(p, "r+b") as f:
      f.truncate(p.stat().st_size // 2)
  logs = []
  with Checkpointer(tmp_path) as ckpt:
    state, host = checkpoint.restore_latest_good(ckpt, _train_state(0), logs.append)
    _assert_trees_equal(state, _train_state(1))
    assert host == {"step": 1}
    assert _step_folders(tmp_path) == [1] and (tmp_path / "2.damaged").is_dir()
    assert len(logs) == 1 and logs[0].startswith("checkpoint step 2 does not restore (") and "2.damaged" in logs[0]
    assert ckpt.save(2, checkpoint.to_saveable(_train_state(2)), {"step": 2})  # the step can be saved again
    ckpt.wait()
    assert checkpoint.restore_latest_good(ckpt, _train_state(0))[1] == {"step": 2}
  with Checkpointer(tmp_path / "none") as ckpt:
    assert checkpoint.restore_latest_good(ckpt, _train_state(0)) is None


def test_a_checkpoint_of_another_tree_is_refused_not_set_aside(tmp_path):
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, checkpoint.to_saveable(_train_state(1)))
  other = dict(_train_state(0), extra=jnp.zeros(3))
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(checkpoint.CheckpointMismatch, match="not in the checkpoint: extra"):
      checkpoint.restore_latest_good(ckpt, other)
  assert _step_folders(tmp_path) == [1]


def test_read_only_checkpointer_sees_steps_written_after_it_opened(tmp_path):
  with Checkpointer(tmp_path) as writer, Checkpointer(tmp_path, read_only=True) as reader:
    writer.save(1, _train_state(1))
    writer.wait()
    assert reader.latest_step() == 1
    writer.save(2, _train_state(2))
    writer.wait()
    assert reader.latest_step() == 2
    _assert_trees_equal(reader.restore(_abstract(_train_state()))[0], _train_state(2))


def test_arrays_may_be_deleted_as_soon_as_async_save_returns(tmp_path):
  state = _train_state(5)
  want = jax.tree.map(lambda x: x.copy(), state)
  with Checkpointer(tmp_path, async_save=True) as ckpt:
    assert ckpt.save(1, state)
    for leaf in jax.tree.leaves(state):  # what a jitted step with donate_argnums does
      leaf.delete()
    restored, _ = ckpt.restore(_abstract(want))
  _assert_trees_equal(restored, want)


def test_synchronous_save_is_complete_when_it_returns(tmp_path):
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, _train_state())
    assert _step_folders(tmp_path) == [1]
    assert not [n for n in os.listdir(tmp_path) if "tmp" in n]


def test_restore_places_arrays_in_the_target_named_sharding(tmp_path):
  mesh = make_mesh((1, 1, 1), devices=jax.devices()[:1])
  split = NamedSharding(mesh, P("fsdp", "tensor"))
  replicated = NamedSharding(mesh, P())
  state = {"w_DF": jnp.arange(12.0).reshape(3, 4), "b_F": jnp.ones(4), "key": jax.random.key(1)}
  shardings = {"w_DF": split, "b_F": replicated, "key": replicated}
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, state)
    restored, _ = ckpt.restore(checkpoint.abstract_state(jax.eval_shape(lambda: state), shardings))
  for name, sharding in shardings.items():
    assert restored[name].sharding == sharding, name
  _assert_trees_equal(restored, state)


def test_restore_casts_to_the_dtype_of_abstract_state(tmp_path):
  state = {"bf16": jnp.asarray([1.5, -2.25, 3e-3], jnp.bfloat16),
           "f32": jnp.asarray([1.0 + 2**-12, 3.14159265, -7e-5], jnp.float32)}
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, state)
    wanted = {"bf16": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=CPU0),
              "f32": jax.ShapeDtypeStruct((3,), jnp.bfloat16, sharding=CPU0)}
    restored, _ = ckpt.restore(wanted)
  assert restored["bf16"].dtype == jnp.float32 and restored["f32"].dtype == jnp.bfloat16
  # bf16 -> f32 widens exactly; f32 -> bf16 must round as astype does.
  np.testing.assert_array_equal(restored["bf16"], state["bf16"].astype(jnp.float32))
  np.testing.assert_array_equal(restored["f32"], state["f32"].astype(jnp.bfloat16))


@pytest.mark.parametrize("make_dir", [False, True])
def test_restore_from_missing_or_empty_directory_names_it_and_creates_nothing(tmp_path, make_dir):
  directory = tmp_path / "no_run_here"
  if make_dir:
    directory.mkdir()
  with Checkpointer(directory) as ckpt:
    with pytest.raises(FileNotFoundError, match="no_run_here.*(is empty|does not exist)"):
      ckpt.restore(_abstract(_train_state()))
  assert directory.exists() == make_dir


def test_restore_of_an_absent_step_lists_the_saved_steps(tmp_path):
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(5, _train_state())
    with pytest.raises(FileNotFoundError, match=r"step 7 .*holds steps \[5\]"):
      ckpt.restore(_abstract(_train_state()), step=7)


def test_mismatched_abstract_tree_error_names_directory_and_leaves(tmp_path):
  state = _train_state()
  with Checkpointer(tmp_path / "run") as ckpt:
    ckpt.save(1, state)
    abstract = _abstract(state)

    extra = dict(abstract, value_head=jax.ShapeDtypeStruct((4,), jnp.float32, sharding=CPU0))
    with pytest.raises(ValueError, match=r"run does not match.*not in the checkpoint: value_head"):
      ckpt.restore(extra)

    fewer = {k: v for k, v in abstract.items() if k != "rbg_key"}
    with pytest.raises(ValueError, match=r"only in the checkpoint: rbg_key"):
      ckpt.restore(fewer)

    bigger = jax.tree.map(lambda x: x, abstract)
    bigger["params"]["embed"]["w_VD"] = jax.ShapeDtypeStruct((6, 4), jnp.float32, sharding=CPU0)
    with pytest.raises(ValueError, match=r"params/embed/w_VD saved \(5, 4\) vs wanted \(6, 4\)"):
      ckpt.restore(bigger)


def test_non_finite_state_is_not_saved_and_the_last_good_checkpoint_stays_latest(tmp_path):
  good = _train_state(1)
  bad = _train_state(2)
  bad["opt_state"][0].nu["norm"] = bad["opt_state"][0].nu["norm"].at[1].set(jnp.nan)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, good)
    with pytest.raises(FloatingPointError, match="step 2.*stays step 1"):
      ckpt.save(2, bad)
    assert ckpt.latest_step() == 1
    _assert_trees_equal(ckpt.restore(_abstract(good))[0], good)


def test_all_finite_looks_at_every_float_leaf_and_skips_ints_and_keys():
  state = _train_state()
  assert all_finite(state)
  assert all_finite({}) and all_finite({"step": 3, "key": jax.random.key(0)})
  assert not all_finite(dict(state, params={"w": jnp.asarray([1.0, jnp.inf], jnp.bfloat16)}))
  assert not all_finite({"nested": [1, {"x": jnp.zeros(3).at[2].set(-jnp.inf)}]})
  assert not all_finite({"lr": float("nan")})


def test_a_step_below_the_latest_is_refused_and_the_latest_again_is_a_no_op(tmp_path):
  state = _train_state()
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(10, state)
    assert not ckpt.save(10, state, force=True)
    with pytest.raises(ValueError, match=r"already holds step 10 > step 9"):
      ckpt.save(9, state, force=True)


def test_host_state_numpy_scalars_become_json_and_objects_are_rejected(tmp_path):
  state = _train_state()
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, state, {"loss": np.float32(0.5), "n": np.int64(3), "acc": jnp.asarray(0.25)})
    _, host = ckpt.restore(_abstract(state))
    assert host == {"loss": 0.5, "n": 3, "acc": 0.25}
    assert type(host["n"]) is int
    with pytest.raises(TypeError, match="host_state holds .*ndarray.*not JSON"):
      ckpt.save(2, state, {"hist": np.zeros(3)})
    assert ckpt.latest_step() == 1


def test_read_only_checkpointer_refuses_to_save(tmp_path):
  with Checkpointer(tmp_path, read_only=True) as ckpt:
    with pytest.raises(ValueError, match="read_only"):
      ckpt.save(1, _train_state())


@pytest.mark.parametrize("kwargs, message", [({"keep": 0}, "keep=0"),
                                             ({"save_every": 0}, "save_every=0")])
def test_bad_options_are_rejected(tmp_path, kwargs, message):
  with pytest.raises(ValueError, match=message):
    Checkpointer(tmp_path, **kwargs)
