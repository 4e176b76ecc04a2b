"""What an evaluation covers: set specs, the paper's and GSM8K's presets, MATH500's level and subject.

A spec is a comma-separated list of items `NAME[:N]`: a data preset (data.dataset.PRESETS), a group below, or a
user's file (.jsonl/.json/.parquet, fields named as for training data); N > 0 adds N sampled responses per
problem (avg@N, pass@k, maj@k) to the greedy pass@1 every set gets. The paper group follows the official README's
evaluation figure (MATH500, Minerva Math, OlympiadBench, AMC23 avg@32); the repository publishes neither its
decoding nor its grader (docs/fidelity_sources.md), so the choices are the project's: greedy pass@1 on each set
and 32 samples at the run's temperature (1.0) on AMC23, graded by hendrycks and math_verify.
"""
from __future__ import annotations

import dataclasses
import logging

from astarpo_jax.data import dataset

log = logging.getLogger(__name__)

GROUPS: dict[str, tuple[tuple[str, int], ...]] = {
    "paper": (("math500", 0), ("minerva", 0), ("olympiadbench", 0), ("amc23", 32)),
    "gsm8k": (("gsm8k_test", 0),),
}
LEVEL_FIELDS = {"math500": ("level", "subject")}  # sets whose rows carry MATH's level (1-5) and subject


@dataclasses.dataclass(frozen=True)
class SetSpec:
  name: str  # a preset name or a file path
  n: int  # sampled responses per problem; 0 = greedy only

  @property
  def is_file(self) -> bool:
    return self.name.endswith(dataset.LOCAL_SUFFIXES)


def parse(spec: str, n: int | None = None) -> list[SetSpec]:
  """The sets of `spec` (see the module docstring); `n`, when given, replaces every item's N but an explicit
  `:N`. Raises ValueError naming an unknown set and what is known."""
  out: dict[str, SetSpec] = {}
  for item in (s.strip() for s in spec.split(",")):
    if not item:
      continue
    name, _, count = item.rpartition(":") if item.rsplit(":", 1)[-1].isdigit() else (item, "", "")
    explicit = int(count) if count else None
    if name in GROUPS:
      members = [(m, explicit if explicit is not None else n if n is not None else k) for m, k in GROUPS[name]]
    elif name in dataset.PRESETS or name.endswith(dataset.LOCAL_SUFFIXES):
      members = [(name, explicit if explicit is not None else n or 0)]
    else:
      raise ValueError(f"--sets: unknown set {name!r}; use a preset {sorted(dataset.PRESETS)}, a group "
                       f"{sorted(GROUPS)}, or a data file ending in {dataset.LOCAL_SUFFIXES} (with --problem_field/"
                       "--answer_field)")
    for m, k in members:
      if k < 0:
        raise ValueError(f"--sets: {item!r} asks for {k} samples; N must be >= 0")
      out[m] = SetSpec(m, k)
  if not out:
    raise ValueError("--sets: no set given")
  return list(out.values())


def problem_meta(name: str, data_dir: str | None) -> dict[str, dict]:
  """uid -> {"level", "subject"} of a set that carries them (MATH500), else {}; the same uids as the prompts'
  (the same preset and source). A source that cannot be read gives {} and a warning: the breakdown is left out."""
  if name not in LEVEL_FIELDS:
    return {}
  p = dataset.PRESETS[name]
  try:
    if data_dir:
      fields = dataclasses.replace(p.local_fields or p.fields, extra=LEVEL_FIELDS[name])
      examples, _ = dataset.load_examples(f"{data_dir}/{p.local_file}", fields, name=name)
    else:
      fields = dataclasses.replace(p.fields, extra=LEVEL_FIELDS[name])
      examples, _ = dataset.load_examples(p.hf_id, fields, name=name, hf_configs=p.hf_configs, split=p.hf_split)
  except (OSError, KeyError, RuntimeError, ValueError) as e:
    log.warning("%s: no level/subject breakdown (%s)", name, e)
    return {}
  return {ex.uid: dict(ex.extra) for ex in examples}
