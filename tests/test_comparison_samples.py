"""A*-PO with k on-policy samples per prompt (astarpo.Config.group_size, the comparison's study of the sample
count): each of the k responses is its own regression term against its prompt's V̂*, so at the first update
(policy = π_ref, log-ratio 0) the loss is the mean over the k x P responses of (r − V̂*(x))², computed here by
hand from the graded rewards."""
import json

import numpy as np
import pytest

from astarpo_jax import methods
from astarpo_jax.data import dataset, synthetic
from astarpo_jax.model import decoder
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.rewards import grading
from astarpo_jax.sampling.rollout import Graded
from astarpo_jax.sampling.token_choice import SamplingConfig
from astarpo_jax.stage1 import value_table as vt
from astarpo_jax.training import loop, update

TOK = synthetic.build_tokenizer()
CFG = ModelConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=64)
SCFG = SamplingConfig(temperature=1.0, max_new_tokens=8, stop_ids=(TOK.eos_token_id,), pad_id=TOK.pad_token_id)
PROMPTS, _ = dataset.build_prompts(synthetic.load_synthetic(64, 0)[0], TOK, synthetic.PROMPT_TEMPLATE)


def _vstar(target: str) -> float:
  """A V̂* that differs between prompts (by their answer), so a misplaced row would change the loss."""
  return 0.05 + 0.1 * (sum(map(ord, target)) % 9)


def _one_step(tmp_path, k: int):
  seen = []

  def grade(texts, golds, truncated):
    r = grading.grade_batch(texts, golds, "math_verify", truncated).rewards
    r = np.maximum(r, np.array([len(t) % 2 for t in texts], np.float32))  # rewards that vary
    seen.extend(zip(golds, r.tolist()))
    return Graded(r, {})

  _, params = decoder.init_params(CFG, seed=0)
  table = vt.ValueTable({p.uid: {"vstar": _vstar(p.target)} for p in PROMPTS}, list(PROMPTS), "", {})
  ctx = loop.RunContext(CFG, params, TOK, grade, SCFG, value_table=table)
  settings = loop.LoopSettings(num_steps=1, rollout_batch=8, mini_batch=8, micro_batch=4)
  method = methods.get("astarpo", {"beta2": 0.1, "entropy_coef": 0.0, "group_size": k})
  loop.run(method, params, PROMPTS, ctx, settings, update.Optimizers(update.make_optimizer(lr=1e-2)),
           loop.RunIO(str(tmp_path), log=lambda s: None))
  return seen, json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])


@pytest.mark.parametrize("k", [1, 4])
def test_k_samples_per_prompt_regress_each_response_on_its_prompts_vstar(tmp_path, k):
  seen, m = _one_step(tmp_path, k)
  assert len(seen) == 8 * k  # k responses of each of the 8 prompts, graded
  golds = [g for g, _ in seen]
  assert all(len(set(golds[i:i + k])) == 1 for i in range(0, 8 * k, k))  # prompt-major groups
  want = np.mean([(r - _vstar(g)) ** 2 for g, r in seen])
  assert m["train/regression_loss"] == pytest.approx(want, abs=1e-4)
  assert m["train/vstar_mean"] == pytest.approx(np.mean([_vstar(g) for g in golds]), abs=1e-6)
  assert m["train/advantage_mean"] == pytest.approx(np.mean([r - _vstar(g) for g, r in seen]), abs=1e-5)


def test_group_size_defaults_to_the_papers_one_sample_and_refuses_a_negative_count():
  assert methods.get("astarpo", {}).responses_per_prompt() == 1
  assert methods.get("astarpo", {"group_size": 8}).responses_per_prompt() == 8
  with pytest.raises(ValueError, match="astarpo.Config.group_size"):
    methods.get("astarpo", {"group_size": -1})
