"""FLOPs, memory bytes and collective bytes of a compiled XLA program, loops counted per trip.

`compiled.cost_analysis()` counts the body of a `lax.scan` / `while_loop` once, not once per trip,
so a 28-layer scan inside an 8-micro-batch scan is undercounted 224-fold. This module reads the
optimised HLO text (`compiled.as_text()`) and sums each computation's cost the way XLA's
HloCostAnalysis does, multiplying every while body by its trip count, read from the loop itself:
the condition `i < N`, the counter's constant start (through copies) and its constant step in the
body (TPU's collective matmul loops step by 2). A loop whose count depends on data (the sampler's
decode loop) counts `unknown_trips` times, so its per-trip cost is cost(1) - cost(0).

Counted like HloCostAnalysis: a dot or convolution is 2 FLOPs per multiply-add over the valid
(non-padding) window positions; an elementwise op 1 FLOP per output element (exp, log, rsqrt, ...
are transcendentals instead). Bytes are each top-level op's operands plus outputs; a fusion operand
read only through (dynamic-)slices counts the slices, an in-place dynamic-update-slice output the
update (likewise for unfused slices and updates), and a scatter, as HloCostAnalysis::HandleScatter
counts it (the operand updated in place), three times its updates plus its indices. A TPU async collective fusion that only continues
a collective started elsewhere (its result buffer comes in aliased) counts neither the collective
again nor the buffers it passes through in place. `bytes` counts every memory space (XLA's "bytes accessed"); `hbm_bytes` only buffers in
device memory (TPU layouts `S(n)` with n > 0 are on-chip VMEM / SMEM, which costs no HBM
bandwidth), and an async copy counts its source and destination once each. Collective bytes are
what one device sends or receives: all-gather (n-1)x its shard, reduce-scatter and all-reduce (ring)
(n-1)/n and 2(n-1)/n of the input, permutes and all-to-all their input. `custom_calls` counts kernel
launches (Pallas, ...), whose FLOPs the caller adds analytically; cuBLAS matmuls are counted from
their backend_config.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re

import numpy as np

from astarpo_jax.aot import hlo_text
from astarpo_jax.aot.hlo_text import Computation, Instr

_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id",
         "replica-id", "while", "call", "conditional", "opt-barrier", "optimization-barrier"}
_TRANSCENDENTAL = {"exponential", "exponential-minus-one", "log", "log-plus-one", "tanh", "logistic", "rsqrt",
                   "sqrt", "cbrt", "power", "sine", "cosine", "tan", "atan2", "erf"}
_ELEMENTWISE = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "compare", "select", "and", "or",
                "xor", "not", "negate", "abs", "clamp", "remainder", "convert", "floor", "ceil", "round-nearest-even",
                "round-nearest-afz", "sign", "shift-left", "shift-right-logical", "shift-right-arithmetic",
                "is-finite", "popcnt", "count-leading-zeros"}
# Ops that only copy, slice, update in place or retype data (no arithmetic): a fusion made of these alone (and of
# scalar index arithmetic) is counted in Cost.moved too, by its root.
_MOVES = {"copy", "dynamic-slice", "dynamic-update-slice", "slice", "concatenate", "convert", "transpose", "pad",
          "reshape", "broadcast", "bitcast-convert"}
_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all",
                "ragged-all-to-all", "collective-broadcast")


@dataclasses.dataclass
class Cost:
  flops: float = 0.0
  transcendentals: float = 0.0
  bytes: float = 0.0  # every memory space, as XLA's "bytes accessed"
  hbm_bytes: float = 0.0  # device memory only
  collective_bytes: float = 0.0
  collective_count: float = 0.0  # collectives issued (trip counts included), for their fixed latency
  collective_hops: float = 0.0  # sum over them of (replica group size - 1): a ring's steps, for TPU latency
  collectives: dict = dataclasses.field(default_factory=collections.Counter)
  custom_calls: dict = dataclasses.field(default_factory=collections.Counter)
  # kernel target -> the HBM bytes of its operands and results as XLA sees them (a Pallas kernel's operand is
  # the whole buffer, e.g. a KV pool, though its grid reads part of it: the caller replaces this count)
  custom_call_hbm: dict = dataclasses.field(default_factory=collections.Counter)
  # (opcode, JAX op name) -> [flops, bytes, hbm_bytes], trip counts included: where the cost is
  by_op: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(lambda: [0.0, 0.0, 0.0]))
  # root opcode -> HBM bytes of the top-level ops that only move data (_MOVES, fused or not), trip counts included:
  # on GPU, a layer scan's per-trip copies of its stacked weights and gradients (docs/tpu.md, the training forward)
  moved: dict = dataclasses.field(default_factory=collections.Counter)

  def add(self, other: "Cost", k: float = 1.0) -> None:
    for f in ("flops", "transcendentals", "bytes", "hbm_bytes", "collective_bytes", "collective_count",
              "collective_hops"):
      setattr(self, f, getattr(self, f) + k * getattr(other, f))
    for mine, theirs in ((self.collectives, other.collectives), (self.custom_calls, other.custom_calls),
                         (self.custom_call_hbm, other.custom_call_hbm), (self.moved, other.moved)):
      for key, v in theirs.items():
        mine[key] += k * v
    for key, vals in other.by_op.items():
      self.by_op[key] = [a + k * b for a, b in zip(self.by_op[key], vals)]


# ----------------------------------------------------------------------------- FLOPs


def _window_pairs(out: int, inp: int, size: int, stride: int, pad_lo: int, lhs_dil: int, rhs_dil: int) -> int:
  """(output position, kernel position) pairs of one spatial dim that land on a real input element."""
  o = np.arange(out, dtype=np.int64)[:, None]
  k = np.arange(size, dtype=np.int64)[None, :]
  x = o * stride + k * rhs_dil - pad_lo
  return int(np.count_nonzero((x >= 0) & (x % lhs_dil == 0) & (x // lhs_dil < inp)))


def _window_field(window: str, key: str, n: int, default: int) -> list[int]:
  m = re.search(rf"\b{key}=([0-9x_\-]+)", window)
  return [int(v.split("_")[0]) for v in m.group(1).split("x")] if m else [default] * n


def _conv_flops(ins: Instr, comp: Computation) -> float:
  labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
  lhs, rhs = (comp.by_name.get(o) for o in ins.operands[:2])
  if not labels or lhs is None or rhs is None:
    return 0.0
  lhs_l, rhs_l, out_l = labels.groups()
  window_m = re.search(r"window=\{([^}]*)\}", ins.attrs)
  window = window_m.group(1) if window_m else ""
  spatial = sorted(c for c in out_l if c.isdigit())
  fields = {k: _window_field(window, k, len(spatial), d) for k, d in
            (("size", 1), ("stride", 1), ("pad", 0), ("lhs_dilate", 1), ("rhs_dilate", 1))}
  pairs = 1
  for d, c in enumerate(spatial):
    pairs *= _window_pairs(ins.dims[out_l.index(c)], lhs.dims[lhs_l.index(c)], fields["size"][d],
                           fields["stride"][d], fields["pad"][d], fields["lhs_dilate"][d], fields["rhs_dilate"][d])
  return 2.0 * ins.dims[out_l.index("b")] * ins.dims[out_l.index("f")] * rhs.dims[rhs_l.index("i")] * pairs


def _dot_flops(ins: Instr, comp: Computation) -> float:
  """A dot, or a GPU library matmul (`__cublas$gemm`, `__cublas$lt$matmul`: dims in its backend_config)."""
  lhs = comp.by_name.get(ins.operands[0]) if ins.operands else None
  m = (re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
       or re.search(r'"lhs_contracting_dimensions":\[([0-9",]*)\]', ins.attrs))
  if lhs is None or not m:
    return 0.0
  contracted = [int(i.strip('"')) for i in m.group(1).split(",") if i.strip('"')]
  return 2.0 * math.prod(ins.dims) * math.prod(lhs.dims[i] for i in contracted)


# ----------------------------------------------------------------------------- bytes


# Flash attention kernels of the cache-free forward (model/flash.py, found by its named scope): how many
# [T, T]-by-head-dim matmuls each makes. Forward: Q K^T and P V. Backward on GPUs, one kernel: Q K^T again, dP, dV,
# dK, dQ; on TPUs a dq kernel (Q K^T, dP, dQ) and a dk/dv kernel (Q K^T, dP, dV, dK); the GPU's preprocessing
# kernel (a row sum of O * dO) makes none.
FLASH_SCOPE = "flash_causal_attention"


def _flash_flops(ins: Instr, comp: Computation, gpu: bool) -> float:
  """A flash kernel's FLOPs from its query operand (GPU [B, T, N, H], TPU [B, N, T, H]): 2 per multiply-add over
  the causal half of the T x T scores (the diagonal blocks it computes whole are left out: <= 10% at 1,280 tokens
  and 64-row blocks); 0 for any other kernel."""
  name = re.search(r'op_name="([^"]*)"', ins.attrs)
  name = name.group(1) if name else ""
  if FLASH_SCOPE not in name or "preprocess_backward" in name or not ins.operands:
    return 0.0
  q = comp.by_name.get(ins.operands[0])
  if q is None or len(q.dims) != 4:
    return 0.0
  if "transpose(" not in name:
    matmuls = 2
  else:
    matmuls = 5 if gpu else 3 if "bwd_dq" in name else 4
  T = q.dims[1] if gpu else q.dims[2]
  return matmuls * 2.0 * math.prod(q.dims) * T / 2


def _group_size(attrs: str) -> int:
  """Devices in one replica group: `mesh['a'=8,'b'=1] {'a'}`, `{{0,1,2,3},...}` or iota `[2,4]<=[8]`."""
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
  if m:
    sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
    return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)))
  m = re.search(r"replica_groups=\{\{([0-9,]*)\}", attrs)
  if m:
    return len(m.group(1).split(","))
  m = re.search(r"replica_groups=\[([0-9,]+)\]<=", attrs)
  return int(m.group(1).split(",")[-1]) if m else 2


def _collective_bytes(ins: Instr, comp: Computation) -> tuple[str, float]:
  kind = next(k for k in _COLLECTIVES if ins.opcode.startswith(k))
  n = _group_size(ins.attrs)
  operand = comp.operand_bytes(ins, hbm=False)
  scale = {"all-gather": n - 1, "reduce-scatter": (n - 1) / n, "all-reduce": 2 * (n - 1) / n}.get(kind, 1)
  return kind, operand * scale


def _aliasing(ins: Instr) -> list[tuple[int, int]]:
  """(output index, operand index) pairs of a fusion's output_to_operand_aliasing."""
  m = re.search(r"output_to_operand_aliasing=\{(.*?)\}\s*(?:,\s*\w+=|$)", ins.attrs)
  return [(int(o or 0), int(p)) for o, p in re.findall(r"\{(\d*)\}:\s*\((\d+)", m.group(1))] if m else []


def _async_continuation(ins: Instr, fused: Computation) -> tuple[set, set, set]:
  """For a fusion that carries an async collective (TPU async collective fusion): the aliased outputs and
  operands, passed through in place, and the collectives it only continues: those whose result buffer
  comes in as an aliased operand, already started elsewhere and counted there."""
  if not any(any(i.opcode.startswith(k) for k in _COLLECTIVES) for i in fused.instrs):
    return set(), set(), set()
  pairs = _aliasing(ins)
  params = {int(i.args): i for i in fused.instrs if i.opcode == "parameter"}
  aliased_shapes = {tuple(params[p].dims) for _, p in pairs if p in params}
  continued = {i.name for i in fused.instrs if any(i.opcode.startswith(k) for k in _COLLECTIVES)
               and tuple(i.dims) in aliased_shapes}
  return {o for o, _ in pairs}, {p for _, p in pairs}, continued


def _sliced_bytes(param: Instr, fused: Computation, comps: dict | None) -> float | None:
  """Bytes a fusion reads of a parameter used only through (dynamic-)slices or as a gather's operand (the rows
  it returns, as HloCostAnalysis counts a gather: an embedding lookup reads its tokens' rows, not the table),
  also where a nested fusion takes it and slices it there (a layer's weights sliced from the stacked [L, ...]
  array); None if any use reads more (the whole operand is then counted)."""
  users = fused.users.get(param.name, [])
  if not users:
    return None
  total = 0.0
  for u in users:
    if u.opcode in ("dynamic-slice", "slice", "gather") and u.operands[0] == param.name:
      total += u.nbytes()
    elif u.opcode == "fusion" and comps is not None and u.called("calls") and u.called("calls")[0] in comps:
      inner = comps[u.called("calls")[0]]
      inner_params = {int(i.args): i for i in inner.instrs if i.opcode == "parameter"}
      read = [_sliced_bytes(inner_params[k], inner, comps) if k in inner_params else None
              for k, o in enumerate(u.operands) if o == param.name]
      if not read or any(r is None for r in read):
        return None
      total += sum(read)
    else:
      return None
  return total


def _fusion_bytes(ins: Instr, comp: Computation, fused: Computation, hbm: bool, comps: dict | None = None) -> float:
  """Operand + output bytes of a fusion; slices of a parameter (also through nested fusions) and in-place
  updates count what they touch; buffers an async collective fusion passes through in place count nothing."""
  params = {int(i.args): i for i in fused.instrs if i.opcode == "parameter"}
  skip_outputs, skip_operands, _ = _async_continuation(ins, fused)
  total = 0.0
  for pos, operand in enumerate(ins.operands):
    outer = comp.by_name.get(operand)
    if outer is None or pos in skip_operands or (hbm and all(a.space for a in outer.arrays)):
      continue
    p = params.get(pos)
    users = fused.users.get(p.name, []) if p is not None else []
    sliced = _sliced_bytes(p, fused, comps) if p is not None else None
    if sliced is not None:
      total += sliced
    elif users and all(u.opcode == "scatter" and u.operands[0] == p.name for u in users):
      total += sum(_scatter_updates_bytes(u, fused) for u in users)  # reads only the elements it updates
    elif not (users and all(u.opcode == "dynamic-update-slice" and u.operands[0] == p.name for u in users)):
      total += outer.nbytes(hbm)  # (an operand updated in place is counted by its update, with the output)
  root = fused.instrs[-1] if fused.instrs else None
  outs = [fused.by_name.get(o) for o in root.operands] if root is not None and root.opcode == "tuple" else [root]
  out_arrays = ins.arrays if len(ins.arrays) == len(outs) else [None] * len(outs)
  for index, (out, arr) in enumerate(zip(outs, out_arrays)):
    if out is None or index in skip_outputs or (hbm and arr is not None and arr.space):
      continue
    if out.opcode == "dynamic-update-slice" and out.operands[1] in fused.by_name:
      total += fused.by_name[out.operands[1]].nbytes()
    elif out.opcode == "scatter":
      total += _scatter_updates_bytes(out, fused)  # in place: writes the elements it updates
    else:
      total += out.nbytes() if arr is None else arr.bytes
  return total


def _scatter_updates_bytes(ins: Instr, comp: Computation) -> float:
  """The updates' bytes of a single-operand scatter (operand, indices, updates)."""
  update = comp.by_name.get(ins.operands[2]) if len(ins.operands) == 3 else None
  return update.nbytes() if update is not None else ins.nbytes()


def _plain_bytes(ins: Instr, comp: Computation, hbm: bool) -> float:
  """Operands + outputs of a top-level op; an async copy's output tuple (dest, source, ...) counts its dest."""
  if ins.opcode == "copy-start" and ins.arrays:  # (dest, source, context)
    return comp.operand_bytes(ins, hbm) + hlo_text.sum_bytes(ins.arrays[:1], hbm)
  if ins.opcode == "slice-start" and len(ins.arrays) > 1:  # ((source), dest, sync): reads the slice only
    source, dest = ins.arrays[0], ins.arrays[1]
    return hlo_text.sum_bytes([hlo_text.Array(dest.dtype, dest.dims, source.space), dest], hbm)
  if ins.opcode in ("dynamic-slice", "slice", "gather"):  # reads only what it returns
    return 2 * ins.nbytes(hbm) if not hbm or any(a.space == 0 for a in ins.arrays) else 0.0
  if ins.opcode == "scatter" and len(ins.operands) == 3 and ins.operands[2] in comp.by_name:
    indices = comp.by_name.get(ins.operands[1])
    return 3 * _scatter_updates_bytes(ins, comp) + (indices.nbytes(hbm) if indices is not None else 0.0)
  if ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1 and ins.operands[1] in comp.by_name:
    update = comp.by_name[ins.operands[1]]  # in place: reads the update, writes its region
    return update.nbytes(hbm) + (update.nbytes() if not hbm or ins.arrays[0].space == 0 else 0.0)
  if ins.opcode.endswith("-start"):
    operands = len(ins.operands)
    return comp.operand_bytes(ins, hbm) + hlo_text.sum_bytes(ins.arrays[operands:2 * operands], hbm)
  return comp.operand_bytes(ins, hbm) + ins.nbytes(hbm)


# ----------------------------------------------------------------------------- loops and traversal


def _through_copies(comp: Computation, ins: Instr | None) -> Instr | None:
  """The instruction a chain of copies / bitcasts / converts starts from (a loop counter's initial value)."""
  for _ in range(8):
    if ins is None or ins.opcode not in ("copy", "copy-start", "copy-done", "bitcast", "convert", "reshape"):
      return ins
    ins = comp.by_name.get(ins.operands[0]) if ins.operands else None
  return ins


def _constant_value(ins: Instr | None) -> int | None:
  if ins is None or ins.opcode != "constant":
    return None
  return int(ins.args) if re.fullmatch(r"-?\d+", ins.args.strip()) else None


def _tuple_index(ins: Instr) -> int | None:
  m = re.search(r"index=(\d+)", ins.attrs)
  return int(m.group(1)) if ins.opcode == "get-tuple-element" and m else None


class _Analyzer:
  def __init__(self, text: str, unknown_trips: float, count_trips: bool):
    self.comps, self.entry = hlo_text.parse_module(text)
    self.unknown_trips, self.count_trips = unknown_trips, count_trips
    self.loops: dict[str, int | None] = {}
    self._cache: dict[str, Cost] = {}

  def trip_count(self, ins: Instr, comp: Computation) -> int | None:
    """`i < N` (or `<=`) on a tuple element that starts at a constant and grows by a constant step."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
    if known:
      return int(known.group(1))
    cond = self.comps.get(ins.called("condition")[0]) if ins.called("condition") else None
    root = cond.instrs[-1] if cond is not None and cond.instrs else None
    direction = re.search(r"direction=(\w+)", root.attrs) if root is not None else None
    if root is None or root.opcode != "compare" or not direction or len(root.operands) != 2:
      return None
    a, b = (cond.by_name.get(o) for o in root.operands)
    d = direction.group(1)
    if _constant_value(a) is not None:
      a, b, d = b, a, {"GT": "LT", "GE": "LE"}.get(d, "")
    index, limit = (_tuple_index(a) if a is not None else None), _constant_value(b)
    tup = comp.by_name.get(ins.operands[0]) if ins.operands else None
    if index is None or limit is None or d not in ("LT", "LE") or tup is None or tup.opcode != "tuple":
      return None
    init = _constant_value(_through_copies(comp, comp.by_name.get(tup.operands[index])))
    step = self._step(ins, index)
    if init is None or step is None:
      return None
    return max(-(-(limit - init + (d == "LE")) // step), 0)

  def _step(self, ins: Instr, index: int) -> int | None:
    """The constant a loop adds to its counter (tuple element `index`) each trip; None if not constant."""
    body = self.comps.get(ins.called("body")[0]) if ins.called("body") else None
    root = body.instrs[-1] if body is not None and body.instrs else None
    if root is None or root.opcode != "tuple" or index >= len(root.operands):
      return None
    nxt = _through_copies(body, body.by_name.get(root.operands[index]))
    if nxt is None or nxt.opcode != "add":
      return None
    parts = [_through_copies(body, body.by_name.get(o)) for o in nxt.operands]
    steps = [_constant_value(p) for p in parts if _constant_value(p) is not None]
    counter = any(p is not None and _tuple_index(p) == index for p in parts)
    return steps[0] if counter and len(steps) == 1 and steps[0] > 0 else None

  def cost(self, name: str) -> Cost:
    if name not in self._cache:
      comp, total = self.comps[name], Cost()
      for ins in comp.instrs:
        c = self.instr_cost(ins, comp)
        if ins.opcode not in ("while", "call", "conditional", "async-start"):
          c.by_op[self._tag(ins)] = [c.flops, c.bytes, c.hbm_bytes]
        total.add(c)
      self._cache[name] = total
    return self._cache[name]

  def _tag(self, ins: Instr) -> tuple[str, str]:
    """(opcode, JAX op name) of a top-level op; a fusion is named by its root, e.g. 'fusion:convolution'."""
    op = ins.opcode
    if op == "fusion" and ins.called("calls") and self.comps[ins.called("calls")[0]].instrs:
      op = "fusion:" + self.comps[ins.called("calls")[0]].instrs[-1].opcode
    tag = re.search(r'op_name="([^"]*)"', ins.attrs)
    return op, tag.group(1) if tag else ""

  def instr_cost(self, ins: Instr, comp: Computation, top: bool = True) -> Cost:
    c, op = Cost(), ins.opcode
    if op == "while":
      trips = self.trip_count(ins, comp)
      self.loops[ins.name] = trips
      k = self.unknown_trips if trips is None else trips if self.count_trips else 1
      for sub in ins.called("body") + ins.called("condition"):
        c.add(self.cost(sub), k)
      return c
    if op in ("call", "conditional", "async-start"):
      subs = ins.called("to_apply") + ins.called("calls") + ins.called("branch_computations")
      subs += ins.called("true_computation") + ins.called("false_computation")
      for sub in subs:  # a conditional's branches are averaged: which one runs is not known here
        c.add(self.cost(sub), 1.0 if op != "conditional" else 1.0 / max(len(subs), 1))
      return c
    if op == "fusion":
      fused = self.comps[ins.called("calls")[0]]
      continued = _async_continuation(ins, fused)[2]
      for inner in fused.instrs:
        if inner.name not in continued:
          c.add(self.instr_cost(inner, fused, top=False))
      if top:
        c.bytes, c.hbm_bytes = (_fusion_bytes(ins, comp, fused, False, self.comps),
                                _fusion_bytes(ins, comp, fused, True, self.comps))
        if fused.instrs and all(i.opcode in _MOVES or i.opcode in _FREE or not i.dims for i in fused.instrs):
          c.moved[fused.instrs[-1].opcode] += c.hbm_bytes
      return c
    if op == "convolution":
      c.flops = _conv_flops(ins, comp)
    elif op == "dot":
      c.flops = _dot_flops(ins, comp)
    elif op in _ELEMENTWISE:
      c.flops = math.prod(ins.dims)
    elif op in _TRANSCENDENTAL:
      c.transcendentals = math.prod(ins.dims)
    elif op in ("reduce", "reduce-window"):
      inputs = ins.operands[:max(len(ins.operands) // 2, 1)]
      c.flops = sum(math.prod(comp.by_name[o].dims) for o in inputs if o in comp.by_name)
    elif op == "custom-call":
      target = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
      c.custom_calls[target.group(1) if target else "?"] += 1
      if target and "cublas" in target.group(1):
        c.flops = _dot_flops(ins, comp)
      elif target and target.group(1) in ("tpu_custom_call", "__gpu$xla.gpu.triton"):
        c.flops = _flash_flops(ins, comp, gpu=target.group(1) != "tpu_custom_call")
    if any(op == k or op == k + "-start" for k in _COLLECTIVES):
      kind, nbytes = _collective_bytes(ins, comp)
      c.collectives[kind] += nbytes
      c.collective_bytes += nbytes
      c.collective_count += 1
      c.collective_hops += max(_group_size(ins.attrs) - 1, 1)
    if top and op not in _FREE and not op.endswith("-done"):
      c.bytes, c.hbm_bytes = _plain_bytes(ins, comp, False), _plain_bytes(ins, comp, True)
      if op in _MOVES:
        c.moved[op] += c.hbm_bytes
      if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
        c.custom_call_hbm[target.group(1) if target else "?"] += c.hbm_bytes
    return c


Program = _Analyzer  # a parsed module: its computations, loop trip counts and each instruction's cost (fixed_costs)


def analyze(hlo_text: str, unknown_trips: float = 1.0, count_trips: bool = True) -> tuple[Cost, dict]:
  """(cost of the entry computation, {while name: trip count or None}) of an optimised HLO module.

  `unknown_trips`: the count used for loops whose trip count depends on data. `count_trips=False`
  counts every loop body once, as `compiled.cost_analysis()` does (a check against XLA's figures).
  """
  a = _Analyzer(hlo_text, unknown_trips, count_trips)
  return a.cost(a.entry), a.loops
