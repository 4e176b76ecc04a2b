"""Math data sets as plain `Example` records, prompt templates, and a resumable batch iterator.

Sources: a preset name (`PRESETS`), a Hugging Face id loaded with `datasets.load_dataset`, or a
local JSONL / JSON / parquet file with an explicit field mapping. Every source goes through
`examples_from_rows`, so gold extraction, skipping and uids behave the same offline and online.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from astarpo_jax.rewards.answers import gsm8k_gold, last_boxed
from astarpo_jax.rewards.user_grader import Target

log = logging.getLogger(__name__)

ANSWER_FORMATS = ("plain", "gsm8k", "boxed", "latex_list", "json")
PROMPT_FILTERS = ("chat_template", "raw")
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclasses.dataclass(frozen=True)
class Example:
  """One problem and its gold answer (a string; any JSON value under answer_format "json"), with the row's
  extra fields (Fields.extra) for a user's reward function."""
  uid: str
  problem: str
  gold: Any
  extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Fields:
  """Which row fields hold the problem and the gold answer, and how to read the answer.

  answer_format: "plain" (the field as given; numbers via str(), so AMC's 27.0 stays "27.0"),
  "gsm8k" (text after `#### `), "boxed" (last `\\boxed{}` of the field, e.g. a MATH solution),
  "latex_list" (a list of LaTeX answers in `$...$`, as OlympiadBench's final_answer: joined by ", ",
  the `$` removed), "json" (the value as loaded, any JSON value: for a user's reward function).
  id: optional field used in the uid instead of the row index.
  extra: other fields kept as loaded with each example, passed to a user's reward function as keywords.
  """
  problem: str
  answer: str
  answer_format: str = "plain"
  id: str | None = None
  extra: tuple[str, ...] = ()

  def __post_init__(self):
    if self.answer_format not in ANSWER_FORMATS:
      raise ValueError(f"answer_format={self.answer_format!r}; expected one of {ANSWER_FORMATS}")
    clash = [f for f in self.extra if f in ("response", "gold") or not isinstance(f, str)]
    if clash:
      raise ValueError(f"extra fields {clash}: a reward function's keywords cannot be 'response' or 'gold'")


@dataclasses.dataclass(frozen=True)
class LoadStats:
  rows: int
  kept: int
  skipped: dict[str, int]  # reason -> count: "missing_problem", "missing_answer" (and "missing_extra" with extras)


@dataclasses.dataclass(frozen=True)
class Preset:
  """A named set: where it lives on the Hub, and optionally as a file under a local data dir."""
  hf_id: str
  hf_configs: tuple[str | None, ...]  # several for per-subject sets; rows are concatenated
  hf_split: str
  fields: Fields
  local_file: str | None = None  # relative to data_dir (e.g. /work/shared/data)
  local_fields: Fields | None = None  # when the local copy names fields differently

_MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra",
                  "number_theory", "prealgebra", "precalculus")
_SOLUTION_BOXED = Fields("problem", "solution", "boxed")

PRESETS: dict[str, Preset] = {
    "gsm8k_train": Preset("openai/gsm8k", ("main",), "train", Fields("question", "answer", "gsm8k"),
                          "gsm8k/train.jsonl"),
    "gsm8k_test": Preset("openai/gsm8k", ("main",), "test", Fields("question", "answer", "gsm8k"),
                         "gsm8k/test.jsonl"),
    # MATH train, 7,500 problems: gold is the last \boxed{} of the solution (no answer field).
    "math_train": Preset("EleutherAI/hendrycks_math", _MATH_SUBJECTS, "train", _SOLUTION_BOXED),
    "math_lighteval_train": Preset("DigitalLearningGmbH/MATH-lighteval", ("default",), "train",
                                   _SOLUTION_BOXED),
    "math500": Preset("HuggingFaceH4/MATH-500", (None,), "test",
                      Fields("problem", "answer", "plain", id="unique_id"), "math500/test.jsonl",
                      Fields("problem", "answer", "plain")),
    "openr1_math": Preset("open-r1/OpenR1-Math-220k", ("default",), "train",
                          Fields("problem", "answer", "plain", id="uuid")),
    "aime24": Preset("HuggingFaceH4/aime_2024", (None,), "train",
                     Fields("problem", "answer", id="id"), "aime24/test.jsonl"),
    "amc23": Preset("math-ai/amc23", (None,), "test", Fields("question", "answer"),
                    "amc23/test.jsonl", Fields("problem", "answer", id="id")),
    "minerva": Preset("math-ai/minervamath", (None,), "test", Fields("question", "answer"),
                      "minerva_math/test.jsonl", Fields("problem", "solution", "boxed", id="idx")),
    # OlympiadBench's English text-only competition math (OE_TO_maths_en_COMP), as the official
    # README's evaluation figure uses it.
    "olympiadbench": Preset("Hothan/OlympiadBench", ("OE_TO_maths_en_COMP",), "train",
                            Fields("question", "final_answer", "latex_list", id="id"), "olympiadbench/test.jsonl"),
    # The full MATH test split (5,000 problems): the official in-training validation set
    # (preprocess/data_preprocess/math_dataset.py reads the same problems from xDAN2099/lighteval-MATH).
    "math_test": Preset("DigitalLearningGmbH/MATH-lighteval", ("default",), "test", _SOLUTION_BOXED),
}


def _gold(value: Any, fmt: str) -> Any:
  """Gold answer string of one answer-field value (the value itself under "json"), or None when there is none."""
  if fmt == "json":
    return None if value is None or value != value else value  # NaN: missing
  if fmt == "latex_list" and isinstance(value, (list, tuple)) and value:
    value = ", ".join(str(v) for v in value)
  if value is None or isinstance(value, (bool, list, dict)) or value != value:  # NaN: missing
    return None
  text = value if isinstance(value, str) else str(value)  # 27.0 -> "27.0": kept as given
  if fmt == "gsm8k":
    text = gsm8k_gold(text)
  elif fmt == "boxed":
    text = last_boxed(text)
  elif fmt == "latex_list":
    text = text.replace("$", "")
  text = (text or "").strip()
  return text or None


def examples_from_rows(rows: Sequence[Mapping[str, Any]], fields: Fields, name: str,
                       columns: Iterable[str] | None = None) -> tuple[list[Example], LoadStats]:
  """Examples from raw rows; rows without a problem or gold are skipped and counted.

  A field that no row has (nor `columns`, the source's schema) is an error listing the fields there.
  """
  available = set(columns or ())
  for row in rows:
    available.update(row.keys())
  roles = (("problem", fields.problem), ("answer", fields.answer), ("id", fields.id),
           *(("extra", f) for f in fields.extra))
  for role, field in roles:
    if field is not None and field not in available:
      raise KeyError(f"{name}: {role} field {field!r} not found; available fields: "
                     f"{sorted(available)}")
  out, skipped = [], {"missing_problem": 0, "missing_answer": 0, **({"missing_extra": 0} if fields.extra else {})}
  for i, row in enumerate(rows):
    problem = row.get(fields.problem)
    if not isinstance(problem, str) or not problem.strip():
      skipped["missing_problem"] += 1
      continue
    gold = _gold(row.get(fields.answer), fields.answer_format)
    if gold is None:
      skipped["missing_answer"] += 1
      continue
    if any(row.get(f) is None for f in fields.extra):
      skipped["missing_extra"] += 1
      continue
    key = row.get(fields.id) if fields.id else None
    out.append(Example(f"{name}/{i if key is None else key}", problem.strip(), gold,
                       {f: row[f] for f in fields.extra}))
  stats = LoadStats(len(rows), len(out), skipped)
  if len(out) < len(rows):
    log.warning("%s: skipped %d of %d rows (%s)", name, len(rows) - len(out), len(rows),
                ", ".join(f"{k}={v}" for k, v in skipped.items() if v))
  return out, stats


def read_rows(path: str) -> list[dict[str, Any]]:
  """Rows of a local JSONL, JSON (a list of objects, or JSON Lines) or parquet file."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"data file not found: {path}")
  if not path.endswith(LOCAL_SUFFIXES):
    raise ValueError(f"{path}: unsupported file type; expected one of {LOCAL_SUFFIXES}")
  if path.endswith(".parquet"):
    import pyarrow.parquet as pq
    return pq.read_table(path).to_pylist()
  with open(path, encoding="utf-8") as f:
    text = f.read()
  if path.endswith(".json"):
    try:
      data = json.loads(text)
    except json.JSONDecodeError:
      data = None  # a .json file holding JSON Lines: read below
    if isinstance(data, list):
      return _check_objects(data, path)
    if data is not None:
      raise ValueError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
  rows = []
  for lineno, line in enumerate(text.splitlines(), 1):
    if line.strip():
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
  return _check_objects(rows, path)


def _check_objects(rows: list, path: str) -> list[dict[str, Any]]:
  for i, row in enumerate(rows):
    if not isinstance(row, dict):
      raise ValueError(f"{path}: row {i} is a {type(row).__name__}, expected a JSON object")
  return rows


def _hub_rows(hf_id: str, configs: Sequence[str | None], split: str, fields: Fields
              ) -> tuple[list[dict[str, Any]], list[str]]:
  """Rows (only the mapped fields) and all column names of a Hub split, over all `configs`."""
  import datasets
  wanted = [f for f in (fields.problem, fields.answer, fields.id, *fields.extra) if f]
  rows, columns = [], []
  for config in configs:
    try:
      ds = datasets.load_dataset(hf_id, config, split=split)
    except Exception as e:  # offline, bad id, missing config: say which set failed
      raise RuntimeError(f"could not load {hf_id!r} (config={config!r}, split={split!r}) from "
                         f"the Hugging Face Hub: {type(e).__name__}: {e}. Offline, pass a local "
                         f"file or a preset's data_dir.") from e
    columns = list(ds.column_names)
    # Drop unmapped columns first: OpenR1 rows carry long generations we never read.
    rows.extend(ds.select_columns([f for f in wanted if f in columns]).to_list())
  return rows, columns


def load_examples(source: str, fields: Fields, *, name: str | None = None,
                  hf_configs: Sequence[str | None] = (None,), split: str = "train"
                  ) -> tuple[list[Example], LoadStats]:
  """Examples from a local file (existing, or named .jsonl/.json/.parquet) or a Hub id."""
  name = name or os.path.splitext(os.path.basename(source))[0]
  if os.path.exists(source) or source.endswith(LOCAL_SUFFIXES) or source.startswith(("/", ".")):
    return examples_from_rows(read_rows(source), fields, name)
  rows, columns = _hub_rows(source, hf_configs, split, fields)
  return examples_from_rows(rows, fields, name, columns)


def load_preset(name: str, data_dir: str | None = None) -> tuple[list[Example], LoadStats]:
  """A preset set: from `data_dir/<local_file>` when given (offline copies), else from the Hub."""
  if name not in PRESETS:
    raise KeyError(f"unknown data set {name!r}; presets: {sorted(PRESETS)}")
  p = PRESETS[name]
  if data_dir is not None:
    if p.local_file is None:
      raise ValueError(f"preset {name!r} has no local copy; load it from the Hub (data_dir=None)")
    path = os.path.join(data_dir, p.local_file)
    return load_examples(path, p.local_fields or p.fields, name=name)
  return load_examples(p.hf_id, p.fields, name=name, hf_configs=p.hf_configs, split=p.hf_split)


# ---------------------------------------------------------------------------------------------
# Prompts: the user turn from a template, raw for base models or in the chat template for instruct.

TEMPLATES = {
    # The paper's prompt (A*-PO, following Qwen2.5-Math evaluation).
    "boxed": "{problem} Let's think step by step and output the final answer within \\boxed{}.",
    "gsm8k": '{problem} Let\'s think step by step and output the final answer after "####".',
    "plain": "{problem}",
}


def format_prompt(problem: str, template: str = "boxed") -> str:
  """User-turn text: `template` is a TEMPLATES name or a custom string with a `{problem}` slot."""
  t = TEMPLATES.get(template, template)
  if "{problem}" not in t:
    raise ValueError(f"template {template!r} is neither one of {sorted(TEMPLATES)} nor a string "
                     "containing '{problem}'")
  return t.replace("{problem}", problem)  # not str.format: problems and templates hold braces


def render_prompt(problem: str, tokenizer: Any = None, template: str = "boxed", chat: bool = False,
                  system: str | None = None, chat_template: str | None = None) -> str:
  """Full prompt text: the template as is (base models), or wrapped by the tokenizer's chat
  template with the assistant turn opened (instruct models); `chat_template` overrides its own."""
  text = format_prompt(problem, template)
  if not chat:
    return text
  if tokenizer is None:
    raise ValueError("chat=True needs a tokenizer to apply its chat template")
  if chat_template is None and not getattr(tokenizer, "chat_template", None):
    raise ValueError(f"{type(tokenizer).__name__} has no chat_template: use chat=False for a base "
                     "model, or pass chat_template=")
  messages = ([{"role": "system", "content": system}] if system else [])
  messages.append({"role": "user", "content": text})
  return tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                       add_generation_prompt=True)


@dataclasses.dataclass(frozen=True)
class Prompt:
  """A rendered prompt and its token ids, carrying the example's uid, gold, raw problem text and extra fields."""
  uid: str
  text: str
  ids: tuple[int, ...]
  gold: Any
  problem: str = ""  # the problem before the template (how the official Stage-1 data names a prompt)
  extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def target(self) -> Any:
    """What a grader is given for this prompt: the gold, or with extra fields a user_grader.Target of both."""
    return Target(self.gold, self.extra) if self.extra else self.gold


@dataclasses.dataclass(frozen=True)
class PromptStats:
  total: int
  kept: int
  too_long: int  # dropped: more than max_prompt_tokens tokens


def filter_lengths(texts: Sequence[str], ids_list: Sequence[Sequence[int]], tokenizer: Any, chat: bool,
                   prompt_filter: str) -> list[int]:
  """The token length each prompt is filtered by: its own ("raw"), or, as the official A*-PO data
  loader measures it, that of the user turn in the tokenizer's chat template with the assistant turn
  opened ("chat_template"; verl/utils/dataset/rl_dataset.py), even when the raw prompt is what is used."""
  if prompt_filter not in PROMPT_FILTERS:
    raise ValueError(f"prompt_filter={prompt_filter!r}: expected one of {PROMPT_FILTERS}")
  if prompt_filter == "raw" or chat:  # a chat prompt is its templated self already
    return [len(ids) for ids in ids_list]
  if not getattr(tokenizer, "chat_template", None):
    raise ValueError(f"prompt_filter='chat_template' measures prompts in the tokenizer's chat template, but "
                     f"{type(tokenizer).__name__} has none: set data.prompt_filter='raw'")
  return [len(tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=True,
                                            add_generation_prompt=True, return_dict=True)["input_ids"])
          for t in texts]


def build_prompts(examples: Sequence[Example], tokenizer: Any, template: str = "boxed",
                  chat: bool = False, max_prompt_tokens: int = 256, system: str | None = None,
                  chat_template: str | None = None, prompt_filter: str = "raw") -> tuple[list[Prompt], PromptStats]:
  """Rendered, tokenized prompts; those longer than `max_prompt_tokens` (measured per `filter_lengths`)
  are dropped and counted."""
  texts = [render_prompt(ex.problem, tokenizer, template, chat, system, chat_template)
           for ex in examples]
  # A chat template writes its own special tokens; a raw prompt gets the tokenizer's (e.g. a BOS).
  ids_list = tokenizer(texts, add_special_tokens=not chat)["input_ids"] if texts else []
  lengths = filter_lengths(texts, ids_list, tokenizer, chat, prompt_filter) if texts else []
  out = [Prompt(ex.uid, text, tuple(ids), ex.gold, ex.problem, ex.extra)
         for ex, text, ids, n in zip(examples, texts, ids_list, lengths) if n <= max_prompt_tokens]
  stats = PromptStats(len(examples), len(out), len(examples) - len(out))
  if stats.too_long:
    log.warning("dropped %d of %d prompts longer than %d tokens", stats.too_long, stats.total,
                max_prompt_tokens)
  return out, stats


# ---------------------------------------------------------------------------------------------
# Resumable iterator: the order is a pure function of (seed, epoch), so a position is two ints.


def epoch_order(num_items: int, seed: int, epoch: int) -> np.ndarray:
  """Permutation of range(num_items) for one epoch, a pure function of (seed, epoch)."""
  return np.random.default_rng([seed, epoch]).permutation(num_items)


def global_batch(num_items: int, global_batch_size: int, seed: int, epoch: int,
                 batch: int) -> np.ndarray:
  """Item indices of batch `batch` of `epoch`; the tail that does not fill a batch is dropped."""
  return epoch_order(num_items, seed, epoch)[batch * global_batch_size:
                                             (batch + 1) * global_batch_size]


def process_share(indices: np.ndarray, process_index: int, process_count: int) -> np.ndarray:
  """This process's contiguous slice of a global batch (process order = global array order)."""
  per = len(indices) // process_count
  return indices[process_index * per:(process_index + 1) * per]


class BatchIterator:
  """Endless batches of `items`, reshuffled each epoch; `state()` / `restore()` resume exactly.

  Each process yields its disjoint share of the global batch, which is the same for any
  process_count. State is global (identical on every process), so one checkpoint serves all.
  """

  def __init__(self, items: Sequence[Any], global_batch_size: int, seed: int = 0,
               process_index: int = 0, process_count: int = 1):
    if process_count < 1 or not 0 <= process_index < process_count:
      raise ValueError(f"process_index={process_index} must be in "
                       f"[0, process_count={process_count})")
    if global_batch_size < 1 or global_batch_size % process_count:
      raise ValueError(f"global_batch_size={global_batch_size} must be a positive multiple of "
                       f"process_count={process_count}")
    if len(items) < global_batch_size:
      raise ValueError(f"global_batch_size={global_batch_size} exceeds the {len(items)} items")
    self.items, self.global_batch_size, self.seed = items, global_batch_size, seed
    self.process_index, self.process_count = process_index, process_count
    self.batches_per_epoch = len(items) // global_batch_size
    self.epoch, self.batch = 0, 0

  def __iter__(self):
    return self

  def next_indices(self) -> np.ndarray:
    """Indices (into items) of this process's share of the next batch; advances the position."""
    idx = global_batch(len(self.items), self.global_batch_size, self.seed, self.epoch, self.batch)
    self.batch += 1
    if self.batch == self.batches_per_epoch:
      self.epoch, self.batch = self.epoch + 1, 0
    return process_share(idx, self.process_index, self.process_count)

  def __next__(self) -> list[Any]:
    return [self.items[i] for i in self.next_indices()]

  def state(self) -> dict[str, int]:
    """Position of the next batch, plus what must match on restore; plain ints for JSON."""
    return {"seed": int(self.seed), "epoch": self.epoch, "batch": self.batch,
            "num_items": len(self.items), "global_batch_size": self.global_batch_size}

  def restore(self, state: Mapping[str, int]) -> None:
    """Continue from a `state()`; refuses one saved over other data or another batch size."""
    for key in ("seed", "num_items", "global_batch_size"):
      mine = self.state()[key]
      if int(state[key]) != mine:
        raise ValueError(f"iterator state has {key}={state[key]} but this iterator has {mine}")
    epoch, batch = int(state["epoch"]), int(state["batch"])
    if epoch < 0 or not 0 <= batch < self.batches_per_epoch:
      raise ValueError(f"iterator state epoch={epoch}, batch={batch} out of range "
                       f"(batches_per_epoch={self.batches_per_epoch})")
    self.epoch, self.batch = epoch, batch
