"""The paper presets equal the official A*-PO settings as docs/fidelity.md tabulates them.

The table's rows are read from the doc itself (not copied here): for each row with a config field, an
"=" row's preset value must be its official value, any other row's the value in its preset column.
"""
import ast
import importlib
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "fidelity.md")


def _rows():
  """(setting, field, variant, official, preset, verdict) of the table's rows with a config field."""
  out = []
  for line in open(DOC, encoding="utf-8").read().splitlines():
    cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
    if len(cells) != 7 or not cells[1].startswith("`"):
      continue
    setting, field, variant, official, _, preset, verdict = cells
    literal = lambda cell: ast.literal_eval(cell.strip("`"))  # noqa: E731
    out.append((setting, field.strip("`"), variant, literal(official), literal(preset), verdict))
  return out


ROWS = _rows()


def _preset(variant):
  return importlib.import_module("configs.qwen1p5b").get_config(variant)


def _value(c, field):
  for part in field.split("."):
    c = c[part]
  return tuple(c) if isinstance(c, (list, tuple)) else c


def test_the_table_covers_the_settings_that_decide_results():
  fields = {f for _, f, *_ in ROWS}
  assert len(ROWS) >= 45
  for f in ("algo.beta2", "stage1.beta1", "stage1.n_samples", "reward.grader", "reward.stage1_grader",
            "reward.eos_required", "algo.entropy_agg", "train.epochs", "optim.zero_lr_first_rollout",
            "sampling.extra_stop_tokens", "data.prompt_filter", "data.test_sets"):
    assert f in fields, f


@pytest.mark.parametrize("variant", ["math", "gsm8k"])
def test_paper_preset_matches_the_official_values_of_the_table(variant):
  c = _preset(variant)
  checked = 0
  for setting, field, row_variant, official, preset, verdict in ROWS:
    if row_variant not in ("both", variant):
      continue
    got = _value(c, field)
    if verdict.startswith("="):
      assert got == official, f"{setting} ({field}): preset {got!r}, official {official!r}"
    else:
      assert got == preset, f"{setting} ({field}): preset {got!r}, the table says {preset!r}"
      assert verdict[0] in "≡≠~", f"{setting}: verdict {verdict!r}"
    checked += 1
  assert checked >= 40


@pytest.mark.parametrize("name", ["qwen3b", "qwen7b"])
def test_the_larger_presets_differ_from_the_1p5b_one_only_in_model_and_micro_batch(name):
  for variant in ("math", "gsm8k"):
    a, b = _preset(variant).to_dict(), importlib.import_module(f"configs.{name}").get_config(variant).to_dict()
    diff = {(s, k) for s in a for k in (a[s] if isinstance(a[s], dict) else [None])
            if (a[s].get(k) if k else a[s]) != (b[s].get(k) if k else b[s])}
    per_device = {("train", "micro_batch_per_device")} if name == "qwen7b" else set()  # one prompt per shard
    assert diff == {("model", "name_or_path"), ("train", "micro_batch")} | per_device, diff
