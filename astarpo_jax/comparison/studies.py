"""The comparison's studies (experiments/compare.py --study=NAME): the registry, and the page they write.

  sweep       lr in {1/3, 1, 3} x each method's config lr on the sweep seeds, grown until the choice is interior,
              chosen on the validation problems by the mean accuracy of the last quarter's evaluations (sweep.py)
  main        every method at its chosen lr over the seeds: final accuracy, time to 95% of the best method's mean
              final accuracy (Stage 1 included for A*-PO), KL to pi_ref, tokens, memory (headline.py)
  equal_time  A*-PO given GRPO's whole-run time as extra epochs: its accuracy at that time (budgets.py)
  beta        A*-PO's beta1 and beta2: the config's, beta1 = beta2, the paper's split, the plain mean, beta1 =
              beta2 = 1/2, beta2 / 5 (questions.py)
  filter      Stage-1 filtering of prompts no sample solved, at the config's N and at N = 32 (questions.py)
  n_samples   Stage 1's N in {2, 4, 8, 16} (questions.py)
  falsifier   pi_ref's coverage of the training and held-out prompts at N = 8, 32, 128; avg@8 before and after
              training on the prompts it never solved in 32 samples, per method (falsifier.py)
  budget      A*-PO given 3x the rollout steps, with the config's beta2 and beta2 / 5 (budgets.py)
  long_sweep  the sweep again at 3x the rollout steps; its choice is long's lr (budgets.py)
  long        every method given 3x the rollout steps (budgets.py; neither long study is in --study=all)
  samples     the lr sweep of A*-PO with k = 8 samples a prompt (answer.py)
  axes        A*-PO (756 steps, and k = 8), GRPO (300 steps): time to targets on steps, samples, tokens, CPU s;
              the break-even cost ratio; plateaus and their tie (answer.py)
  seeds       A*-PO and GRPO at 25 epochs: tests by seed and by problem, π_ref per seed, train/kl (answer.py)
"""
from __future__ import annotations

import json
import os

from astarpo_jax.comparison import answer, budgets, falsifier as falsifier_study, headline, questions, sweep as sweeps
from astarpo_jax.comparison.context import Context

STUDIES = ("sweep", "main", "equal_time", "beta", "filter", "n_samples", "falsifier", "budget", "long_sweep", "long",
           "samples", "axes", "seeds")
# the long studies train every method 3x longer, issue 52's studies run A*-PO and GRPO long: asked for by name only
ALL_STUDIES = tuple(s for s in STUDIES if s not in ("long_sweep", "long", "samples", "axes", "seeds"))


def falsifier(ctx: Context) -> list[str]:
  return falsifier_study.run(ctx, headline.main_runs, sweeps.chosen_scales(ctx)[0], answer.long_groups(ctx))


STUDY_FNS = {"sweep": sweeps.sweep, "main": headline.main_table, "equal_time": budgets.equal_time,
             "beta": questions.beta, "filter": questions.filtering, "n_samples": questions.n_samples,
             "falsifier": falsifier, "budget": budgets.budget, "long_sweep": budgets.long_sweep,
             "long": budgets.long_budget, "samples": answer.samples, "axes": answer.axes, "seeds": answer.seeds_study}


def run_study(name: str, ctx: Context) -> None:
  write_section(ctx, name, STUDY_FNS[name](ctx))


def write_section(ctx: Context, name: str, lines: list[str]) -> None:
  """Replaces the study's section of <workdir>/comparison.md (the others are kept)."""
  path = os.path.join(ctx.workdir, "comparison.md")
  sections = json.load(open(path + ".json")) if os.path.exists(path + ".json") else {}
  sections[name] = [f"## {name}", "", f"`python experiments/compare.py {ctx.command}`", ""] + lines + [""]
  with open(path + ".json", "w") as f:
    json.dump(sections, f)
  with open(path, "w") as f:
    f.write("\n".join(line for s in STUDIES if s in sections for line in sections[s]) + "\n")
  ctx.log("\n".join(sections[name]))
