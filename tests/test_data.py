"""Data loading, prompt templates and the resumable iterator, on real data rows (tests/fixtures/data;
the full files of ../shared/data for the row-count tests)."""
import json
import logging
import os
import pathlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub downloads from tests

import numpy as np
import pytest

from astarpo_jax.data import dataset
from tests.data_paths import DATA_ROOTS, FIXTURES, SHARED, full_data, qwen_tokenizer_dir

DATA_DIR = pathlib.Path(FIXTURES)

# Row counts from shared/data/README.md, and of the fixtures (tests/fixtures/data/README.md).
README_ROWS = {"gsm8k_train": 7473, "gsm8k_test": 1319, "math500": 500, "aime24": 30, "amc23": 40,
               "minerva": 272, "olympiadbench": 675}
FIXTURE_ROWS = {"gsm8k_train": 42, "gsm8k_test": 40, "math500": 65, "aime24": 20, "amc23": 20, "minerva": 40,
                "olympiadbench": 30}

# Hand-checked against the files: first gold of each set.
FIRST_GOLD = {"gsm8k_train": "72", "gsm8k_test": "18",
              "math500": "\\left( 3, \\frac{\\pi}{2} \\right)", "aime24": "204", "amc23": "27.0",
              "minerva": "1.6", "olympiadbench": "2"}

QWEN_CHATML = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def qwen_tokenizer():
  from transformers import AutoTokenizer
  return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


def _write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


# --- loading ------------------------------------------------------------------------------------


def _check_loads(name, data_dir, rows):
  examples, stats = dataset.load_preset(name, data_dir=str(data_dir))
  assert stats.rows == rows
  assert stats.kept == len(examples) == rows
  assert all(ex.gold.strip() and ex.problem.strip() for ex in examples)
  assert len({ex.uid for ex in examples}) == len(examples)
  assert examples[0].gold == FIRST_GOLD[name]


@full_data
@pytest.mark.parametrize("name", sorted(README_ROWS))
def test_every_shared_file_loads_with_readme_row_count_and_golds(name):
  _check_loads(name, SHARED, README_ROWS[name])


@pytest.mark.parametrize("name", sorted(FIXTURE_ROWS))
def test_every_fixture_file_loads_with_its_row_count_and_golds(name):
  _check_loads(name, FIXTURES, FIXTURE_ROWS[name])


def test_gsm8k_gold_is_text_after_hashes_with_commas_removed():
  examples, _ = dataset.load_preset("gsm8k_train", data_dir=str(DATA_DIR))
  raw = dataset.read_rows(str(DATA_DIR / "gsm8k/train.jsonl"))
  assert raw[40]["answer"].endswith("#### 1,080")  # row 345 of the full file
  assert examples[40].gold == "1080"
  assert examples[0].problem == raw[0]["question"]


def test_aime_gold_kept_as_written_and_minerva_gold_is_last_box_of_solution():
  aime, _ = dataset.load_preset("aime24", data_dir=str(DATA_DIR))
  assert aime[7].gold == "025" and aime[0].uid == "aime24/60"
  minerva, _ = dataset.load_preset("minerva", data_dir=str(DATA_DIR))
  raw = dataset.read_rows(str(DATA_DIR / "minerva_math/test.jsonl"))
  assert "\\boxed{1.6} \\mathrm{~cm}" in raw[0]["solution"]
  assert minerva[0].gold == "1.6"


def test_unknown_field_error_names_field_and_lists_available(tmp_path):
  path = _write_jsonl(tmp_path / "x.jsonl", [{"question": "1+1?", "answer": "2"}])
  with pytest.raises(KeyError, match=r"'problem'.*available fields: \['answer', 'question'\]"):
    dataset.load_examples(path, dataset.Fields("problem", "answer"))


def test_missing_file_unsupported_type_and_unknown_preset_errors_name_them(tmp_path):
  fields = dataset.Fields("problem", "answer")
  for missing in (str(tmp_path / "nope.jsonl"), str(tmp_path / "nope")):
    with pytest.raises(FileNotFoundError, match="data file not found: .*nope"):
      dataset.load_examples(missing, fields)
  (tmp_path / "rows.csv").write_text("problem,answer\n1+1,2\n")
  with pytest.raises(ValueError, match="rows.csv: unsupported file type"):
    dataset.load_examples(str(tmp_path / "rows.csv"), fields)
  (tmp_path / "broken.jsonl").write_text('{"problem": "p", "answer": "1"}\n{"problem": \n')
  with pytest.raises(ValueError, match="broken.jsonl:2: not valid JSON"):
    dataset.load_examples(str(tmp_path / "broken.jsonl"), fields)
  with pytest.raises(KeyError, match="unknown data set 'gsm9k'.*gsm8k_test"):
    dataset.load_preset("gsm9k")
  with pytest.raises(ValueError, match="'math_train' has no local copy"):
    dataset.load_preset("math_train", data_dir=str(DATA_DIR))


def test_rows_without_problem_or_answer_are_skipped_counted_and_warned(tmp_path, caplog):
  rows = [{"q": "ok 1", "a": "x #### 3"},
          {"a": "x #### 4"},                 # no problem key
          {"q": "   ", "a": "x #### 5"},     # blank problem
          {"q": "no gold", "a": "7"},        # no `####`
          {"q": "null gold", "a": None},
          {"q": "empty gold", "a": "x ####  "},
          {"q": "ok 2", "a": "#### 1,000"}]
  path = _write_jsonl(tmp_path / "bad.jsonl", rows)
  with caplog.at_level(logging.WARNING, logger="astarpo_jax.data"):
    examples, stats = dataset.load_examples(path, dataset.Fields("q", "a", "gsm8k"), name="bad")
  assert [(e.uid, e.gold) for e in examples] == [("bad/0", "3"), ("bad/6", "1000")]
  assert stats == dataset.LoadStats(rows=7, kept=2,
                                 skipped={"missing_problem": 2, "missing_answer": 3})
  assert "skipped 5 of 7 rows" in caplog.text


def test_json_list_and_parquet_files_load_like_jsonl(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  rows = [{"problem": "p1", "solution": "so \\boxed{\\frac{1}{2}}."},
          {"problem": "p2", "solution": "\\boxed{7}"}]
  fields = dataset.Fields("problem", "solution", "boxed")
  (tmp_path / "a.json").write_text(json.dumps(rows))
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
  want = [dataset.Example("a/0", "p1", "\\frac{1}{2}"), dataset.Example("a/1", "p2", "7")]
  for suffix in ("json", "parquet"):
    assert dataset.load_examples(str(tmp_path / f"a.{suffix}"), fields)[0] == want
  # A float answer column with a gap: parquet gives NaN/None, which is a missing gold.
  pq.write_table(pa.Table.from_pylist([{"p": "a", "x": 27.0}, {"p": "b", "x": float("nan")},
                                       {"p": "c", "x": None}]), tmp_path / "f.parquet")
  examples, stats = dataset.load_examples(str(tmp_path / "f.parquet"), dataset.Fields("p", "x"))
  assert [e.gold for e in examples] == ["27.0"] and stats.skipped["missing_answer"] == 2
  assert dataset.load_examples(_write_jsonl(tmp_path / "a.jsonl", rows), fields)[0] == want


def test_hub_path_concatenates_configs_and_keeps_only_mapped_columns(monkeypatch):
  import datasets
  calls = []

  def fake_load_dataset(hf_id, config, split):
    calls.append((hf_id, config, split))
    return datasets.Dataset.from_list([{"problem": f"{config} p", "level": "Level 1",
                                        "type": config, "solution": f"so \\boxed{{{len(calls)}}}"}])

  monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
  examples, stats = dataset.load_preset("math_train")
  assert [c[1] for c in calls] == list(dataset.PRESETS["math_train"].hf_configs)
  assert {(c[0], c[2]) for c in calls} == {("EleutherAI/hendrycks_math", "train")}
  assert stats.kept == 7 and [e.gold for e in examples] == [str(i) for i in range(1, 8)]
  assert examples[0] == dataset.Example("math_train/0", "algebra p", "1")


def test_hub_path_offline_raises_error_naming_the_dataset(monkeypatch):
  import datasets
  import huggingface_hub
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
  monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
  with pytest.raises(RuntimeError, match="could not load 'HuggingFaceH4/MATH-500'"):
    dataset.load_preset("math500")


# --- prompts ------------------------------------------------------------------------------------


def test_templates_match_paper_and_gsm8k_wording():
  assert dataset.format_prompt("What is $1+1$?") == (
      "What is $1+1$? Let's think step by step and output the final answer within \\boxed{}.")
  assert dataset.format_prompt("Q {x}", "gsm8k") == (
      'Q {x} Let\'s think step by step and output the final answer after "####".')
  assert dataset.format_prompt("3+4", "{problem}=") == "3+4="
  with pytest.raises(ValueError, match="neither one of"):
    dataset.format_prompt("x", "boxd")


def test_raw_prompt_tokenizes_to_qwen_ids_without_special_tokens(qwen_tokenizer):
  examples, _ = dataset.load_preset("gsm8k_test", data_dir=str(DATA_DIR))
  prompts, stats = dataset.build_prompts(examples[:5], qwen_tokenizer, template="gsm8k")
  assert stats == dataset.PromptStats(total=5, kept=5, too_long=0)
  p = prompts[0]
  assert p.text == (examples[0].problem +
                    ' Let\'s think step by step and output the final answer after "####".')
  assert qwen_tokenizer.decode(p.ids) == p.text
  assert not set(p.ids) & set(qwen_tokenizer.all_special_ids)
  assert (p.uid, p.gold) == ("gsm8k_test/0", "18")


def test_chat_prompt_wraps_user_turn_in_chatml_with_assistant_turn_open(qwen_tokenizer):
  ex = [dataset.Example("u/0", "What is $2+3$?", "5")]
  prompts, _ = dataset.build_prompts(ex, qwen_tokenizer, chat=True, chat_template=QWEN_CHATML)
  want = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
          "<|im_end|>\n<|im_start|>user\nWhat is $2+3$? Let's think step by step and output the "
          "final answer within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
  assert prompts[0].text == want
  im_start, im_end = qwen_tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
  ids = prompts[0].ids
  assert ids[0] == im_start and ids.count(im_start) == 3 and ids.count(im_end) == 2
  assert qwen_tokenizer.decode(ids) == want
  sys_text = dataset.render_prompt("x", qwen_tokenizer, chat=True, system="Be brief.",
                                chat_template=QWEN_CHATML)
  assert sys_text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nx ")


def test_chat_uses_the_tokenizers_own_template_when_none_is_passed(qwen_tokenizer):
  # These tokenizer files carry a (Qwen3-style) ChatML template of their own.
  text = dataset.render_prompt("hi", qwen_tokenizer, template="plain", chat=True)
  assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_without_a_chat_template_is_a_clear_error():
  from astarpo_jax.data import synthetic
  with pytest.raises(ValueError, match="has no chat_template"):
    dataset.build_prompts([dataset.Example("u", "p", "1")], synthetic.build_tokenizer(), chat=True)
  with pytest.raises(ValueError, match="needs a tokenizer"):
    dataset.render_prompt("p", None, chat=True)


def test_prompts_over_the_token_limit_are_dropped_and_counted(qwen_tokenizer):
  from astarpo_jax.data import synthetic
  char_tok = synthetic.build_tokenizer()  # one token per character plus BOS: lengths known
  examples = [dataset.Example(f"u/{k}", "1" * k, "1") for k in range(1, 11)]
  prompts, stats = dataset.build_prompts(examples, char_tok, template="plain", max_prompt_tokens=6)
  assert [p.uid for p in prompts] == [f"u/{k}" for k in range(1, 6)]  # k + BOS <= 6
  assert stats == dataset.PromptStats(total=10, kept=5, too_long=5)
  math500, _ = dataset.load_preset("math500", data_dir=str(DATA_DIR))
  prompts, stats = dataset.build_prompts(math500, qwen_tokenizer)  # default limit 256
  assert stats.too_long > 0 and stats.kept + stats.too_long == FIXTURE_ROWS["math500"]
  assert max(len(p.ids) for p in prompts) <= 256


# --- iterator -----------------------------------------------------------------------------------


def _take(it, n):
  return [list(it.next_indices()) for _ in range(n)]


def test_iterator_is_deterministic_by_seed_and_each_epoch_is_a_reshuffled_permutation():
  items = list(range(103))
  a, b, c = (dataset.BatchIterator(items, 10, seed=s) for s in (7, 7, 8))
  ea, eb, ec = _take(a, 20), _take(b, 20), _take(c, 20)
  assert ea == eb and ea != ec
  epoch0, epoch1 = sum(ea[:10], []), sum(ea[10:], [])
  assert len(set(epoch0)) == len(set(epoch1)) == 100  # 3 tail items dropped per epoch
  assert epoch0 != epoch1
  assert dataset.BatchIterator(items, 10, seed=7).state()["epoch"] == 0 and a.state()["epoch"] == 2


def test_iterator_resumes_exactly_from_json_state_across_epoch_boundary():
  items = [f"x{i}" for i in range(50)]
  ref = dataset.BatchIterator(items, 8, seed=3)
  for _ in range(9):  # 6 batches per epoch: stop mid-epoch 1
    next(ref)
  saved = json.loads(json.dumps(ref.state()))
  assert saved == {"seed": 3, "epoch": 1, "batch": 3, "num_items": 50, "global_batch_size": 8}
  resumed = dataset.BatchIterator(items, 8, seed=3)
  resumed.restore(saved)
  assert [next(resumed) for _ in range(10)] == [next(ref) for _ in range(10)]


def test_iterator_restore_refuses_state_of_other_data_or_batch_size():
  it = dataset.BatchIterator(list(range(50)), 8, seed=3)
  state = it.state()
  with pytest.raises(ValueError, match="num_items=50 but this iterator has 49"):
    dataset.BatchIterator(list(range(49)), 8, seed=3).restore(state)
  with pytest.raises(ValueError, match="global_batch_size=8 but this iterator has 10"):
    dataset.BatchIterator(list(range(50)), 10, seed=3).restore(state)
  with pytest.raises(ValueError, match="out of range"):
    it.restore(dict(state, batch=6))


def test_process_shares_are_disjoint_and_concatenate_to_the_single_process_batch():
  items, gbs, count = list(range(77)), 12, 4
  single = dataset.BatchIterator(items, gbs, seed=5)
  shards = [dataset.BatchIterator(items, gbs, seed=5, process_index=p, process_count=count)
            for p in range(count)]
  for _ in range(15):  # crosses two epoch boundaries
    whole = next(single)
    parts = [next(s) for s in shards]
    assert all(len(p) == gbs // count for p in parts)
    assert sum(parts, []) == whole
    assert len(set(sum(parts, []))) == gbs
  assert {json.dumps(s.state()) for s in shards} == {json.dumps(single.state())}


def test_iterator_rejects_batch_not_divisible_by_processes_or_larger_than_data():
  with pytest.raises(ValueError, match="multiple of process_count=4"):
    dataset.BatchIterator(list(range(20)), 10, process_index=0, process_count=4)
  with pytest.raises(ValueError, match="exceeds the 5 items"):
    dataset.BatchIterator(list(range(5)), 8)
  with pytest.raises(ValueError, match="process_index=2"):
    dataset.BatchIterator(list(range(20)), 4, process_index=2, process_count=2)


def test_epoch_order_is_a_pure_function_of_seed_and_epoch():
  np.testing.assert_array_equal(dataset.epoch_order(30, 1, 4), dataset.epoch_order(30, 1, 4))
  assert sorted(dataset.epoch_order(30, 1, 4)) == list(range(30))
  assert not np.array_equal(dataset.epoch_order(30, 1, 4), dataset.epoch_order(30, 1, 5))


def test_tests_read_data_files_only_through_data_paths():
  """A user's clone has no ../shared/data: a test naming it directly would fail there (CI hides it too)."""
  tests_dir = pathlib.Path(__file__).parent
  allowed = {"data_paths.py", "conftest.py", pathlib.Path(__file__).name}  # the lookup, the marker, this check
  offenders = [p.name for p in tests_dir.glob("*.py")
               if p.name not in allowed and ('"shared"' in p.read_text() or "shared/data" in p.read_text())]
  assert offenders == []


def test_chat_template_length_filter_counts_the_templated_user_turn(qwen_tokenizer):
  # The official loader keeps a prompt if its user turn, in the chat template with the generation prompt
  # opened, is <= the limit, though the raw prompt is what is used (docs/fidelity.md).
  ex = [dataset.Example("u/0", "x " * 40, "1")]
  raw_len = len(qwen_tokenizer(dataset.format_prompt(ex[0].problem))["input_ids"])
  templated_len = len(qwen_tokenizer.apply_chat_template([{"role": "user", "content": dataset.format_prompt(ex[0].problem)}],
                                                         tokenize=True, add_generation_prompt=True, return_dict=True)
                      ["input_ids"])
  assert templated_len > raw_len
  for limit, kept in ((raw_len, 0), (templated_len - 1, 0), (templated_len, 1)):
    prompts, _ = dataset.build_prompts(ex, qwen_tokenizer, max_prompt_tokens=limit, prompt_filter="chat_template")
    assert len(prompts) == kept, limit
  prompts, _ = dataset.build_prompts(ex, qwen_tokenizer, max_prompt_tokens=raw_len, prompt_filter="raw")
  assert len(prompts) == 1 and prompts[0].problem == ex[0].problem and len(prompts[0].ids) == raw_len
  from astarpo_jax.data import synthetic
  with pytest.raises(ValueError, match="has none: set data.prompt_filter='raw'"):
    dataset.build_prompts(ex, synthetic.build_tokenizer(), prompt_filter="chat_template")


@pytest.mark.parametrize("root,rollout_batch,steps", [
    pytest.param(DATA_ROOTS[0].values[0], 8, (42 // 8) * 25 - 1, id="fixtures"),
    pytest.param(DATA_ROOTS[1].values[0], 256, 724, id="full", marks=DATA_ROOTS[1].marks)])
def test_gsm8k_train_keeps_every_prompt_and_25_epochs_give_the_official_step_count(qwen_tokenizer, root,
                                                                                   rollout_batch, steps):
  from astarpo_jax.training import loop
  examples, _ = dataset.load_preset("gsm8k_train", data_dir=str(root))
  prompts, stats = dataset.build_prompts(examples, qwen_tokenizer, template="gsm8k", prompt_filter="chat_template")
  assert stats.too_long == 0 and stats.kept == len(examples)  # no GSM8K train prompt is over 256 tokens
  assert loop.steps_for_epochs(stats.kept, rollout_batch, 25) == steps  # 7,473 // 256 = 29 per epoch


def test_olympiadbench_golds_are_the_final_answers_without_dollars():
  examples, stats = dataset.load_preset("olympiadbench", data_dir=str(DATA_DIR))
  raw = dataset.read_rows(str(DATA_DIR / "olympiadbench/test.jsonl"))
  assert stats.kept == len(raw) == 30
  for ex, row in zip(examples, raw):
    assert "$" not in ex.gold and ex.gold == ", ".join(row["final_answer"]).replace("$", "").strip()
  assert examples[0].uid == f"olympiadbench/{raw[0]['id']}"
