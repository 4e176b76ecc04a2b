"""Sampler behaviour on tiny random fp32 models, checked against the full (no-cache) forward."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from astarpo_jax.model import decoder as model_lib
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.sampling import sampler as sampler_lib
from astarpo_jax.sampling.token_choice import SamplingConfig

PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8, 30, 2, 11, 6, 19, 3, 3, 17, 21, 2, 9, 13, 5, 1, 2], [12], [3, 3, 3, 3, 3, 8]]


def tiny_model(vocab=37, seed=0, head_scale=6.0, arch="qwen2"):
  """A 2-layer model with output logits scaled so next-token distributions are far from uniform
  and q/k scaled so attention (hence a position or mask error) matters. "qwen2": q/k/v biases,
  untied lm_head; "llama": no biases, tied embeddings, Llama 3 rope scaling; "qwen3": per-head
  q/k norms, no biases, head dim 12 (not hidden / heads)."""
  kw = {"qwen2": dict(tie_embeddings=False, head_dim=8),
        "llama": dict(arch="llama", qkv_bias=False, tie_embeddings=True, rope_llama3_scaling=(8.0, 1.0, 4.0, 16),
                      head_dim=8),
        "qwen3": dict(arch="qwen3", qkv_bias=False, qk_norm=True, tie_embeddings=False, head_dim=12)}[arch]
  cfg = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, **kw)
  _, params = model_lib.init_params(cfg, seed)
  params["final_norm"] = params["final_norm"] * head_scale
  for w in ("wq", "wk"):
    params["layers"][w] = params["layers"][w] * 5.0
  if arch == "qwen2":  # nonzero biases, so that a dropped bias shows
    for b in ("bq", "bk", "bv"):
      params["layers"][b] = jax.random.normal(jax.random.key(seed + 1), params["layers"][b].shape) * 0.05
  elif arch == "qwen3":  # uneven per-dimension norm scales, so that a dropped or misplaced q/k norm shows
    for i, n in enumerate(("q_norm", "k_norm")):
      params["layers"][n] = 1.0 + jax.random.normal(jax.random.key(seed + 2 + i), params["layers"][n].shape)
  else:  # larger layer outputs, else tied embeddings make every row repeat its last token
    for w in ("wv", "wo", "w_gate", "w_up", "w_down"):
      params["layers"][w] = params["layers"][w] * 10.0
  return cfg, params


@functools.partial(jax.jit, static_argnums=0)
def _causal_logits(cfg, params, tokens_1T):
  return model_lib.forward(cfg, params, tokens_1T, jnp.arange(tokens_1T.shape[1])[None],
                           jnp.ones_like(tokens_1T, bool))[0]


def full_logits(cfg, params, tokens, width=64):
  """Next-token logits [T, V] of one unpadded sequence, without a cache (right-padded to `width`
  so that one compiled program serves every length: causal attention never sees the padding)."""
  t = np.zeros((1, width), np.int32)
  t[0, :len(tokens)] = tokens
  return np.asarray(_causal_logits(cfg, params, jnp.asarray(t))[0, :len(tokens)], np.float64)


def log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def response(out, i):
  return np.asarray(out.tokens_BT[i][: int(out.length_B[i])]).tolist()


def response_logp_rows(cfg, params, prompt, resp, width=64):
  """log softmax of the full-forward logits [len(resp), V] at the positions that predict `resp`."""
  return log_softmax(full_logits(cfg, params, prompt + resp, width=width))[len(prompt) - 1: -1]


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_greedy_sample_matches_stepwise_full_forward_argmax(arch):
  cfg, params = tiny_model(arch=arch)
  scfg = SamplingConfig(temperature=0.0, max_new_tokens=10)
  out = jax.device_get(sampler_lib.sample(cfg, params, PROMPTS, jax.random.key(0), scfg))
  for i, prompt in enumerate(PROMPTS):
    seq, logps = list(prompt), []
    for _ in range(scfg.max_new_tokens):
      logits = full_logits(cfg, params, seq)[-1]
      seq.append(int(np.argmax(logits)))
      logps.append(log_softmax(logits)[seq[-1]])
    assert response(out, i) == seq[len(prompt):]
    np.testing.assert_allclose(out.logp_BT[i], logps, atol=1e-4)
  assert out.truncated_B.all() and not out.finished_B.any()


def test_greedy_sample_stays_exact_across_decode_phases():
  # 80 new tokens: the cache grows after 64 (the first decode phase ends there).
  cfg, params = tiny_model(seed=3)
  scfg = SamplingConfig(temperature=0.0, max_new_tokens=80)
  out = jax.device_get(sampler_lib.sample(cfg, params, PROMPTS, jax.random.key(0), scfg))
  for i, prompt in enumerate(PROMPTS):
    resp = response(out, i)
    assert len(resp) == 80
    logp_TV = response_logp_rows(cfg, params, prompt, resp, width=128)
    assert resp == np.argmax(logp_TV, axis=-1).tolist()  # each token is the argmax given its prefix
    np.testing.assert_allclose(out.logp_BT[i], logp_TV[np.arange(80), resp], atol=1e-4)
  # Stop ids that every row emits within the first phase (here its 6th token): the later phase is skipped.
  stops = tuple(sorted({int(t) for t in out.tokens_BT[:, 5]}))
  stopped = jax.device_get(sampler_lib.sample(cfg, params, PROMPTS, jax.random.key(0),
                                              SamplingConfig(temperature=0.0, max_new_tokens=80, stop_ids=stops)))
  for i in range(len(PROMPTS)):
    n = next(t for t, tok in enumerate(out.tokens_BT[i]) if tok in stops) + 1
    assert stopped.finished_B[i] and stopped.length_B[i] == n <= 6
    assert stopped.tokens_BT[i, :n].tolist() == out.tokens_BT[i, :n].tolist() and (stopped.tokens_BT[i, n:] == 0).all()


def test_logprobs_at_temperature_one_match_full_forward_over_prompt_and_response():
  cfg, params = tiny_model(seed=1)
  scfg = SamplingConfig(temperature=1.0, max_new_tokens=12)
  out = jax.device_get(sampler_lib.sample(cfg, params, PROMPTS, jax.random.key(3), scfg))
  for i, prompt in enumerate(PROMPTS):
    resp = response(out, i)
    logp_TV = response_logp_rows(cfg, params, prompt, resp)
    np.testing.assert_allclose(out.logp_BT[i], logp_TV[np.arange(len(resp)), resp], atol=1e-4)


def test_greedy_output_is_the_same_alone_and_inside_a_left_padded_batch():
  cfg, params = tiny_model(seed=2)
  scfg = SamplingConfig(temperature=0.0, max_new_tokens=10)
  batch = jax.device_get(sampler_lib.sample(cfg, params, PROMPTS, jax.random.key(0), scfg))
  # Extra left padding beyond the bucket is trimmed; a wider padded input must not matter either.
  order = [2, 0, 3, 1]
  tokens, mask = sampler_lib.left_pad([PROMPTS[i] for i in order], scfg.pad_id, length=40)
  padded = jax.device_get(sampler_lib.sample_padded(cfg, params, jnp.asarray(tokens), jnp.asarray(mask),
                                                    jax.random.key(0), scfg))  # device arrays in
  for j, i in enumerate(order[:2]):
    alone = jax.device_get(sampler_lib.sample(cfg, params, [PROMPTS[i]], jax.random.key(0), scfg))
    assert response(alone, 0) == response(batch, i) == response(padded, j)
    np.testing.assert_allclose(alone.logp_BT[0], batch.logp_BT[i], atol=1e-5)


@pytest.fixture(scope="module")
def free_and_stopped():
  """Greedy responses without stop tokens, and again with a stop token that some rows emit."""
  cfg, params = tiny_model(seed=4)
  free = jax.device_get(sampler_lib.sample(cfg, params, PROMPTS, jax.random.key(0),
                                           SamplingConfig(temperature=0.0, max_new_tokens=10)))
  rows = [set(r) for r in free.tokens_BT.tolist()]
  # A token that row 1 emits but some other row never does: a mix of finished and truncated rows.
  stop = next(int(t) for t in free.tokens_BT[1] if not all(int(t) in r for r in rows))
  never = next(t for t in range(cfg.vocab_size) if not any(t in r for r in rows))  # a second, unused stop id
  scfg = SamplingConfig(temperature=0.0, max_new_tokens=10, stop_ids=(never, stop), pad_id=0)
  stopped = jax.device_get(sampler_lib.sample(cfg, params, PROMPTS, jax.random.key(0), scfg))
  hits = [[t for t, tok in enumerate(row) if tok in scfg.stop_ids] for row in free.tokens_BT.tolist()]
  assert any(hits) and not all(hits), "the test needs a mix of finished and truncated rows"
  return free, stopped, scfg, hits


def test_stop_token_ends_its_row_and_mask_covers_exactly_the_response(free_and_stopped):
  free, out, scfg, hits = free_and_stopped
  for i in range(len(PROMPTS)):
    n = hits[i][0] + 1 if hits[i] else scfg.max_new_tokens
    assert out.length_B[i] == n
    assert out.tokens_BT[i, :n].tolist() == free.tokens_BT[i, :n].tolist()
    assert (out.tokens_BT[i, n:] == scfg.pad_id).all() and (out.logp_BT[i, n:] == 0).all()
    assert out.mask_BT[i].tolist() == [t < n for t in range(scfg.max_new_tokens)]
  assert out.finished_B[1]


def test_rows_that_reach_the_token_limit_are_flagged_truncated(free_and_stopped):
  _, out, scfg, hits = free_and_stopped
  hit_B = np.array([bool(h) for h in hits])
  np.testing.assert_array_equal(out.finished_B, hit_B)
  np.testing.assert_array_equal(out.truncated_B, ~hit_B)
  np.testing.assert_array_equal(out.length_B[~hit_B], scfg.max_new_tokens)
  assert out.mask_BT[~hit_B].all()


def exact_filtered_probs(logits, scfg):
  """Reference sampling distribution: temperature, then top-k, then top-p on the sorted probabilities."""
  p = np.exp(log_softmax(logits / scfg.temperature))
  keep = np.ones_like(p, bool)
  if scfg.top_k:
    keep &= p >= np.sort(p)[::-1][scfg.top_k - 1]
  p = np.where(keep, p, 0.0)
  p /= p.sum()
  if scfg.top_p < 1:
    desc = np.sort(p)[::-1]
    mass_before = np.cumsum(desc) - desc
    smallest_kept = desc[mass_before < scfg.top_p].min()
    p = np.where(p >= smallest_kept, p, 0.0)
    p /= p.sum()
  return p


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (1.0, 9, 0.6)])
def test_sampled_token_frequencies_match_the_exact_filtered_softmax(temperature, top_k, top_p):
  cfg, params = tiny_model(seed=6, head_scale=3.0)
  scfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1)
  prompt, n = [4, 17, 2, 9], 4096
  out = jax.device_get(sampler_lib.sample(cfg, params, [prompt], jax.random.key(7), scfg, num_samples=n))
  p = exact_filtered_probs(full_logits(cfg, params, prompt)[-1], scfg)
  if top_k or top_p < 1:
    assert 2 < (p > 0).sum() < cfg.vocab_size, "the case should filter some but not all tokens"
  tok = out.tokens_BT[:, 0]
  freq = np.bincount(tok, minlength=cfg.vocab_size) / n
  assert (freq[p == 0] == 0).all(), "a filtered-out token was sampled"
  tv = 0.5 * np.abs(freq - p).sum()
  assert tv < 0.05, f"total variation {tv:.3f} between sampled and exact distributions"  # ~0.02 expected
  np.testing.assert_allclose(out.logp_BT[:, 0], np.log(p[tok]), atol=1e-4)


def test_chunked_batch_gives_the_same_samples_as_one_batch():
  cfg, params = tiny_model(seed=8)
  prompts = PROMPTS + [[2, 2, 5]]
  scfg = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=8, stop_ids=(1,))
  one = jax.device_get(sampler_lib.sample(cfg, params, prompts, jax.random.key(11), scfg))
  chunked = jax.device_get(sampler_lib.sample(cfg, params, prompts, jax.random.key(11), scfg, max_batch=2))
  again = jax.device_get(sampler_lib.sample(cfg, params, prompts, jax.random.key(11), scfg, max_batch=2))
  other = jax.device_get(sampler_lib.sample(cfg, params, prompts, jax.random.key(12), scfg))
  np.testing.assert_array_equal(chunked.tokens_BT, one.tokens_BT)
  np.testing.assert_array_equal(chunked.length_B, one.length_B)
  np.testing.assert_allclose(chunked.logp_BT, one.logp_BT, atol=1e-5)
  np.testing.assert_array_equal(again.tokens_BT, chunked.tokens_BT)
  assert (other.tokens_BT != one.tokens_BT).any()


def test_bad_inputs_raise_errors_that_name_the_problem():
  cfg, params = tiny_model()
  key = jax.random.key(0)
  with pytest.raises(ValueError, match="empty"):
    sampler_lib.sample(cfg, params, [[1, 2], []], key, SamplingConfig())
  with pytest.raises(ValueError, match="left-padded"):
    sampler_lib.sample_padded(cfg, params, np.ones((1, 4), np.int32), np.array([[True, True, False, False]]), key,
                              SamplingConfig())
  with pytest.raises(ValueError, match="PRNG key"):
    sampler_lib.sample(cfg, params, [[1]], 0, SamplingConfig())
  with pytest.raises(ValueError, match="top_p"):
    SamplingConfig(top_p=0.0)
  with pytest.raises(ValueError, match="stop_ids"):
    SamplingConfig(stop_ids=[2])
  with pytest.raises(ValueError, match="outside the vocabulary"):
    sampler_lib.sample(cfg, params, [[1]], key, SamplingConfig(stop_ids=(cfg.vocab_size,)))
  with pytest.raises(ValueError, match="max_position_embeddings"):
    sampler_lib.sample(cfg, params, [[1]], key, SamplingConfig(max_new_tokens=cfg.max_position_embeddings))


def test_bucket_lengths_are_few_and_cover_the_prompt():
  buckets = {sampler_lib.bucket_length(n) for n in range(1, 1025)}
  assert all(sampler_lib.bucket_length(n) >= n for n in range(1, 1025))
  assert len(buckets) <= 12
