"""The run cache's key (astarpo_jax/comparison/cache_key.py): a result is reused only by the code, config,
reference and jax that would make it now, so runs of two codes never mix."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tree(root, files: dict[str, str]) -> str:
  for rel, text in files.items():
    path = os.path.join(root, "astarpo_jax", rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
      f.write(text)
  return str(root)


def test_code_hash_changes_with_a_statement_and_not_with_a_comment_docstring_or_the_comparison(tmp_path):
  from astarpo_jax.comparison import cache_key
  base = {"training/loss.py": '"""Doc."""\ndef f(x):\n  """Why."""\n  return x * 2\n',
          "comparison/table.py": "X = 1\n", "aot/cost.py": "Y = 1\n"}
  h0 = cache_key.code_hash(_tree(tmp_path / "a", base))
  same = dict(base, **{"training/loss.py": '"""Other doc."""\ndef f(x):  # a comment\n  return x * 2\n',
                       "comparison/table.py": "X = 2\n", "aot/cost.py": "Y = 3\n"})
  assert cache_key.code_hash(_tree(tmp_path / "b", same)) == h0
  changed = dict(base, **{"training/loss.py": '"""Doc."""\ndef f(x):\n  return x * 3\n'})
  assert cache_key.code_hash(_tree(tmp_path / "c", changed)) != h0
  moved = dict(base, **{"sampling/loss.py": base["training/loss.py"]})
  del moved["training/loss.py"]
  assert cache_key.code_hash(_tree(tmp_path / "d", moved)) != h0  # the module's path is part of it


def test_config_hash_ignores_bookkeeping_fields_and_sees_every_other():
  from astarpo_jax.comparison import cache_key
  c = {"optim": {"lr": 1e-5}, "train": {"checkpoint_every": 100, "num_steps": 100}, "reward": {"num_workers": 2},
       "export_hf": True, "wandb": {"mode": "disabled"}}
  h = cache_key.config_hash(c)
  assert cache_key.config_hash({**c, "export_hf": False, "wandb": {"mode": "online"},
                                "train": {"checkpoint_every": 7, "num_steps": 100}, "reward": {"num_workers": 8}}) == h
  assert cache_key.config_hash({**c, "optim": {"lr": 3e-5}}) != h
  assert cache_key.config_hash({**c, "train": {"checkpoint_every": 100, "num_steps": 300}}) != h


def test_matches_needs_every_part_and_reads_a_stamped_result_only_under_its_named_code():
  from astarpo_jax.comparison import cache_key
  now = {"code": "c2", "config": "f", "reference": "r", "jax": "j"}
  assert cache_key.matches(dict(now), now)
  for part in now:
    assert not cache_key.matches(dict(now, **{part: "other"}), now), part
  assert not cache_key.matches(None, now)  # a result written before the key
  legacy = {"code": "c1", "config": None, "reference": None, "jax": None}
  assert not cache_key.matches(legacy, now)
  assert cache_key.matches(legacy, now, code_id="c1")
  assert not cache_key.matches(now, now, code_id="c1")  # naming c1 reads c1's results only


def test_a_run_of_another_code_is_not_reused_and_is_not_overwritten(tmp_path, monkeypatch):
  """A result under the same spec but another code hash: the run gets its own directory (the old result
  stays); with --code_id of the old code the old result is read and nothing runs; a missing run under a
  foreign code is an error naming the fix."""
  sys.path.insert(0, ROOT)
  from astarpo_jax.comparison import cache_key, runs as runs_lib
  spec = runs_lib.RunSpec("chains", "test", "grpo", 2, 1.0, ())
  ref = tmp_path / "reference_chains_test" / "reference"
  ref.mkdir(parents=True)
  (ref / "config.json").write_text("{}")
  (ref / "model.safetensors").write_bytes(b"weights")
  old = tmp_path / "runs" / spec.name
  old.mkdir(parents=True)
  result = {"spec": json.loads(json.dumps(runs_lib.dataclasses.asdict(spec))), "lr": spec.config().optim.lr}
  (old / "result.json").write_text(json.dumps(result))
  assert cache_key.stamp(str(tmp_path), ROOT, log=lambda s: None) == 1
  stamped = json.loads((old / "result.json").read_text())["key"]
  monkeypatch.setattr(runs_lib, "_code_hash", lambda: "a-newer-code")
  key = runs_lib.key_now(spec, str(tmp_path))
  assert key["code"] == "a-newer-code" and key["reference"] == cache_key.file_hash(str(ref / "model.safetensors"))
  assert runs_lib.run_dir_of(spec, str(tmp_path)) == str(tmp_path / "runs" / f"{spec.name}_{cache_key.short(key)}")
  assert runs_lib.run_dir_of(spec, str(tmp_path), code_id=stamped["code"]) == str(old)

  def no_run(*a, **k):
    raise AssertionError("a run was started")
  monkeypatch.setattr(runs_lib.subprocess, "call", no_run)
  run_dir, got = runs_lib.ensure_run(spec, str(tmp_path), False, lambda s: None, code_id=stamped["code"])
  assert run_dir == str(old) and got["key"]["code"] == stamped["code"]
  other = runs_lib.RunSpec("chains", "test", "grpo", 3, 1.0, ())
  with pytest.raises(RuntimeError, match="drop --code_id"):
    runs_lib.ensure_run(other, str(tmp_path), False, lambda s: None, code_id=stamped["code"])
