"""A*-PO's Stage 1: N samples per training prompt from pi_ref -> V*(x), computed once and kept.

  estimate       the Stage-1 run: chunks of prompts, N samples each (or adaptive N), resumable
  value_table    V* = beta1 * log mean exp(r / beta1) and the table's file format; Stage 2 looks it up
  official_data  the official A*-PO Stage-1 data sets (eval_0..eval_7 columns) imported as a V* table

May import: sampling, data, rewards, infra.
"""
