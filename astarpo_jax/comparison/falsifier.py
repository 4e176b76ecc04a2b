"""The comparison's falsifier study: does A*-PO improve less than the baselines on prompts pi_ref
never solves? (Its V* is 0 there: the regression target is the bare reward, and the method's
no-exploration argument does not cover them.)

The training prompts pi_ref solves in none of 32 samples (a Stage-1 run with N = 32, temperature 1) are
the set; on it, avg@8 (8 samples per prompt, the task's sampling and grader) of pi_ref and of each main
run's final policy, mean ± std over seeds.
"""
from __future__ import annotations

import os

from astarpo_jax.comparison import summary as cmp
from astarpo_jax.comparison.runs import LABELS, RunSpec, ensure_run, reference_dir, write_csv

N_REF, K, MIN_PROMPTS, MAX_PROMPTS = 32, 8, 50, 96


def never_solved(ctx, spec: RunSpec):
  """(setup, prompts pi_ref solved in none of N_REF samples, number of training prompts)."""
  import shutil

  from astarpo_jax import experiment
  from astarpo_jax.stage1 import estimate
  work = os.path.join(ctx.workdir, f"falsifier_{ctx.task}_{ctx.size}")
  if not os.path.exists(os.path.join(work, "reference")):
    shutil.copytree(os.path.join(reference_dir(ctx.workdir, ctx.task, ctx.size, ctx.log), "reference"),
                    os.path.join(work, "reference"))
  c = spec.config()
  setup = experiment.build(c, work, log=lambda s: None)
  draw = estimate.rollout_draw(setup.cfg, setup.ref_params, setup.scfg, setup.tokenizer, setup.graders.stage1,
                               setup.loop.sample_max_batch, setup.mesh)
  table = estimate.run_stage1(setup.train_prompts, draw, out_dir=work, n_samples=N_REF, beta1=0.5,
                              chunk_prompts=c.stage1.chunk_prompts, seed=1000, log=lambda s: None, progress=False)
  hard = [p for p in setup.train_prompts if table.records[p.uid]["num_correct"] == 0]
  return setup, hard[:MAX_PROMPTS], len(setup.train_prompts)


def avg_at_k(setup, params, prompts) -> float:
  import jax

  from astarpo_jax.training import evaluate
  return evaluate.evaluate(setup.cfg, params, prompts, setup.tokenizer, setup.graders.eval[0][1], setup.scfg,
                           jax.random.key(11), k=K)["accuracy"]


def run(ctx, main_runs, scales: dict[str, float]) -> list[str]:
  """`main_runs(ctx)` makes sure every main run exists; `scales`: each method's lr multiple (the sweep's choice)."""
  import jax

  from astarpo_jax.model import hf
  main_runs(ctx)  # make sure every final policy exists
  setup, hard, num_train = never_solved(ctx, RunSpec(ctx.task, ctx.size))
  with setup, jax.set_mesh(setup.mesh):
    if not hard:
      return [f"pi_ref solved every one of the {num_train} training prompts at least once in {N_REF} samples: "
              "no prompt to test on."]
    before = avg_at_k(setup, setup.ref_params, hard)
    rows, csv_rows = [], []
    for m in ctx.methods:
      after = []
      for s in ctx.seeds:
        spec = RunSpec(ctx.task, ctx.size, m, s, scales.get(m, 1.0), tuple(ctx.overrides))
        run_dir, _ = ensure_run(spec, ctx.workdir, False, ctx.log, ctx.cache_dir)
        _, params = hf.load_hf(os.path.join(run_dir, "export"), dtype=setup.cfg.dtype, param_dtype=setup.cfg.param_dtype)
        after.append(avg_at_k(setup, params, hard))
        csv_rows.append({"method": m, "seed": s, "before": before, "after": after[-1]})
      rows.append([LABELS[m], f"{before:.3f}", cmp.fmt_pm(after), cmp.fmt_pm([a - before for a in after])])
  write_csv(os.path.join(ctx.workdir, "falsifier.csv"), csv_rows)
  note = "" if len(hard) >= MIN_PROMPTS else f" (fewer than the {MIN_PROMPTS} wanted: read with care)"
  return ([f"{len(hard)} of {num_train} training prompts{note} that π_ref solved in none of {N_REF} samples; avg@{K} "
           "on them before (π_ref) and after training, per method, over the main runs' seeds.", ""]
          + ["| method | before | after | gain |", "|---|---|---|---|"]
          + ["| " + " | ".join(r) + " |" for r in rows])
