"""Sampling from a policy: prompts -> responses with their log-probs, as fast as the backend allows.

  sampler       the sampling API: n samples per prompt, per-row budgets, decode slots per backend
  engine        continuous batching: prompts prefilled once, decode slots refilled between segments
  decode_plan   the host's plan for a run: slot ladder, attention windows, cache layout per backend, RunStats
  decode_cache  the dense decode slots' keys/values in either layout: init, write rows, take rows, shard
  paged_cache   the paged layout's pool, page tables, free-page stack and sizing (TPU/GPU)
  token_choice  SamplingConfig, SampleOutput; temperature / top-k / top-p without sorting, the draw
  rollout       prompts -> sampled responses -> text -> rewards (every method, Stage 1, evaluation)

May import: model, infra.
"""
