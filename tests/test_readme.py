"""The README stays a front page (≤ 150 lines of ≤ 120 characters), its layout tree lists every module and script
that exists, and every file path that README.md and docs/ name exists."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES, MAX_WIDTH = 150, 120


def _readme() -> str:
  return open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def test_readme_is_at_most_150_lines_of_at_most_120_characters():
  lines = _readme().splitlines()
  assert len(lines) <= MAX_LINES, len(lines)
  wide = [(i + 1, len(line)) for i, line in enumerate(lines) if len(line) > MAX_WIDTH]
  assert not wide, wide


def _layout_blocks() -> dict[str, str]:
  """The layout tree's entries: 'astarpo_jax/<pkg>/' or 'experiments/' -> the text of its lines."""
  text = _readme().split("## Layout", 1)[1].split("```")[1]
  blocks: dict[str, str] = {}
  top, current = None, None
  for line in text.splitlines():
    if re.match(r"^\S+/", line):  # astarpo_jax/ or experiments/ at column 0
      top = line.split("/")[0]
      current = top + "/"
      blocks[current] = line[len(current):]
    elif top == "astarpo_jax" and re.match(r"^  \w+/", line):
      current = f"astarpo_jax/{line.split('/')[0].strip()}/"
      blocks[current] = line
    elif top == "astarpo_jax" and re.match(r"^  \w+\.py", line):
      blocks["astarpo_jax/"] = blocks.get("astarpo_jax/", "") + line
    elif current:
      blocks[current] += " " + line
  return blocks


def _names(directory: str) -> list[str]:
  return sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, directory))
                if f.endswith(".py") and not f.startswith("_"))


def test_the_layout_lists_every_sub_package_module_and_script():
  blocks = _layout_blocks()
  pkg = os.path.join(ROOT, "astarpo_jax")
  subpackages = sorted(d for d in os.listdir(pkg) if os.path.exists(os.path.join(pkg, d, "__init__.py")))
  missing = [f"astarpo_jax/{d}/" for d in subpackages if f"astarpo_jax/{d}/" not in blocks]
  for d in subpackages:
    text = blocks.get(f"astarpo_jax/{d}/", "")
    missing += [f"astarpo_jax/{d}/{m}.py" for m in _names(f"astarpo_jax/{d}")
                if not re.search(rf"\b{m}\b", text)]
  missing += [f"astarpo_jax/{m}.py" for m in _names("astarpo_jax") if f"{m}.py" not in blocks.get("astarpo_jax/", "")]
  missing += [f"experiments/{m}.py" for m in _names("experiments") if f"{m}.py" not in blocks.get("experiments/", "")]
  assert not missing, missing


def _docs() -> list[str]:
  return ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                                if f.endswith(".md"))


@pytest.mark.parametrize("doc", _docs())
def test_every_file_a_doc_names_exists(doc):
  text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
  here = os.path.dirname(os.path.join(ROOT, doc))
  paths = set(re.findall(r"\b((?:astarpo_jax|experiments|configs|tests|docs|notebooks)/[\w/.-]+\.(?:py|md|csv|png|ipynb))",
                         text))
  links = {os.path.normpath(os.path.join(here, p)) for p in re.findall(r"\]\(([^)#:]+)\)", text)}
  gone = sorted(p for p in paths if not os.path.exists(os.path.join(ROOT, p)))
  gone += sorted(os.path.relpath(p, ROOT) for p in links if not os.path.exists(p))
  assert not gone, gone
