"""Stage 1 bookkeeping: V̂* through run_stage1, resume after a kill, damaged chunks, refused resumes,
the summary, drop_all_fail, eval_i imports and adaptive N. Sampling and grading are fakes (turned into
Stage 1's `draw` by `as_draw`): the unit under test is the bookkeeping, not the model."""
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np
import pytest

from astarpo_jax.data.dataset import Prompt
from astarpo_jax.stage1 import estimate as S, value_table as VT

# The paper's table for N = 8, β1 = 1/2, k correct out of 8 (to 4 decimals).
VSTAR_TABLE_N8 = [0.0, 0.2935, 0.4772, 0.6113, 0.7169, 0.8040, 0.8782, 0.9428, 1.0]


def closed_form(k, n, beta1=0.5):
  return beta1 * np.log((k * np.exp(1 / beta1) + (n - k)) / n)


def make_prompts(golds, prefix="p"):
  return [Prompt(f"{prefix}/{i}", f"problem {i}", (i + 1, 7), g) for i, g in enumerate(golds)]


class PatternGen:
  """The j-th response ever drawn for a prompt is 'c' or 'w' as the prompt's gold pattern says.

  Gold "k:<int>" means the first k responses are correct. Counts calls and the requests of each.
  """

  def __init__(self, golds_by_ids):
    self.golds = golds_by_ids
    self.seen = {}
    self.calls = []

  def __call__(self, prompt_ids, key):
    self.calls.append([tuple(p) for p in prompt_ids])
    texts, trunc = [], []
    for ids in map(tuple, prompt_ids):
      j = self.seen.get(ids, 0)
      self.seen[ids] = j + 1
      gold = self.golds[ids]
      ok = j < int(gold[2:]) if gold.startswith("k:") else gold[j] == "1"
      texts.append("c" if ok else "w")
      trunc.append(j == 7)
    return texts, trunc


def as_draw(generate, grade):
  """Stage 1's draw from a fake `generate(prompt_ids, key) -> (texts, truncated)` and `grade`."""
  def draw(prompts, n, key):
    rows = [p for p in prompts for _ in range(n)]
    texts, trunc = generate([p.ids for p in rows], key)
    rewards = grade(texts, [p.gold for p in rows], trunc)
    P = len(prompts)
    return S.Drawn(np.asarray(rewards).reshape(P, -1), np.asarray(trunc).reshape(P, -1),
                   [list(texts[i * n:(i + 1) * n]) for i in range(P)])
  return draw


def pattern_grade(texts, golds, truncated):
  return np.array([t == "c" for t in texts], np.float32)


def pattern_run(prompts, tmp_path, **kw):
  gen = PatternGen({p.ids: p.gold for p in prompts})
  res = S.run_stage1(prompts, as_draw(gen, pattern_grade), out_dir=str(tmp_path), progress=False,
                     log=lambda s: None, **kw)
  return res, gen


class RandomGen:
  """Correct with a prompt-dependent probability, drawn from the chunk key; optionally fails on call `fail_at`."""

  def __init__(self, fail_at=None):
    self.calls, self.fail_at = [], fail_at

  def __call__(self, prompt_ids, key):
    if self.fail_at is not None and len(self.calls) == self.fail_at:
      raise RuntimeError("simulated kill")
    self.calls.append([tuple(p) for p in prompt_ids])
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).tolist())
    u = rng.random(len(prompt_ids))
    p_correct = np.array([(ids[0] % 5) / 4 for ids in prompt_ids])
    return ["right" if x else "wrong" for x in u < p_correct], list(rng.random(len(prompt_ids)) < 0.1)


def text_grade(texts, golds, truncated):
  return np.array([t == "right" for t in texts], np.float32)


def random_run(prompts, out_dir, gen, **kw):
  kw = {"chunk_prompts": 2, "seed": 3, **kw}
  return S.run_stage1(prompts, as_draw(gen, text_grade), out_dir=str(out_dir), progress=False,
                      log=lambda s: None, **kw)


def read(path):
  with open(path, encoding="utf-8") as f:
    return f.read()


# ---------------------------------------------------------------------------------------------

def test_vstar_table_n8_beta_half_end_to_end(tmp_path):
  prompts = make_prompts([f"k:{k}" for k in range(9)])
  res, gen = pattern_run(prompts, tmp_path, chunk_prompts=4)
  got = [res.records[p.uid]["vstar"] for p in prompts]
  np.testing.assert_allclose(got, VSTAR_TABLE_N8, atol=5e-5)
  np.testing.assert_allclose(got, [closed_form(k, 8) for k in range(9)], atol=1e-6)
  assert [res.records[p.uid]["num_correct"] for p in prompts] == list(range(9))
  assert all(res.records[p.uid]["n"] == 8 for p in prompts)
  assert len(gen.calls) == 3 and all(len(c) == 8 * len(set(c)) for c in gen.calls)  # one call per chunk
  on_disk = VT.load_table(os.path.join(tmp_path, "stage1", "vstar.jsonl"))
  assert list(on_disk) == [p.uid for p in prompts]
  np.testing.assert_allclose(VT.lookup(on_disk, prompts), VSTAR_TABLE_N8, atol=5e-5)


def test_beta1_zero_gives_the_pass_rate(tmp_path):
  prompts = make_prompts([f"k:{k}" for k in (0, 3, 8)])
  res, _ = pattern_run(prompts, tmp_path, beta1=0.0)
  np.testing.assert_allclose(res.lookup(prompts), [0.0, 3 / 8, 1.0], atol=1e-7)


def test_resume_after_kill_skips_finished_chunks_and_matches_uninterrupted_run(tmp_path):
  prompts = make_prompts(["x"] * 10)  # 5 chunks of 2
  whole = random_run(prompts, tmp_path / "whole", RandomGen())
  assert 0 < whole.summary["mean_pass_rate"] < 1  # the fake is random enough to tell chunks apart

  with pytest.raises(RuntimeError, match="simulated kill"):
    random_run(prompts, tmp_path / "killed", RandomGen(fail_at=3))  # dies in chunk 3
  chunk_dir = tmp_path / "killed" / "stage1" / "chunks"
  assert sorted(os.listdir(chunk_dir)) == [f"chunk_0000{c}.jsonl" for c in range(3)]

  gen = RandomGen()
  resumed = random_run(prompts, tmp_path / "killed", gen)
  assert len(gen.calls) == 2  # chunks 0-2 not regenerated
  assert [sorted(set(c)) for c in gen.calls] == [[p.ids for p in prompts[6:8]], [p.ids for p in prompts[8:10]]]
  assert read(resumed.path) == read(whole.path)
  assert resumed.summary == whole.summary


@pytest.mark.parametrize("damage", ["cut_mid_line", "drop_last_line", "edit_vstar", "other_uids"])
def test_damaged_chunk_is_detected_and_redone(tmp_path, damage):
  prompts = make_prompts(["x"] * 6)
  whole = random_run(prompts, tmp_path, RandomGen())
  path = tmp_path / "stage1" / "chunks" / "chunk_00001.jsonl"
  text = read(path)
  lines = text.splitlines(keepends=True)
  if damage == "cut_mid_line":
    text = text[:len(text) // 2 + 3]
  elif damage == "drop_last_line":
    text = "".join(lines[:-1])
  elif damage == "edit_vstar":
    rec = json.loads(lines[0])
    rec["vstar"] += 0.1
    text = json.dumps(rec) + "\n" + "".join(lines[1:])
  else:
    text = text.replace('"p/2"', '"p/0"')
  path.write_text(text)

  gen = RandomGen()
  again = random_run(prompts, tmp_path, gen)
  assert len(gen.calls) == 1 and sorted(set(gen.calls[0])) == [p.ids for p in prompts[2:4]]
  assert read(again.path) == read(whole.path)
  assert (tmp_path / "stage1" / "chunks" / "chunk_00001.jsonl.bad").exists()


def test_temp_file_of_a_write_killed_midway_is_never_read(tmp_path):
  prompts = make_prompts(["x"] * 6)
  whole = random_run(prompts, tmp_path / "whole", RandomGen())
  with pytest.raises(RuntimeError):
    random_run(prompts, tmp_path / "run", RandomGen(fail_at=2))
  chunk_dir = tmp_path / "run" / "stage1" / "chunks"
  good = read(tmp_path / "whole" / "stage1" / "chunks" / "chunk_00002.jsonl")
  (chunk_dir / "chunk_00002.jsonl.tmp.12345").write_text(good[:len(good) // 2])  # os.replace never ran
  gen = RandomGen()
  resumed = random_run(prompts, tmp_path / "run", gen)
  assert len(gen.calls) == 1
  assert not list(chunk_dir.glob("*.tmp.*"))
  assert read(resumed.path) == read(whole.path)


def test_resume_with_other_settings_is_refused(tmp_path):
  prompts = make_prompts(["x"] * 6)
  with pytest.raises(RuntimeError):
    random_run(prompts, tmp_path, RandomGen(fail_at=1), n_samples=8)
  with pytest.raises(ValueError, match=r"other settings \(n_samples: stored 8, now 4\)"):
    random_run(prompts, tmp_path, RandomGen(), n_samples=4)
  with pytest.raises(ValueError, match="beta1"):
    random_run(prompts, tmp_path, RandomGen(), beta1=1.0)
  with pytest.raises(ValueError, match="uids_sha256"):
    random_run(prompts[:4], tmp_path, RandomGen())
  regraded = [Prompt(p.uid, p.text, p.ids, "y") for p in prompts]
  with pytest.raises(ValueError, match="token ids or golds differ"):
    random_run(regraded, tmp_path, RandomGen())
  gen = RandomGen()
  random_run(prompts, tmp_path, gen)  # the original settings still resume
  assert len(gen.calls) == 2


def test_summary_on_hand_made_case(tmp_path):
  prompts = make_prompts(["k:0", "k:0", "k:3", "k:8"])
  res, _ = pattern_run(prompts, tmp_path, chunk_prompts=3)
  s = res.summary
  assert s["pass_count_hist"] == [2, 0, 0, 1, 0, 0, 0, 0, 1]
  assert s["frac_zero_correct"] == 0.5 and s["frac_all_correct"] == 0.25 and s["pass_at_n"] == 0.5
  assert s["mean_pass_rate"] == pytest.approx((3 / 8 + 1) / 4)
  assert s["mean_vstar"] == pytest.approx((closed_form(3, 8) + 1) / 4, abs=1e-6)
  assert s["frac_truncated"] == pytest.approx(1 / 8)  # the fake truncates each prompt's 8th response
  assert s["num_prompts"] == 4 and s["num_samples"] == 32
  with open(tmp_path / "stage1" / "summary.json") as f:
    assert json.load(f) == s


def test_drop_all_fail_removes_zero_correct_prompts_but_keeps_them_in_the_file(tmp_path):
  prompts = make_prompts(["k:0", "k:2", "k:0", "k:8"])
  res, _ = pattern_run(prompts, tmp_path, drop_all_fail=True)
  assert [p.uid for p in res.prompts] == ["p/1", "p/3"]
  on_disk = VT.load_table(res.path)
  assert [r["all_fail"] for r in on_disk.values()] == [True, False, True, False]
  assert res.summary["num_kept"] == 2 and res.summary["frac_zero_correct"] == 0.5
  np.testing.assert_allclose(res.lookup(res.prompts), [closed_form(2, 8), 1.0], atol=1e-6)


def test_keep_responses_stores_texts_and_truncation(tmp_path):
  prompts = make_prompts(["k:3"])
  res, _ = pattern_run(prompts, tmp_path, keep_responses=True)
  rec = VT.load_table(res.path)["p/0"]
  assert rec["responses"] == ["c"] * 3 + ["w"] * 5
  assert rec["truncated"] == [False] * 7 + [True] and rec["num_truncated"] == 1


def test_adaptive_n_draws_more_only_for_prompts_not_all_correct(tmp_path):
  golds = ["111100000000",  # all correct in n_min=4: stops at 4
           "000000000001",  # all fail in 4: 8 more, one success
           "101000000000",  # mixed: 8 more
           "111111111111"]  # all correct: stops at 4 although more would also be correct
  prompts = make_prompts(golds)
  cfg = S.AdaptiveConfig(n_min=4, n_max=12)
  res, gen = pattern_run(prompts, tmp_path, adaptive=cfg, chunk_prompts=4)
  assert len(gen.calls) == 2
  assert sorted(gen.calls[0]) == sorted([p.ids for p in prompts] * 4)
  assert sorted(gen.calls[1]) == sorted([prompts[1].ids, prompts[2].ids] * 8)
  recs = [res.records[p.uid] for p in prompts]
  assert [r["n"] for r in recs] == [4, 12, 12, 4]
  assert [r["num_correct"] for r in recs] == [4, 1, 2, 4]
  np.testing.assert_allclose([r["vstar"] for r in recs],
                             [1.0, closed_form(1, 12), closed_form(2, 12), 1.0], atol=1e-6)
  assert res.summary["num_samples"] == 32 and len(res.summary["pass_count_hist"]) == 13
  with pytest.raises(ValueError, match="n_samples=8 but adaptive.n_max=12"):
    pattern_run(prompts, tmp_path / "b", adaptive=cfg, n_samples=8)
  with pytest.raises(ValueError, match="1 <= n_min < n_max"):
    S.AdaptiveConfig(4, 4)


def test_bad_callables_and_inputs_get_clear_errors(tmp_path):
  prompts = make_prompts(["k:1", "k:1"])
  short = lambda ps, n, key: S.Drawn(np.zeros((1, n)), np.zeros((1, n), bool), [["c"] * n])
  with pytest.raises(ValueError, match=r"draw returned rewards \(1, 8\).* for 2 prompts x 8"):
    S.run_stage1(prompts, short, out_dir=str(tmp_path / "a"), progress=False)
  nan = lambda ps, n, key: S.Drawn(np.full((len(ps), n), np.nan), np.zeros((len(ps), n), bool), [["c"] * n] * len(ps))
  with pytest.raises(ValueError, match="draw returned non-finite rewards"):
    S.run_stage1(prompts, nan, out_dir=str(tmp_path / "b"), progress=False)
  gen = PatternGen({p.ids: p.gold for p in prompts})
  with pytest.raises(ValueError, match="duplicate prompt uids"):
    S.run_stage1(prompts + prompts[:1], as_draw(gen, pattern_grade), out_dir=str(tmp_path / "c"), progress=False)
  with pytest.raises(KeyError, match="no V\\* for 1 of 2 prompts"):
    VT.lookup({"p/0": {"vstar": 0.5}}, prompts)
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"uid": "a", "vstar": 0.5, "num_correct": 1, "n": 2, "rewards": [1.0, 0.0]}\n{"uid": "b"\n')
  with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
    VT.load_table(str(bad))
