"""A synthetic verifiable task (sums of small numbers) and its character-level tokenizer.

Sized for a CPU demo: a tiny decoder pretrained briefly on `target_response` gets some sums right
and others wrong (more terms and digits are harder), leaving RL something to improve. Prompts
look like `12+34+5=` and targets like `46+5=51 \\boxed{51}` + EOS, both well under 24 tokens.
Rows go through `dataset.examples_from_rows`, the same path as real data sets.
"""
from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from astarpo_jax.data import dataset

PROMPT_TEMPLATE = "{problem}="  # for dataset.format_prompt / build_prompts
FIELDS = dataset.Fields("problem", "answer")
BOX = "\\boxed{"
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = tuple("0123456789+= }")
VOCAB = SPECIALS + CHARS + (BOX,)
TEST_BUCKETS = 8  # one problem in 8 (by hash of its text) belongs to the test split


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
  """Difficulty: the number of terms and the digits per term (each drawn uniformly per problem)."""
  min_terms: int = 2
  max_terms: int = 3
  max_digits: int = 2
  worked_step: bool = True  # write running sums before the box (`46+5=51 \boxed{51}`)

  def __post_init__(self):
    if not 2 <= self.min_terms <= self.max_terms <= 4:
      raise ValueError(f"need 2 <= min_terms <= max_terms <= 4, got {self.min_terms}, "
                       f"{self.max_terms}")
    if not 1 <= self.max_digits <= 3:
      raise ValueError(f"max_digits must be in [1, 3], got {self.max_digits}")


def split_of(problem: str) -> str:
  """"test" for a fixed 1/TEST_BUCKETS of problems (by hash), else "train": splits never overlap."""
  return "test" if zlib.crc32(problem.encode()) % TEST_BUCKETS == 0 else "train"


def sample_problem(rng: np.random.Generator, cfg: SyntheticConfig) -> tuple[str, str]:
  """One (problem, answer): e.g. ("12+34+5", "51")."""
  n_terms = int(rng.integers(cfg.min_terms, cfg.max_terms + 1))
  digits = rng.integers(1, cfg.max_digits + 1, size=n_terms)
  terms = [int(rng.integers(0 if d == 1 else 10 ** (d - 1), 10 ** d)) for d in digits]
  return "+".join(map(str, terms)), str(sum(terms))


def generate_rows(n: int, seed: int, cfg: SyntheticConfig = SyntheticConfig(),
                  split: str = "train") -> list[dict[str, str]]:
  """`n` rows {"problem", "answer"} of `split`, a pure function of (n, seed, cfg, split)."""
  if split not in ("train", "test"):
    raise ValueError(f"split must be 'train' or 'test', got {split!r}")
  rng = np.random.default_rng([seed, 0 if split == "train" else 1])
  rows, tries = [], 0
  while len(rows) < n:
    tries += 1
    if tries > 1000 * (n + 10):  # cannot happen for valid configs; guards an endless loop
      raise RuntimeError(f"could not draw {n} {split} problems for {cfg}")
    problem, answer = sample_problem(rng, cfg)
    if split_of(problem) == split:
      rows.append({"problem": problem, "answer": answer})
  return rows


def load_synthetic(n: int, seed: int, cfg: SyntheticConfig = SyntheticConfig(),
                   split: str = "train") -> tuple[list[dataset.Example], dataset.LoadStats]:
  """Synthetic examples through the same row -> Example path as real data sets."""
  return dataset.examples_from_rows(generate_rows(n, seed, cfg, split), FIELDS, f"synthetic_{split}")


def target_response(problem: str, worked_step: bool = True, boxed: bool = True) -> str:
  """A correct response to `problem` (text after the prompt's `=`), without EOS.

  With worked_step, running sums from the second term on: "12+34+5" -> "46+5=51 \\boxed{51}".
  With boxed=False the final answer is written bare ("46+5=51 51"): right, but a grader that
  reads the last \\boxed{} scores it 0, as with base models that ignore the format instruction.
  """
  terms = [int(t) for t in problem.split("+")]
  total, steps = terms[0] + terms[1], []
  for t in terms[2:]:
    steps.append(f"{total}+{t}={total + t} ")
    total += t
  final = f"{BOX}{total}}}" if boxed else f"{total}"
  return ("".join(steps) if worked_step else "") + final


def supervised_pair(tokenizer, problem: str, worked_step: bool = True, boxed: bool = True
                    ) -> tuple[list[int], list[int]]:
  """(prompt ids with BOS, target response ids ending in EOS) for the supervised warm start."""
  prompt = tokenizer(dataset.format_prompt(problem, PROMPT_TEMPLATE))["input_ids"]
  response = tokenizer(target_response(problem, worked_step, boxed), add_special_tokens=False)["input_ids"]
  return list(prompt), list(response) + [tokenizer.eos_token_id]


def build_tokenizer(tokens: tuple[str, ...] = VOCAB):
  """Character-level `PreTrainedTokenizerFast` with `\\boxed{` as one token; adds BOS to inputs.

  `tokens`: SPECIALS, then single characters, then BOX (other offline tasks pass their own).
  """
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
  from transformers import PreTrainedTokenizerFast
  vocab = {tok: i for i, tok in enumerate(tokens)}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\\boxed\{|[\s\S]"), behavior="isolated")
  tok.decoder = decoders.Fuse()  # concatenate: no spaces inserted between characters
  tok.post_processor = processors.TemplateProcessing(
      single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])])
  return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                 eos_token="<eos>", unk_token="<unk>",
                                 clean_up_tokenization_spaces=False)


def save_tokenizer(directory: str, tokens: tuple[str, ...] = VOCAB) -> str:
  """Writes the tokenizer in HF format so `AutoTokenizer.from_pretrained(directory)` loads it."""
  build_tokenizer(tokens).save_pretrained(directory)
  return directory
