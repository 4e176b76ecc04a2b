"""The responses of an evaluation: n per problem, sampled by chunk, graded by every grader, kept as records.

A chunk is `chunk_rows // n` problems (at least one), sampled in one rollout call (the engine: continuous
batching, the n samples of a problem from one prefill) with the key `fold_in(key, its first row)` (rows counted
n per problem, as training.evaluate keys its chunks); with an output
folder each finished chunk is a JSONL file, so a killed evaluation resumes at its first missing chunk and
samples nothing twice. A record is one response: its set, mode ("greedy" or "sampled"), problem uid, sample
index, text, length, truncation, and per grader its reward and extracted answer (None for a user's function,
which has no extractor). `regrade` grades kept records again without sampling.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from astarpo_jax.data.dataset import Prompt
from astarpo_jax.infra import files, multihost
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.rewards import grading, user_grader
from astarpo_jax.sampling import rollout as rollout_lib
from astarpo_jax.sampling.token_choice import SamplingConfig
from astarpo_jax.training.evaluate import greedy

MODES = ("greedy", "sampled")


@dataclasses.dataclass(frozen=True)
class Engine:
  """How responses are drawn and graded; the same for every set and model of an evaluation.

  graders: (name, grade) pairs, the first the headline; a grade is `(texts, golds, truncated) -> Graded`, and
  `grade.eos_required` (experiment.Grader's; False when absent) says whether a response cut off scores 0,
  which the extracted answers follow too.
  """
  cfg: ModelConfig
  tokenizer: Any
  scfg: SamplingConfig  # the sampled mode's; the greedy mode decodes the same limits greedily
  graders: tuple[tuple[str, Callable], ...]
  max_batch: int | None = None
  sample_mesh: Any = None
  chunk_rows: int = 256  # responses per rollout call (and per resumable chunk)


@dataclasses.dataclass(frozen=True)
class SetRun:
  """One set in one mode: greedy (one response) or n sampled responses per problem."""
  name: str
  mode: str
  n: int
  prompts: tuple[Prompt, ...]

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"SetRun.mode={self.mode!r}: expected one of {MODES}")
    if self.n < 1 or (self.mode == "greedy" and self.n != 1):
      raise ValueError(f"SetRun {self.name}: n={self.n}; greedy takes n=1, sampled n >= 1")
    if not self.prompts:
      raise ValueError(f"SetRun {self.name}: no prompts")

  @property
  def label(self) -> str:
    return f"{self.name}/{'pass@1' if self.mode == 'greedy' else f'avg@{self.n}'}"


def answer_of(name: str, grade: Callable, text: str, truncated: bool) -> str | None:
  """The answer `name` extracts from `text` (what maj@k votes on), or None (no answer, or a user's function)."""
  if user_grader.is_spec(name):
    return None
  return grading.extract(name, text, bool(truncated) if getattr(grade, "eos_required", False) else None)


def grade_records(records: list[dict], golds: Sequence, graders: Sequence[tuple[str, Callable]]) -> list[dict]:
  """`records` with each grader's reward and answer set (golds: one per record, as the graders take them)."""
  texts = [r["response"] for r in records]
  truncated = [bool(r["truncated"]) for r in records]
  for name, grade in graders:
    rewards = np.asarray(grade(texts, list(golds), truncated)[0], np.float64)
    for r, reward, text, cut in zip(records, rewards, texts, truncated):
      r.setdefault("rewards", {})[name] = float(reward)
      r.setdefault("answers", {})[name] = answer_of(name, grade, text, cut)
  return records


def _fingerprint(engine: Engine, run: SetRun, model_id: str) -> dict:
  ids = hashlib.sha256(json.dumps([[p.uid, list(p.ids)] for p in run.prompts]).encode()).hexdigest()[:16]
  s = engine.scfg
  return {"set": run.name, "mode": run.mode, "n": run.n, "prompts": ids, "num_prompts": len(run.prompts),
          "model": model_id, "chunk_rows": engine.chunk_rows, "temperature": s.temperature, "top_p": s.top_p,
          "top_k": s.top_k, "max_new_tokens": s.max_new_tokens, "graders": [g for g, _ in engine.graders]}


def _folder_name(name: str) -> str:
  """A set's chunk folder: its name, or for a file path its last characters made safe and a digest of the path."""
  if re.fullmatch(r"[\w.-]+", name):
    return name
  return re.sub(r"[^\w.-]", "_", name)[-48:] + "-" + hashlib.sha256(name.encode()).hexdigest()[:8]


def _open_chunks(chunk_dir: str, meta: dict) -> None:
  """Writes the run's meta.json, or checks that an earlier run's matches (else its chunks are not ours)."""
  path = os.path.join(chunk_dir, "meta.json")
  if os.path.exists(path):
    with open(path) as f:
      stored = json.load(f)
    diff = {k: (stored.get(k), v) for k, v in meta.items() if stored.get(k) != v}
    if diff:
      raise ValueError(f"{chunk_dir} holds chunks of another evaluation ({diff}: stored vs now); evaluate into "
                       "another --out folder, or delete that one to start over")
  else:
    os.makedirs(chunk_dir, exist_ok=True)
    files.write_text_atomic(path, json.dumps(meta, indent=1))


def sample_set(engine: Engine, params, run: SetRun, key: jax.Array, *, model_id: str = "", out_dir: str | None = None,
               log=print) -> list[dict]:
  """Every record of `run` (problem-major, sample index within): sampled and graded by chunk; with `out_dir`,
  finished chunks are read back instead of sampled (resume) and new ones written as they finish."""
  scfg = greedy(engine.scfg) if run.mode == "greedy" else engine.scfg
  per_chunk = max(1, engine.chunk_rows // run.n)
  chunk_dir = os.path.join(out_dir, "chunks", _folder_name(run.name), run.mode) if out_dir else None
  if chunk_dir and jax.process_index() == 0:
    _open_chunks(chunk_dir, _fingerprint(engine, run, model_id))
  (_, headline), others = engine.graders[0], engine.graders[1:]
  out: list[dict] = []
  num_chunks = -(-len(run.prompts) // per_chunk)
  for i in range(num_chunks):
    chunk = run.prompts[i * per_chunk:(i + 1) * per_chunk]
    path = os.path.join(chunk_dir, f"{i:05d}.jsonl") if chunk_dir else None
    done = None
    if path:  # process 0 reads a finished chunk; every process gets it (they sample together or not at all)
      done = multihost.broadcast_json(read_jsonl(path) if jax.process_index() == 0 and os.path.exists(path) else None)
    if done is not None:
      out += done
      continue
    r = rollout_lib.rollout(engine.cfg, params, [p.ids for p in chunk], [p.target for p in chunk],
                            jax.random.fold_in(key, i * per_chunk * run.n), scfg, engine.tokenizer, headline,
                            engine.max_batch, num_samples=run.n, sample_mesh=engine.sample_mesh)
    records = [{"set": run.name, "mode": run.mode, "uid": chunk[b // run.n].uid, "sample": b % run.n,
                "response": r.texts[b], "length": int(r.length_B[b]), "truncated": bool(r.truncated_B[b])}
               for b in range(len(r.texts))]
    golds = [chunk[b // run.n].target for b in range(len(records))]
    for rec, reward in zip(records, r.rewards_B):
      rec["rewards"] = {engine.graders[0][0]: float(reward)}
      rec["answers"] = {engine.graders[0][0]: answer_of(engine.graders[0][0], headline, rec["response"],
                                                        rec["truncated"])}
    grade_records(records, golds, others)
    if path and jax.process_index() == 0:
      files.write_text_atomic(path, "".join(json.dumps(x) + "\n" for x in records))
    out += records
    if num_chunks > 1:
      log(f"eval {run.label}: chunk {i + 1}/{num_chunks} ({len(chunk)} problems)")
  return out


def read_jsonl(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: str, records: Sequence[dict]) -> None:
  files.write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def regrade(records: list[dict], golds_by_uid: dict, graders: Sequence[tuple[str, Callable]]) -> list[dict]:
  """Kept records graded again by `graders` (their rewards and answers replaced), without sampling."""
  missing = sorted({r["uid"] for r in records} - set(golds_by_uid))
  if missing:
    raise ValueError(f"regrade: {len(missing)} sampled problems are not in the sets given (e.g. {missing[:3]}); "
                     "pass the same --sets (and data files) as the evaluation that sampled them")
  fresh = [{k: v for k, v in r.items() if k not in ("rewards", "answers")} for r in records]
  return grade_records(fresh, [golds_by_uid[r["uid"]] for r in records], graders)
