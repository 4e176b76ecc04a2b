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

from astarpo_jax.data import dataset
from astarpo_jax.infra import files
from astarpo_jax.stage1 import value_table as vt


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


def read_source(source: str) -> list[dict[str, Any]]:
  """Rows of a local .parquet / .jsonl / .json file, or of a Hub data set's train split (the official
  sets are `Cornell-AGI/{math,gsm8k}_size_qwen2.5_{1.5,3,7}b_eval`, as scripts/apo_math.sh reads them)."""
  if os.path.exists(source) or source.endswith(dataset.LOCAL_SUFFIXES) or source.startswith(("/", ".")):
    return dataset.read_rows(source)
  import datasets
  try:
    return datasets.load_dataset(source, split="train").to_list()
  except Exception as e:  # offline, bad id
    raise RuntimeError(f"could not load the Stage-1 data {source!r} from the Hugging Face Hub: "
                       f"{type(e).__name__}: {e}. Offline, pass a local parquet/jsonl copy.") from e


def _eval_columns(row: Mapping[str, Any], num_columns: int | None, name: str) -> int:
  """How many eval_i columns to use: the first `num_columns` (official num_gen_to_use), or all."""
  n = 0
  while f"eval_{n}" in row:
    n += 1
  if n == 0:
    raise KeyError(f"{name}: no eval_0..eval_{{N-1}} columns; fields: {sorted(row)}")
  if num_columns is not None:
    if n < num_columns:
      raise ValueError(f"{name}: {n} eval_i columns, fewer than the {num_columns} asked for (stage1.n_samples)")
    n = num_columns
  return n


def _row_evals(row: Mapping[str, Any], n: int, i: int, name: str) -> list[float] | None:
  """The 0/1 values of eval_0..eval_{n-1}; None when one is missing; a value that is not 0/1 is an error."""
  vals = [row.get(f"eval_{j}") for j in range(n)]
  if any(v is None or (isinstance(v, float) and v != v) for v in vals):
    return None
  bad = [v for v in vals if not (isinstance(v, (bool, int, float, np.number)) and float(v) in (0.0, 1.0))]
  if bad:
    raise ValueError(f"{name}: row {i} has eval value {bad[0]!r}; eval_i columns must be 0/1")
  return [float(v) for v in vals]


def import_eval_columns(source: str | Sequence[Mapping[str, Any]], *, key: str = "extra_info.question",
                        uid_of: Mapping[str, str] | None = None, beta1: float = 0.5,
                        num_columns: int | None = None, out_path: str | None = None,
                        log: Callable[[str], Any] = print) -> tuple[dict[str, dict[str, Any]], ImportStats]:
  """Records (as Stage 1 writes them) from rows with 0/1 columns eval_0..eval_{N-1}.

  `source`: a .parquet / .jsonl / .json file, a Hub data set id, or a list of rows. `key`: the field
  naming the prompt, dotted for nested ones (official sets: "extra_info.question" for the raw problem,
  "prompt.0.content" for the prompt text, "extra_info.index"). `uid_of` maps key values to uids (e.g.
  {prompt.problem: prompt.uid}; whitespace is normalised on both sides); None uses the key value as the
  uid. `num_columns`: use only the first N eval columns (the official num_gen_to_use). Rows whose key
  is not in uid_of (counted, with examples in the log), repeated uids, and rows with a missing eval
  value are skipped and counted. Writes `out_path` (a V̂* file that `value_table.load_table` reads).
  """
  rows = read_source(source) if isinstance(source, str) else list(source)
  name = source if isinstance(source, str) else "rows"
  if not rows:
    raise ValueError(f"{name}: no rows")
  n = _eval_columns(rows[0], num_columns, name)
  if _get(rows[0], key) is None:
    raise KeyError(f"{name}: key field {key!r} not found in the first row; fields: {sorted(rows[0])}")
  norm_map = None if uid_of is None else {_norm(k): u for k, u in uid_of.items()}
  uids, evals, skipped, unmatched = [], [], {"unmatched": 0, "duplicate": 0, "missing_eval": 0}, []
  seen = set()
  for i, row in enumerate(rows):
    raw = _get(row, key)
    uid = None if raw is None else (str(raw) if norm_map is None else norm_map.get(_norm(raw)))
    vals = None if uid is None else _row_evals(row, n, i, name)
    reason = "unmatched" if uid is None else "missing_eval" if vals is None else "duplicate" if uid in seen else None
    if reason:
      skipped[reason] += 1
      if reason == "unmatched" and len(unmatched) < 3:
        unmatched.append(str(raw)[:80])
      continue
    seen.add(uid)
    uids.append(uid)
    evals.append(vals)
  if not uids:
    raise ValueError(f"{name}: no row could be used ({skipped}); check `key` ({key!r}) and `uid_of`; "
                     f"unmatched keys look like {unmatched}")
  rewards_PN = np.array(evals, np.float32)
  recs = vt.make_records(uids, rewards_PN, np.ones(rewards_PN.shape, bool), beta1)
  stats = ImportStats(len(rows), len(recs), skipped)
  if len(recs) < len(rows):
    log(f"import_eval_columns: {name}: used {len(recs)} of {len(rows)} rows (eval_0..eval_{n - 1}); skipped "
        f"{skipped}" + (f"; unmatched keys, e.g. {unmatched}" if unmatched else ""))
  if out_path is not None:
    files.path(os.path.dirname(out_path) or ".").mkdir(parents=True, exist_ok=True)
    files.write_text_atomic(out_path, vt.to_jsonl(recs))
  return {r["uid"]: r for r in recs}, stats
