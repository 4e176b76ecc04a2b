"""Shape fields of the config.json of models the project plans for, so memory plans and ahead-of-time
compiles need neither weights nor hub access (a run loads the checkpoint's own config.json).

Values copied from each model's config.json on the Hugging Face Hub.
"""
from __future__ import annotations

_QWEN25 = dict(architectures=["Qwen2ForCausalLM"], rope_theta=1000000.0, rms_norm_eps=1e-6,
               max_position_embeddings=131072)

HF_CONFIGS: dict[str, dict] = {
    "Qwen/Qwen2.5-1.5B": dict(_QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                              num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                              tie_word_embeddings=True),
    "Qwen/Qwen2.5-3B": dict(_QWEN25, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                            num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                            tie_word_embeddings=True),
    "Qwen/Qwen2.5-7B": dict(_QWEN25, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                            num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                            tie_word_embeddings=False),
}
