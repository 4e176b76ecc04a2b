"""The Flax decoder against HF transformers (PyTorch CPU) on tiny random Qwen2, Qwen3 and Llama models; without
PyTorch (a GPU image), against the same models' logits recorded where it is (tests/hf_fixtures.py)."""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from astarpo_jax.model import decoder, hf
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.sampling import decode_cache
from tests.hf_fixtures import PARITY_CASES as CASES, hf_logits, padded_batch, tiny_hf_model


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{'tied' if t else 'untied'}" for a, t in CASES])
def converted(request, tmp_path_factory):
  arch, tied = request.param
  hf_model = tiny_hf_model(arch, tied)
  path = str(tmp_path_factory.mktemp(f"{arch}_{tied}"))
  hf_model.save_pretrained(path)
  cfg, params = hf.load_hf(path)
  return hf_model, cfg, params


def test_config_is_read_from_hf_config(converted):
  hf_model, cfg, _ = converted
  assert cfg.arch == hf_model.config.model_type
  assert cfg.tie_embeddings == hf_model.config.tie_word_embeddings
  assert cfg.num_kv_heads == 2 and cfg.head_dim == (24 if cfg.arch == "qwen3" else 16)
  assert (cfg.rope_llama3_scaling is not None) == (cfg.arch == "llama")
  assert cfg.qkv_bias == (cfg.arch == "qwen2") and cfg.qk_norm == (cfg.arch == "qwen3")


@pytest.mark.parametrize("block", [0, 5], ids=["one-attention-block", "query-blocks-of-5"])
def test_logits_match_hf_with_left_padding(converted, block):
  hf_model, cfg, params = converted
  cfg = dataclasses.replace(cfg, attention_block=block)  # 5: blocks [0,5) [5,10) [10,12) of the 12 positions
  tokens, mask = padded_batch()
  ref = hf_logits(hf_model, tokens, mask)
  logits, _ = decoder.forward(cfg, params, jnp.asarray(tokens), decoder.positions_from_mask(jnp.asarray(mask)),
                              jnp.asarray(mask))
  np.testing.assert_allclose(np.asarray(logits)[mask], ref[mask], atol=1e-4, rtol=1e-4)


def test_cached_decoding_matches_full_forward(converted):
  _, cfg, params = converted
  tokens, mask = padded_batch(seed=1)
  tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
  positions = decoder.positions_from_mask(mask)
  full, _ = decoder.forward(cfg, params, tokens, positions, mask)
  cache = decoder.init_cache(cfg, batch=3, max_len=16)
  step = jax.jit(lambda p, t, pos, m, c: decoder.forward(cfg, p, t, pos, m, c))
  pieces = []
  logits, cache = step(params, tokens[:, :8], positions[:, :8], mask[:, :8], cache)  # prefill
  pieces.append(logits)
  for t in range(8, 12):  # then one token at a time
    logits, cache = step(params, tokens[:, t:t + 1], positions[:, t:t + 1], mask[:, t:t + 1], cache)
    pieces.append(logits)
  assert int(cache["index"]) == 12
  inc = jnp.concatenate(pieces, axis=1)
  np.testing.assert_allclose(np.asarray(inc)[np.asarray(mask)], np.asarray(full)[np.asarray(mask)], atol=1e-5)


def test_export_then_transformers_reload_gives_same_logits(converted, tmp_path):
  pytest.importorskip("torch", reason="transformers reloads the export into PyTorch")
  import transformers
  _, cfg, params = converted
  hf.save_hf(cfg, params, str(tmp_path))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
  tokens, mask = padded_batch(seed=2)
  ours, _ = decoder.forward(cfg, params, jnp.asarray(tokens), decoder.positions_from_mask(jnp.asarray(mask)),
                            jnp.asarray(mask))
  np.testing.assert_allclose(hf_logits(reloaded, tokens, mask)[mask], np.asarray(ours)[mask], atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_import_equals_single_file(converted, tmp_path):
  _, cfg, params = converted
  hf.save_hf(cfg, params, str(tmp_path), max_shard_bytes=20_000)
  assert os.path.exists(tmp_path / "model.safetensors.index.json")
  assert len([p for p in os.listdir(tmp_path) if p.endswith(".safetensors")]) > 2
  cfg2, params2 = hf.load_hf(str(tmp_path))
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_bf16_params_and_compute_stay_close_to_fp32(converted):
  _, cfg, params = converted
  cfg16 = dataclasses.replace(cfg, dtype="bfloat16", param_dtype="bfloat16")
  p16 = decoder.cast_params(params, "bfloat16")
  assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(p16))
  tokens, mask = (jnp.asarray(a) for a in padded_batch())
  pos = decoder.positions_from_mask(mask)
  l32, _ = decoder.forward(cfg, params, tokens, pos, mask)
  l16, _ = decoder.forward(cfg16, p16, tokens, pos, mask)
  assert l16.dtype == jnp.float32
  assert float(jnp.abs(l16 - l32)[mask].max()) < 0.1


def test_remat_gives_same_gradients(converted):
  _, cfg, params = converted
  tokens, mask = (jnp.asarray(a) for a in padded_batch())
  pos = decoder.positions_from_mask(mask)

  def loss(p, c):
    logits, _ = decoder.forward(c, p, tokens, pos, mask)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0] * mask)

  g1 = jax.grad(loss)(params, cfg)
  g2 = jax.grad(loss)(params, dataclasses.replace(cfg, remat=True))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g1, g2)


def test_query_blocked_attention_gives_the_same_gradients_as_one_block(converted):
  _, cfg, params = converted
  tokens, mask = (jnp.asarray(a) for a in padded_batch(seed=3))
  pos = decoder.positions_from_mask(mask)

  def loss(p, c):
    logits, _ = decoder.forward(c, p, tokens, pos, mask)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0] * mask)

  g1 = jax.grad(loss)(params, dataclasses.replace(cfg, attention_block=0))
  g2 = jax.grad(loss)(params, dataclasses.replace(cfg, attention_block=4))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), g1, g2)


def test_attention_block_must_be_a_nonnegative_int():
  with pytest.raises(ValueError, match="attention_block"):
    ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                num_kv_heads=1, head_dim=4, attention_block=-1)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-cpu-layout", "stacked-layout"])
def test_one_token_decode_at_per_row_columns_matches_full_forward(converted, fused):
  # Prefill 8 tokens, then feed tokens 8..11 one at a time; each row writes at its own cache columns
  # (row b leaves b empty columns after the prompt), which attention must not care about.
  _, cfg, params = converted
  tokens, mask = (jnp.asarray(a) for a in padded_batch(seed=4))
  positions = decoder.positions_from_mask(mask)
  full, _ = decoder.forward(cfg, params, tokens, positions, mask)
  _, cache = decoder.hidden_states(cfg, params, tokens[:, :8], positions[:, :8], mask[:, :8], decoder.init_cache(cfg, 3, 8))
  dparams = decoder.fused_decode_params(cfg, params) if fused else params
  assert decoder.is_fused(dparams) == fused
  dcache = decode_cache.write(decode_cache.init(cfg, 3, 16, fused),
                                    decode_cache.from_prefill(cache, fused), 0)
  live = jnp.zeros((3, 16), bool).at[:, :8].set(mask[:, :8])
  step = jax.jit(lambda *a: decoder.decode_step(cfg, *a))
  for t in range(8, 12):
    col = 8 + (t - 8) + jnp.arange(3)  # row b: column 8 + b for its first decoded token
    live = live.at[jnp.arange(3), col].set(mask[:, t])
    logits_VB, dcache = step(dparams, dcache, tokens[:, t], positions[:, t], col, live)
    rows = np.asarray(mask[:, t])
    np.testing.assert_allclose(np.asarray(logits_VB).T[rows], np.asarray(full[:, t])[rows], atol=1e-5, rtol=1e-5)
