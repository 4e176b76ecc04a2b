"""The cache-free forward's causal attention (scoring, training) as a fused flash kernel.

XLA's blocked attention (layers.causal_attention) writes every block's fp32 scores and probabilities to HBM
and reads them back for the softmax and the PV matmul (and, in the backward, again): on 4 x H100 about a third of
pi_ref's scoring call (some 60 of 191 GB, compile-only). A flash kernel keeps a block's scores on chip and reads
Q, K, V and writes the output once. The kernels are the ones JAX ships: Triton on GPUs
(`pallas.ops.gpu.attention.mha`), Mosaic on TPUs (`pallas.ops.tpu.flash_attention`). Both want as many key/value
heads as query heads, so grouped-query K and V are repeated first ([B, T, N, H] each, small beside the scores),
and both take the mask as segment ids: a packed row's sequence ids (packing.py), or 1 for a real token and 0 for
padding. A padding query then attends to padding (its output feeds nothing); no real token sees either.

`model.train_attention` picks ("auto": the kernel on GPUs, XLA's blocks elsewhere: on TPUs the compile-only
projection has not shown the Mosaic kernel's grid steps paying off, docs/tpu.md 3.5).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from astarpo_jax.infra import platforms
from astarpo_jax.infra import sharding as sharding_lib
from astarpo_jax.model.config import TRAIN_ATTENTION

SCOPE = "flash_causal_attention"  # the named scope the aot cost model finds the kernels by (hlo_cost)


def train_attention(impl: str, platform: str) -> str:
  """"xla" or "flash" for the cache-free forward: `impl` as given, or "auto": flash on GPUs, XLA elsewhere."""
  if impl not in TRAIN_ATTENTION:
    raise ValueError(f"train_attention={impl!r}: use one of {TRAIN_ATTENTION}")
  if impl != "auto":
    return impl
  return "flash" if platforms.is_gpu(platform) else "xla"


def kernel_for(platform: str) -> str:
  """The flash kernel a platform runs: "triton" (GPU) or "mosaic" (TPU); the CPU has none (tests interpret one)."""
  if platforms.is_gpu(platform):
    return "triton"
  if platform == "tpu":
    return "mosaic"
  raise ValueError(f"train_attention='flash' runs a GPU or TPU kernel; on {platform!r} use 'xla' (or 'auto')")


def forward_kernel(impl: str, platform: str, T: int) -> str:
  """The kernel a cache-free forward of length T runs ("" = XLA's blocks): `impl` for `platform`; "auto" also keeps
  XLA's blocks for a length the kernel does not take ("flash" then refuses it, in `flash_causal_attention`)."""
  if train_attention(impl, platform) != "flash":
    return ""
  kernel = kernel_for(platform)
  return kernel if impl == "flash" or supports(T, kernel) else ""


def block_for(T: int, sizes: tuple[int, ...]) -> int:
  """The largest block in `sizes` that divides the sequence length T (the kernels want whole blocks); 0 if none."""
  return next((b for b in sizes if b <= T and T % b == 0), 0)


def supports(T: int, kernel: str) -> bool:
  """Whether a flash kernel takes sequences of length T (whole blocks: 16-row multiples on GPUs, 128 on TPUs)."""
  return block_for(T, _SIZES[kernel]) > 0


_SIZES = {"triton": (128, 64, 32, 16), "mosaic": (512, 256, 128)}


def _triton(q_BTNH, k_BTNH, v_BTNH, seg_BT, interpret: bool):
  from jax.experimental.pallas.ops.gpu import attention as gpu_attention
  T, H = q_BTNH.shape[1], q_BTNH.shape[3]
  fwd, bwd = block_for(T, _SIZES["triton"]), block_for(T, (32, 16))
  blocks = gpu_attention.BlockSizes(block_q=fwd, block_k=fwd, block_q_dkv=bwd, block_kv_dkv=bwd, block_q_dq=bwd,
                                    block_kv_dq=bwd)
  return gpu_attention.mha(q_BTNH, k_BTNH, v_BTNH, seg_BT, sm_scale=1.0 / math.sqrt(H), causal=True,
                           block_sizes=blocks, interpret=interpret)


def _mosaic(q_BTNH, k_BTNH, v_BTNH, seg_BT, interpret: bool):
  from jax.experimental.pallas.ops.tpu import flash_attention as tpu_attention
  T, H = q_BTNH.shape[1], q_BTNH.shape[3]
  b = block_for(T, _SIZES["mosaic"])
  blocks = tpu_attention.BlockSizes(block_q=b, block_k_major=b, block_k=b, block_b=1, block_q_major_dkv=b,
                                    block_k_major_dkv=b, block_k_dkv=b, block_q_dkv=b, block_k_major_dq=b,
                                    block_k_dq=b, block_q_dq=b)
  to_BNTH = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
  call = functools.partial(tpu_attention.flash_attention, segment_ids=tpu_attention.SegmentIds(seg_BT, seg_BT),
                           causal=True, sm_scale=1.0 / math.sqrt(H), block_sizes=blocks)
  del interpret  # the caller enters pltpu.force_tpu_interpret_mode() around the whole computation (the backward too)
  return to_BNTH(call(to_BNTH(q_BTNH), to_BNTH(k_BTNH), to_BNTH(v_BTNH)))


_KERNELS = {"triton": _triton, "mosaic": _mosaic}


def flash_causal_attention(q_BTNH, k_BTKH, v_BTKH, segments_BT, kernel: str, interpret: bool = False):
  """Causal attention within segments (ids as packing.py's; 0 = padding), softmax in fp32 inside the kernel.

  Equal to `layers.attention` under the mask causal & same-segment & key-is-real for every real query (a
  padding query's output differs and feeds nothing). `interpret`: run the Triton kernel in Pallas' interpreter
  (the CPU tests; for Mosaic's they enter pltpu.force_tpu_interpret_mode() around forward and backward). Under a
  mesh the kernel runs per device (shard_map over the rows, the heads on the tensor axis when they divide), with
  no collective."""
  B, T, N, H = q_BTNH.shape
  if not supports(T, kernel):
    raise ValueError(f"flash attention ({kernel}) needs the sequence length ({T}) to be a multiple of "
                     f"{min(_SIZES[kernel])}: use model.train_attention='xla'")
  group = N // k_BTKH.shape[2]
  k_BTNH, v_BTNH = (jnp.repeat(x, group, axis=2) if group > 1 else x for x in (k_BTKH, v_BTKH))
  seg_BT = segments_BT.astype(jnp.int32)
  fn = functools.partial(_KERNELS[kernel], interpret=interpret)
  with jax.named_scope(SCOPE):
    return _on_mesh(fn, N)(q_BTNH, k_BTNH, v_BTNH, seg_BT)


def _on_mesh(fn, num_heads: int):
  """`fn(q, k, v, seg)` per device under a mesh: rows over the batch axes and heads over the tensor axis that
  are not manual already (a shard_map the caller runs in, as the per-device update's)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn
  manual = set(getattr(mesh, "manual_axes", ()))
  free = {a: n for a, n in mesh.shape.items() if a not in manual}  # size-1 axes too: Mosaic wants all manual
  if not free:
    return fn
  P = jax.sharding.PartitionSpec
  rows = sharding_lib.logical_to_spec(("batch",), None, {a: free.get(a, 1) for a in mesh.shape})[0]
  head = "tensor" if free.get("tensor", 1) > 1 and num_heads % free["tensor"] == 0 else None
  qkv, seg = P(rows, None, head, None), P(rows, None)
  return jax.shard_map(fn, mesh=mesh, in_specs=(qkv, qkv, qkv, seg), out_specs=qkv, axis_names=set(free),
                       check_vma=False)
