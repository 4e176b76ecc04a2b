"""RLOO (methods/rloo.py): leave-one-out advantages by hand, its step against the loss from full-forward
log-probs, micro-batch accumulation, and the reward rising on the tiny task of tests/test_baselines.py."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from astarpo_jax.methods import rloo
from astarpo_jax.model import decoder
from astarpo_jax.training import loop, update
from tests import method_steps as MS
from tests.test_baselines import CFG, OPT, PROMPTS, SCFG, TOK, P, _batch, _full_forward, _metrics, _starts_low_digit

METHOD = MS.method("rloo", group_size=4, kl_coef=0.1, entropy_coef=0.01, logp_chunk=2)


def _rloo_batch(seed=0):
  b = _batch(seed)
  return {k: b[k] for k in ("tokens", "mask", "resp_mask", "old_logp", "rewards", "adv")}


def test_leave_one_out_advantage_is_the_reward_minus_the_others_mean():
  r = np.array([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
  # prompt 0: 1 − (0 + 0 + 1)/3 = 2/3 for the correct ones, 0 − (1 + 0 + 1)/3 = −2/3 for the others
  np.testing.assert_allclose(rloo.leave_one_out_advantages(r), [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0, 0, 0, 0]])
  assert rloo.Config(group_size=0).group_size == 4


def test_step_loss_equals_the_clipped_sequence_loss_on_full_forward_logprobs():
  _, params = decoder.init_params(CFG, seed=1)
  b = _rloo_batch()
  _, m = MS.jit_step(CFG, METHOD, OPT, P)(MS.init_state(jax.tree.map(jnp.copy, params), OPT),
                                          update.split_microbatches(b, 8))
  logp, ent = _full_forward(params, b)
  mask = b["resp_mask"]
  ratio = np.exp(np.where(mask, logp - b["old_logp"], 0.0).sum(-1))
  adv = b["adv"].astype(np.float64)
  pg = np.maximum(-ratio * adv, -np.clip(ratio, 0.8, 1.2) * adv).mean()
  want = pg - 0.01 * (ent * mask).sum() / mask.sum()
  np.testing.assert_allclose(float(m["loss"]), want, rtol=1e-4)


def test_microbatch_accumulation_equals_the_full_batch_gradient():
  _, params = decoder.init_params(CFG, seed=2)
  b = _rloo_batch(seed=2)
  sgd = optax.sgd(1.0)  # the change of each param IS its accumulated gradient
  step = MS.jit_step(CFG, METHOD, sgd, P)
  s1, _ = step(MS.init_state(jax.tree.map(jnp.copy, params), sgd), update.split_microbatches(b, 16))
  s2, _ = step(MS.init_state(jax.tree.map(jnp.copy, params), sgd), update.split_microbatches(b, 4))
  g1, g2 = (jax.tree.map(jnp.subtract, params, s["params"]) for s in (s1, s2))
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g2))
  assert scale > 1e-4
  jax.tree.map(lambda a, c: np.testing.assert_allclose(a, c, atol=1e-5 * scale), g1, g2)


def test_loop_raises_the_reward_on_a_tiny_task(tmp_path):
  _, p = decoder.init_params(CFG, seed=0)
  settings = loop.LoopSettings(num_steps=10, rollout_batch=8, mini_batch=4, micro_batch=2, checkpoint_every=4)
  ctx = loop.RunContext(CFG, p, TOK, _starts_low_digit, SCFG)
  loop.run(METHOD, p, PROMPTS, ctx, settings, update.Optimizers(OPT), loop.RunIO(str(tmp_path), log=lambda s: None))
  r = [m["train/reward_mean"] for m in _metrics(tmp_path)]
  assert len(r) == 10 and np.mean(r[-3:]) > np.mean(r[:3]) + 0.2, r
  assert all("train/seq_kl" in m and "train/no_signal_frac" in m for m in _metrics(tmp_path))


def test_config_validates_and_the_memory_plan_counts_its_k_responses():
  import importlib

  from astarpo_jax import experiment, run_config
  from astarpo_jax.aot import memory_plan as mp
  c = importlib.import_module("configs.rloo_qwen1p5b").get_config("math")
  run_config.validate_config(c)
  method = run_config.build_method(c)
  assert (method.name, method.responses_per_prompt()) == ("rloo", 4)
  cfg = experiment.model_config(c)
  shape = dict(prompt_len=256, response_len=1024, rollout_batch=256, micro_batch=8, logp_chunk=256)
  rloo_plan = mp.plan_memory(cfg, mp.RunShape(**shape, sample_batch=1024, rows_per_prompt=4), (1, -1, 1),
                             num_devices=8, method=method)
  astarpo_plan = mp.plan_memory(cfg, mp.RunShape(**shape, sample_batch=256), (1, -1, 1), num_devices=8)
  assert rloo_plan.phases["sample"].parts["kv_cache"] == 4 * astarpo_plan.phases["sample"].parts["kv_cache"]
  assert rloo_plan.resident == astarpo_plan.resident  # no critic
