"""The text of an optimised XLA HLO module, parsed into computations and instructions with their arrays.

Read by hlo_cost.py, which counts FLOPs and bytes over what this returns: `parse_module(compiled.as_text())`
gives each computation's instructions (name, result shape, opcode, operand names, the text inside the
parentheses and the attributes after them) and the entry computation's name. A shape's arrays keep their
memory space (TPU layouts `S(n)`, n > 0: on-chip VMEM / SMEM), so byte counts can leave those out.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5}
ARRAY_RE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\](\{[^}]*\})?")
NAME_RE = re.compile(r"%([\w.\-]+)")


def dtype_bytes(dtype: str) -> float:
  return 1 if dtype.startswith(("f8", "s8", "u8")) else DTYPE_BYTES.get(dtype, 0)


@dataclasses.dataclass(frozen=True)
class Array:
  dtype: str
  dims: tuple[int, ...]
  space: int  # memory space: 0 device memory (HBM), > 0 on-chip (TPU VMEM, SMEM, ...)

  @property
  def bytes(self) -> float:
    return dtype_bytes(self.dtype) * math.prod(self.dims)


def shape_arrays(shape_text: str) -> list[Array]:
  """Every array of a shape (one for an array, several for a tuple), with its memory space."""
  out = []
  for dt, dims, layout in ARRAY_RE.findall(shape_text):
    space = re.search(r"S\((\d+)\)", layout)
    out.append(Array(dt, tuple(int(d) for d in dims.split(",") if d), int(space.group(1)) if space else 0))
  return out


def sum_bytes(arrays, hbm: bool) -> float:
  return sum(a.bytes for a in arrays if not hbm or a.space == 0)


@dataclasses.dataclass
class Instr:
  name: str
  shape: str
  opcode: str
  operands: list[str]
  args: str  # the text between the opcode's parentheses (a parameter's index, a constant's value)
  attrs: str

  def __post_init__(self):
    self.arrays = shape_arrays(self.shape)

  @property
  def dims(self) -> tuple[int, ...]:
    return self.arrays[0].dims if self.arrays else ()

  def nbytes(self, hbm: bool = False) -> float:
    return sum_bytes(self.arrays, hbm)

  def called(self, key: str) -> list[str]:
    m = re.search(rf"\b{key}=\{{([^}}]*)\}}", self.attrs) or re.search(rf"\b{key}=(%[\w.\-]+)", self.attrs)
    return NAME_RE.findall(m.group(1)) if m else []


@dataclasses.dataclass
class Computation:
  name: str
  instrs: list[Instr]

  def __post_init__(self):
    self.by_name = {i.name: i for i in self.instrs}
    self.users: dict[str, list[Instr]] = collections.defaultdict(list)
    for i in self.instrs:
      for o in i.operands:
        self.users[o].append(i)

  def operand_bytes(self, ins: Instr, hbm: bool) -> float:
    return sum(self.by_name[o].nbytes(hbm) for o in ins.operands if o in self.by_name)


def _matching(text: str, start: int) -> int:
  """Index just past the bracket that closes the one at text[start]."""
  depth = 0
  for j in range(start, len(text)):
    if text[j] in "({":
      depth += 1
    elif text[j] in ")}":
      depth -= 1
      if depth == 0:
        return j + 1
  return len(text)


def _parse_instr(line: str) -> Instr | None:
  m = re.match(r"\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*", line)
  if not m:
    return None
  rest = line[m.end():]
  if rest.startswith("("):
    end = _matching(rest, 0)
    shape, rest = rest[:end], rest[end:].lstrip()
  else:
    shape, _, rest = rest.partition(" ")
  op = re.match(r"([\w\-]+)\(", rest)
  if not op:
    return None
  end = _matching(rest, op.end() - 1)
  args = rest[op.end():end - 1]
  return Instr(m.group(1), shape, op.group(1), NAME_RE.findall(args), args, rest[end:])


def parse_module(text: str) -> tuple[dict[str, Computation], str]:
  """The computations of an HLO module's text and the name of its entry computation."""
  comps, entry, name, instrs = {}, "", None, []
  for line in text.splitlines():
    header = re.match(r"(ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$", line)
    if name is None and header:
      name, instrs = header.group(2), []
      entry = name if header.group(1) else entry
    elif name is not None and line.startswith("}"):
      comps[name], name = Computation(name, instrs), None
    elif name is not None:
      ins = _parse_instr(line)
      if ins is not None:
        instrs.append(ins)
  if not entry:
    raise ValueError("no ENTRY computation in the HLO text (pass compiled.as_text())")
  return comps, entry
