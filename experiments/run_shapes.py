"""Config -> the run shape a memory plan or an ahead-of-time compile needs (memory_plan.py and aot.py).

Reads only the ml_collections config, like the other scripts in experiments/; no weights, no hub.
"""
from __future__ import annotations


def run_shape(c, reference_batch: int | None = None, backend: str | None = "tpu"):
  """The RunShape of a config: batches in prompts, rows per prompt the config's method's; decode slots as
  the sampler gives them on `backend` (the accelerators' by default; None: this process's backend)."""
  from astarpo_jax import memory_plan, run_config, sampler
  t, G = c.train, run_config.build_method(c).responses_per_prompt()
  return memory_plan.RunShape(
      prompt_len=sampler.bucket_length(c.data.max_prompt_tokens), response_len=c.sampling.max_new_tokens,
      rollout_batch=t.rollout_batch, micro_batch=t.micro_batch, mini_batch=t.mini_batch,
      micro_batch_per_device=t.micro_batch_per_device,
      sample_batch=sampler.decode_slots(c.sampling.max_batch, t.rollout_batch * G, backend), logp_chunk=t.logp_chunk,
      reference_batch=reference_batch, rows_per_prompt=G,
      stage1_batch=sampler.decode_slots(c.sampling.max_batch, c.stage1.chunk_prompts * c.stage1.n_samples, backend),
      ref_param_dtype=c.model.ref_param_dtype)
