"""A rollout's rows packed into fewer rows of the same width, so the cache-free forwards skip padding.

A rollout's rows are [left-padded prompt | right-padded response], all as wide as the longest response's
bucket (rollout.trim_response). When responses stop early most columns are padding, and the update's
forward and backward compute them all the same (docs/performance.md: two thirds of the columns at the
chains task's lengths). Packing moves each row's real tokens (its prompt's and its response's, which are
contiguous) into packed rows of the same width, first fit by decreasing length, each row a segment whose
positions start at 0; the model attends within a segment (`model.hidden_states(segments_BT=...)`). The
hidden state that predicts response token t of row b is read back by a gather (`src_BR`), so log-probs,
entropies and every method's loss keep their [B, R] layout and values (up to summation order).

The official A*-PO config pads every response to max_response_length and leaves verl's packing off
(`use_remove_padding: False` in verl/trainer/config/apo_trainer.yaml); here `train.pack_rows` is on by default
(the arithmetic is the same, tests/test_packing.py), False pads as the official config does.
Host-side numpy; the packed row count is rounded up to a multiple of an eighth of the micro-batch, so at
most eight shapes compile per response width (a power of two lost the gain: 9 rows needed of 16 ran 16).
On a mesh that splits rows (data x fsdp > 1) each batch shard's rows are packed apart, into rows of that
shard, and read back within it: no packed row spans two devices.
"""
from __future__ import annotations

import numpy as np

KEYS = ("pack_tokens", "pack_segments", "pack_positions", "pack_src")


def _bins(lengths_B: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, int]:
  """(packed row, offset) of every row, first fit by decreasing length, and the number of packed rows."""
  row_B, off_B, fill = np.zeros(len(lengths_B), np.int64), np.zeros(len(lengths_B), np.int64), []
  for b in np.argsort(-lengths_B, kind="stable"):
    n = int(lengths_B[b])
    q = next((i for i, f in enumerate(fill) if f + n <= width), len(fill))
    if q == len(fill):
      fill.append(0)
    row_B[b], off_B[b] = q, fill[q]
    fill[q] += n
  return row_B, off_B, len(fill)


def pack_rows(tokens_BS: np.ndarray, mask_BS: np.ndarray, prompt_len: int, num_packed: int | None = None,
              bins: tuple | None = None) -> dict[str, np.ndarray]:
  """The packed arrays of one batch of rows: tokens, segment ids (row index + 1; 0 is padding) and
  positions [Q, S], and src_BR, the flat index into [Q * S] of the hidden state that predicts response
  token t of row b (a response's padding points at its row's last real token: masked by the losses).
  `bins`: `_bins` of these rows when the caller has it already."""
  tokens_BS, mask_BS = np.asarray(tokens_BS), np.asarray(mask_BS, bool)
  B, S = mask_BS.shape
  R = S - prompt_len
  lengths_B = mask_BS.sum(1)
  prompt_B, resp_B = mask_BS[:, :prompt_len].sum(1), mask_BS[:, prompt_len:].sum(1)
  if (lengths_B != prompt_B + resp_B).any() or (prompt_B == 0).any():
    raise ValueError("pack_rows needs rows of a left-padded prompt (at least one token) and a response")
  starts_B = prompt_len - prompt_B
  if not all(mask_BS[b, starts_B[b]:starts_B[b] + lengths_B[b]].all() for b in range(B)):
    raise ValueError("pack_rows needs each row's real tokens contiguous (left-padded prompt, right-padded "
                     "response)")
  row_B, off_B, Q = bins if bins is not None else _bins(lengths_B, S)
  if num_packed is not None:
    if num_packed < Q:
      raise ValueError(f"the rows need {Q} packed rows, more than num_packed={num_packed}")
    Q = num_packed
  tokens_QS, seg_QS, pos_QS = (np.zeros((Q, S), np.int32) for _ in range(3))
  for b in range(B):
    q, o, n = row_B[b], off_B[b], lengths_B[b]
    tokens_QS[q, o:o + n] = tokens_BS[b, starts_B[b]:starts_B[b] + n]
    seg_QS[q, o:o + n] = b + 1
    pos_QS[q, o:o + n] = np.arange(n)
  t_BR = np.minimum(np.arange(R)[None, :], np.maximum(resp_B - 1, 0)[:, None])
  src_BR = row_B[:, None] * S + off_B[:, None] + prompt_B[:, None] + t_BR - 1
  return {"pack_tokens": tokens_QS, "pack_segments": seg_QS, "pack_positions": pos_QS,
          "pack_src": src_BR.astype(np.int32)}


def _rounded(needed: int, rows: int) -> int:
  """Packed rows for `needed` of `rows`: rounded up to a multiple of rows / 8 (at most eight shapes)."""
  step = max(1, rows // 8)
  return min(rows, -(-needed // step) * step)


def pack_microbatches(mb: dict[str, np.ndarray], prompt_len: int, shards: int = 1) -> dict[str, np.ndarray]:
  """`mb` ([M, b, ...] arrays with "tokens" and "mask") with each micro-batch's rows packed: pack_tokens,
  pack_segments and pack_positions [M, W, Q, S] and pack_src [M, W, b / W, R] added.

  W = `shards`, the batch shards of the mesh (sharding.batch_ways): each shard's b / W consecutive rows are
  packed apart into its own Q rows and pack_src indexes that shard's [Q * S] columns, so under the
  sharding of axis 1 the forward and the gather back never cross devices. Q is the most any shard of any
  micro-batch needs, rounded up to a multiple of (b / W) / 8.
  """
  tokens, mask = np.asarray(mb["tokens"]), np.asarray(mb["mask"], bool)
  M, b, S = mask.shape
  if shards < 1 or b % shards:
    raise ValueError(f"pack_microbatches: {b} rows per micro-batch do not split into {shards} batch shards")
  g = b // shards
  shard = [slice(w * g, (w + 1) * g) for w in range(shards)]
  bins = [[_bins(mask[m, r].sum(1), S) for r in shard] for m in range(M)]  # once per shard: Q, then the fill
  Q = _rounded(max(q for per_m in bins for _, _, q in per_m), g)
  packed = [[pack_rows(tokens[m, r], mask[m, r], prompt_len, Q, bins[m][w]) for w, r in enumerate(shard)]
            for m in range(M)]
  return {**mb, **{k: np.stack([np.stack([p[k] for p in per_m]) for per_m in packed]) for k in KEYS}}


def packed_shapes(rows: int, prompt_len: int, response_len: int, shards: int = 1, fill: float = 0.5) -> dict:
  """{key: (shape, dtype)} of one micro-batch's packed arrays when each shard's rows need `fill` of their
  row count once packed (the ahead-of-time compiles' stand-in for a rollout's lengths)."""
  g = rows // shards
  Q = _rounded(int(np.ceil(fill * g - 1e-9)), g)
  S = prompt_len + response_len
  return {**{k: ((shards, Q, S), np.int32) for k in KEYS[:3]}, "pack_src": ((shards, g, response_len), np.int32)}


def fill_of_lengths(lengths_NXg: np.ndarray, width: int) -> float:
  """The packed row count, as a share of the g rows of a group, that pack_microbatches gives for lengths drawn
  N times for X groups (every shard of every micro-batch packed together) of g rows: per draw the most any group
  needs, rounded as the run rounds it; the median over draws. The projections' stand-in for a run's lengths."""
  N, X, g = lengths_NXg.shape
  if (lengths_NXg > width).any():
    raise ValueError(f"fill_of_lengths: a row of more than width={width} tokens")
  Q_N = [_rounded(max(_bins(lengths_NXg[n, x], width)[2] for x in range(X)), g) for n in range(N)]
  return float(np.median(Q_N)) / g


def from_batch(mb: dict) -> dict | None:
  """The packed arrays of a (micro-)batch, or None where it is not packed."""
  return {k: mb[k] for k in KEYS} if KEYS[0] in mb else None
