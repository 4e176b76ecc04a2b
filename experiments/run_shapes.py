"""Config -> the shapes a plan or an ahead-of-time compile needs (shared by memory_plan.py and aot.py).

Reads only the ml_collections config, like the other scripts in experiments/; no weights, no hub.
"""
from __future__ import annotations

import dataclasses
import os


def model_config(c):
  """ModelConfig of the run's policy from the config: known hub id, local folder, or the random demo model."""
  from astarpo_jax import hf, memory_plan, model, synthetic
  m = c.model
  if m.name_or_path == "random":
    r = m.random
    return model.ModelConfig(vocab_size=len(synthetic.VOCAB), hidden_size=r.hidden_size,
                             intermediate_size=r.intermediate_size, num_layers=r.num_layers, num_heads=r.num_heads,
                             num_kv_heads=r.num_kv_heads, head_dim=r.head_dim, tie_embeddings=r.tie_embeddings,
                             max_position_embeddings=r.max_position_embeddings, dtype=m.dtype,
                             param_dtype=m.param_dtype, remat=m.remat, attention_block=m.attention_block)
  if m.name_or_path in memory_plan.KNOWN_MODELS:
    return memory_plan.known_model_config(m.name_or_path, dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat,
                                          attention_block=m.attention_block)
  if os.path.exists(os.path.join(m.name_or_path, "config.json")):
    cfg = hf.load_hf_config(m.name_or_path, dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat)
    return dataclasses.replace(cfg, attention_block=m.attention_block)
  raise SystemExit(f"model.name_or_path={m.name_or_path!r}: not a local folder with config.json nor one of "
                   f"{sorted(memory_plan.KNOWN_MODELS)}; add its config.json shape fields to "
                   "memory_plan.KNOWN_MODELS")


def run_shape(c):
  """The RunShape of a config, in rows (a baseline's prompts x its group size)."""
  from astarpo_jax import baselines, memory_plan, sampler
  t = c.train
  g = 1 if c.algo.name == "astarpo" else (c.algo.group_size or baselines.DEFAULT_GROUP_SIZE[c.algo.name])
  return memory_plan.RunShape(
      prompt_len=sampler.bucket_length(c.data.max_prompt_tokens), response_len=c.sampling.max_new_tokens,
      rollout_batch=t.rollout_batch * g, micro_batch=t.micro_batch * g, mini_batch=t.mini_batch * g,
      sample_batch=c.sampling.max_batch or t.rollout_batch * g, logp_chunk=t.logp_chunk,
      stage1_batch=c.sampling.max_batch or c.stage1.chunk_prompts * c.stage1.n_samples,
      ref_param_dtype=c.model.ref_param_dtype)
