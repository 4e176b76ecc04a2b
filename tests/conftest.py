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
