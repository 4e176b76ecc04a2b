"""The package's layering: every import of astarpo_jax/ and experiments/ (at module level, inside functions, under
TYPE_CHECKING, and the scripts' sys.path imports) goes down a layer, never up, and no module imports itself back.

A sub-package's layers are stated in its `__init__.py` docstring, on a line `May import: a, b, ...` (the other
sub-packages it may import; its own modules always); the top-level modules (`experiment`, `run_config`) may
import every sub-package but the comparison's; the scripts of experiments/ import anything. The planted-import
test copies the tree, adds one upward import, and expects this check to name it.
"""
from __future__ import annotations

import ast
import os
import re
import shutil
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "astarpo_jax"
TOP_MODULES = ("experiment", "run_config", "run_inputs")  # astarpo_jax/<name>.py beside the sub-packages
MAX_TOP_MODULES = 4


def _modules(root: str) -> dict[str, str]:
  """Dotted module name -> path, for astarpo_jax/** and experiments/*.py."""
  out = {}
  for base in (PKG, "experiments"):
    for dirpath, _, files in os.walk(os.path.join(root, base)):
      for f in files:
        if f.endswith(".py"):
          rel = os.path.relpath(os.path.join(dirpath, f), root)[:-3].replace(os.sep, ".")
          out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, f)
  return out


def _resolve(name: str, modules: dict[str, str], script_dir_names: set[str]) -> str | None:
  """The module an imported dotted name lands in: the longest known prefix (a name imported from a module
  is an edge to that module); a bare script name (`from run_shapes import ...`) is experiments' script."""
  if name in script_dir_names:
    return f"experiments.{name}"
  parts = name.split(".")
  for i in range(len(parts), 0, -1):
    if ".".join(parts[:i]) in modules:
      return ".".join(parts[:i])
  return None


def import_graph(root: str) -> dict[str, set[str]]:
  """module -> the modules it imports (of astarpo_jax/ and experiments/), from every import statement."""
  modules = _modules(root)
  scripts = {m.split(".", 1)[1] for m in modules if m.startswith("experiments.")}
  graph: dict[str, set[str]] = defaultdict(set)
  for mod, path in modules.items():
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    is_pkg = path.endswith("__init__.py")
    for node in ast.walk(tree):
      targets: list[str | None] = []
      if isinstance(node, ast.Import):
        targets = [_resolve(a.name, modules, scripts) for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        if node.level:  # relative: from the module's package
          base = mod.split(".") if is_pkg else mod.split(".")[:-1]
          base = base[:len(base) - node.level + 1]
          stem = ".".join(base + ([node.module] if node.module else []))
        else:
          stem = node.module or ""
        for a in node.names:  # a name that is a module is an edge to it; any other name, to the module it is in
          full = f"{stem}.{a.name}"
          targets.append(full if full in modules else _resolve(stem, modules, scripts))
      graph[mod].update(t for t in targets if t and t != mod)
  for mod in modules:
    graph.setdefault(mod, set())
  return dict(graph)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def layer_of(mod: str) -> str:
  """A module's layer: its sub-package, `top` for astarpo_jax's top-level modules, `scripts` for experiments/."""
  parts = mod.split(".")
  if parts[0] == "experiments":
    return "scripts"
  if len(parts) == 1:
    return "root"
  return "top" if parts[1] in TOP_MODULES else parts[1]


def allowed_layers(root: str) -> dict[str, set[str]]:
  """Each sub-package's `May import:` line, read from its __init__ docstring."""
  out = {}
  pkg_dir = os.path.join(root, PKG)
  for name in sorted(os.listdir(pkg_dir)):
    init = os.path.join(pkg_dir, name, "__init__.py")
    if os.path.exists(init):
      doc = ast.get_docstring(ast.parse(open(init, encoding="utf-8").read())) or ""
      m = re.search(r"^May import:(.*?)(?:\.\s*$|$)", doc, re.M)
      if m is None:
        out[name] = None
      else:
        text = m.group(1).strip()
        out[name] = set() if text in ("", "nothing") else {x.strip() for x in text.split(",") if x.strip()}
  return out


def problems(root: str) -> list[str]:
  """Every layering problem of the tree at `root`: cycles, upward imports, undeclared layers."""
  graph, allowed = import_graph(root), allowed_layers(root)
  found = [f"{name}/__init__.py: its docstring has no 'May import:' line" for name, a in allowed.items() if a is None]
  subpackages = set(allowed)
  allowed = {k: v or set() for k, v in allowed.items()}
  allowed["top"] = (subpackages - {"comparison"}) | {"top"}
  allowed["root"] = {"infra"}  # astarpo_jax/__init__.py: infra.platforms, before any backend starts
  for name, layers in allowed.items():
    unknown = layers - subpackages - {"top"}
    if unknown:
      found.append(f"{name}: 'May import' names unknown layers {sorted(unknown)}")
  layer_cycles = cycles({k: v for k, v in allowed.items()})
  found += [f"the declared layers import each other: {c}" for c in layer_cycles]
  found += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
  for mod, targets in sorted(graph.items()):
    src = layer_of(mod)
    if src == "scripts":
      continue
    for t in sorted(targets):
      dst = layer_of(t)
      if dst == "scripts":
        found.append(f"{mod} imports the script {t}: a library never imports experiments/")
      elif dst != src and dst not in allowed.get(src, set()):
        found.append(f"{mod} imports {t}: layer '{src}' may not import '{dst}' (its May import: "
                     f"{sorted(allowed.get(src, set()))})")
  return found


def test_no_cycle_and_no_upward_import():
  assert problems(ROOT) == []


def test_at_most_four_top_level_modules_beside_the_sub_packages():
  top = [f for f in os.listdir(os.path.join(ROOT, PKG)) if f.endswith(".py") and f != "__init__.py"]
  assert len(top) <= MAX_TOP_MODULES, top
  assert sorted(f[:-3] for f in top) == sorted(TOP_MODULES)


def test_every_sub_package_docstring_says_what_it_holds_and_may_import():
  allowed = allowed_layers(ROOT)
  assert allowed and all(v is not None for v in allowed.values()), allowed


def _copy(tmp_path) -> str:
  root = str(tmp_path / "tree")
  for base in (PKG, "experiments"):
    shutil.copytree(os.path.join(ROOT, base), os.path.join(root, base),
                    ignore=shutil.ignore_patterns("__pycache__"))
  return root


def _plant(path: str, line: str) -> None:
  with open(path, "a", encoding="utf-8") as f:
    f.write(f"\n\ndef _planted():\n  {line}\n")


def test_a_planted_upward_import_inside_a_function_is_found(tmp_path):
  root = _copy(tmp_path)
  _plant(os.path.join(root, PKG, "model", "layers.py"), "from astarpo_jax.training import loop  # noqa: F401")
  found = problems(root)
  assert any("astarpo_jax.model.layers imports astarpo_jax.training.loop" in p and "'model' may not import "
             "'training'" in p for p in found), found


def test_a_planted_type_checking_import_of_a_script_and_a_cycle_are_found(tmp_path):
  root = _copy(tmp_path)
  with open(os.path.join(root, PKG, "infra", "files.py"), "a", encoding="utf-8") as f:
    f.write("\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  from experiments.compare import main\n")
  with open(os.path.join(root, "experiments", "aot.py"), "a", encoding="utf-8") as f:
    f.write("\nfrom memory_plan import main as _m  # noqa\n")
  with open(os.path.join(root, "experiments", "memory_plan.py"), "a", encoding="utf-8") as f:
    f.write("\ndef _back():\n  import aot  # noqa\n")
  found = problems(root)
  assert any("astarpo_jax.infra.files imports the script experiments.compare" in p for p in found), found
  assert any(p.startswith("import cycle") and "experiments.aot" in p and "experiments.memory_plan" in p
             for p in found), found
