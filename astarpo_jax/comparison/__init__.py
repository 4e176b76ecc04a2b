"""The comparison of A*-PO with GRPO, PPO, REBEL and RLOO on a CPU task (experiments/compare.py).

  runs       a run's spec, one run in its own process (result.json), the cache of finished runs
  cache_key  the cache's key: training code, resolved config, reference weights, jax (runs of two codes never mix)
  context    what every study shares: the context, its runs through the cache, the tables' formatting
  sweep      the lr sweeps and the choice the tables run at
  headline   the main table and its target
  questions  A*-PO alone against the main table: betas, Stage-1 filtering, N
  budgets    A*-PO given more steps: equal wall time, the budget and long studies
  falsifier  pi_ref's coverage at N = 8, 32, 128; avg@k before and after on the prompts it never solves
  answer     A*-PO against GRPO on steps, samples, tokens and CPU s; break-even ratio; plateaus; five seeds; k samples
  stats      the reading rules: first reach, break-even ratio, plateau, tie, tests by seed and by problem
  studies    the registry of studies and the page they write
  summary    runs read back into curves, times to a threshold, means over seeds, the plot

May import: top, aot, methods, stage1, training, sampling, data, model, infra.
"""
