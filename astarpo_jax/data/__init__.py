"""Prompts to train and evaluate on: data sets by hub id or local file, and the offline tasks.

  dataset    examples from JSONL / JSON / parquet / the hub with named fields, prompt templates and
             filters, the resumable sharded batch iterator
  synthetic  the sums task with its own character tokenizer (the CPU demo)
  chains     the chains-of-operations task (the CPU comparison: responses of tens to hundreds of tokens)

May import: rewards, infra.
"""
