"""The run cache's key: everything that changes a run's arithmetic, so results of two codes never mix.

A finished run is reused only where its result.json carries the same key as the run would have now:
  code       a hash of the training code's syntax trees (astarpo_jax minus comparison/ and aot/, docstrings
             dropped): any change to a statement changes it, a comment or docstring does not
  config     a hash of the run's resolved config without the fields that cannot change its numbers (NOT_ARITHMETIC)
  reference  a hash of the warm-started reference's weights every run starts from
  jax        the jax and jaxlib versions (XLA's kernels)
Results written before the key (run 9) are stamped with their commit's code hash (`stamp`); under another
code they are read only by naming that code (`--code_id`), never mixed with this code's runs.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os

# The training code: every module a run executes for its numbers. comparison/ reads results, aot/ only measures.
CODE_EXCLUDE = ("comparison", "aot")
# Config fields that change no number of a run: I/O, logging, worker counts and the run's own bookkeeping.
NOT_ARITHMETIC = ("export_hf", "preemption_grace_s", "wandb", "reward.num_workers", "train.checkpoint_every",
                  "stage1.keep_responses", "stage1.eval_columns_file", "stage1.eval_columns_key")


def _strip_docstrings(tree: ast.AST) -> ast.AST:
  for node in ast.walk(tree):
    body = getattr(node, "body", None)
    if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
      node.body = body[1:] or [ast.Pass()]
  return tree


def code_hash(root: str) -> str:
  """sha1 over the training code's modules under `root`/astarpo_jax: path and syntax tree without docstrings."""
  pkg = os.path.join(root, "astarpo_jax")
  if not os.path.isdir(pkg):
    raise FileNotFoundError(f"cache_key.code_hash: no astarpo_jax package under {root!r}")
  h = hashlib.sha1()
  for dirpath, dirnames, filenames in os.walk(pkg):
    rel_dir = os.path.relpath(dirpath, pkg)
    dirnames[:] = sorted(d for d in dirnames if not (rel_dir == "." and d in CODE_EXCLUDE) and d != "__pycache__")
    for name in sorted(f for f in filenames if f.endswith(".py")):
      rel = os.path.normpath(os.path.join(rel_dir, name))
      with open(os.path.join(dirpath, name), encoding="utf-8") as f:
        tree = _strip_docstrings(ast.parse(f.read(), filename=rel))
      h.update(rel.encode() + b"\0" + ast.dump(tree).encode() + b"\0")
  return h.hexdigest()[:12]


def arithmetic_config(config: dict) -> dict:
  """The resolved config (as a plain dict) without NOT_ARITHMETIC's fields."""
  out = json.loads(json.dumps(config, default=str))
  for field in NOT_ARITHMETIC:
    *path, key = field.split(".")
    node = out
    for part in path:
      node = node.get(part, {})
    node.pop(key, None)
  return out


def config_hash(config: dict) -> str:
  return hashlib.sha1(json.dumps(arithmetic_config(config), sort_keys=True).encode()).hexdigest()[:12]


def file_hash(path: str) -> str:
  h = hashlib.sha1()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()[:12]


def jax_versions() -> str:
  import jax
  import jaxlib
  return f"jax {jax.__version__}, jaxlib {jaxlib.__version__}"


def run_key(config: dict, code: str, reference_weights: str) -> dict:
  """The key a run's result carries (and must carry to be reused)."""
  return {"code": code, "config": config_hash(config), "reference": file_hash(reference_weights),
          "jax": jax_versions()}


def matches(stored: dict | None, wanted: dict, code_id: str = "") -> bool:
  """Whether a result's stored key lets it stand for a run with key `wanted`: every part equal, or, naming a
  foreign code (`code_id`: reprinting another code's tables), the code alone (the config of that code is not
  this checkout's to resolve)."""
  if not stored:
    return False
  if code_id and code_id != wanted["code"]:
    return stored.get("code") == code_id
  return all(stored.get(k) == v for k, v in wanted.items())


def short(key: dict) -> str:
  """A run directory's suffix for its key."""
  return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:6]


def stamp(workdir: str, tree: str, log=print) -> int:
  """Stamps the results in `workdir`/runs that have no key with the code hash of the checkout `tree` (the
  commit they ran at: `git worktree add` or `git archive` it there); their config, reference and jax parts stay
  unknown (null), so they stand only for reprints that name that code. Returns how many were stamped."""
  code, n = code_hash(tree), 0
  runs = os.path.join(workdir, "runs")
  for name in sorted(os.listdir(runs)):
    path = os.path.join(runs, name, "result.json")
    if not os.path.exists(path):
      continue
    with open(path) as f:
      result = json.load(f)
    if result.get("key"):
      continue
    result["key"] = {"code": code, "config": None, "reference": None, "jax": None, "stamped_from": tree}
    with open(path, "w") as f:
      json.dump(result, f, indent=1, default=str)
    n += 1
  log(f"stamped {n} result(s) in {runs} with code {code}")
  return n


if __name__ == "__main__":  # python -m astarpo_jax.comparison.cache_key WORKDIR TREE: stamp results without a key
  import sys
  stamp(sys.argv[1], sys.argv[2])
