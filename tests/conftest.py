"""pytest settings shared by every test file.

XLA's CPU backend at optimisation level 0: most tests compile many small programs and run them once,
so compiling is most of their time; at level 0 a compile-bound file runs 1.3-2x faster here
(tests/test_update_step.py 49 -> 31 s, test_compare 119 -> 93 s, side by side on 2 cores), while a
test that trains for minutes runs slower (test_demo 166 -> 268 s), so those subprocesses drop the flag
(`default_xla_env`). The level changes no result these tests compare: they hold against independent
references within float tolerances. Set before JAX starts (pytest imports this file first); a level
already in XLA_FLAGS is kept.
"""
import dataclasses
import fcntl
import os
import subprocess
import sys

import pytest

LEVEL_FLAG = "--xla_backend_optimization_level"
ADDED = f"{LEVEL_FLAG}=0" if LEVEL_FLAG not in os.environ.get("XLA_FLAGS", "") else ""
if ADDED:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {ADDED}").strip()


def default_xla_env(env: dict) -> dict:
  """`env` without the level-0 flag this file added (a level the caller set stays): for subprocesses that
  compute more than they compile."""
  flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if not (ADDED and f == ADDED))
  return {**env, "XLA_FLAGS": flags}


def pytest_configure(config):
  config.addinivalue_line("markers", "full_data: needs the full offline data files (../shared/data); see tests/data_paths.py")


# The longest files (minutes each on 2 cores) go first, so that under `pytest -n 2 --dist loadfile`
# (the README's command) they run beside the short ones instead of ending the run alone.
LONGEST_FIRST = ("test_demo.py", "test_aot.py", "test_multihost.py", "test_compare.py", "test_sharded.py", "test_chains.py")


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class DemoShared:
  """What the demo tests share: the warm-started pi_ref (`reference`, a folder to copy into a run's workdir; it
  stands in for a downloaded model), Stage 1's V* file of configs/demo.py:tiny, and `env`, the demo runs'
  environment with one JAX persistent compilation cache (a program compiled by one run is loaded by the next)."""
  reference: str
  vstar_file: str
  env: dict


@pytest.fixture(scope="session")
def demo_shared(tmp_path_factory) -> DemoShared:
  """Builds the demo's reference and Stage 1 once per test session (`main.py --config.mode=stage1` on
  configs/demo.py:tiny), shared by test_demo and test_lora_demo, also across pytest-xdist workers (one builds
  under a file lock, the others wait and reuse). A run given this reference checks that it was built from its
  own settings (training/warmstart.check_cached)."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # the session's folder, shared by its workers
  shared = root / "demo_shared"
  env = default_xla_env(dict(os.environ, HF_HUB_OFFLINE="1", JAX_COMPILATION_CACHE_DIR=str(root / "demo_jax_cache"),
                             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1"))
  with open(root / "demo_shared.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (shared / "report.json").exists():
      run = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "main.py"), "--config=configs/demo.py:tiny",
                            "--config.mode=stage1", f"--workdir={shared}"], cwd=ROOT, capture_output=True, text=True,
                           timeout=1800, env=env)
      assert run.returncode == 0, run.stderr[-3000:]
  return DemoShared(reference=str(shared / "reference"), vstar_file=str(shared / "stage1" / "vstar.jsonl"), env=env)
