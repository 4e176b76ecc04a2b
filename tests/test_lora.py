"""LoRA on the frozen base (model/lora.py): step 0 is the base, the merge equals the adapter's forward, the
gradient is the full-weight gradient projected onto the adapter, and PEFT loads our adapter folder onto the HF
model with the logits of our forward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from astarpo_jax.model import decoder, hf, lora
from tests.hf_fixtures import hf_logits, padded_batch, tiny_hf_model

CASES = [("qwen2", True), ("llama", False)]
IDS = [f"{a}-{'tied' if t else 'untied'}" for a, t in CASES]


def _converted(tmp_path, arch="qwen2", tied=True):
  ref = tiny_hf_model(arch, tied)
  ref.save_pretrained(tmp_path / "hf")
  cfg, params = hf.load_hf(str(tmp_path / "hf"))
  return ref, cfg, params


def _random_adapter(cfg, lcfg, seed):
  """An adapter with B != 0 (a trained one), so that every target changes the logits."""
  adapter = lora.init_adapter(cfg, lcfg, seed)
  keys = iter(jax.random.split(jax.random.key(seed + 100), len(adapter["layers"])))
  return {"layers": {n: (0.05 * jax.random.normal(next(keys), w.shape) if n.endswith("_lora_b") else w)
                     for n, w in adapter["layers"].items()}}


def _logits(cfg, params, tokens, mask):
  return np.asarray(decoder.forward(cfg, params, tokens, decoder.positions_from_mask(mask), mask)[0])


def test_adapter_with_zero_b_gives_the_hf_base_models_logits(tmp_path):
  ref, cfg, params = _converted(tmp_path)
  lcfg = lora.LoraConfig(rank=4, alpha=8.0)
  lcfg_cfg = lora.model_config(cfg, lcfg)
  adapter = lora.init_adapter(cfg, lcfg, seed=1)
  assert all(np.all(np.asarray(w) == 0) for n, w in adapter["layers"].items() if n.endswith("_lora_b"))
  assert all(np.any(np.asarray(w) != 0) for n, w in adapter["layers"].items() if n.endswith("_lora_a"))
  tokens, mask = padded_batch(seed=2)
  ours = _logits(lcfg_cfg, lora.attach(params, adapter), tokens, mask)
  np.testing.assert_allclose(ours[mask], hf_logits(ref, tokens, mask)[mask], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("targets", [lora.ALL_LINEAR, ("q", "v"), ("o", "down")])
def test_merged_weights_give_the_adapter_forwards_logits_in_fp32(tmp_path, targets):
  _, cfg, params = _converted(tmp_path)
  lcfg = lora.LoraConfig(targets=targets, rank=4, alpha=16.0)
  lcfg_cfg = lora.model_config(cfg, lcfg)
  policy = lora.attach(params, _random_adapter(cfg, lcfg, seed=3))
  tokens, mask = padded_batch(seed=1)
  with_adapter = _logits(lcfg_cfg, policy, tokens, mask)
  merged = lora.merged(lcfg_cfg, policy, "float32")
  assert not lora.has_adapter(merged)
  np.testing.assert_allclose(_logits(cfg, merged, tokens, mask)[mask], with_adapter[mask], atol=1e-5, rtol=1e-5)
  assert np.abs(with_adapter - _logits(cfg, params, tokens, mask))[mask].max() > 1e-2  # the adapter mattered


def test_the_adapter_gradient_is_the_full_weight_gradient_projected(tmp_path):
  """W' = W + s A B: dL/dB = s A^T dL/dW' and dL/dA = s dL/dW' B^T (flattened [in, out]), the full-weight
  gradient taken on the merged model with no adapter at all."""
  _, cfg, params = _converted(tmp_path)
  lcfg = lora.LoraConfig(targets=("q", "o", "gate", "down"), rank=3, alpha=6.0)
  lcfg_cfg = lora.model_config(cfg, lcfg)
  adapter = _random_adapter(cfg, lcfg, seed=5)
  tokens, mask = padded_batch(seed=3)

  def loss(logits):
    return jnp.sum(jnp.where(mask[..., None], jax.nn.log_softmax(logits) * 0.01, 0.0) ** 2)
  g_adapter = jax.grad(lambda a: loss(decoder.forward(lcfg_cfg, lora.attach(params, a), tokens,
                                                      decoder.positions_from_mask(mask), mask)[0]))(adapter)
  merged = lora.merged(lcfg_cfg, lora.attach(params, adapter), "float32")
  g_full = jax.grad(lambda p: loss(decoder.forward(cfg, p, tokens, decoder.positions_from_mask(mask), mask)[0]))(
      merged)
  for t in lcfg.targets:
    name = lora.TARGETS[t]
    a, b = (np.asarray(adapter["layers"][name + s]) for s in ("_lora_a", "_lora_b"))
    L, r = a.shape[0], a.shape[-1]
    g_W = np.asarray(g_full["layers"][name]).reshape(L, a.reshape(L, -1, r).shape[1], -1)
    want_b = lcfg.scale * np.einsum("LIr,LIO->LrO", a.reshape(L, -1, r), g_W)
    want_a = lcfg.scale * np.einsum("LIO,LrO->LIr", g_W, b.reshape(L, r, -1))
    np.testing.assert_allclose(np.asarray(g_adapter["layers"][name + "_lora_b"]).reshape(want_b.shape), want_b,
                               atol=1e-6, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(g_adapter["layers"][name + "_lora_a"]).reshape(want_a.shape), want_a,
                               atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("arch,tied", CASES, ids=IDS)
def test_peft_loads_our_adapter_folder_onto_the_hf_model_with_our_logits(tmp_path, arch, tied):
  peft = pytest.importorskip("peft")
  ref, cfg, params = _converted(tmp_path, arch, tied)
  lcfg = lora.LoraConfig(targets=("q", "k", "v", "o", "gate", "up", "down"), rank=4, alpha=12.0)
  lcfg_cfg = lora.model_config(cfg, lcfg)
  adapter = _random_adapter(cfg, lcfg, seed=7)
  hf.save_peft_adapter(lora.peft_tensors(cfg, adapter), str(tmp_path / "peft"), rank=lcfg.rank, alpha=lcfg.alpha,
                       base_model=str(tmp_path / "hf"))
  with_peft = peft.PeftModel.from_pretrained(ref, str(tmp_path / "peft")).eval()
  tokens, mask = padded_batch(seed=0)
  ours = _logits(lcfg_cfg, lora.attach(params, adapter), tokens, mask)
  np.testing.assert_allclose(hf_logits(with_peft, tokens, mask)[mask], ours[mask], atol=1e-4, rtol=1e-4)
  assert np.abs(ours - _logits(cfg, params, tokens, mask))[mask].max() > 1e-2  # PEFT applied a real adapter


def test_bad_lora_settings_are_refused_naming_the_field():
  with pytest.raises(ValueError, match="model.lora.targets"):
    lora.LoraConfig(targets=("q", "qkv"))
  with pytest.raises(ValueError, match="model.lora.rank"):
    lora.LoraConfig(rank=0)
  with pytest.raises(ValueError, match="model.lora.alpha"):
    lora.LoraConfig(alpha=0.0)
  assert lora.parse_targets("all-linear") == lora.ALL_LINEAR
  assert lora.parse_targets("q, v") == ("q", "v")
