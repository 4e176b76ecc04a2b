"""What every study shares: the comparison's context (work directory, task, methods, seeds), its runs (cached in
the work directory) and the tables' formatting. The studies call `runs` through this module, so a test can stand
in for the training runs in one place."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from astarpo_jax.comparison import summary as cmp
from astarpo_jax.comparison.runs import RunSpec, ensure_run, summary_of


@dataclasses.dataclass
class Context:
  workdir: str
  task: str
  size: str
  methods: list[str]
  seeds: list[int]
  fresh: bool
  log: Callable[[str], None]
  command: str
  cache_dir: str = ""  # JAX's persistent compilation cache of the runs
  sweep_seeds: tuple[int, ...] = (0,)  # the lr sweeps' seeds, disjoint from `seeds` (evaluation)
  overrides: tuple[tuple[str, object], ...] = ()  # every run's, before a study's own (e.g. train.pack_rows)
  code_id: str = ""  # read another code's results (cache_key): reprint its tables, run nothing


def runs(ctx: Context, specs: list[RunSpec]) -> list[cmp.RunSummary]:
  """The runs' summaries, each run launched in its own process unless its result is in the work directory."""
  out = []
  for spec in specs:
    run_dir, result = ensure_run(spec, ctx.workdir, ctx.fresh, ctx.log, ctx.cache_dir, ctx.code_id)
    out.append(summary_of(spec, run_dir, result))
  return out


def base(ctx: Context, method: str, seed: int = 0, lr_scale: float = 1.0, overrides=()) -> RunSpec:
  return RunSpec(ctx.task, ctx.size, method, seed, lr_scale, tuple(ctx.overrides) + tuple(overrides))


def astarpo_value(ctx: Context, field: str):
  """A field ("section.key") of A*-PO's config in this comparison."""
  node = base(ctx, "astarpo").config()
  for part in field.split("."):
    node = node[part]
  return node


def steps_overrides(num_steps: int) -> list[tuple[str, int]]:
  """A run of `num_steps` rollout steps (one checkpoint, at its end)."""
  return [("train.num_steps", num_steps), ("train.checkpoint_every", num_steps)]


def table(header: list[str], rows: list[list]) -> list[str]:
  return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
      "| " + " | ".join(str(x) for x in r) + " |" for r in rows]


def pm(values: list[float], digits: int = 3) -> str:
  """mean ± std over seeds, or the one value."""
  return cmp.fmt_pm(values, digits) if len(values) > 1 else f"{values[0]:.{digits}f}"


def seeds_text(seeds) -> str:
  return f"seed {seeds[0]}" if len(seeds) == 1 else "seeds " + ", ".join(str(s) for s in seeds)
