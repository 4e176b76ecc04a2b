"""The decoder and everything about its weights: one definition that training, scoring and sampling call.

  config        ModelConfig: shape and numerics (Qwen2 / Qwen3 / Llama)
  decoder       params (NNX declarations with logical axes), the forward in every form (full, prefill,
                one-token decode), the KV cache of a prefill
  layer_forms   the decoder layer written once, in its two layouts (rows; one-token columns), LoRA applied
  lora          LoRA adapters on the frozen base (π_ref = the base with the adapter off), merge, PEFT export
  layers        the decoder's math: RMSNorm, RoPE, attention (causal in query blocks), SwiGLU (own backward)
  kernels       the chunked log-prob / entropy heads with a hand-written backward
  paged_attention  decode attention over a paged KV cache: the GPU's Pallas-on-Triton kernel, XLA's gather
  paged_attention_tpu  the TPU kernel: a grid of row blocks streaming each row's live pages; its fixed_cost
  hf            HF config.json <-> ModelConfig, safetensors import (lazy, into shardings) and export
  known_models  config.json shapes of the models the project plans for (no hub needed)

May import: infra.
"""
