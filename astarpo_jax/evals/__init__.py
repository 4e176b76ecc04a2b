"""Evaluation as math-reasoning papers report it: sampled responses kept, then pass@k, maj@k, avg@n per set.

  sets      what to evaluate: set specs (`math500:32`), the paper's and GSM8K's presets, MATH500 level/subject
  samples   the n responses of each problem sampled by chunk (resumable), graded, kept as JSONL; regrading
  metrics   the estimators: unbiased pass@k, maj@k over extracted answers, standard errors, paired comparisons
  summary   per-set and overall figures from the samples, by level and subject, and run-report rows
  run       one model over the set runs: records, then figures (what both entry points call); regrading
  report    eval.json, the markdown table, the pass@k-vs-k plot

`experiments/evaluate.py` and `experiment.evaluate_all` (main.py's evaluation) both run `samples` then `summary`.

May import: training, sampling, rewards, data, stage1, model, infra.
"""
