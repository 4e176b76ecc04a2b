"""The run's shape as the memory plan and the compiles see it (RunShape), and per-device byte counts of
sharded trees: what memory_plan.py, the AOT phases and the fit search share (memory_plan.py re-exports them)."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from astarpo_jax.infra import sharding as sharding_lib
from astarpo_jax.model import lora as lora_lib

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class RunShape:
  """The run settings that decide memory (worst case: the longest prompt bucket, full responses)."""
  prompt_len: int  # P, padded prompt bucket
  response_len: int  # R, sampling.max_new_tokens
  rollout_batch: int  # prompts per rollout
  micro_batch: int  # prompts per forward/backward of the update
  sample_batch: int  # decode slots (sampler.decode_slots: sampling.max_batch or the accelerators' default)
  logp_chunk: int = 256  # response positions per block of logits
  reference_batch: int | None = None  # prompts per scoring forward; None = micro_batch (as the loop runs it)
  rows_per_prompt: int = 1  # G responses per prompt (the method's)
  mini_batch: int = 0  # prompts per optimizer step (0 = micro_batch): M = mini_batch / micro_batch micro-batches
  stage1_batch: int = 0  # rows per Stage-1 sampler call (chunk_prompts x n_samples, or max_batch); 0 = sample_batch
  stage1_prompts: int = 0  # prompts per Stage-1 sampler call (stage1.chunk_prompts); 0 = rollout_batch
  ref_param_dtype: str = "bfloat16"  # the frozen reference (Stage 1 samples with it)
  decode_len: int = 0  # the decode segment compiled: its cache reaches P + decode_len - 1 slots; 0 = response_len
  micro_batch_per_device: int = 0  # the config's train.micro_batch_per_device (0: micro_batch is set globally)
  lora: lora_lib.LoraConfig | None = None  # model.lora: an adapter on the frozen base (None = full fine-tuning)
  optimizer: str = "adamw"  # optim.kind: "adamw" (official) or "adafactor" (training/optimizers.py)
  mu_dtype: str = ""  # optim.mu_dtype: AdamW's first moment's dtype ("" = the param dtype, official)

  @property
  def micro_setting(self) -> str:
    """The config field that sets micro_batch, for advice a user can apply as written."""
    if self.micro_batch_per_device:
      return (f"train.micro_batch_per_device (now {self.micro_batch_per_device}: {self.micro_batch} prompts per "
              "micro-batch over the batch shards)")
    return f"train.micro_batch (now {self.micro_batch})"

  @property
  def seq_len(self) -> int:
    return self.prompt_len + self.response_len

  @property
  def reference_rows(self) -> int:
    return (self.reference_batch or self.micro_batch) * self.rows_per_prompt

  @property
  def micro_rows(self) -> int:
    return self.micro_batch * self.rows_per_prompt

  @property
  def mini_rows(self) -> int:
    return (self.mini_batch or self.micro_batch) * self.rows_per_prompt

  @property
  def stage1_rows(self) -> int:
    return self.stage1_batch or self.sample_batch


def format_bytes(n: int) -> str:
  """'12.34 GiB' or '5.6 MiB'."""
  return f"{n / GiB:.2f} GiB" if abs(n) >= GiB / 4 else f"{n / (1 << 20):.1f} MiB"


def _nbytes(shape, dtype) -> int:
  return int(np.prod(shape, dtype=np.int64)) * jnp.dtype(dtype).itemsize


def tree_bytes_per_device(shapes, shardings) -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs placed with `shardings` (same tree)."""
  return sum(_nbytes(sh.shard_shape(s.shape), s.dtype) for s, sh in
             zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings)))


def _local(dim: int, name: str, mesh_shape: dict[str, int]) -> int:
  """Per-device size of a dim with logical axis `name` under the rule table (whole if indivisible)."""
  spec = sharding_lib.logical_to_spec((name,), (dim,), mesh_shape)[0]
  axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
  return dim // math.prod(mesh_shape[a] for a in axes)
