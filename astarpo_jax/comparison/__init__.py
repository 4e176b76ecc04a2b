"""The comparison of A*-PO with GRPO, PPO, REBEL and RLOO on a CPU task (experiments/compare.py).

  runs       a run's spec, one run in its own process (result.json), the cache of finished runs
  studies    the studies: lr sweep, main table, beta, filter, N, budget and their tables
  falsifier  avg@k before and after training on the prompts pi_ref never solves
  summary    runs read back into curves, times to a threshold, means over seeds, the plot

May import: top, aot, methods, stage1, training, sampling, data, model, infra.
"""
