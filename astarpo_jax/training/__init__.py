"""Stage 2's shared machinery: what every method's step is built from, and the loop that runs it.

  loop            rollout, prepare, updates, the non-finite stop, logs, evaluation, checkpoints, resume
  update          optimizer, gradient accumulation, the one guarded update step every method uses
  scoring         log-probs of responses under any param tree (policy, pi_ref, old policy), in blocks
  packing         responses packed into rows without padding, for the update and the fixed-score forwards
  losses          the A*-PO regression loss (the paper's Stage 2)
  baseline_losses GRPO, PPO, REBEL, RLOO formulas
  warmstart       supervised warm-start (the demo's reference policy)
  evaluate        greedy pass@1 and sampled avg@k

May import: sampling, data, model, infra.
"""
