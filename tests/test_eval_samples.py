"""The evaluation's samples: a killed evaluation resumes at its first missing chunk with the same records, a regrade
of kept samples equals the grading at sampling time, and set and model specs refuse bad input by name."""
import json
import os

import numpy as np
import pytest

from astarpo_jax.data import dataset, synthetic
from astarpo_jax.evals import models, run as evals_run, samples, sets, summary
from astarpo_jax.model import decoder
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.rewards import grading
from astarpo_jax.sampling import rollout
from astarpo_jax.sampling.token_choice import SamplingConfig

TOK = synthetic.build_tokenizer()
CFG = ModelConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=64)
SCFG = SamplingConfig(temperature=1.0, max_new_tokens=6, stop_ids=(TOK.eos_token_id,), pad_id=TOK.pad_token_id)
PROMPTS, _ = dataset.build_prompts(synthetic.load_synthetic(6, 0)[0], TOK, synthetic.PROMPT_TEMPLATE)


class MathVerify:
  """math_verify in this process (no pool), no EOS rule."""
  eos_required = False

  def __call__(self, texts, golds, truncated):
    return rollout.Graded(grading.grade_batch(texts, golds, "math_verify", timeout_s=None).rewards, {})


class Lengths:
  """A reward of the text and its gold, so that different samples score differently; a user function's name."""
  calls = 0
  fail_at = None

  def __call__(self, texts, golds, truncated):
    Lengths.calls += 1
    if Lengths.calls == Lengths.fail_at:
      raise KeyboardInterrupt("killed")
    return rollout.Graded(np.array([(len(t) + len(str(g))) % 3 == 0 for t, g in zip(texts, golds)], np.float32), {})


ENGINE = samples.Engine(CFG, TOK, SCFG, (("math_verify", MathVerify()), ("user.py:score", Lengths())), chunk_rows=8)
RUNS = [samples.SetRun("syn", "greedy", 1, tuple(PROMPTS)), samples.SetRun("syn", "sampled", 4, tuple(PROMPTS))]


@pytest.fixture(scope="module")
def params():
  return decoder.init_params(CFG, seed=3)[1]


def test_a_killed_evaluation_resumes_at_its_first_missing_chunk_with_the_same_records(params, tmp_path, monkeypatch):
  whole = evals_run.evaluate(ENGINE, params, RUNS, seed=5, out_dir=str(tmp_path / "whole"))
  Lengths.calls, Lengths.fail_at = 0, 3  # greedy: 1 chunk (6 problems); sampled: 2 per chunk, killed in the second
  with pytest.raises(KeyboardInterrupt):
    evals_run.evaluate(ENGINE, params, RUNS, seed=5, out_dir=str(tmp_path / "cut"))
  Lengths.fail_at = None
  assert sorted(os.listdir(tmp_path / "cut" / "chunks" / "syn" / "sampled")) == ["00000.jsonl", "meta.json"]
  sampled = []
  real = rollout.rollout
  monkeypatch.setattr(rollout, "rollout", lambda *a, **k: sampled.append(len(a[2])) or real(*a, **k))
  resumed = evals_run.evaluate(ENGINE, params, RUNS, seed=5, out_dir=str(tmp_path / "cut"))
  assert sampled == [2, 2]  # the sampled set's chunks 1 and 2 only: the greedy chunk and chunk 0 were read back
  assert resumed.records == whole.records
  assert json.dumps(resumed.results) == json.dumps(whole.results)
  rewards = [r["rewards"]["user.py:score"] for r in whole.records if r["mode"] == "sampled"]
  assert 0 < np.mean(rewards) < 1 and len({r["response"] for r in whole.records}) > 6  # samples tell apart
  other = samples.Engine(CFG, TOK, SCFG, ENGINE.graders, chunk_rows=4)
  with pytest.raises(ValueError, match="holds chunks of another evaluation"):
    evals_run.evaluate(other, params, RUNS, seed=5, out_dir=str(tmp_path / "cut"))


def test_regrading_kept_samples_equals_the_grading_at_sampling_time(params, tmp_path):
  ev = evals_run.evaluate(ENGINE, params, RUNS, seed=7)
  path = str(tmp_path / "samples.jsonl")
  samples.write_jsonl(path, ev.records)
  again = evals_run.regrade(samples.read_jsonl(path), RUNS, ENGINE.graders)
  assert again.records == ev.records
  assert json.dumps(again.results) == json.dumps(ev.results)
  ov = summary.overall(ev.results)["user.py:score"]  # the greedy and the sampled pass@1 are not pooled together
  assert ov["greedy pass@1"]["mean"] == ev.results[0]["graders"]["user.py:score"]["pass@1"]["mean"]
  assert ov["pass@1"]["mean"] == ev.results[1]["graders"]["user.py:score"]["pass@1"]["mean"]
  assert ov["pass@1"]["num_problems"] == ov["greedy pass@1"]["num_problems"] == len(PROMPTS)
  one = evals_run.regrade(ev.records, RUNS, ENGINE.graders[1:])  # another grader set: only its figures
  assert set(one.results[1]["graders"]) == {"user.py:score"}
  with pytest.raises(ValueError, match="not in the sets given"):
    evals_run.regrade(ev.records, [samples.SetRun("syn", "greedy", 1, tuple(PROMPTS[:2]))], ENGINE.graders)


def test_set_specs_expand_the_paper_preset_and_refuse_an_unknown_set():
  assert sets.parse("paper") == [sets.SetSpec("math500", 0), sets.SetSpec("minerva", 0),
                                 sets.SetSpec("olympiadbench", 0), sets.SetSpec("amc23", 32)]
  assert sets.parse("paper", n=4)[3] == sets.SetSpec("amc23", 4)
  assert sets.parse("math500:8,gsm8k,my/file.jsonl", n=2) == [
      sets.SetSpec("math500", 8), sets.SetSpec("gsm8k_test", 2), sets.SetSpec("my/file.jsonl", 2)]
  with pytest.raises(ValueError, match=r"unknown set .math5000.; use a preset"):
    sets.parse("math500,math5000")


def test_model_specs_name_a_run_step_a_folder_without_tokenizer_and_a_hub_id(tmp_path):
  (tmp_path / "run" / "checkpoints").mkdir(parents=True)
  assert models.parse(f"{tmp_path}/run@50") == models.ModelSpec("run", f"{tmp_path}/run", 50)
  (tmp_path / "hf").mkdir()
  (tmp_path / "hf" / "config.json").write_text("{}")
  with pytest.raises(ValueError, match="the HF folder has no tokenizer"):
    models.parse(str(tmp_path / "hf"))
  with pytest.raises(ValueError, match="neither a run's work directory"):
    models.parse(str(tmp_path))
  with pytest.raises(ValueError, match="has no checkpoints/ folder"):
    models.parse(f"{tmp_path}/hf@3")
  assert models.parse("Qwen/Qwen2.5-1.5B") == models.ModelSpec("hub", "Qwen/Qwen2.5-1.5B")
