"""Packed rows (packing.py): the layout worked by hand, and the packed forward, log-probs, entropies and
every method's update equal to the padded ones (the reference: the unpacked rows, as every run uses)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from astarpo_jax import methods
from astarpo_jax.methods import ppo
from astarpo_jax.model import decoder
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.training import packing, scoring, update

P, R = 4, 6


def _rows():
  """Four rows, width P + R = 10: real lengths 5, 9, 3, 6 (prompt 2, 3, 1, 4; response 3, 6, 2, 2)."""
  prompt = [2, 3, 1, 4]
  resp = [3, 6, 2, 2]
  tokens = np.zeros((4, P + R), np.int32)
  mask = np.zeros((4, P + R), bool)
  rng = np.random.default_rng(0)
  for b in range(4):
    mask[b, P - prompt[b]:P + resp[b]] = True
    tokens[b, mask[b]] = rng.integers(3, 50, mask[b].sum())
  return tokens, mask


def test_rows_pack_first_fit_by_decreasing_length_with_segments_positions_and_sources():
  tokens, mask = _rows()
  p = packing.pack_rows(tokens, mask, P)
  # lengths 9, 6, 5, 3 in width 10: row 1 alone (9), row 3 (6) then row 2 (3) beside it, row 0 (5) alone
  assert p["pack_segments"].tolist() == [[2] * 9 + [0], [4] * 6 + [3] * 3 + [0], [1] * 5 + [0] * 5]
  assert p["pack_positions"][1].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 0]
  assert p["pack_tokens"][1, 6:9].tolist() == tokens[2, 3:6].tolist()  # row 2: prompt col 3, response 4..5
  # row 2 (prompt 1 token at packed column 6): response token t is predicted from column 6 + 1 + t - 1
  assert p["pack_src"][2].tolist() == [10 + 6, 10 + 7, 10 + 7, 10 + 7, 10 + 7, 10 + 7]  # padding -> last real
  assert p["pack_src"][1].tolist() == [0 * 10 + 2 + t for t in range(6)]
  with pytest.raises(ValueError, match="more than num_packed"):
    packing.pack_rows(tokens, mask, P, num_packed=2)
  holes = mask.copy()
  holes[1, P + 1] = False
  with pytest.raises(ValueError, match="contiguous"):
    packing.pack_rows(tokens, holes, P)


def _tiny():
  cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, max_position_embeddings=64, attention_block=4)
  return cfg, decoder.init_params(cfg, 0)[1]


def test_packed_logprobs_entropy_and_their_gradients_equal_the_padded_rows():
  cfg, params = _tiny()
  tokens, mask = _rows()
  resp = mask[:, P:]
  pack = jax.tree.map(lambda x: jnp.asarray(x)[None], packing.pack_rows(tokens, mask, P))  # one batch shard

  def f(params, pack):
    lp, ent = scoring.logprobs_and_entropy(cfg, params, tokens, mask, P, pack=pack)
    return jnp.sum(jnp.where(resp, lp + 0.1 * ent, 0.0)), (lp, ent)
  (v0, (lp0, ent0)), g0 = jax.value_and_grad(f, has_aux=True)(params, None)
  (v1, (lp1, ent1)), g1 = jax.value_and_grad(f, has_aux=True)(params, pack)
  np.testing.assert_allclose(np.asarray(lp1)[resp], np.asarray(lp0)[resp], atol=2e-5)
  np.testing.assert_allclose(np.asarray(ent1)[resp], np.asarray(ent0)[resp], atol=2e-5)
  np.testing.assert_allclose(float(v1), float(v0), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
  # packing changes the work: 3 packed rows of 10 columns for 4 rows, 23 real tokens of 40
  assert pack["pack_tokens"].shape == (1, 3, P + R)


@pytest.mark.parametrize("name", ["astarpo", "grpo", "ppo", "rebel", "rloo"])
def test_an_update_on_packed_micro_batches_equals_the_padded_one(name):
  """One update step (PPO's: its critic's value loss too) on packed micro-batches gives the padded step's
  params, critic included."""
  cfg, params = _tiny()
  tokens, mask = _rows()
  tokens, mask = np.concatenate([tokens, tokens[::-1]]), np.concatenate([mask, mask[::-1]])  # 8 rows
  B = len(tokens)
  rng = np.random.default_rng(1)
  batch = {"tokens": tokens, "mask": mask, "resp_mask": mask[:, P:], "rewards": rng.integers(0, 2, B).astype(np.float32),
           "ref_logp": rng.normal(-2, 0.3, (B, R)).astype(np.float32), "vstar": np.full(B, 0.4, np.float32),
           "old_logp": rng.normal(-2, 0.3, (B, R)).astype(np.float32), "adv": rng.normal(0, 1, B).astype(np.float32)}
  critic = None
  if name == "ppo":  # per-token advantages, returns and old values; a critic with its own optimizer
    batch.update({k: rng.normal(0, 1, (B, R)).astype(np.float32) for k in ("adv", "returns", "old_values")})
    critic = ppo.init_critic(cfg, params, seed=3)
    # a rollout's first update: old log-probs are the policy's own (ratio 1, nothing clipped), and a head of
    # scale 1, not 0.02. Both keep every gradient well above Adam's eps: its first step is g / (|g| + eps),
    # which turns float noise in a ~1e-8 gradient (a clipped token's, a tiny head's) into a ~1e-5 difference.
    batch["old_logp"] = np.asarray(scoring.logprobs(cfg, params, jnp.asarray(tokens), jnp.asarray(mask), prompt_len=P))
    critic["head"]["w"] = critic["head"]["w"] * 50
  method = methods.get(name)
  optimizers = update.Optimizers(update.make_optimizer(lr=1e-2),
                                 update.make_optimizer(lr=1e-2) if critic is not None else None)
  step = update.jit_update_step(cfg, functools.partial(method.loss, cfg, P), optimizers)
  mb = update.split_microbatches(batch, 4)
  packed = packing.pack_microbatches(mb, P)
  assert packed["pack_tokens"].shape == (2, 1, 3, P + R)  # each micro-batch needs 3 packed rows (b / 8 < 1: exact)
  outs = []
  for b in (mb, packed):
    state, m = step(update.init_train_state(jax.tree.map(jnp.copy, params), optimizers,
                                            jax.tree.map(jnp.copy, critic)), b)
    outs.append(((state["params"], state.get("value_params")), m))
  (p0, m0), (p1, m1) = outs
  np.testing.assert_allclose(float(m1["loss"]), float(m0["loss"]), rtol=1e-5)
  # One Adam step of lr 1e-2 moves each weight by up to 1e-2 (g / (|g| + eps)); a packing error (a row's tokens or
  # mask misplaced) changes gradients by O(1) and the steps by ~1e-2. 2e-5 (0.2% of a step) allows the float noise
  # the normalisation amplifies where a gradient nearly cancels (REBEL's, seen at 1.45e-5 in a fresh venv).
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p0)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


def test_packed_fixed_scores_in_row_blocks_equal_the_padded_forward(monkeypatch):
  """π_ref's (and π_old's) log-probs of a rollout, `rows` rows at a time and each block packed, equal one
  padded forward over all rows; the last block is shorter than `rows`."""
  cfg, params = _tiny()
  tokens, mask = _rows()
  tokens, mask = np.concatenate([tokens, tokens[::-1]]), np.concatenate([mask, mask[::-1]])  # 8 rows
  resp = mask[:, P:]
  padded = np.asarray(scoring.logprobs(cfg, params, jnp.asarray(tokens), jnp.asarray(mask), prompt_len=P))
  packs = []
  real = packing.pack_microbatches
  monkeypatch.setattr(packing, "pack_microbatches",
                      lambda mb, p, shards: packs.append(real(mb, p, shards)) or packs[-1])
  packed = scoring.logprobs_in_blocks(cfg, params, tokens, mask, P, rows=3, pack=True)
  assert packed.shape == (8, R)
  np.testing.assert_allclose(packed[resp], padded[resp], atol=2e-5)
  # blocks of 3, 3 and 2 rows, each forward over fewer rows than it scores: (3 -> 2), (3 -> 2), (2 -> 2);
  # the whole blocks packed together (one packed row count, one compile), the short tail apart
  assert [p["pack_tokens"].shape[:3] for p in packs] == [(2, 1, 2), (1, 1, 2)]
  assert [p["pack_src"].shape[:3] for p in packs] == [(2, 1, 3), (1, 1, 2)]


def test_packed_critic_values_in_row_blocks_equal_the_padded_forward():
  """PPO's critic values before the updates (its prepare), packed blocks against one padded forward."""
  cfg, params = _tiny()
  critic = ppo.init_critic(cfg, params, seed=3)
  tokens, mask = _rows()
  tokens, mask = np.concatenate([tokens, tokens[::-1]]), np.concatenate([mask, mask[::-1]])
  resp = mask[:, P:]
  padded = np.asarray(ppo.critic_values(cfg, critic, jnp.asarray(tokens), jnp.asarray(mask), prompt_len=P))
  packed = scoring.in_packed_blocks(lambda t, m, pk: ppo.critic_values(cfg, critic, t, m, prompt_len=P, pack=pk),
                                    3, tokens, mask, P, pack=True)
  assert packed.shape == (8, R) and np.abs(padded[resp]).max() > 1e-3
  np.testing.assert_allclose(packed[resp], padded[resp], atol=2e-5)


def test_each_batch_shard_packs_its_own_rows_and_reads_back_within_them():
  """Two batch shards of 4 rows: shard 0 holds rows 0-3, shard 1 rows 4-7 (reversed), each packed into its
  own rows (lengths 9 / 6+3 / 5 as the hand-worked layout above) with sources inside its own [Q * S]; the
  log-probs and entropies equal the padded rows'."""
  cfg, params = _tiny()
  tokens, mask = _rows()
  tokens, mask = np.concatenate([tokens, tokens[::-1]]), np.concatenate([mask, mask[::-1]])
  packed = packing.pack_microbatches({"tokens": tokens[None], "mask": mask[None]}, P, shards=2)
  assert packed["pack_tokens"].shape == (1, 2, 3, P + R) and packed["pack_src"].shape == (1, 2, 4, R)
  seg = packed["pack_segments"][0]
  assert sorted(set(seg[0].ravel()) - {0}) == [1, 2, 3, 4] == sorted(set(seg[1].ravel()) - {0})  # local ids
  np.testing.assert_array_equal(packed["pack_tokens"][0, 1, 0, :9], tokens[6, P - 3:P + 6])  # row 6 = row 1
  assert packed["pack_src"].max() < 3 * (P + R)  # within the shard's own columns
  with pytest.raises(ValueError, match="do not split into 3 batch shards"):
    packing.pack_microbatches({"tokens": tokens[None], "mask": mask[None]}, P, shards=3)
  pack = jax.tree.map(lambda x: jnp.asarray(x[0]), packing.from_batch(packed))
  lp0, ent0 = scoring.logprobs_and_entropy(cfg, params, tokens, mask, P)
  lp1, ent1 = scoring.logprobs_and_entropy(cfg, params, tokens, mask, P, pack=pack)
  resp = mask[:, P:]
  np.testing.assert_allclose(np.asarray(lp1)[resp], np.asarray(lp0)[resp], atol=2e-5)
  np.testing.assert_allclose(np.asarray(ent1)[resp], np.asarray(ent0)[resp], atol=2e-5)


def test_fill_of_lengths_is_the_median_draws_most_packed_rows_over_its_groups():
  """Hand-worked: width 10, groups of 4 rows. Draw 0: lengths 5,5,5,5 -> 2 rows; 9,9,1,1 -> 2 (9+1 twice); the
  most is 2. Draw 1: 6,6,6,6 -> 4 rows. Draw 2: 3,3,3,1 -> 1. Median of (2, 4, 1) packed rows = 2 of 4: 0.5."""
  lengths = np.array([[[5, 5, 5, 5], [9, 9, 1, 1]], [[6, 6, 6, 6], [1, 1, 1, 1]], [[3, 3, 3, 1], [2, 2, 2, 2]]])
  assert packing.fill_of_lengths(lengths, 10) == 0.5
  with pytest.raises(ValueError, match="width=10"):
    packing.fill_of_lengths(lengths + 8, 10)
  # the compiles' shapes at that fill: 2 packed rows of 4 per shard
  assert packing.packed_shapes(8, 4, 6, shards=2, fill=0.5)["pack_tokens"][0] == (2, 2, 10)
