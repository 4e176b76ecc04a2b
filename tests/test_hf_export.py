"""Exports are standard safetensors folders: the `safetensors` package reads them, transformers reloads
bf16 exports as the bf16-rounded model.

(fp32 exports reloading in transformers with the same logits, for Qwen2 and Llama, tied and untied:
tests/test_model_parity.py::test_export_then_transformers_reload_gives_same_logits.)
"""
import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from astarpo_jax.model import hf
from tests.hf_fixtures import hf_logits, padded_batch, tiny_hf_model

CASES = [("qwen2", True), ("llama", False)]


@pytest.mark.parametrize("arch,tied", CASES, ids=[f"{a}-{'tied' if t else 'untied'}" for a, t in CASES])
def test_bf16_export_reloads_in_transformers_as_the_bf16_rounded_model(tmp_path, arch, tied):
  ref = tiny_hf_model(arch, tied)
  ref.save_pretrained(tmp_path / "hf")
  cfg, params = hf.load_hf(str(tmp_path / "hf"))
  hf.save_hf(cfg, params, str(tmp_path / "out"), dtype="bfloat16")
  assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
  with torch.no_grad():  # the reference: HF's own model with every weight rounded to bf16
    for p in ref.parameters():
      p.copy_(p.to(torch.bfloat16).float())
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
  tokens, mask = padded_batch(seed=4)
  np.testing.assert_allclose(hf_logits(reloaded, tokens, mask)[mask], hf_logits(ref, tokens, mask)[mask], atol=1e-5)


def test_sharded_export_is_read_by_the_safetensors_package(tmp_path):
  ref = tiny_hf_model("llama", tied=False)
  ref.save_pretrained(tmp_path / "hf")
  cfg, params = hf.load_hf(str(tmp_path / "hf"))
  hf.save_hf(cfg, params, str(tmp_path / "out"), dtype="bfloat16", max_shard_bytes=30_000)
  index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
  files = sorted(set(index["weight_map"].values()))
  assert len(files) > 1
  tensors = {}
  for name in files:
    part = load_file(str(tmp_path / "out" / name))
    assert {k for k, v in index["weight_map"].items() if v == name} == set(part)
    tensors.update(part)
  want = {k: v.to(torch.bfloat16).view(torch.int16).numpy() for k, v in ref.state_dict().items()}
  assert set(tensors) == set(want)
  assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
  for k, v in tensors.items():
    assert str(v.dtype) == "bfloat16", k
    np.testing.assert_array_equal(v.view(np.int16), want[k], err_msg=k)  # bit-exact bf16 rounding
