"""A reward function of the user's, named by import path: `path/to/file.py:function` or `package.module:function`.

The function is `fn(response: str, gold, **extra) -> float` in [0, 1]: the raw response text, the row's
gold as loaded (any JSON value under data.answer_format "json", else the gold string) and the row's
other fields that data.extra_fields names. It runs in the reward pool's workers (reward_pool.py) under
their time and memory limits, so a hang, a crash or a blow-up costs its item a zero and a count, never
the run. The pool limits time and memory; it is NOT a sandbox: the function runs with the run's rights,
and a reward that executes model-written code needs a real sandbox of its own.

A value that is not a real number (str, None, a list; `bool` counts as 0/1), NaN, or outside [0, 1]
scores 0 as an error with a message saying which, as does an exception (its traceback is the message).
The workers keep the built-in graders' guard: sympy's string parser (`sympify`/`parse_expr` of a string)
refuses anything but a number or a name there, since model text must never reach `eval`.
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib
import importlib.util
import numbers
import os
import sys
import traceback
from collections.abc import Mapping, Sequence
from typing import Any, Callable, NamedTuple

from astarpo_jax.rewards import grading

MAX_MESSAGE_CHARS = 4000  # an error message keeps its tail: a traceback may quote megabytes of model text


class Target(NamedTuple):
  """What a user function is given besides the response: the row's gold and its named extra fields."""
  gold: Any
  extra: Mapping[str, Any]


class BadReward(Exception):
  """The function returned something that is not a reward in [0, 1]."""


@dataclasses.dataclass(frozen=True)
class Spec:
  """A parsed `where:function`: a file (absolute path) or a module name, and the function's name."""
  where: str
  function: str
  is_file: bool

  def __str__(self) -> str:
    return f"{self.where}:{self.function}"


def is_spec(grader: str) -> bool:
  """True for a user function's import path; the built-in graders' names have no ':'."""
  return isinstance(grader, str) and ":" in grader


def parse(grader: str) -> Spec:
  """`path/to/file.py:fn` (relative paths from the working directory) or `package.module:fn`."""
  where, _, function = grader.rpartition(":")
  if not where or not function.isidentifier():
    raise ValueError(f"{grader!r} is neither a built-in grader ({', '.join(grading.GRADERS)}) nor "
                     "'path/to/file.py:function' or 'package.module:function'")
  if where.endswith(".py") or os.sep in where or "/" in where:
    return Spec(os.path.abspath(where), function, True)
  if not all(part.isidentifier() for part in where.split(".")):
    raise ValueError(f"{grader!r}: {where!r} is not a module name (a.b.c) nor a path ending in .py")
  return Spec(where, function, False)


def _source_file(spec: Spec) -> str | None:
  """The file that defines `spec`'s function, without running the module (parent packages are imported)."""
  if spec.is_file:
    if not os.path.isfile(spec.where):
      raise ValueError(f"{spec}: file {spec.where} not found")
    return spec.where
  try:
    found = importlib.util.find_spec(spec.where)
  except (ImportError, ValueError) as e:
    raise ValueError(f"{spec}: module {spec.where!r} cannot be found ({type(e).__name__}: {e})") from None
  if found is None:
    raise ValueError(f"{spec}: module {spec.where!r} not found on sys.path (run from the folder that holds it, "
                     "or name the file: path/to/file.py:function)")
  return found.origin if found.origin and found.origin.endswith(".py") else None


def _top_level_names(body: Sequence[ast.stmt]) -> set[str]:
  """Names a module's statements bind at top level (defs, classes, assignments, imports), through if/try/with."""
  out: set[str] = set()
  for node in body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      out.add(node.name)
      continue
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
      for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
        out |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      out |= {(a.asname or a.name).split(".")[0] for a in node.names}
    inner = [*getattr(node, "body", []), *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
    inner += [s for h in getattr(node, "handlers", []) for s in h.body]
    out |= _top_level_names([s for s in inner if isinstance(s, ast.stmt)])
  return out


def check(grader: str) -> Spec:
  """The parsed spec, after checking without running the user's code that its file exists, parses, and binds
  the function's name at top level; a ValueError says what is wrong."""
  spec = parse(grader)
  path = _source_file(spec)
  if path is None:  # a compiled module: nothing to read, the workers' import will tell
    return spec
  try:
    tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
  except (OSError, UnicodeDecodeError, SyntaxError) as e:
    raise ValueError(f"{spec}: cannot read {path}: {type(e).__name__}: {e}") from None
  names = _top_level_names(tree.body)
  if spec.function not in names and "__getattr__" not in names:
    defs = sorted(n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_"))
    raise ValueError(f"{spec}: {path} defines no {spec.function!r} at top level (functions there: {defs})")
  return spec


def source_sha256(grader: str) -> str:
  """sha256 of the source file that defines the function (all of it: its helpers count): a changed function
  must not reuse V* computed with the old one."""
  spec = parse(grader)
  path = _source_file(spec)
  if path is None:
    module = importlib.import_module(spec.where)
    path = getattr(module, "__file__", None)
  if not path:
    raise ValueError(f"{spec}: no source file to fingerprint")
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def load(grader: str) -> Callable[..., Any]:
  """Import the function (runs the module). A file's folder is appended to sys.path so its siblings import."""
  spec = parse(grader)
  if spec.is_file:
    name = "astarpo_user_reward_" + hashlib.sha1(spec.where.encode()).hexdigest()[:12]
    module = sys.modules.get(name)
    if module is None:
      if os.path.dirname(spec.where) not in sys.path:
        sys.path.append(os.path.dirname(spec.where))
      found = importlib.util.spec_from_file_location(name, spec.where)
      if found is None or found.loader is None:
        raise ImportError(f"cannot import {spec.where}")
      module = importlib.util.module_from_spec(found)
      sys.modules[name] = module
      try:
        found.loader.exec_module(module)
      except BaseException:
        del sys.modules[name]
        raise
  else:
    module = importlib.import_module(spec.where)
  fn = getattr(module, spec.function, None)
  if not callable(fn):
    raise TypeError(f"{spec}: {spec.function!r} is {'missing' if fn is None else type(fn).__name__}, not callable")
  return fn


def checked_reward(value: Any) -> float:
  """`value` as a reward, or BadReward saying why it is not one: a real number in [0, 1]."""
  if not isinstance(value, numbers.Real):
    raise BadReward(f"returned {type(value).__module__}.{type(value).__qualname__} {_short(repr(value))}, "
                    "not a number: return a float in [0, 1]")
  reward = float(value)
  if not (0.0 <= reward <= 1.0):  # NaN fails too
    raise BadReward(f"returned {reward!r}, outside [0, 1]: rewards must lie in [0, 1]")
  return reward


def _short(text: str, limit: int = 200) -> str:
  return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def clip_message(text: str) -> str:
  return text if len(text) <= MAX_MESSAGE_CHARS else "..." + text[-MAX_MESSAGE_CHARS:]


def run(fn: Callable | BaseException, grader: str, response: str, gold: Any,
        extra: Mapping[str, Any]) -> tuple[float, int, str | None]:
  """(reward, status, message) of one response; never raises. `fn` is the loaded function, or the exception
  its import raised (then every item is an error carrying that exception's text)."""
  if isinstance(fn, BaseException):
    return 0.0, grading.ERROR, clip_message(f"reward function {grader} could not be imported:\n{fn}")
  try:
    return checked_reward(fn(response, gold, **extra)), grading.OK, None
  except BadReward as e:
    return 0.0, grading.ERROR, f"reward function {grader} {e}"
  except (Exception, grading.UnsafeInput) as e:  # noqa: BLE001 -- includes MemoryError and RecursionError
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    return 0.0, grading.ERROR, clip_message(f"reward function {grader} raised:\n{tb}")


def import_or_error(grader: str) -> Callable | BaseException:
  """`load(grader)`, or the exception (with its traceback as text) when it fails: a worker keeps going."""
  try:
    return load(grader)
  except BaseException as e:  # noqa: BLE001 -- SystemExit from a module's top level too
    return ImportError("".join(traceback.format_exception(type(e), e, e.__traceback__)))


def prepare(responses: Sequence[str | None], golds: Sequence, truncated: Sequence[bool] | None
            ) -> tuple[list[float], list[int], list[tuple[int, str, Any, dict]]]:
  """The pool's jobs for a user function: (rewards_N, status_N, [(i, response, gold, extra)]).

  Rows flagged truncated (when flags are given: the EOS rule) and missing responses score 0 without a call,
  as under the built-in graders. A gold is a Target (gold and extra fields) or a plain gold (no extras).
  """
  n = len(responses)
  if len(golds) != n:
    raise ValueError(f"{n} responses but {len(golds)} golds")
  if truncated is not None and len(truncated) != n:
    raise ValueError(f"{n} responses but {len(truncated)} truncated flags")
  rewards, status, jobs = [0.0] * n, [grading.NO_ANSWER] * n, []
  for i, (response, gold) in enumerate(zip(responses, golds)):
    if response is not None and not isinstance(response, str):
      raise TypeError(f"response {i}: must be str or None, got {type(response).__name__}")
    if truncated is not None and truncated[i]:
      status[i] = grading.TRUNCATED
    elif response is not None:
      target = gold if isinstance(gold, Target) else Target(gold, {})
      status[i] = grading.OK
      jobs.append((i, response, target.gold, dict(target.extra)))
  return rewards, status, jobs
