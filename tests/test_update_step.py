"""The jitted A*-PO update step: loss value, micro-batch accumulation, masking, non-finite guard."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from astarpo_jax.model import decoder
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.training import scoring, update
from tests import method_steps as MS

CFG = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)
P, R = 6, 5


def _batch(seed=0, B=4):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, CFG.vocab_size, (B, P + R)).astype(np.int32)
  prompt_lens = np.array([6, 4, 2, 5][:B])
  resp_lens = np.array([5, 3, 1, 4][:B])
  mask = np.zeros((B, P + R), bool)
  resp_mask = np.zeros((B, R), bool)
  for i in range(B):
    mask[i, P - prompt_lens[i]:P + resp_lens[i]] = True
    resp_mask[i, :resp_lens[i]] = True
  return {"tokens": tokens, "mask": mask, "resp_mask": resp_mask,
          "ref_logp": rng.normal(-3.0, 0.5, (B, R)).astype(np.float32),
          "rewards": np.array([1, 0, 1, 0][:B], np.float32), "vstar": np.array([0.5, 0.2, 0.9, 0.0][:B], np.float32)}


def _fresh(params, opt):
  """A new state on copies of `params` (the step donates its input state)."""
  return MS.init_state(jax.tree.map(jnp.copy, params), opt)


def _hand_loss(params, b, beta2, ent_coef):
  """The loss from full-forward logits, in numpy: (beta2*sum log-ratio - (r - V*))^2 mean - c*entropy."""
  logp, ent = MS.full_forward_logp_entropy(CFG, params, b, P)
  m = b["resp_mask"]
  ratio = ((logp - b["ref_logp"]) * m).sum(-1)
  reg = np.mean((beta2 * ratio - (b["rewards"] - b["vstar"])) ** 2)
  return reg - ent_coef * np.mean((ent * m).sum(-1) / m.sum(-1))  # the official per-response token mean


def test_step_loss_equals_hand_computation_from_full_forward():
  _, params = decoder.init_params(CFG, seed=1)
  settings = dict(beta2=0.05, entropy_coef=0.01, logp_chunk=2)
  opt = update.make_optimizer(lr=1e-3)
  b = _batch()
  _, metrics = MS.astarpo_step(CFG, opt, P, **settings)(_fresh(params, opt),
                                                               update.split_microbatches(b, 4))
  np.testing.assert_allclose(float(metrics["loss"]), _hand_loss(params, b, 0.05, 0.01), rtol=1e-4)


def test_microbatch_accumulation_equals_full_batch_update():
  _, params = decoder.init_params(CFG, seed=2)
  settings = dict(beta2=0.05, entropy_coef=0.01)
  # Plain SGD at lr 1, so each param's change IS its accumulated gradient. (AdamW divides by |g|,
  # which turns float rounding in a near-zero gradient into a visible difference of the update.)
  opt = optax.sgd(1.0)
  b = _batch()
  step = MS.astarpo_step(CFG, opt, P, **settings)
  s1, m1 = step(_fresh(params, opt), update.split_microbatches(b, 4))
  s2, m2 = step(_fresh(params, opt), update.split_microbatches(b, 1))
  np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-5)
  np.testing.assert_allclose(float(m1["grad_norm"]), float(m2["grad_norm"]), rtol=1e-4)
  g1 = jax.tree.map(jnp.subtract, params, s1["params"])
  g2 = jax.tree.map(jnp.subtract, params, s2["params"])
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g2))
  assert scale > 1e-4  # the step moved the params
  jax.tree.map(lambda a, c: np.testing.assert_allclose(a, c, atol=1e-5 * scale), g1, g2)
  assert int(s1["step"]) == 1


@pytest.mark.parametrize("tied", [True, False], ids=["tied-embeddings", "untied"])
def test_step_gradient_equals_autodiff_of_the_full_forward_loss(tied):
  # The step's custom pieces (chunked log-prob head, hand-written MLP backward, blocked attention,
  # the tied embedding's separately accumulated [D, V] gradient) against jax.grad of the plain loss.
  cfg = dataclasses.replace(CFG, tie_embeddings=tied, attention_block=4)
  _, params = decoder.init_params(cfg, seed=4)
  settings = dict(beta2=0.05, entropy_coef=0.01, logp_chunk=2)
  b = _batch()
  m = jnp.asarray(b["resp_mask"], jnp.float32)

  def plain_loss(p):
    mask = jnp.asarray(b["mask"])
    logits, _ = decoder.forward(dataclasses.replace(cfg, attention_block=0), p, jnp.asarray(b["tokens"]),
                                decoder.positions_from_mask(mask), mask)
    logp_all = jax.nn.log_softmax(logits[:, P - 1:-1])
    logp = jnp.take_along_axis(logp_all, jnp.asarray(b["tokens"])[:, P:, None], -1)[..., 0]
    ent = -(jnp.exp(logp_all) * logp_all).sum(-1)
    ratio = ((logp - b["ref_logp"]) * m).sum(-1)
    reg = jnp.mean((0.05 * ratio - (b["rewards"] - b["vstar"])) ** 2)
    return reg - 0.01 * jnp.mean((ent * m).sum(-1) / m.sum(-1))

  want = jax.grad(plain_loss)(params)
  opt = optax.sgd(1e3)  # a step far larger than the params, so (params - new) / 1e3 keeps the gradient's digits
  s, _ = MS.astarpo_step(cfg, opt, P, **settings)(_fresh(params, opt), update.split_microbatches(b, 2))
  got = jax.tree.map(lambda a, c: (a - c) / 1e3, params, s["params"])
  assert set(got) == set(want) and ("lm_head" in got) == (not tied)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, atol=1e-6 * float(jnp.abs(w).max()) + 1e-9, rtol=1e-4)


def test_padding_and_post_eos_tokens_do_not_change_the_update():
  _, params = decoder.init_params(CFG, seed=3)
  settings = dict(beta2=0.05, entropy_coef=0.01)
  opt = update.make_optimizer(lr=1e-2)
  b = _batch()
  b2 = {k: v.copy() for k, v in b.items()}
  rng = np.random.default_rng(9)
  junk = rng.integers(1, CFG.vocab_size, b["tokens"].shape)
  b2["tokens"] = np.where(b["mask"], b["tokens"], junk).astype(np.int32)  # pads and post-EOS changed
  b2["ref_logp"] = np.where(b["resp_mask"], b["ref_logp"], 123.0).astype(np.float32)
  step = MS.astarpo_step(CFG, opt, P, **settings)
  s1, _ = step(_fresh(params, opt), update.split_microbatches(b, 2))
  s2, _ = step(_fresh(params, opt), update.split_microbatches(b2, 2))
  jax.tree.map(lambda a, c: np.testing.assert_allclose(a, c, atol=1e-5), s1["params"], s2["params"])


def test_non_finite_loss_leaves_state_untouched_and_is_reported():
  _, params = decoder.init_params(CFG, seed=4)
  opt = update.make_optimizer(lr=1e-2)
  b = _batch()
  b["rewards"][1] = np.nan
  state = _fresh(params, opt)
  before = jax.tree.map(np.asarray, state)
  new, metrics = MS.astarpo_step(CFG, opt, P)(state, update.split_microbatches(b, 2))
  assert not bool(metrics["finite"])
  assert int(new["step"]) == 0
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, new["params"]), before["params"])


def test_reference_logprobs_match_full_forward():
  _, params = decoder.init_params(CFG, seed=5)
  b = _batch()
  got = scoring.logprobs(CFG, params, jnp.asarray(b["tokens"]), jnp.asarray(b["mask"]), prompt_len=P, chunk=3)
  mask = jnp.asarray(b["mask"])
  logits, _ = decoder.forward(CFG, params, jnp.asarray(b["tokens"]), decoder.positions_from_mask(mask), mask)
  want = jnp.take_along_axis(jax.nn.log_softmax(logits[:, P - 1:-1]), jnp.asarray(b["tokens"])[:, P:, None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(got)[b["resp_mask"]], np.asarray(want)[b["resp_mask"]], atol=1e-5)


def test_optimizer_defaults_are_the_papers():
  opt = update.make_optimizer()
  params = {"w": jnp.ones((3,))}
  state = opt.init(params)
  grads = {"w": jnp.array([100.0, 0.0, 0.0])}  # clipped to norm 1 first
  updates, _ = opt.update(grads, state, params)
  # Adam's first step is lr * sign(g) (for g != 0) plus decoupled weight decay lr * wd * w.
  np.testing.assert_allclose(np.asarray(updates["w"]), -1e-6 * np.array([1.0, 0.0, 0.0]) - 1e-6 * 0.01, rtol=1e-3)
  assert isinstance(opt, optax.GradientTransformation)
