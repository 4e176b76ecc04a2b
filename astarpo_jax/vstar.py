"""A*-PO Stage 1: N responses of π_ref per training prompt → V̂*(x), cached in a resumable file.

V̂*(x) = β1·log mean_i exp(r_i/β1) (plain mean when β1 = 0), computed by `losses.vstar`. Stage 1
runs once, offline; Stage 2 trains on (prompt, V̂*). Sampling and grading are injected:

  generate(prompt_ids: list[list[int]], key) -> (texts: list[str], truncated: list[bool])
                                                 or (texts, truncated, rows) for only the requests `rows`
  grade(texts, golds, truncated) -> np.ndarray float32, one reward per response

Several JAX processes run this together: `generate` samples all requests as one program and
returns (texts, truncated, rows) for the rows this process holds; each process grades only
those, the rewards (and texts, when kept) are gathered so that every process has all records,
and process 0 alone reads and writes the files (its resume decision is broadcast). `out_dir` may
be a bucket (gs://...) through etils.epath.

Files under `<out_dir>/stage1/`:
  meta.json               what the run is (prompt fingerprint, N, β1, chunking, seed); checked on resume
  chunks/chunk_00012.jsonl one finished chunk, written to a temp file then os.replace'd (atomic)
  vstar.jsonl             all records in prompt order, merged from the chunks at the end
  summary.json            pass-count histogram and the other figures of `summarize`

A record (one JSONL line): uid, vstar, num_correct, n, rewards [n], num_truncated, all_fail, and
with keep_responses also responses [n] and truncated [n]. A response is correct when its reward
is >= 1 (the graders give 0/1). The chunk key is fold_in(key(seed), chunk index), so a resumed
run gives the same file as an uninterrupted one.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from tqdm import tqdm

from astarpo_jax import data
from astarpo_jax import multihost
from astarpo_jax.data import Prompt
from astarpo_jax.losses import vstar as vstar_fn

Generate = Callable[[list[list[int]], jax.Array], tuple[list[str], list[bool]]]
Grade = Callable[[list[str], list[str], list[bool]], np.ndarray]
RECORD_KEYS = ("uid", "vstar", "num_correct", "n", "rewards")
DEFAULT_N = 8


@dataclasses.dataclass(frozen=True)
class AdaptiveConfig:
  """Adaptive N: n_min samples for every prompt, then n_max − n_min more unless all n_min were correct.

  Rule (two rounds per chunk): a prompt whose first n_min responses are all correct keeps n = n_min
  (V̂* = 1 exactly, and further samples are mostly wasted on it); every other prompt (all failed, or
  mixed) gets n_max − n_min more, so n = n_max. All-fail prompts gain the most: a single success in
  the extra draws lifts V̂* off 0. V̂* is over all samples a prompt drew (mask-aware `vstar`).
  """
  n_min: int
  n_max: int

  def __post_init__(self):
    if not (isinstance(self.n_min, int) and isinstance(self.n_max, int) and 1 <= self.n_min < self.n_max):
      raise ValueError(f"AdaptiveConfig(n_min={self.n_min!r}, n_max={self.n_max!r}): need ints with "
                       "1 <= n_min < n_max")


@dataclasses.dataclass
class Stage1Result:
  records: dict[str, dict[str, Any]]  # uid -> record, in prompt order, all prompts
  prompts: list[Prompt]  # the prompts to train on (all-fail ones removed under drop_all_fail)
  vstar_path: str
  summary: dict[str, Any]

  def vstar_for(self, prompts: Sequence[Prompt | str]) -> np.ndarray:
    """V̂* of each prompt (or uid), [P] float32."""
    return vstar_for(self.records, prompts)


# ---------------------------------------------------------------------------------------------
# Records and the summary.

def make_records(uids: Sequence[str], rewards_PN: np.ndarray, mask_PN: np.ndarray, beta1: float,
                 truncated_PN: np.ndarray | None = None, responses: Sequence[Sequence[str]] | None = None
                 ) -> list[dict[str, Any]]:
  """One record per prompt from its (masked-in) rewards; V̂* from `losses.vstar`."""
  mask_PN = np.asarray(mask_PN, bool)
  v_P = np.asarray(vstar_fn(np.asarray(rewards_PN, np.float32), beta1, mask_PN))
  out = []
  for p, uid in enumerate(uids):
    r = [float(x) for x in np.asarray(rewards_PN[p], np.float32)[mask_PN[p]]]
    k = sum(x >= 1.0 for x in r)
    rec = {"uid": uid, "vstar": float(v_P[p]), "num_correct": int(k), "n": len(r), "rewards": r,
           "num_truncated": None if truncated_PN is None else int(np.asarray(truncated_PN[p])[mask_PN[p]].sum()),
           "all_fail": k == 0}
    if responses is not None:
      rec["responses"] = list(responses[p])
      rec["truncated"] = [bool(t) for t in np.asarray(truncated_PN[p])[mask_PN[p]]]
    out.append(rec)
  return out


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """Figures the paper does not give: pass-count histogram over 0..max n, zero/all-correct shares,
  mean V̂*, mean pass rate k/n, pass@n, truncated share (when known)."""
  if not records:
    raise ValueError("summarize: no records")
  k = np.array([r["num_correct"] for r in records])
  n = np.array([r["n"] for r in records])
  trunc = [r.get("num_truncated") for r in records]
  out = {
      "num_prompts": len(records),
      "num_samples": int(n.sum()),
      "mean_n": float(n.mean()),
      "pass_count_hist": np.bincount(k, minlength=int(n.max()) + 1).tolist(),
      "frac_zero_correct": float((k == 0).mean()),
      "frac_all_correct": float((k == n).mean()),
      "pass_at_n": float((k > 0).mean()),
      "mean_vstar": float(np.mean([r["vstar"] for r in records])),
      "mean_pass_rate": float((k / n).mean()),
      "frac_truncated": None if None in trunc else float(sum(trunc) / n.sum()),
  }
  return out


def format_summary(s: Mapping[str, Any]) -> str:
  trunc = "n/a" if s["frac_truncated"] is None else f"{s['frac_truncated']:.3f}"
  return (f"stage1: {s['num_prompts']} prompts, {s['num_samples']} samples (mean n {s['mean_n']:.2f}); "
          f"pass-count histogram {s['pass_count_hist']}; zero correct {s['frac_zero_correct']:.3f} "
          f"(no exploration guarantee there), all correct {s['frac_all_correct']:.3f}; "
          f"mean V* {s['mean_vstar']:.4f}, mean pass rate {s['mean_pass_rate']:.4f}, truncated {trunc}")


def _check_record(rec: Any, where: str) -> str | None:
  """Why `rec` is not a well-formed record, or None."""
  if not isinstance(rec, dict) or any(k not in rec for k in RECORD_KEYS):
    return f"{where}: not a record with keys {RECORD_KEYS}"
  r = rec["rewards"]
  if not isinstance(r, list) or len(r) != rec["n"] or rec["n"] < 1:
    return f"{where}: `rewards` must be a list of n={rec['n']} numbers"
  if rec["num_correct"] != sum(x >= 1.0 for x in r):
    return f"{where}: num_correct={rec['num_correct']} disagrees with the rewards"
  if not (isinstance(rec["vstar"], (int, float)) and math.isfinite(rec["vstar"])):
    return f"{where}: vstar={rec['vstar']!r} is not a finite number"
  return None


def load_vstar(path: str) -> dict[str, dict[str, Any]]:
  """uid -> record of a V̂* file (Stage 1's vstar.jsonl, or one written by `import_eval_columns`)."""
  if not multihost.path(path).is_file():
    raise FileNotFoundError(f"V* file not found: {path}")
  out = {}
  for lineno, line in enumerate(multihost.path(path).read_text(encoding="utf-8").splitlines(), 1):
    if not line.strip():
      continue
    try:
      rec = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); the file is damaged") from None
    problem = _check_record(rec, f"{path}:{lineno}")
    if problem:
      raise ValueError(problem)
    if rec["uid"] in out:
      raise ValueError(f"{path}:{lineno}: uid {rec['uid']!r} appears twice")
    out[rec["uid"]] = rec
  return out


def vstar_for(records: Mapping[str, Mapping[str, Any]], prompts: Sequence[Prompt | str]) -> np.ndarray:
  """V̂* of each prompt (or uid) from `records` (uid -> record), [P] float32."""
  uids = [p if isinstance(p, str) else p.uid for p in prompts]
  missing = [u for u in uids if u not in records]
  if missing:
    raise KeyError(f"no V* for {len(missing)} of {len(uids)} prompts (first: {missing[:5]}); run "
                   "Stage 1 on these prompts or drop them")
  return np.array([records[u]["vstar"] for u in uids], np.float32)


# ---------------------------------------------------------------------------------------------
# Files: atomic writes, run metadata, chunk validation.

def _write_atomic(path: str, text: str) -> None:
  """Readers see the old file or the whole new one (temp file + os.replace; one upload on a bucket)."""
  multihost.write_text_atomic(path, text)


def _jsonl(records: Sequence[Mapping[str, Any]]) -> str:
  return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def _fingerprint(prompts: Sequence[Prompt]) -> tuple[str, str]:
  """(sha of the uids in order, sha of uid + token ids + gold): to tell 'other prompts' from 're-rendered'."""
  h_uid, h_all = hashlib.sha256(), hashlib.sha256()
  for p in prompts:
    h_uid.update(p.uid.encode() + b"\0")
    h_all.update(json.dumps([p.uid, list(p.ids), p.gold]).encode() + b"\0")
  return h_uid.hexdigest(), h_all.hexdigest()


def _meta(prompts, n_samples, beta1, chunk_prompts, seed, keep_responses, adaptive) -> dict[str, Any]:
  uids_sha, prompts_sha = _fingerprint(prompts)
  return {"num_prompts": len(prompts), "uids_sha256": uids_sha, "prompts_sha256": prompts_sha,
          "n_samples": n_samples, "beta1": beta1, "chunk_prompts": chunk_prompts, "seed": seed,
          "keep_responses": keep_responses,
          "adaptive": None if adaptive is None else dataclasses.asdict(adaptive)}


def _check_resume(stored: Mapping[str, Any], meta: Mapping[str, Any], stage_dir: str) -> None:
  diffs = [f"{k}: stored {stored.get(k)!r}, now {v!r}" for k, v in meta.items() if stored.get(k) != v]
  if diffs:
    what = ("the uids are the same but token ids or golds differ (another template or tokenizer?)"
            if diffs == [d for d in diffs if d.startswith("prompts_sha256")] else "; ".join(diffs))
    raise ValueError(f"{stage_dir} holds a Stage-1 run with other settings ({what}); refusing to mix "
                     "them. Use another out_dir, or delete that directory to start over.")


def _read_chunk(path: str, uids: Sequence[str], beta1: float) -> list[dict[str, Any]] | None:
  """The chunk's records if the file is complete and consistent with `uids`, else None."""
  try:
    recs = [json.loads(line) for line in multihost.path(path).read_text(encoding="utf-8").splitlines()]
  except (OSError, UnicodeDecodeError, json.JSONDecodeError):
    return None
  if len(recs) != len(uids) or any(_check_record(r, path) for r in recs):
    return None
  if [r["uid"] for r in recs] != list(uids):
    return None
  n_max = max(r["n"] for r in recs)
  rewards_PN = np.zeros((len(recs), n_max), np.float32)
  mask_PN = np.zeros((len(recs), n_max), bool)
  for p, r in enumerate(recs):
    rewards_PN[p, :r["n"]], mask_PN[p, :r["n"]] = r["rewards"], True
  if not np.allclose(np.asarray(vstar_fn(rewards_PN, beta1, mask_PN)), [r["vstar"] for r in recs], atol=1e-6):
    return None
  return recs


# ---------------------------------------------------------------------------------------------
# Sampling one chunk.

def chunk_key(seed: int, chunk: int) -> jax.Array:
  """PRNG key of a chunk: a pure function of (seed, chunk index), so resuming changes nothing."""
  return jax.random.fold_in(jax.random.key(seed), chunk)


def _draw(prompts: Sequence[Prompt], n: int, generate: Generate, grade: Grade, key: jax.Array,
          with_texts: bool = True) -> tuple[np.ndarray, np.ndarray, list[list[str]] | None]:
  """n responses per prompt in one `generate` call: rewards [P, n], truncated [P, n], texts [P][n].

  This process grades the rows `generate` returned; rewards and flags (and texts when
  `with_texts`) are gathered from all processes, so every process returns all P·n.
  """
  P = len(prompts)
  got = generate([list(p.ids) for p in prompts for _ in range(n)], key)
  texts, truncated = got[0], got[1]
  rows = np.arange(P * n) if len(got) == 2 else np.asarray(got[2], np.int64)
  if len(texts) != len(rows) or len(truncated) != len(rows) or (len(got) == 2 and len(rows) != P * n):
    of = f"{P * n} requests" if len(got) == 2 else f"its {len(rows)} rows of {P * n} requests"
    raise ValueError(f"generate returned {len(texts)} texts and {len(truncated)} truncated flags for {of} "
                     f"({P} prompts x {n}); it must return one per request (or per returned row), in order")
  golds = [p.gold for p in prompts for _ in range(n)]
  rewards = np.asarray(grade(list(texts), [golds[r] for r in rows], [bool(t) for t in truncated]), np.float32)
  if rewards.shape != (len(rows),) or not np.isfinite(rewards).all():
    raise ValueError(f"grade returned shape {rewards.shape} (need ({len(rows)},)) or non-finite rewards")
  rewards = multihost.gather_rows(rewards, rows, P * n)
  truncated = multihost.gather_rows(np.asarray(truncated, bool), rows, P * n)
  if not with_texts:
    return rewards.reshape(P, n), truncated.reshape(P, n), None
  texts = multihost.gather_texts(list(texts), rows, P * n)
  return rewards.reshape(P, n), truncated.reshape(P, n), [list(texts[i * n:(i + 1) * n]) for i in range(P)]


def _sample_chunk(prompts: Sequence[Prompt], generate: Generate, grade: Grade, key: jax.Array,
                  n_samples: int, beta1: float, keep_responses: bool,
                  adaptive: AdaptiveConfig | None) -> list[dict[str, Any]]:
  uids = [p.uid for p in prompts]
  if adaptive is None:
    r_PN, t_PN, texts = _draw(prompts, n_samples, generate, grade, key, keep_responses)
    return make_records(uids, r_PN, np.ones(r_PN.shape, bool), beta1, t_PN,
                        texts if keep_responses else None)
  lo, hi = adaptive.n_min, adaptive.n_max
  r_PN = np.zeros((len(prompts), hi), np.float32)
  t_PN = np.zeros((len(prompts), hi), bool)
  mask_PN = np.zeros((len(prompts), hi), bool)
  r_PN[:, :lo], t_PN[:, :lo], texts = _draw(prompts, lo, generate, grade, key, keep_responses)
  mask_PN[:, :lo] = True
  more = np.flatnonzero((r_PN[:, :lo] < 1.0).any(-1))  # not all correct: all failed, or mixed
  if len(more):
    r2, t2, texts2 = _draw([prompts[i] for i in more], hi - lo, generate, grade, jax.random.fold_in(key, 1),
                           keep_responses)
    r_PN[more, lo:], t_PN[more, lo:], mask_PN[more, lo:] = r2, t2, True
    for j, i in enumerate(more if keep_responses else ()):
      texts[i] = texts[i] + texts2[j]
  return make_records(uids, r_PN, mask_PN, beta1, t_PN, texts if keep_responses else None)


# ---------------------------------------------------------------------------------------------
# The driver.

def _open_run(stage_dir, chunk_dir, meta, bounds, path_of, uids, beta1, log) -> dict[int, list[dict[str, Any]]]:
  """Checks or writes meta.json, clears temp files, and returns the finished chunks (damaged ones moved aside)."""
  d = multihost.path(chunk_dir)
  d.mkdir(parents=True, exist_ok=True)
  for tmp in list(d.glob("*.tmp.*")) + list(multihost.path(stage_dir).glob("*.tmp.*")):
    tmp.unlink()  # left by a run killed mid-write; never read as data
  meta_path = multihost.path(os.path.join(stage_dir, "meta.json"))
  if meta_path.exists():
    _check_resume(json.loads(meta_path.read_text(encoding="utf-8")), meta, stage_dir)
  elif list(d.glob("chunk_*.jsonl")):
    raise ValueError(f"{chunk_dir} holds chunk files but {meta_path} is missing, so their settings are "
                     "unknown; delete the directory or use another out_dir")
  else:
    _write_atomic(str(meta_path), json.dumps(meta, indent=1) + "\n")
  chunks: dict[int, list[dict[str, Any]]] = {}
  for c, (s, e) in enumerate(bounds):
    if multihost.path(path_of(c)).exists():
      recs = _read_chunk(path_of(c), uids[s:e], beta1)
      if recs is None:
        log(f"stage1: {path_of(c)} is incomplete or damaged; redoing chunk {c}")
        multihost.path(path_of(c)).replace(path_of(c) + ".bad")
      else:
        chunks[c] = recs
  return chunks

def run_stage1(prompts: Sequence[Prompt], generate: Generate, grade: Grade, *, out_dir: str,
               n_samples: int | None = None, beta1: float = 0.5, chunk_prompts: int = 64, seed: int = 0,
               keep_responses: bool = False, drop_all_fail: bool = False,
               adaptive: AdaptiveConfig | None = None, log: Callable[[str], Any] = print,
               progress: bool = True) -> Stage1Result:
  """V̂* of every prompt from n_samples (default 8) responses each, chunk by chunk, resumable.

  Finished chunks found under out_dir/stage1 are reused (damaged ones are redone); the run must
  have the same prompts, N, β1, chunking, seed and options, else it is refused. With `adaptive`,
  N varies per prompt (see AdaptiveConfig) and n_samples, if given, must equal adaptive.n_max.
  drop_all_fail leaves prompts with 0 correct out of `result.prompts` (the file keeps them, all_fail).
  """
  prompts = list(prompts)
  if not prompts:
    raise ValueError("run_stage1: no prompts")
  uids = [p.uid for p in prompts]
  if len(set(uids)) != len(uids):
    dup = sorted({u for u in uids if uids.count(u) > 1})
    raise ValueError(f"run_stage1: duplicate prompt uids {dup[:5]}; uids must be unique")
  if adaptive is not None:
    if n_samples is not None and n_samples != adaptive.n_max:
      raise ValueError(f"run_stage1: n_samples={n_samples} but adaptive.n_max={adaptive.n_max}; "
                       "with adaptive N leave n_samples unset")
    n_samples = adaptive.n_max
  n_samples = DEFAULT_N if n_samples is None else n_samples
  if not isinstance(n_samples, int) or n_samples < 1:
    raise ValueError(f"run_stage1: n_samples={n_samples!r} must be an int >= 1")
  if not isinstance(chunk_prompts, int) or chunk_prompts < 1:
    raise ValueError(f"run_stage1: chunk_prompts={chunk_prompts!r} must be an int >= 1")
  if not isinstance(beta1, (int, float)) or beta1 < 0:
    raise ValueError(f"run_stage1: beta1={beta1!r} must be a number >= 0")

  stage_dir = os.path.join(out_dir, "stage1")
  chunk_dir = os.path.join(stage_dir, "chunks")
  meta = _meta(prompts, n_samples, float(beta1), chunk_prompts, seed, keep_responses, adaptive)
  bounds = [(s, min(s + chunk_prompts, len(prompts))) for s in range(0, len(prompts), chunk_prompts)]
  path_of = lambda c: os.path.join(chunk_dir, f"chunk_{c:05d}.jsonl")
  lead = jax.process_index() == 0  # the one process that reads and writes the files
  if jax.process_count() == 1:
    chunks = _open_run(stage_dir, chunk_dir, meta, bounds, path_of, uids, float(beta1), log)
  else:  # process 0 decides which chunks are done; a refusal stops every process
    try:
      found = {"chunks": _open_run(stage_dir, chunk_dir, meta, bounds, path_of, uids, float(beta1), log)} \
          if lead else None
    except (ValueError, OSError) as e:
      multihost.broadcast_json({"error": f"{type(e).__name__}: {e}"})
      raise
    found = multihost.broadcast_json(found)
    if "error" in found:
      raise ValueError(f"stage1 (process 0): {found['error']}")
    chunks = {int(c): recs for c, recs in found["chunks"].items()}
  todo = [c for c in range(len(bounds)) if c not in chunks]
  done_prompts = sum(len(v) for v in chunks.values())
  if chunks:
    log(f"stage1: resuming: {len(chunks)} of {len(bounds)} chunks ({done_prompts} prompts) already done")

  with tqdm(total=len(prompts), initial=done_prompts, unit="prompt", desc="stage1 V*",
            disable=not (progress and lead), dynamic_ncols=True) as bar:
    for c in todo:
      s, e = bounds[c]
      recs = _sample_chunk(prompts[s:e], generate, grade, chunk_key(seed, c), n_samples, float(beta1),
                           keep_responses, adaptive)
      if lead:
        _write_atomic(path_of(c), _jsonl(recs))
      chunks[c] = recs
      bar.update(e - s)

  records = [r for c in range(len(bounds)) for r in chunks[c]]
  vstar_path = os.path.join(stage_dir, "vstar.jsonl")
  if lead:
    _write_atomic(vstar_path, _jsonl(records))
  summary = summarize(records)
  summary.update(beta1=float(beta1), n_samples=n_samples,
                 adaptive=meta["adaptive"], drop_all_fail=drop_all_fail)
  kept = [p for p, r in zip(prompts, records) if not (drop_all_fail and r["all_fail"])]
  summary["num_kept"] = len(kept)
  if lead:
    _write_atomic(os.path.join(stage_dir, "summary.json"), json.dumps(summary, indent=1) + "\n")
  multihost.barrier("stage1_written")  # nobody goes on before the files are complete
  log(format_summary(summary))
  if drop_all_fail:
    log(f"stage1: drop_all_fail: training on {len(kept)} of {len(prompts)} prompts")
  return Stage1Result({r["uid"]: r for r in records}, kept, vstar_path, summary)


# ---------------------------------------------------------------------------------------------
# Precomputed Stage-1 results with 0/1 columns eval_0..eval_{N-1} (the official A*-PO data sets).

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
  recs = make_records(uids, rewards_PN, np.ones(rewards_PN.shape, bool), beta1)
  stats = ImportStats(len(rows), len(recs), skipped)
  if len(recs) < len(rows):
    log(f"import_eval_columns: {name}: used {len(recs)} of {len(rows)} rows; skipped {skipped}")
  if out_path is not None:
    multihost.path(os.path.dirname(out_path) or ".").mkdir(parents=True, exist_ok=True)
    _write_atomic(out_path, _jsonl(recs))
  return {r["uid"]: r for r in recs}, stats
