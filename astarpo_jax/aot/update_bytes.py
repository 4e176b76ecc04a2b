"""The HBM bytes one device must touch in one call of the update (`update.update_step`), from the model and the run:
the floor a compiled update's HBM bytes (`hlo_cost`) are read against; what a compile moves above it is copies,
intra-layer activations and attention scores (not counted here).

Per device and optimizer step, with P params (P_L in the layers and norms, DV in the output projection, VD in the
embedding), M micro-batches, c / m the compute / master dtype's bytes, n the batch ways (data x fsdp) that shard
the master params, t the tensor ways, A the ways the gradient accumulator is split (n: reduce-scattered each
micro-batch; 1: accumulated whole on each device), C = ceil(R / chunk) log-prob chunks:

  copy         (m + 2c) P / (n t) + c P / t     cast the master shard, all-gather the compute copy (once per step:
                                                gather_weights per_step)
  weights      M (3 c P_L + 3 C c DV) / t       each layer's weights read by its forward, its remat recompute and its
                                                backward's input gradient; the output projection by each chunk's
                                                logits, their recompute and the hidden states' gradient
  gradients    M (c P_L + c VD + 2 C c DV) / t  each weight gradient written once (the embedding's scattered into a
                                                zeroed [V, D]); the projection's accumulated over the chunks
  accumulate   M (c P / t + 2 m P / (A t))      each micro-batch's gradient read into the accumulator, read and written
  optimizer    8 m P / (n t)                    AdamW once: gradient read for the norm and the update; params, mu, nu
                                                read and written
  activations  M 5 L r S D c                    at each layer boundary the residual written and read forward, read
                                                again by the remat recompute, its gradient written and read backward
  logits       M (16 + 3 c) h R V / t           each [h, chunk, V] fp32 block written and read forward, recomputed and
                                                read backward, its bf16 gradient written and read by two matmuls

r rows of S columns a micro-batch on a device (packed rows when packed), h the response rows whose logits it forms
(the unpacked rows: packing gathers the response back), D the model dim, L layers, R response positions.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from astarpo_jax.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class UpdateShape:
  """One device's share of one update call."""
  micro_batches: int  # M
  rows: int  # r: rows of seq_len columns each micro-batch's layers run on this device (packed rows when packed)
  head_rows: int  # h: response rows whose logits each micro-batch forms on this device
  seq_len: int  # S
  response_len: int  # R
  logp_chunk: int  # positions per block of logits (train.logp_chunk)
  batch_ways: int  # n: data x fsdp, the master params' and optimizer state's split
  tensor_ways: int = 1  # t
  acc_ways: int | None = None  # A: the gradient accumulator's split; None = batch_ways (reduce-scattered each step)


def update_bytes(cfg: ModelConfig, shape: UpdateShape) -> dict[str, float]:
  """{term: bytes} of the module docstring's formula for `cfg` (its param and compute dtypes) at `shape`, and
  "total"."""
  for name in ("micro_batches", "rows", "head_rows", "seq_len", "response_len", "logp_chunk", "batch_ways",
               "tensor_ways"):
    if int(getattr(shape, name)) < 1:
      raise ValueError(f"UpdateShape.{name}={getattr(shape, name)!r}: must be >= 1")
  c, m = jnp.dtype(cfg.dtype).itemsize, jnp.dtype(cfg.param_dtype).itemsize
  D, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
  P = cfg.num_params
  head = D * V  # the output projection (the embedding itself when tied)
  embed = 0 if cfg.tie_embeddings else V * D
  P_L = P - head - embed
  M, n, t = shape.micro_batches, shape.batch_ways, shape.tensor_ways
  A = shape.acc_ways or n
  C = math.ceil(shape.response_len / min(shape.logp_chunk, shape.response_len))
  out = {
      "copy": (m + 2 * c) * P / (n * t) + c * P / t,
      "weights": M * (3 * c * P_L + 3 * C * c * head) / t,
      "gradients": M * (c * P_L + c * V * D + 2 * C * c * head) / t,
      "accumulate": M * (c * P / t + 2 * m * P / (A * t)),
      "optimizer": 8 * m * P / (n * t),
      "activations": M * 5 * L * shape.rows * shape.seq_len * D * c,
      "logits": M * (16 + 3 * c) * shape.head_rows * shape.response_len * V / t,
  }
  out["total"] = sum(out.values())
  return out


def of_run(cfg: ModelConfig, run, mesh_shape, packed_rows: int | None = None, acc_ways: int | None = None
           ) -> UpdateShape:
  """The UpdateShape of an `aot.run_shape.RunShape` (a method's run: its rows per prompt) on a (data, fsdp, tensor)
  mesh; `packed_rows`: the rows a device's micro-batch packs into (default: unpacked)."""
  d, f, t = (int(x) for x in mesh_shape)
  n = d * f
  if run.micro_rows % n:
    raise ValueError(f"micro-batch of {run.micro_rows} rows does not split over {n} batch shards")
  rows = run.micro_rows // n
  return UpdateShape(micro_batches=run.mini_rows // run.micro_rows, rows=packed_rows or rows, head_rows=rows,
                     seq_len=run.seq_len, response_len=run.response_len, logp_chunk=run.logp_chunk, batch_ways=n,
                     tensor_ways=t, acc_ways=acc_ways)
