"""Evaluation: avg@k draws the k samples of a prompt from one prefill, and its figures equal those of the
rows it stands for (each prompt repeated k times, in chunks of batch_size rows keyed by the chunk's first
row), so sharing the prefill changed no evaluation."""
import jax
import numpy as np

from astarpo_jax.data import dataset, synthetic
from astarpo_jax.model import decoder
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.sampling import rollout
from astarpo_jax.sampling.token_choice import SamplingConfig
from astarpo_jax.training import evaluate

TOK = synthetic.build_tokenizer()
CFG = ModelConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=64)
SCFG = SamplingConfig(temperature=1.0, max_new_tokens=6, stop_ids=(TOK.eos_token_id,), pad_id=TOK.pad_token_id)
PROMPTS, _ = dataset.build_prompts(synthetic.load_synthetic(16, 0)[0], TOK, synthetic.PROMPT_TEMPLATE)


def _grade(texts, golds, truncated):
  """A reward that depends on the text and its gold, so a different sample or pairing changes the mean."""
  return rollout.Graded(np.array([(len(t) + len(g)) % 3 == 0 for t, g in zip(texts, golds)], np.float32), {})


def _repeated_rows(params, prompts, k, batch_size, key):
  rows = [p for p in prompts for _ in range(k)]
  rewards, lengths = [], []
  for start in range(0, len(rows), batch_size):
    chunk = rows[start:start + batch_size]
    r = rollout.rollout(CFG, params, [p.ids for p in chunk], [p.gold for p in chunk], jax.random.fold_in(key, start),
                        SCFG, TOK, _grade)
    rewards.append(r.rewards_B)
    lengths.append(r.length_B)
  return np.concatenate(rewards), np.concatenate(lengths)


def test_avg_at_k_from_one_prefill_per_prompt_equals_the_repeated_rows():
  _, params = decoder.init_params(CFG, seed=3)
  prompts, key = PROMPTS[:6], jax.random.key(11)
  for k, batch_size in ((4, 8), (3, 8)):  # 8 % 3 != 0: the rows are repeated as before
    rewards, lengths = _repeated_rows(params, prompts, k, batch_size, key)
    got = evaluate.evaluate(CFG, params, prompts, TOK, _grade, SCFG, key, k=k, batch_size=batch_size)
    assert got["accuracy"] == float(rewards.mean())
    assert got["response_length"] == float(lengths.mean())
    assert 0 < got["accuracy"] < 1 and len(set(lengths.tolist())) > 1  # the figures can tell samples apart
