"""The Stage-2 loop: resume after a kill reaches the same parameters; non-finite steps stop the run."""
import json

import jax
import numpy as np
import pytest

from astarpo_jax import data, grading, model, sampler, stage2, synthetic, train

TOK = synthetic.build_tokenizer()
CFG = model.ModelConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=8, max_position_embeddings=64)
SCFG = sampler.SamplingConfig(temperature=1.0, max_new_tokens=8, stop_ids=(TOK.eos_token_id,), pad_id=TOK.pad_token_id)
PROMPTS, _ = data.build_prompts(synthetic.load_synthetic(64, 0)[0], TOK, synthetic.PROMPT_TEMPLATE)
LOOP = stage2.Stage2Config(num_steps=4, rollout_batch=8, mini_batch=4, micro_batch=2, checkpoint_every=2)


class Killed(Exception):
  pass


def _grade(kill_on_call=None):
  calls = {"n": 0}

  def grade(texts, golds, truncated):
    calls["n"] += 1
    if calls["n"] == kill_on_call:
      raise Killed()
    # Half credit by a deterministic rule on the text, so rewards vary and gradients are non-zero.
    r = grading.grade_batch(texts, golds, "math_verify", truncated).rewards
    return np.maximum(r, np.array([len(t) % 2 for t in texts], np.float32))
  return grade


def _run(workdir, grade, loop=LOOP):
  _, params = model.init_params(CFG, seed=0)
  return stage2.run_stage2(CFG, params, params, prompts=PROMPTS, vstar_of=lambda ps: np.full(len(ps), 0.3, np.float32),
                           tokenizer=TOK, grade=grade, scfg=SCFG, loss_cfg=train.LossConfig(beta2=0.1),
                           optimizer=train.make_optimizer(lr=1e-2), loop=loop, workdir=str(workdir), log=lambda s: None)


def test_killed_run_resumed_reaches_the_same_parameters(tmp_path):
  straight, _ = _run(tmp_path / "a", _grade())
  with pytest.raises(Killed):
    _run(tmp_path / "b", _grade(kill_on_call=4))  # dies in rollout 4, after the checkpoint of rollout 2
  resumed, _ = _run(tmp_path / "b", _grade())
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), straight, resumed)
  lines = [json.loads(s) for s in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
  assert [m["step"] for m in lines] == [1, 2, 3, 1 + 2, 2 + 2]  # rollouts 3-4 logged again after the resume
  _, init = model.init_params(CFG, seed=0)
  assert not np.allclose(np.asarray(init["embed"]), np.asarray(straight["embed"]))  # training moved the params


def test_every_step_logs_the_papers_metrics(tmp_path):
  _run(tmp_path, _grade(), stage2.Stage2Config(num_steps=1, rollout_batch=8, mini_batch=4, micro_batch=4))
  m = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
  for k in ("loss", "reward_mean", "vstar_mean", "advantage_mean", "kl", "entropy", "response_length",
            "truncation_rate", "grad_norm", "lr", "sec_sample", "sec_grade", "sec_ref", "sec_update", "tokens_per_sec"):
    assert f"train/{k}" in m, k
  assert m["train/lr"] == pytest.approx(1e-2)
  assert m["train/vstar_mean"] == pytest.approx(0.3)


def test_non_finite_reward_stops_the_run_and_keeps_the_last_checkpoint(tmp_path):
  calls = {"n": 0}

  def grade(texts, golds, truncated):
    calls["n"] += 1
    r = np.zeros(len(texts), np.float32)
    if calls["n"] == 3:
      r[0] = np.nan
    return r

  with pytest.raises(FloatingPointError, match=r"non-finite loss or gradient at step 5 .*last good checkpoint \(step 2\)"):
    _run(tmp_path, grade)
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]


def test_batch_sizes_that_do_not_divide_are_refused():
  with pytest.raises(ValueError, match="rollout_batch=10 is not divisible by mini_batch=4"):
    stage2.Stage2Config(rollout_batch=10, mini_batch=4, micro_batch=2)
  with pytest.raises(ValueError, match="mini_batch=4 is not divisible by micro_batch=3"):
    stage2.Stage2Config(rollout_batch=8, mini_batch=4, micro_batch=3)
