"""Every evaluation set of the shared data folder (tests/data_paths.SHARED) (full_data; it skips where the folder is absent) loads, is sampled by a tiny
model under the real Qwen tokenizer and scored, and regrading its gold answers as responses scores every problem."""
import os

import numpy as np

from astarpo_jax.data import dataset
from astarpo_jax.evals import run as evals_run, samples, sets
from astarpo_jax.model import decoder, hf
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.rewards import grading
from astarpo_jax.sampling import rollout
from astarpo_jax.sampling.token_choice import SamplingConfig
from tests.data_paths import SHARED, full_data, qwen_tokenizer_dir

EVAL_SETS = [n for n, p in dataset.PRESETS.items() if p.local_file and n != "gsm8k_train"]


class InProcess:
  """A built-in grader in this process (no pool), no EOS rule."""
  eos_required = False

  def __init__(self, name):
    self.name = name

  def __call__(self, texts, golds, truncated):
    return rollout.Graded(grading.grade_batch(texts, golds, self.name, timeout_s=5.0).rewards, {})


@full_data
def test_every_shared_set_loads_is_sampled_and_scored_and_its_golds_regrade_as_correct():
  tok = hf.load_tokenizer(qwen_tokenizer_dir())
  cfg = ModelConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=8, max_position_embeddings=2048)
  params = decoder.init_params(cfg, seed=0)[1]
  scfg = SamplingConfig(temperature=1.0, max_new_tokens=4, stop_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id)
  present = [n for n in EVAL_SETS if os.path.exists(os.path.join(SHARED, dataset.PRESETS[n].local_file))]
  assert {"math500", "gsm8k_test", "amc23", "aime24", "minerva", "olympiadbench"} <= set(present)
  for name in present:
    examples, stats = dataset.load_preset(name, data_dir=SHARED)
    assert stats.kept == stats.rows > 0, (name, stats)
    prompts, _ = dataset.build_prompts(examples, tok, "gsm8k" if name.startswith("gsm8k") else "boxed",
                                       max_prompt_tokens=4096)
    assert len(prompts) == len(examples)
    grader = "gsm8k_strict" if name.startswith("gsm8k") else "math_verify"
    engine = samples.Engine(cfg, tok, scfg, ((grader, InProcess(grader)),))
    few = tuple(prompts[:2])
    runs = [samples.SetRun(name, "greedy", 1, few), samples.SetRun(name, "sampled", 2, few)]
    meta = {name: sets.problem_meta(name, SHARED)}
    ev = evals_run.evaluate(engine, params, runs, seed=0, meta=meta)
    assert [r["num_problems"] for r in ev.results] == [2, 2]
    if name == "math500":
      assert len(meta[name]) == stats.rows and set(ev.results[0]["by_level"]) <= set("12345")
      assert ev.results[0]["by_subject"]
    # The golds as responses: regrading scores them (all problems of the set, under its grader)
    gold_run = samples.SetRun(name, "greedy", 1, tuple(prompts))
    said = "#### {}" if name.startswith("gsm8k") else "\\boxed{{{}}}"
    records = [{"set": name, "mode": "greedy", "uid": p.uid, "sample": 0, "response": said.format(p.gold),
                "length": 1, "truncated": False} for p in prompts]
    got = evals_run.regrade(records, [gold_run], engine.graders).results[0]
    score = got["graders"][grader]["pass@1"]["mean"]
    assert score >= 0.97, (name, score, [r["uid"] for r in records][:3])
    assert np.isfinite(got["graders"][grader]["pass@1"]["se"])
