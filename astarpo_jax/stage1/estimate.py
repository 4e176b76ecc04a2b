"""A*-PO Stage 1: N responses of π_ref per training prompt, graded -> the V̂* table, in a resumable file.

Runs once, offline. Sampling and grading come in as one function, `draw(prompts, n, key) -> Drawn`
(`rollout_draw` builds it from the sampler and a grader; tests pass fakes), which returns every
prompt's n rewards on every process. Prompts go in chunks; each finished chunk is a file, so a killed
run resumes where it stopped, and the chunk key is fold_in(key(seed), chunk index), so a resumed run
gives the same file as an uninterrupted one. A preemption notice (infra/preemption.py) lets the chunk in
flight finish and be written, then ends the run (`Preempted`). With several JAX processes, `draw` samples all requests
as one program and gathers the results; process 0 alone reads and writes the files (its resume
decision is broadcast). `out_dir` may be a bucket (gs://...) through etils.epath.

Files under `<out_dir>/stage1/`:
  meta.json                what the run is (prompt fingerprint, N, β1, chunking, seed, pass threshold, and a
                           user reward function's source hash); checked on resume
  chunks/chunk_00012.jsonl one finished chunk, written to a temp file then renamed (atomic)
  vstar.jsonl              all records in prompt order (value_table.py's format), merged at the end
  summary.json             pass-count histogram and the other figures of `value_table.summarize`
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import numpy as np
from tqdm import tqdm

from astarpo_jax.data.dataset import Prompt
from astarpo_jax.infra import files, multihost, preemption
from astarpo_jax.sampling import rollout as rollout_lib
from astarpo_jax.stage1 import value_table as vt
from astarpo_jax.stage1.value_table import optimal_value

DEFAULT_N = 8


class Drawn(NamedTuple):
  """n graded responses of each of P prompts."""
  rewards_PN: np.ndarray  # [P, n] float32
  truncated_PN: np.ndarray  # [P, n] bool: no stop token within the length limit
  texts: list[list[str]]  # [P][n] response texts
  lengths_PN: np.ndarray | None = None  # [P, n] response tokens (None when unknown)


Draw = Callable[[Sequence[Prompt], int, jax.Array], Drawn]  # (prompts, n, key) -> Drawn


@dataclasses.dataclass(frozen=True)
class AdaptiveConfig:
  """Adaptive N: n_min samples for every prompt, then n_max − n_min more unless all n_min were correct.

  Rule (two rounds per chunk): a prompt whose first n_min responses all pass (r >= the pass threshold)
  keeps n = n_min (with 0/1 rewards V̂* = 1 exactly, and further samples are mostly wasted on it); every
  other prompt (none passed, or some) gets n_max − n_min more, so n = n_max. All-fail prompts gain the
  most: a single success in the extra draws lifts V̂* off 0. V̂* is over all samples a prompt drew
  (mask-aware optimal_value).
  """
  n_min: int
  n_max: int

  def __post_init__(self):
    if not (isinstance(self.n_min, int) and isinstance(self.n_max, int) and 1 <= self.n_min < self.n_max):
      raise ValueError(f"AdaptiveConfig(n_min={self.n_min!r}, n_max={self.n_max!r}): need ints with "
                       "1 <= n_min < n_max")


def rollout_draw(cfg, params, scfg, tokenizer, grade: rollout_lib.GradeFn, max_batch: int | None = None,
                 mesh=None, sample_mesh=None) -> Draw:
  """`draw` from the sampler: the n samples of a prompt are n rows of one rollout (prompt-major, the prompt
  prefilled once), graded; on `sample_mesh` when given (see rollout.rollout)."""
  def draw(prompts: Sequence[Prompt], n: int, key: jax.Array) -> Drawn:
    ro = rollout_lib.rollout(cfg, params, [p.ids for p in prompts], [p.target for p in prompts], key, scfg, tokenizer,
                             grade, max_batch, mesh, num_samples=n, sample_mesh=sample_mesh)
    P = len(prompts)
    return Drawn(ro.rewards_B.reshape(P, n), ro.truncated_B.reshape(P, n),
                 [list(ro.texts[i * n:(i + 1) * n]) for i in range(P)], ro.length_B.reshape(P, n))
  return draw


# ---------------------------------------------------------------------------------------------
# Sampling one chunk.

def chunk_key(seed: int, chunk: int) -> jax.Array:
  """PRNG key of a chunk: a pure function of (seed, chunk index), so resuming changes nothing."""
  return jax.random.fold_in(jax.random.key(seed), chunk)


def _checked_draw(draw: Draw, prompts: Sequence[Prompt], n: int, key: jax.Array) -> Drawn:
  got = draw(prompts, n, key)
  P = len(prompts)
  if (np.shape(got.rewards_PN) != (P, n) or np.shape(got.truncated_PN) != (P, n) or len(got.texts) != P
      or any(len(t) != n for t in got.texts)):
    raise ValueError(f"draw returned rewards {np.shape(got.rewards_PN)}, truncated {np.shape(got.truncated_PN)} and "
                     f"{len(got.texts)} text lists for {P} prompts x {n}; it must return [{P}, {n}] of each")
  if not np.isfinite(np.asarray(got.rewards_PN, np.float32)).all():
    raise ValueError("draw returned non-finite rewards")
  lengths = None if got.lengths_PN is None else np.asarray(got.lengths_PN, np.int64)
  return Drawn(np.asarray(got.rewards_PN, np.float32), np.asarray(got.truncated_PN, bool), got.texts, lengths)


def _sample_chunk(prompts: Sequence[Prompt], draw: Draw, key: jax.Array, n_samples: int, beta1: float,
                  keep_responses: bool, adaptive: AdaptiveConfig | None, pass_threshold: float = 1.0
                  ) -> list[dict[str, Any]]:
  uids = [p.uid for p in prompts]
  if adaptive is None:
    d = _checked_draw(draw, prompts, n_samples, key)
    return vt.make_records(uids, d.rewards_PN, np.ones(d.rewards_PN.shape, bool), beta1, d.truncated_PN,
                           d.texts if keep_responses else None, d.lengths_PN, pass_threshold)
  lo, hi = adaptive.n_min, adaptive.n_max
  r_PN = np.zeros((len(prompts), hi), np.float32)
  t_PN = np.zeros((len(prompts), hi), bool)
  mask_PN = np.zeros((len(prompts), hi), bool)
  d = _checked_draw(draw, prompts, lo, key)
  r_PN[:, :lo], t_PN[:, :lo], texts = d.rewards_PN, d.truncated_PN, d.texts
  mask_PN[:, :lo] = True
  len_PN = None if d.lengths_PN is None else np.zeros((len(prompts), hi), np.int64)
  if len_PN is not None:
    len_PN[:, :lo] = d.lengths_PN
  more = np.flatnonzero((r_PN[:, :lo] < pass_threshold).any(-1))  # not all passed: none, or some
  if len(more):
    d2 = _checked_draw(draw, [prompts[i] for i in more], hi - lo, jax.random.fold_in(key, 1))
    r_PN[more, lo:], t_PN[more, lo:], mask_PN[more, lo:] = d2.rewards_PN, d2.truncated_PN, True
    if len_PN is not None and d2.lengths_PN is not None:
      len_PN[more, lo:] = d2.lengths_PN
    for j, i in enumerate(more):
      texts[i] = texts[i] + d2.texts[j]
  return vt.make_records(uids, r_PN, mask_PN, beta1, t_PN, texts if keep_responses else None, len_PN,
                         pass_threshold)


# ---------------------------------------------------------------------------------------------
# Files: run metadata, chunk validation, resume.

def _fingerprint(prompts: Sequence[Prompt]) -> tuple[str, str]:
  """(sha of the uids in order, sha of uid + token ids + gold): to tell 'other prompts' from 're-rendered'."""
  h_uid, h_all = hashlib.sha256(), hashlib.sha256()
  for p in prompts:
    h_uid.update(p.uid.encode() + b"\0")
    h_all.update(json.dumps([p.uid, list(p.ids), p.gold, *([p.extra] if p.extra else [])]).encode() + b"\0")
  return h_uid.hexdigest(), h_all.hexdigest()


def _meta(prompts, n_samples, beta1, chunk_prompts, seed, keep_responses, adaptive, pass_threshold=1.0,
          reward_id="") -> dict[str, Any]:
  """What the run is. Keys added since the first format appear only when they differ from what older runs
  did (pass threshold 1, a built-in grader), so those runs still resume."""
  uids_sha, prompts_sha = _fingerprint(prompts)
  meta = {"num_prompts": len(prompts), "uids_sha256": uids_sha, "prompts_sha256": prompts_sha,
          "n_samples": n_samples, "beta1": beta1, "chunk_prompts": chunk_prompts, "seed": seed,
          "keep_responses": keep_responses,
          "adaptive": None if adaptive is None else dataclasses.asdict(adaptive)}
  if pass_threshold != 1.0:
    meta["pass_threshold"] = pass_threshold
  if reward_id:
    meta["reward"] = reward_id
  return meta


def _check_resume(stored: Mapping[str, Any], meta: Mapping[str, Any], stage_dir: str) -> None:
  diffs = [f"{k}: stored {stored.get(k)!r}, now {meta.get(k)!r}" for k in sorted(set(meta) | set(stored))
           if stored.get(k) != meta.get(k)]
  if diffs:
    what = ("the uids are the same but token ids or golds differ (another template or tokenizer?)"
            if diffs == [d for d in diffs if d.startswith("prompts_sha256")] else "; ".join(diffs))
    raise ValueError(f"{stage_dir} holds a Stage-1 run with other settings ({what}); refusing to mix "
                     "them. Use another out_dir, or delete that directory to start over.")


def _read_chunk(path: str, uids: Sequence[str], beta1: float, pass_threshold: float = 1.0
                ) -> list[dict[str, Any]] | None:
  """The chunk's records if the file is complete and consistent with `uids`, else None."""
  try:
    recs = [json.loads(line) for line in files.path(path).read_text(encoding="utf-8").splitlines()]
  except (OSError, UnicodeDecodeError, json.JSONDecodeError):
    return None
  if len(recs) != len(uids) or any(vt.check_record(r, path) for r in recs):
    return None
  if [r["uid"] for r in recs] != list(uids) or any(r.get("pass_threshold", 1.0) != pass_threshold for r in recs):
    return None
  n_max = max(r["n"] for r in recs)
  rewards_PN = np.zeros((len(recs), n_max), np.float32)
  mask_PN = np.zeros((len(recs), n_max), bool)
  for p, r in enumerate(recs):
    rewards_PN[p, :r["n"]], mask_PN[p, :r["n"]] = r["rewards"], True
  if not np.allclose(np.asarray(optimal_value(rewards_PN, beta1, mask_PN)), [r["vstar"] for r in recs],
                     atol=1e-6):
    return None
  return recs


def _open_run(stage_dir, chunk_dir, meta, bounds, path_of, uids, beta1, log) -> dict[int, list[dict[str, Any]]]:
  """Checks or writes meta.json, clears temp files, and returns the finished chunks (damaged ones moved aside)."""
  d = files.path(chunk_dir)
  d.mkdir(parents=True, exist_ok=True)
  for tmp in list(d.glob("*.tmp.*")) + list(files.path(stage_dir).glob("*.tmp.*")):
    tmp.unlink()  # left by a run killed mid-write; never read as data
  meta_path = files.path(os.path.join(stage_dir, "meta.json"))
  if meta_path.exists():
    _check_resume(json.loads(meta_path.read_text(encoding="utf-8")), meta, stage_dir)
  elif list(d.glob("chunk_*.jsonl")):
    raise ValueError(f"{chunk_dir} holds chunk files but {meta_path} is missing, so their settings are "
                     "unknown; delete the directory or use another out_dir")
  else:
    files.write_text_atomic(str(meta_path), json.dumps(meta, indent=1) + "\n")
  chunks: dict[int, list[dict[str, Any]]] = {}
  for c, (s, e) in enumerate(bounds):
    if files.path(path_of(c)).exists():
      recs = _read_chunk(path_of(c), uids[s:e], beta1, meta.get("pass_threshold", 1.0))
      if recs is None:
        log(f"stage1: {path_of(c)} is incomplete or damaged; redoing chunk {c}")
        files.path(path_of(c)).replace(path_of(c) + ".bad")
      else:
        chunks[c] = recs
  return chunks


def _finished_chunks(stage_dir, chunk_dir, meta, bounds, path_of, uids, beta1, log) -> dict[int, list]:
  """`_open_run` on process 0, its answer broadcast to every process (a refusal stops them all)."""
  if jax.process_count() == 1:
    return _open_run(stage_dir, chunk_dir, meta, bounds, path_of, uids, beta1, log)
  try:
    found = {"chunks": _open_run(stage_dir, chunk_dir, meta, bounds, path_of, uids, beta1, log)} \
        if jax.process_index() == 0 else None
  except (ValueError, OSError) as e:
    multihost.broadcast_json({"error": f"{type(e).__name__}: {e}"})
    raise
  found = multihost.broadcast_json(found)
  if "error" in found:
    raise ValueError(f"stage1 (process 0): {found['error']}")
  return {int(c): recs for c, recs in found["chunks"].items()}


# ---------------------------------------------------------------------------------------------
# The driver.

def _check_args(prompts, n_samples, beta1, chunk_prompts, adaptive, pass_threshold=1.0) -> int:
  """The number of samples per prompt, after refusing arguments the run cannot use."""
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
  if not isinstance(pass_threshold, (int, float)) or not 0 < pass_threshold <= 1:
    raise ValueError(f"run_stage1: pass_threshold={pass_threshold!r} must be in (0, 1]")
  return n_samples


def run_stage1(prompts: Sequence[Prompt], draw: Draw, *, out_dir: str, n_samples: int | None = None,
               beta1: float = 0.5, chunk_prompts: int = 64, seed: int = 0, keep_responses: bool = False,
               drop_all_fail: bool = False, adaptive: AdaptiveConfig | None = None, pass_threshold: float = 1.0,
               reward_id: str = "", log: Callable[[str], Any] = print, progress: bool = True,
               watch: preemption.Watch | None = None) -> vt.ValueTable:
  """V̂* of every prompt from n_samples (default 8) responses each, chunk by chunk, resumable.

  Finished chunks found under out_dir/stage1 are reused (damaged ones are redone); the run must have
  the same prompts, N, β1, chunking, seed and options, else it is refused. With `adaptive`, N varies
  per prompt (see AdaptiveConfig) and n_samples, if given, must equal adaptive.n_max. drop_all_fail
  leaves prompts with 0 correct out of the table's `prompts` (the file keeps them, all_fail). A response is
  correct when r >= pass_threshold (value_table.py). `reward_id` names what `draw` grades with (a user reward
  function's path and source hash): kept in meta.json, so a changed function does not resume on old V̂*.
  `watch`: a notice finishes and writes the chunk in flight, then raises `Preempted`.
  """
  prompts = list(prompts)
  n_samples = _check_args(prompts, n_samples, beta1, chunk_prompts, adaptive, pass_threshold)
  uids = [p.uid for p in prompts]
  stage_dir = os.path.join(out_dir, "stage1")
  chunk_dir = os.path.join(stage_dir, "chunks")
  meta = _meta(prompts, n_samples, float(beta1), chunk_prompts, seed, keep_responses, adaptive,
               float(pass_threshold), reward_id)
  bounds = [(s, min(s + chunk_prompts, len(prompts))) for s in range(0, len(prompts), chunk_prompts)]
  path_of = lambda c: os.path.join(chunk_dir, f"chunk_{c:05d}.jsonl")  # noqa: E731
  lead = jax.process_index() == 0  # the one process that reads and writes the files
  chunks = _finished_chunks(stage_dir, chunk_dir, meta, bounds, path_of, uids, float(beta1), log)
  done_prompts = sum(len(v) for v in chunks.values())
  if chunks:
    log(f"stage1: resuming: {len(chunks)} of {len(bounds)} chunks ({done_prompts} prompts) already done")
  watch = watch or preemption.Watch()  # one not installed never stops the run
  watch.resume_point = f"the chunks written in {chunk_dir}"
  with tqdm(total=len(prompts), initial=done_prompts, unit="prompt", desc="stage1 V*",
            disable=not (progress and lead), dynamic_ncols=True) as bar, watch.finishing("the Stage-1 chunk in flight"):
    for c in [c for c in range(len(bounds)) if c not in chunks]:
      s, e = bounds[c]
      chunks[c] = _sample_chunk(prompts[s:e], draw, chunk_key(seed, c), n_samples, float(beta1), keep_responses,
                                adaptive, float(pass_threshold))
      if lead:
        files.write_text_atomic(path_of(c), vt.to_jsonl(chunks[c]))
      bar.update(e - s)
      if watch.stop_requested():  # the same answer on every process
        watch.disarm()
        raise watch.preempted(f"Stage-1 chunk {c} finished and written to {path_of(c)}")
  records = [r for c in range(len(bounds)) for r in chunks[c]]
  return _finish(stage_dir, prompts, records, meta, drop_all_fail, log)


def _finish(stage_dir, prompts, records, meta, drop_all_fail: bool, log) -> vt.ValueTable:
  """vstar.jsonl and summary.json (process 0), once every process is past its last chunk."""
  lead = jax.process_index() == 0
  path = os.path.join(stage_dir, "vstar.jsonl")
  if lead:
    files.write_text_atomic(path, vt.to_jsonl(records))
  summary = vt.summarize(records)
  summary.update(beta1=meta["beta1"], n_samples=meta["n_samples"], adaptive=meta["adaptive"],
                 drop_all_fail=drop_all_fail)
  kept = [p for p, r in zip(prompts, records) if not (drop_all_fail and r["all_fail"])]
  summary["num_kept"] = len(kept)
  if lead:
    files.write_text_atomic(os.path.join(stage_dir, "summary.json"), json.dumps(summary, indent=1) + "\n")
  multihost.barrier("stage1_written")  # nobody goes on before the files are complete
  log(vt.format_summary(summary))
  if drop_all_fail:
    log(f"stage1: drop_all_fail: training on {len(kept)} of {len(prompts)} prompts")
  return vt.ValueTable({r["uid"]: r for r in records}, kept, path, summary)
