"""Importing the official A*-PO Stage-1 data sets: rows with 0/1 columns eval_0..eval_{N-1}.

The official data (github ZhaolinGao/A-PO, preprocess/data_generation/model_generate.py; published as
the Cornell-AGI/{math,gsm8k}_size_qwen2.5_*_eval sets) grade N responses of π_ref per prompt into
columns eval_i; the trainer uses the first num_gen_to_use of them. This turns such rows into V̂* table
records (value_table.py), matched to the run's prompts.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from astarpo_jax import data, files
from astarpo_jax import value_table as vt


@dataclasses.dataclass(frozen=True)
class ImportStats:
  rows: int
  imported: int
  skipped: dict[str, int]  # "unmatched" (key not in uid_of), "duplicate" (uid seen), "missing_eval"


def _get(row: Mapping[str, Any], dotted: str) -> Any:
  """row["a"]["b"] for "a.b"; a numeric part indexes a list ("prompt.0.content"); None if absent."""
  x: Any = row
  for part in dotted.split("."):
    if isinstance(x, Mapping):
      x = x.get(part)
    elif isinstance(x, (list, tuple)) and part.isdigit() and int(part) < len(x):
      x = x[int(part)]
    else:
      return None
  return x


def _norm(key: Any) -> str:
  return " ".join(str(key).split())  # whitespace differences between copies of a problem don't matter


def import_eval_columns(source: str | Sequence[Mapping[str, Any]], *, key: str = "extra_info.question",
                        uid_of: Mapping[str, str] | None = None, beta1: float = 0.5,
                        out_path: str | None = None, log: Callable[[str], Any] = print
                        ) -> tuple[dict[str, dict[str, Any]], ImportStats]:
  """Records (as Stage 1 writes them) from rows with 0/1 columns eval_0..eval_{N-1}.

  `source`: a .parquet / .jsonl / .json file or a list of rows. `key`: the field naming the prompt,
  dotted for nested ones (official sets: "extra_info.question" for the problem text, or
  "extra_info.index"). `uid_of` maps key values to uids (e.g. {ex.problem: ex.uid for ex in
  examples}; whitespace is normalised on both sides); None uses the key value as the uid. Rows
  whose key is not in uid_of, repeated uids, and rows with a missing eval value are skipped and
  counted. Writes `out_path` (a V̂* file that `load_vstar` reads) when given.
  """
  rows = data.read_rows(source) if isinstance(source, str) else list(source)
  name = source if isinstance(source, str) else "rows"
  if not rows:
    raise ValueError(f"{name}: no rows")
  cols = set(rows[0])
  n = 0
  while f"eval_{n}" in cols:
    n += 1
  if n == 0:
    raise KeyError(f"{name}: no eval_0..eval_{{N-1}} columns; fields: {sorted(cols)}")
  if _get(rows[0], key) is None:
    raise KeyError(f"{name}: key field {key!r} not found in the first row; fields: {sorted(cols)}")
  norm_map = None if uid_of is None else {_norm(k): u for k, u in uid_of.items()}
  uids, evals, skipped = [], [], {"unmatched": 0, "duplicate": 0, "missing_eval": 0}
  seen = set()
  for i, row in enumerate(rows):
    raw = _get(row, key)
    uid = None if raw is None else (str(raw) if norm_map is None else norm_map.get(_norm(raw)))
    if uid is None:
      skipped["unmatched"] += 1
      continue
    vals = [row.get(f"eval_{j}") for j in range(n)]
    if any(v is None or (isinstance(v, float) and v != v) for v in vals):
      skipped["missing_eval"] += 1
      continue
    bad = [v for v in vals if not (isinstance(v, (bool, int, float, np.number)) and float(v) in (0.0, 1.0))]
    if bad:
      raise ValueError(f"{name}: row {i} has eval value {bad[0]!r}; eval_i columns must be 0/1")
    if uid in seen:
      skipped["duplicate"] += 1
      continue
    seen.add(uid)
    uids.append(uid)
    evals.append([float(v) for v in vals])
  if not uids:
    raise ValueError(f"{name}: no row could be used ({skipped}); check `key` and `uid_of`")
  rewards_PN = np.array(evals, np.float32)
  recs = vt.make_records(uids, rewards_PN, np.ones(rewards_PN.shape, bool), beta1)
  stats = ImportStats(len(rows), len(recs), skipped)
  if len(recs) < len(rows):
    log(f"import_eval_columns: {name}: used {len(recs)} of {len(rows)} rows; skipped {skipped}")
  if out_path is not None:
    files.path(os.path.dirname(out_path) or ".").mkdir(parents=True, exist_ok=True)
    files.write_text_atomic(out_path, vt.to_jsonl(recs))
  return {r["uid"]: r for r in recs}, stats
