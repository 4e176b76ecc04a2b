"""Bad checkpoints get a clear CheckpointError that names the problem."""
import json

import numpy as np
import pytest

from astarpo_jax.model import decoder, hf
from astarpo_jax.model.config import ModelConfig

CFG = ModelConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=4, tie_embeddings=False)


@pytest.fixture()
def ckpt(tmp_path):
  _, params = decoder.init_params(CFG)
  hf.save_hf(CFG, params, str(tmp_path))
  return tmp_path


def _rewrite(ckpt, edit):
  st = hf.SafetensorsIndex([str(ckpt / "model.safetensors")])
  tensors = {n: np.array(st.get(n)) for n in st.names()}
  edit(tensors)
  del st
  hf._write_safetensors(str(ckpt / "model.safetensors"), tensors)


def test_folder_without_weights_is_named(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(hf.config_to_hf(CFG)))
  with pytest.raises(hf.CheckpointError, match="no safetensors weights"):
    hf.load_hf(str(tmp_path))


def test_missing_folder_is_named(tmp_path):
  with pytest.raises(hf.CheckpointError, match="does not exist"):
    hf.load_hf(str(tmp_path / "nope"))


def test_unsupported_architecture_lists_supported(ckpt):
  cfg = json.loads((ckpt / "config.json").read_text())
  cfg.update(architectures=["MistralForCausalLM"], model_type="mistral")
  (ckpt / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(hf.CheckpointError, match="MistralForCausalLM.*Qwen2ForCausalLM"):
    hf.load_hf(str(ckpt))


def test_missing_tensor_is_named(ckpt):
  _rewrite(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  with pytest.raises(hf.CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
    hf.load_hf(str(ckpt))


def test_misshaped_tensor_names_expected_and_found_shapes(ckpt):
  _rewrite(ckpt, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((4, 16), np.float32)}))
  with pytest.raises(hf.CheckpointError, match=r"k_proj\.weight.*\(4, 16\).*expected \(8, 16\)"):
    hf.load_hf(str(ckpt))


@pytest.mark.parametrize("edit,match", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_attention_heads": 3, "num_key_value_heads": 2, "head_dim": 4}, "multiple of num_kv_heads"),
    ({"use_sliding_window": True, "sliding_window": 16, "max_position_embeddings": 4096}, "sliding_window"),
])
def test_config_the_model_cannot_represent_is_refused(ckpt, edit, match):
  cfg = json.loads((ckpt / "config.json").read_text())
  cfg.pop("rope_parameters", None)
  cfg.update(edit)
  (ckpt / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(hf.CheckpointError, match=match):
    hf.load_hf(str(ckpt))


def test_unknown_hub_id_offline_gives_clear_error(monkeypatch):
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  with pytest.raises(hf.CheckpointError, match="could not fetch 'no-such-org/no-such-model'"):
    hf.load_hf("no-such-org/no-such-model")
