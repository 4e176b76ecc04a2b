"""Sampling from a policy: prompts -> responses with their log-probs, as fast as the backend allows.

  sampler       the sampling API: n samples per prompt, per-row budgets, decode slots per backend
  engine        continuous batching: prompts prefilled once, decode slots refilled between segments
  decode_cache  the decode slots' keys/values in either layout: init, write rows, take rows, shard
  token_choice  SamplingConfig, SampleOutput; temperature / top-k / top-p without sorting, the draw
  rollout       prompts -> sampled responses -> text -> rewards (every method, Stage 1, evaluation)

May import: model, infra.
"""
