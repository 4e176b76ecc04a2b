"""A*-PO against GRPO, PPO, REBEL and RLOO on a CPU task, over several seeds, with the paper's critics' questions.

  python experiments/compare.py --workdir=/work/cmp9 --size=paper --study=sweep --pack_rows  # the paper's protocol
  python experiments/compare.py --workdir=/work/cmp9 --size=paper --study=main --pack_rows   # (docs/comparison.md)
  python experiments/compare.py --workdir=/tmp/cmp --study=sweep      # lr sweep {1/3, 1, 3} x each lr, seeds 0 and 4
  python experiments/compare.py --workdir=/tmp/cmp --study=main --seeds=3   # the main table (the sweep's lrs)
  python experiments/compare.py --workdir=/tmp/cmp --study=beta|filter|n_samples|falsifier --seeds=3
  python experiments/compare.py --workdir=/tmp/cmp --study=budget --seeds=3    # A*-PO at 3x the steps vs main
  python experiments/compare.py --workdir=/tmp/cmp --study=long_sweep        # the lr sweep at 3x the steps
  python experiments/compare.py --workdir=/tmp/cmp --study=long --seeds=3      # every method at 3x the steps
  python experiments/compare.py --workdir=/tmp/cmp --study=long_sweep --sweep_seeds=0,7,8  # lr chosen over 3 seeds
  python experiments/compare.py --workdir=/work/cmp --size=paper --pack_rows --study=samples   # A*-PO k = 8 lr sweep
  python experiments/compare.py --workdir=/work/cmp --size=paper --pack_rows --study=axes|seeds --eval_seeds=1,2,3,5,6
  python experiments/compare.py --workdir=/work/cmp9 --size=paper --pack_rows --study=axes --code_id=ce87161bc21d
                                                  # run 9's tables from its cache, nothing run (docs/comparison.md)
  python experiments/compare.py --workdir=/tmp/cmp_q --quick                 # a smoke run (QUICK below), ~5 min
  python experiments/compare.py --workdir=/tmp/cmp_s --task=sums             # the old demo comparison

Every run starts from one warm-started reference (built once per task, copied into each run's work
directory), trains on the same prompts (the task's problems are fixed by config.data.seed; config.seed
varies the rollouts, Stage 1 and the data order), and is evaluated the same way. A run is a subprocess
(astarpo_jax/comparison/runs.py), so its peak RSS is its own; a run whose result.json exists under the same
key (training code, resolved config, reference, jax: comparison/cache_key.py) is reused (--fresh reruns). Each study writes a section to <workdir>/comparison.md and its numbers to <study>.csv.

--quick: the task's quick size, one seed, A*-PO and GRPO at their config lrs, the main table and the
falsifier. Every run is a process that compiles its own programs (~45 s each here, cold), so the whole
set of studies (the sweep's 15 runs, five methods, six question variants) takes ~18 min even at this
size; --methods and --study add the rest to a quick run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # configs/ and the package

from astarpo_jax.comparison import studies  # noqa: E402
from astarpo_jax.comparison.runs import METHODS, QUICK_METHODS, QUICK_STUDIES, TASKS, parse_sweep_seeds  # noqa: E402


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--task", default="chains", choices=sorted(TASKS))
  ap.add_argument("--study", default="all", choices=("all",) + studies.STUDIES)
  ap.add_argument("--seeds", type=int, default=3, help="seeds of the main table and the questions")
  ap.add_argument("--first_seed", type=int, default=1,
                  help="the first of them (the sweep runs on seed 0: its runs compile, the table's find the cache)")
  ap.add_argument("--eval_seeds", default="",
                  help="comma-separated evaluation seeds, in place of --seeds/--first_seed (e.g. 1,2,3,5,6: seed 4 is "
                       "a sweep seed)")
  ap.add_argument("--sweep_seeds", default="0,4",
                  help="comma-separated seeds of the lr sweeps (sweep, long_sweep; disjoint from the evaluation seeds); "
                       "the choice is the lr with the best mean over them, kept apart from seed 0's")
  ap.add_argument("--compile_cache", default="<workdir>/jax_cache",
                  help="JAX's persistent compilation cache shared by the runs ('' = none: every run compiles)")
  ap.add_argument("--methods", default="", help=f"comma-separated, of {METHODS} (default: all; --quick: {QUICK_METHODS})")
  ap.add_argument("--quick", action="store_true",
                  help=f"the task's quick size, 1 seed unless --seeds is given, studies {QUICK_STUDIES} unless --study "
                       "names one, methods as --methods says")
  ap.add_argument("--size", default="", help="the task config's variant (default full, or quick with --quick)")
  ap.add_argument("--fresh", action="store_true", help="rerun runs whose result exists")
  ap.add_argument("--pack_rows", action="store_true",
                  help="every run with train.pack_rows named as an override (packing is the config's default now; the "
                       "flag keeps the cached runs' names, _pack_rowsTrue, apart from runs before that default)")
  ap.add_argument("--code_id", default="",
                  help="reprint the tables of another code's runs (the code hash their result.json keys carry, e.g. run "
                       "9's); a run missing under it is an error, never run (astarpo_jax/comparison/cache_key.py)")
  args = ap.parse_args()
  workdir = os.path.abspath(args.workdir)
  methods = [m for m in (args.methods or ",".join(QUICK_METHODS if args.quick else METHODS)).split(",") if m]
  if any(m not in METHODS for m in methods):
    raise SystemExit(f"--methods: choose from {METHODS}")
  size = args.size or (TASKS[args.task][2] if args.quick else "full")
  seeds = args.seeds if (args.seeds != 3 or not args.quick) else 1
  log = lambda s: print(s, flush=True)  # noqa: E731
  os.makedirs(workdir, exist_ok=True)
  cache_dir = args.compile_cache.replace("<workdir>", workdir)
  eval_seeds = list(range(args.first_seed, args.first_seed + seeds))
  if args.eval_seeds:
    eval_seeds = [int(x) for x in args.eval_seeds.split(",") if x.strip()]
    if not eval_seeds or len(set(eval_seeds)) != len(eval_seeds) or min(eval_seeds) < 0:
      raise SystemExit(f"--eval_seeds={args.eval_seeds!r}: distinct non-negative seeds, at least one")
  sweep_seeds = parse_sweep_seeds(args.sweep_seeds, eval_seeds)
  ctx = studies.Context(workdir, args.task, size, methods, eval_seeds, args.fresh, log, " ".join(sys.argv[1:]),
                        cache_dir, sweep_seeds, (("train.pack_rows", True),) if args.pack_rows else (), args.code_id)
  chosen = (args.study,) if args.study != "all" else QUICK_STUDIES if args.quick else studies.ALL_STUDIES
  t_all = time.perf_counter()
  for study in chosen:
    t = time.perf_counter()
    studies.run_study(study, ctx)
    log(f"study {study}: {time.perf_counter() - t:.0f}s")
  log(f"studies {', '.join(chosen)}: {time.perf_counter() - t_all:.0f}s")


if __name__ == "__main__":
  main()
