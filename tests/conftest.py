"""pytest settings shared by every test file.

XLA's CPU backend at optimisation level 0: most tests compile many small programs and run them once,
so compiling is most of their time; at level 0 a compile-bound file runs 1.3-2x faster here
(tests/test_update_step.py 49 -> 31 s, test_compare 119 -> 93 s, side by side on 2 cores), while a
test that trains for minutes runs slower (test_demo 166 -> 268 s), so those subprocesses drop the flag
(`default_xla_env`). The level changes no result these tests compare: they hold against independent
references within float tolerances. Set before JAX starts (pytest imports this file first); a level
already in XLA_FLAGS is kept.
"""
import os

LEVEL_FLAG = "--xla_backend_optimization_level"
if LEVEL_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {LEVEL_FLAG}=0").strip()


def default_xla_env(env: dict) -> dict:
  """`env` with the level-0 flag this file added removed: for subprocesses that compute more than compile."""
  flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(LEVEL_FLAG))
  return {**env, "XLA_FLAGS": flags}


def pytest_configure(config):
  config.addinivalue_line("markers", "full_data: needs the full offline data files (../shared/data); see tests/data_paths.py")
