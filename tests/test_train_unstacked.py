"""The GPU's training forward (layers unstacked once per call, a Python loop with remat per layer) computes what the
layer scan computes, and its backward neither slices nor updates the [L, ...] stack inside a loop; the LM head of a
chunked scoring head is gathered once per call, not once per chunk (TPU compile-only, libtpu)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from astarpo_jax.model import decoder, kernels, layer_forms
from astarpo_jax.model.config import ModelConfig
from tests.test_aot import needs_libtpu

CFG = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_layers=5, num_heads=4, num_kv_heads=2,
                  head_dim=4, remat=True, attention_block=4)


def _batch(packed: bool):
  tokens_BT = jax.random.randint(jax.random.key(1), (2, 9), 0, CFG.vocab_size)
  mask_BT = jnp.ones((2, 9), bool).at[0, :2].set(False)
  if not packed:
    return tokens_BT, decoder.positions_from_mask(mask_BT), mask_BT, None
  segments_BT = jnp.array([[1, 1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1]])
  positions_BT = jnp.array([[0, 1, 2, 3, 0, 1, 2, 3, 0], list(range(9))])
  return tokens_BT, positions_BT, segments_BT > 0, segments_BT


def _loss_and_grads(params, form: str, packed: bool):
  """A training loss of the shape every method has: masked mean log-prob of the next token plus the entropy."""
  tokens_BT, positions_BT, mask_BT, segments_BT = _batch(packed)

  def loss(p):
    h_BTD, _ = decoder.hidden_states(CFG, p, tokens_BT, positions_BT, mask_BT, segments_BT=segments_BT,
                                     layer_form=form)
    logits_BTV = decoder.logits_from_hidden(CFG, p, h_BTD)[:, :-1]
    logp_BT = kernels.token_logprobs(logits_BTV, tokens_BT[:, 1:])
    ent_BT = kernels.token_entropy(logits_BTV)
    w_BT = mask_BT[:, 1:].astype(jnp.float32)
    return ((logp_BT + 0.01 * ent_BT) * w_BT).sum() / w_BT.sum(), logits_BTV
  (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return value, logits, grads


@pytest.mark.parametrize("packed", [False, True])
def test_unstacked_training_forward_gives_the_scans_logits_loss_and_gradients(packed):
  _, params = decoder.init_params(CFG, 0)
  v_scan, logits_scan, g_scan = _loss_and_grads(params, "scan", packed)
  v_loop, logits_loop, g_loop = _loss_and_grads(params, "unstacked", packed)
  np.testing.assert_allclose(logits_loop, logits_scan, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(v_loop, v_scan, rtol=1e-6)
  assert jax.tree.structure(g_loop) == jax.tree.structure(g_scan)  # stacked [L, ...] gradients, as the params
  for path, a, b in zip(jax.tree.leaves_with_path(g_loop), jax.tree.leaves(g_loop), jax.tree.leaves(g_scan)):
    assert a.shape == b.shape, path
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(jnp.abs(b).max()) + 1e-7, err_msg=str(path[0]))


def test_auto_form_unstacks_only_for_gpus():
  assert layer_forms.train_layer_form("auto", "gpu") == layer_forms.train_layer_form("auto", "cuda") == "unstacked"
  assert layer_forms.train_layer_form("auto", "tpu") == layer_forms.train_layer_form("auto", "cpu") == "scan"
  assert layer_forms.train_layer_form("scan", "gpu") == "scan"  # a given form is kept
  with jax.set_mesh(jax.make_mesh((1,), ("data",))):  # the mesh's platform is what the code is traced for
    assert layer_forms.target_platform() == "cpu" and layer_forms.train_layer_form() == "scan"
  with pytest.raises(ValueError, match="layer_form='loop'"):
    layer_forms.train_layer_form("loop")


def _loop_ops(form: str) -> list[str]:
  """Opcodes inside while loops of the CPU-compiled gradient of the training loss, that touch an [L, ...] array."""
  _, params = decoder.init_params(CFG, 0)
  tokens_BT, positions_BT, mask_BT, _ = _batch(False)

  def loss(p):
    h_BTD, _ = decoder.hidden_states(CFG, p, tokens_BT, positions_BT, mask_BT, layer_form=form)
    return h_BTD.sum()
  from astarpo_jax.aot import hlo_text
  comps, _ = hlo_text.parse_module(jax.jit(jax.grad(loss)).lower(params).compile().as_text())
  bodies = {b for comp in comps.values() for ins in comp.instrs if ins.opcode == "while" for b in ins.called("body")}
  stack = f"[{CFG.num_layers},"  # no other array here has a leading 5
  return [ins.opcode for b in bodies for ins in comps[b].instrs if ins.opcode not in ("parameter", "tuple")
          and (stack in ins.shape or any(stack in comps[b].by_name[o].shape for o in ins.operands
                                         if o in comps[b].by_name))]


def test_unstacked_backward_moves_no_layer_stack_inside_a_loop():
  """The scan's forward slices its [L, ...] weights per trip and its backward writes each layer's gradient into the
  stack per trip; the unstacked form slices once per call and stacks the gradients once, outside any loop."""
  assert _loop_ops("scan")  # the check can fail: the scan does it
  assert _loop_ops("unstacked") == []


@needs_libtpu
def test_gathered_unembed_is_all_gathered_once_per_call_not_per_chunk():
  """FSDP over 4 chips (v5e:2x2 compile-only): the chunked scoring head over 4 position chunks all-gathers the
  [D, V] LM head in every chunk when it is taken as stored, once (3/4 x D x V x 2 bytes) when gathered first."""
  import dataclasses

  from astarpo_jax.aot import chips, hlo_cost, layouts
  from astarpo_jax.infra import sharding
  cfg = dataclasses.replace(CFG, tie_embeddings=False, dtype="bfloat16", param_dtype="bfloat16", hidden_size=256,
                            vocab_size=1024)
  mesh = layouts.abstract_mesh_devices(chips.topology_devices("v5e:2x2"), (1, 4, 1))
  params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        decoder.abstract_params(cfg)[1], decoder.param_shardings(cfg, mesh))
  B, R, chunks = 4, 32, 4
  rows = jax.sharding.NamedSharding(mesh, sharding.logical_to_spec(("batch", None, None), (B, R, 256)))
  h_BRD = jax.ShapeDtypeStruct((B, R, 256), jnp.bfloat16, sharding=rows)
  tgt_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*rows.spec[:2]))
  tgt_BR = jax.ShapeDtypeStruct((B, R), jnp.int32, sharding=tgt_sharding)

  def gathered_bytes(unembed):
    fn = jax.jit(lambda p, h, t: kernels.vocab_chunked_logprobs(h, unembed(cfg, p), t, chunk=R // chunks,
                                                                vocab_chunk=256))
    with jax.set_mesh(mesh):
      text = fn.lower(params, h_BRD, tgt_BR).compile().as_text()
    cost, _ = hlo_cost.analyze(text)
    return cost.collectives.get("all-gather", 0) + cost.collectives.get("collective-permute", 0)
  head_bytes = 3 / 4 * 256 * 1024 * 2
  assert gathered_bytes(decoder.gathered_unembed) == pytest.approx(head_bytes, rel=0.05)
  assert gathered_bytes(decoder.unembed_matrix) >= chunks * head_bytes * 0.95


def test_stack_layers_undoes_unstack_layers():
  _, params = decoder.init_params(CFG, 0)
  back = decoder.stack_layers(decoder.unstack_layers(params))
  assert jax.tree.structure(back) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
