"""Verifiable rewards: a response's text and the gold answer -> a reward in [0, 1], safely.

  answers      answer extraction (\\boxed{}, GSM8K ####, plain numbers)
  grading      the graders (GSM8K strict / flexible, Hendrycks MATH, math-verify), in one process
  reward_pool  grading in worker processes with time and memory limits (model text is hostile input)

May import: infra.
"""
