"""The V̂* table: Stage 1's result, one record per training prompt, and its file format.

A record (one JSONL line): uid, vstar, num_correct, n, rewards [n], num_truncated, all_fail, pass_threshold,
and with keep_responses also responses [n] and truncated [n]. Rewards lie in [0, 1]: the built-in graders
give 0/1, a user's function any value between. A response passes (is "correct") when r >= pass_threshold τ
(config reward.pass_threshold; 1 = full credit; for 0/1 rewards every τ in (0, 1] counts the same):
num_correct counts the passes, all_fail means none passed.

V̂*(x) = β1·log mean_i exp(r_i/β1) is `optimal_value`, for any r in [0, 1]: a soft maximum of the rewards,
from their mean (β1 → ∞; β1 = 0 also gives the mean here, as the paper does) to their maximum (β1 → 0+).
β1 is in reward units: a sample scoring β1 less than another weighs e times less in V̂*. Stage 2 looks V̂*
up by prompt uid (`ValueTable.lookup`); estimate.py writes the table, official_data.py imports one from
the official A*-PO data sets.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from astarpo_jax.data.dataset import Prompt
from astarpo_jax.infra import files
from astarpo_jax.infra.masks import check_shapes, f32, is_concrete

RECORD_KEYS = ("uid", "vstar", "num_correct", "n", "rewards")


def optimal_value(rewards_PN: jax.Array, beta1: float, mask_PN: jax.Array | None = None) -> jax.Array:
  """V̂*(x) = β1·log( mean_i exp(r_i/β1) ) over the masked-in samples of each prompt (log-sum-exp).

  β1 = 0 gives the plain mean (the β1 → 0 limit is the max; the paper uses the mean there).
  `mask_PN` allows a different N per prompt (adaptive sampling); every prompt needs ≥ 1 sample.
  """
  check_shapes("optimal_value", rewards_PN=(rewards_PN, ("P", "N")), mask_PN=(mask_PN, ("P", "N")))
  if not isinstance(beta1, (int, float)) or beta1 < 0:
    raise ValueError(f"optimal_value: `beta1` must be a Python number >= 0, got {beta1!r}")
  r = rewards_PN.astype(f32)
  mask = jnp.ones(r.shape, bool) if mask_PN is None else mask_PN.astype(bool)
  count_P = mask.sum(-1)
  if is_concrete(count_P) and bool((count_P == 0).any()):
    empty = [int(i) for i in jnp.nonzero(count_P == 0)[0]]
    raise ValueError(f"optimal_value: prompts {empty[:10]} have no sample in `mask_PN`; V* is undefined for them")
  if beta1 == 0:
    return jnp.where(mask, r, 0.0).sum(-1) / jnp.maximum(count_P, 1)
  scaled = jnp.where(mask, r / beta1, -jnp.inf)
  return beta1 * (jax.nn.logsumexp(scaled, axis=-1) - jnp.log(jnp.maximum(count_P, 1).astype(f32)))


@dataclasses.dataclass
class ValueTable:
  """Stage 1's result: the records of every prompt, the prompts to train on, the file and its summary."""
  records: dict[str, dict[str, Any]]  # uid -> record, in prompt order, all prompts
  prompts: list[Prompt]  # the prompts to train on (all-fail ones removed under drop_all_fail)
  path: str  # the V̂* file (vstar.jsonl), or "" when nothing was written
  summary: dict[str, Any]

  def lookup(self, prompts: Sequence[Prompt | str]) -> np.ndarray:
    """V̂* of each prompt (or uid), [P] float32."""
    return lookup(self.records, prompts)


def make_records(uids: Sequence[str], rewards_PN: np.ndarray, mask_PN: np.ndarray, beta1: float,
                 truncated_PN: np.ndarray | None = None, responses: Sequence[Sequence[str]] | None = None,
                 lengths_PN: np.ndarray | None = None, pass_threshold: float = 1.0) -> list[dict[str, Any]]:
  """One record per prompt from its (masked-in) rewards; V̂* from `optimal_value`, passes at r >= pass_threshold."""
  mask_PN = np.asarray(mask_PN, bool)
  v_P = np.asarray(optimal_value(np.asarray(rewards_PN, np.float32), beta1, mask_PN))
  out = []
  for p, uid in enumerate(uids):
    r = [float(x) for x in np.asarray(rewards_PN[p], np.float32)[mask_PN[p]]]
    k = sum(x >= pass_threshold for x in r)
    rec = {"uid": uid, "vstar": float(v_P[p]), "num_correct": int(k), "n": len(r), "rewards": r,
           "num_truncated": None if truncated_PN is None else int(np.asarray(truncated_PN[p])[mask_PN[p]].sum()),
           "all_fail": k == 0, "pass_threshold": float(pass_threshold)}
    if lengths_PN is not None:
      rec["num_tokens"] = int(np.asarray(lengths_PN[p])[mask_PN[p]].sum())
    if responses is not None:
      rec["responses"] = list(responses[p])
      rec["truncated"] = [bool(t) for t in np.asarray(truncated_PN[p])[mask_PN[p]]]
    out.append(rec)
  return out


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """Figures the paper does not give: pass-count histogram over 0..max n, zero/all-correct shares,
  mean V̂*, mean pass rate k/n, mean reward, pass@n, truncated share (when known)."""
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
      "mean_reward": float(np.mean([np.mean(r["rewards"]) for r in records])),  # = mean_pass_rate for 0/1 rewards
      "frac_truncated": None if None in trunc else float(sum(trunc) / n.sum()),
      "num_tokens": sum(r["num_tokens"] for r in records) if all("num_tokens" in r for r in records) else None,
  }
  return out


def format_summary(s: Mapping[str, Any]) -> str:
  trunc = "n/a" if s["frac_truncated"] is None else f"{s['frac_truncated']:.3f}"
  return (f"stage1: {s['num_prompts']} prompts, {s['num_samples']} samples (mean n {s['mean_n']:.2f}); "
          f"pass-count histogram {s['pass_count_hist']}; zero correct {s['frac_zero_correct']:.3f} "
          f"(no exploration guarantee there), all correct {s['frac_all_correct']:.3f}; "
          f"mean V* {s['mean_vstar']:.4f}, mean pass rate {s['mean_pass_rate']:.4f}, truncated {trunc}")


def check_record(rec: Any, where: str) -> str | None:
  """Why `rec` is not a well-formed record, or None."""
  if not isinstance(rec, dict) or any(k not in rec for k in RECORD_KEYS):
    return f"{where}: not a record with keys {RECORD_KEYS}"
  r = rec["rewards"]
  if not isinstance(r, list) or len(r) != rec["n"] or rec["n"] < 1:
    return f"{where}: `rewards` must be a list of n={rec['n']} numbers"
  threshold = rec.get("pass_threshold", 1.0)  # files written before it was recorded used 1
  if rec["num_correct"] != sum(x >= threshold for x in r):
    return f"{where}: num_correct={rec['num_correct']} disagrees with the rewards (passing at r >= {threshold})"
  if not (isinstance(rec["vstar"], (int, float)) and math.isfinite(rec["vstar"])):
    return f"{where}: vstar={rec['vstar']!r} is not a finite number"
  return None


def load_table(path: str) -> dict[str, dict[str, Any]]:
  """uid -> record of a V̂* file (Stage 1's vstar.jsonl, or one written by `import_eval_columns`)."""
  if not files.path(path).is_file():
    raise FileNotFoundError(f"V* file not found: {path}")
  out = {}
  for lineno, line in enumerate(files.path(path).read_text(encoding="utf-8").splitlines(), 1):
    if not line.strip():
      continue
    try:
      rec = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); the file is damaged") from None
    problem = check_record(rec, f"{path}:{lineno}")
    if problem:
      raise ValueError(problem)
    if rec["uid"] in out:
      raise ValueError(f"{path}:{lineno}: uid {rec['uid']!r} appears twice")
    out[rec["uid"]] = rec
  return out


def lookup(records: Mapping[str, Mapping[str, Any]], prompts: Sequence[Prompt | str]) -> np.ndarray:
  """V̂* of each prompt (or uid) from `records` (uid -> record), [P] float32."""
  uids = [p if isinstance(p, str) else p.uid for p in prompts]
  missing = [u for u in uids if u not in records]
  if missing:
    raise KeyError(f"no V* for {len(missing)} of {len(uids)} prompts (first: {missing[:5]}); run "
                   "Stage 1 on these prompts or drop them")
  return np.array([records[u]["vstar"] for u in uids], np.float32)


def to_jsonl(records: Sequence[Mapping[str, Any]]) -> str:
  """The records as a JSONL file's text, one per line, in order."""
  return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
