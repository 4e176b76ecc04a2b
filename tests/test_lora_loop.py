"""LoRA through the update and the loop: the adapter alone is trained and checkpointed, π_ref is the base read
from the same arrays, every method runs with it, and a killed LoRA run resumes bit-identically."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from astarpo_jax import methods
from astarpo_jax.infra import checkpoint as ckpt_lib
from astarpo_jax.model import decoder, lora
from astarpo_jax.stage1 import value_table as vt
from astarpo_jax.training import loop, update
from tests import method_steps as MS
from tests.test_loop import CFG, LOOP, PROMPTS, SCFG, TOK, Killed, _grade  # the loop tests' model, data and grader

LCFG = lora.LoraConfig(rank=4, alpha=8.0)
POLICY_CFG = lora.model_config(CFG, LCFG)


def _base():
  return decoder.init_params(CFG, seed=0)[1]


def _run(workdir, grade, algo="astarpo", settings=LOOP, base=None, **algo_settings):
  base = _base() if base is None else base
  table = vt.ValueTable({p.uid: {"vstar": 0.3} for p in PROMPTS}, list(PROMPTS), "", {})
  ctx = loop.RunContext(POLICY_CFG, base, TOK, grade, SCFG, value_table=table, lora=LCFG)
  method = methods.get(algo, {"beta2": 0.1, **algo_settings})
  critic = update.make_optimizer(lr=1e-3) if method.footprint().critic else None
  result = loop.run(method, lora.init_adapter(CFG, LCFG, seed=1), PROMPTS, ctx, settings,
                    update.Optimizers(update.make_optimizer(lr=1e-2), critic), loop.RunIO(str(workdir), log=lambda s: None))
  return result.params, ctx


def test_only_the_adapter_has_gradients_and_optimizer_state_and_the_base_is_untouched():
  base = _base()
  state = MS.init_state(lora.attach(base, lora.init_adapter(CFG, LCFG, seed=1)), update.make_optimizer(lr=1e-2))
  adapter_shapes = {n: w.shape for n, w in state["params"]["layers"].items()}
  assert set(state["params"]) == {"layers"} and all(lora.is_adapter_leaf(n) for n in adapter_shapes)
  assert len(adapter_shapes) == 2 * len(lora.ALL_LINEAR)
  moments = [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim > 0]  # AdamW's mu and nu
  assert sorted(x.shape for x in moments) == sorted(list(adapter_shapes.values()) * 2)
  before = jax.tree.map(np.array, base)
  rng = np.random.default_rng(0)
  P, R = 6, 5
  tokens = rng.integers(3, CFG.vocab_size, (1, 4, P + R)).astype(np.int32)
  batch = {"tokens": tokens, "mask": np.ones_like(tokens, bool), "resp_mask": np.ones((1, 4, R), bool),
           "rewards": np.array([[1.0, 0.0, 1.0, 0.0]], np.float32), "ref_logp": np.full((1, 4, R), -3.0, np.float32),
           "vstar": np.full((1, 4), 0.4, np.float32)}
  step = update.jit_update_step(POLICY_CFG, lambda p, u, c, mb, n: methods.get("astarpo", {"beta2": 0.1}).loss(
      POLICY_CFG, P, p, u, c, mb, n), update.Optimizers(update.make_optimizer(lr=1e-2)), lora_base=True)
  old_b = np.array(state["params"]["layers"]["wq_lora_b"])
  new, metrics = step(state, batch, base)
  assert bool(metrics["finite"]) and float(metrics["grad_norm"]) > 0
  assert set(new["params"]["layers"]) == set(adapter_shapes)
  assert not np.array_equal(np.asarray(new["params"]["layers"]["wq_lora_b"]), old_b)  # B moved off 0
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, base), before)  # base neither donated nor changed


def test_pi_ref_log_probs_are_the_base_models_from_the_same_arrays(tmp_path):
  """After training, the A*-PO reference forward still scores the base model: log-probs equal a float64 full
  forward of a plain model (no LoRA config) on the base params, and differ from the trained policy's."""
  base = _base()
  policy, ctx = _run(tmp_path, _grade(), settings=loop.LoopSettings(num_steps=2, rollout_batch=8, mini_batch=4,
                                                                     micro_batch=4, checkpoint_every=2), base=base)
  assert ctx.ref_params is base and all(policy[k] is base[k] for k in base if k != "layers")
  assert all(policy["layers"][n] is w for n, w in base["layers"].items())  # no second copy of the weights
  rng = np.random.default_rng(1)
  P, R = 6, 5
  tokens = rng.integers(3, CFG.vocab_size, (4, P + R)).astype(np.int32)
  mask = np.ones_like(tokens, bool)
  from astarpo_jax.training import scoring
  ref = scoring.logprobs_in_blocks(ctx.cfg, ctx.ref_params, tokens, mask, P, rows=4)
  want, _ = MS.full_forward_logp_entropy(CFG, base, {"tokens": tokens, "mask": mask}, P)
  np.testing.assert_allclose(ref, want, atol=1e-5)
  trained = scoring.logprobs_in_blocks(ctx.cfg, ctx.policy(lora.split(policy)[1]), tokens, mask, P, rows=4)
  assert np.abs(trained - ref).max() > 1e-3  # the adapter trained; π_ref did not move


@pytest.mark.parametrize("algo", methods.names())
def test_every_method_runs_a_few_steps_with_lora(algo, tmp_path):
  G = methods.get(algo, {}).responses_per_prompt()
  settings = loop.LoopSettings(num_steps=2, rollout_batch=8, mini_batch=4, micro_batch=2 if G > 1 else 4,
                               checkpoint_every=2)
  base = _base()
  before = jax.tree.map(np.array, base)
  policy, _ = _run(tmp_path, _grade(), algo, settings, base=base)
  lines = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [m["step"] for m in lines] == [1, 2] and all(np.isfinite(m["train/loss"]) for m in lines)
  adapter = lora.split(policy)[1]["layers"]
  assert any(np.abs(np.asarray(w)).max() > 0 for n, w in adapter.items() if n.endswith("_lora_b"))
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, base), before)
  saved = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"))
  assert saved.latest_step() == 2


def test_killed_lora_run_resumed_is_bit_identical(tmp_path):
  straight, _ = _run(tmp_path / "a", _grade())
  with pytest.raises(Killed):
    _run(tmp_path / "b", _grade(kill_on_call=4))  # dies in rollout 4, after the checkpoint of rollout 2
  resumed, _ = _run(tmp_path / "b", _grade())
  a, b = lora.split(straight)[1], lora.split(resumed)[1]
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
  assert any(np.abs(np.asarray(w)).max() > 0 for n, w in a["layers"].items() if n.endswith("_lora_b"))
  # The checkpoint holds the adapter and its optimizer state, not the base.
  ckpt = ckpt_lib.Checkpointer(str(tmp_path / "b" / "checkpoints"))
  like = update.init_train_state(a, update.Optimizers(update.make_optimizer(lr=1e-2)))
  restored, _ = ckpt_lib.restore_train_state(ckpt, like)
  assert set(restored["params"]["layers"]) == set(a["layers"])
  saved_bytes = sum(x.nbytes for x in jax.tree.leaves(restored))
  assert saved_bytes < sum(x.nbytes for x in jax.tree.leaves(_base()))  # the base (larger) is not in it
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), restored["params"], a)


def test_sampling_uses_the_merged_adapter():
  base = _base()
  adapter = lora.init_adapter(CFG, LCFG, seed=2)
  adapter = {"layers": {n: (w + 0.1 if n.endswith("_lora_b") else w) for n, w in adapter["layers"].items()}}
  ctx = loop.RunContext(POLICY_CFG, base, TOK, None, SCFG, lora=LCFG)
  merged = ctx.sampling_params(adapter)
  assert not lora.has_adapter(merged) and merged["layers"]["wq"].dtype == jnp.dtype(CFG.dtype)
  tokens = np.arange(3, 13, dtype=np.int32)[None]
  mask = np.ones_like(tokens, bool)
  pos = decoder.positions_from_mask(mask)
  np.testing.assert_allclose(decoder.forward(CFG, merged, tokens, pos, mask)[0],
                             decoder.forward(POLICY_CFG, ctx.policy(adapter), tokens, pos, mask)[0], atol=1e-5)
