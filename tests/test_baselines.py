"""GRPO / PPO / REBEL train steps and loop: losses against full-forward log-probs, masking, micro-batching,
the non-finite guard, PPO's targets against a closed form, and reward going up on a tiny task."""
import dataclasses
import importlib
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from astarpo_jax import run_config
from astarpo_jax.data import dataset, synthetic
from astarpo_jax.methods import ppo as ppo_method
from astarpo_jax.model import decoder
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.sampling.rollout import Graded
from astarpo_jax.sampling.token_choice import SamplingConfig
from astarpo_jax.training import baseline_losses as BL, loop, update
from tests import method_steps as MS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One tiny model, batch shape, config and pair of optimizer objects for the step tests and the loop
# tests alike: each method's step then compiles once per micro-batch shape in this file.
TOK = synthetic.build_tokenizer()
CFG = ModelConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=64)
P, R = 16, 6  # the loop's prompt bucket and its response length (max_new_tokens)
ALGOS = ("grpo", "ppo", "rebel")
OPT, VOPT = update.make_optimizer(lr=1e-2), update.make_optimizer(lr=1e-2)
SETTINGS = dict(kl_coef=0.1, entropy_coef=0.01, logp_chunk=2, loss_agg="seq_mean_token_mean")
METHOD = {a: MS.method(a, **SETTINGS, group_size=4 if a == "grpo" else 0) for a in ALGOS}


def _batch(seed=0, B=16):
  """B rows of left-padded prompts and responses of random lengths (each at least one token)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, CFG.vocab_size, (B, P + R)).astype(np.int32)
  prompt_lens, resp_lens = rng.integers(2, P + 1, B), rng.integers(1, R + 1, B)
  mask = np.zeros((B, P + R), bool)
  resp_mask = np.zeros((B, R), bool)
  for i in range(B):
    mask[i, P - prompt_lens[i]:P + resp_lens[i]] = True
    resp_mask[i, :resp_lens[i]] = True
  f = lambda *a: rng.normal(*a).astype(np.float32)  # noqa: E731
  return {"tokens": tokens, "mask": mask, "resp_mask": resp_mask, "old_logp": f(-3.0, 0.3, (B, R)),
          "ref_logp": f(-3.0, 0.5, (B, R)), "rewards": rng.integers(0, 2, B).astype(np.float32),
          "adv": f(0.0, 1.0, (B,)),  # GRPO's per-sequence advantages; PPO's per-token ones come from `_for`
          "old_values": f(0.3, 0.2, (B, R)), "returns": f(0.5, 0.5, (B, R))}


def _for(algo, b):
  """The keys a method's step reads (PPO's advantages are per token)."""
  keys = {"grpo": ("tokens", "mask", "resp_mask", "old_logp", "ref_logp", "rewards", "adv"),
          "ppo": ("tokens", "mask", "resp_mask", "old_logp", "ref_logp", "rewards", "adv", "old_values", "returns"),
          "rebel": ("tokens", "mask", "resp_mask", "old_logp", "rewards")}[algo]
  out = {k: b[k] for k in keys}
  if algo == "ppo":
    out["adv"] = (b["returns"] - b["old_values"]).astype(np.float32)
  return out


def _step(algo):
  return MS.jit_step(CFG, METHOD[algo], OPT, P, VOPT if algo == "ppo" else None)


def _state(algo, params, seed=0):
  """A fresh state on copies of `params` (the step donates its input state)."""
  own = jax.tree.map(jnp.copy, params)
  if algo == "ppo":
    return MS.init_state(own, OPT, ppo_method.init_critic(CFG, params, seed), VOPT)
  return MS.init_state(own, OPT)


def _full_forward(params, b):
  """log pi and entropy of the response tokens from full-forward logits, in float64 numpy."""
  return MS.full_forward_logp_entropy(CFG, params, b, P)


def _critic_values(value_params, b):
  """V from the critic's hidden states and head, in numpy (hidden state at P+t-1 for token t)."""
  mask = jnp.asarray(b["mask"])
  h, _ = decoder.hidden_states(CFG, value_params["body"], jnp.asarray(b["tokens"]), decoder.positions_from_mask(mask), mask)
  h = np.asarray(h, np.float64)[:, P - 1:-1]
  return h @ np.asarray(value_params["head"]["w"], np.float64) + float(value_params["head"]["b"])


@pytest.fixture(scope="module")
def params():
  return decoder.init_params(CFG, seed=1)[1]


@pytest.mark.parametrize("algo", ALGOS)
def test_step_loss_equals_baseline_losses_on_full_forward_logprobs(algo, params):
  b = _for(algo, _batch())
  state = _state(algo, params)
  value_params = jax.tree.map(np.asarray, state.get("value_params"))
  _, m = _step(algo)(state, update.split_microbatches(b, 8))
  logp, ent = _full_forward(params, b)
  j = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  if algo == "grpo":
    want, _ = BL.grpo_loss(j(logp), j(b["old_logp"]), j(b["ref_logp"]), j(b["resp_mask"]), j(b["adv"]), j(ent),
                           clip_eps=0.2, kl_coef=0.1, entropy_coef=0.01, loss_agg="seq_mean_token_mean")
  elif algo == "ppo":
    want, _ = BL.ppo_policy_loss(j(logp), j(b["old_logp"]), j(b["resp_mask"]), j(b["adv"]), j(ent), entropy_coef=0.01)
    want_v, _ = BL.ppo_value_loss(j(_critic_values(value_params, b)), j(b["old_values"]), j(b["returns"]),
                                  j(b["resp_mask"]), value_clip=0.5)
    np.testing.assert_allclose(float(m["value_loss"]), float(want_v), rtol=1e-4)
  else:
    pair = lambda x: j(x).reshape(-1, 2, *np.shape(x)[1:])  # noqa: E731
    rebel, _ = BL.rebel_loss(pair(logp), pair(b["old_logp"]), pair(b["resp_mask"]), pair(b["rewards"]), eta=1.0)
    want = rebel - 0.01 * (ent * b["resp_mask"]).sum() / b["resp_mask"].sum()
  np.testing.assert_allclose(float(m["loss"]), float(want), rtol=1e-4)
  assert bool(m["finite"])


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_step_gradients_equal_autodiff_of_the_plain_losses(algo, params):
  # update.accumulate_gradients (tied unembedding accumulated in [D, V], PPO's critic as `extra`) and the
  # model's custom pieces, against jax.grad of the method's loss on full-forward log-probs.
  b = _for(algo, _batch(seed=4))
  j = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  mask, tokens = jnp.asarray(b["mask"]), jnp.asarray(b["tokens"])

  def logp_ent(p):
    logits, _ = decoder.forward(dataclasses.replace(CFG, attention_block=0), p, tokens, decoder.positions_from_mask(mask),
                                mask)
    lp_all = jax.nn.log_softmax(logits[:, P - 1:-1])
    return (jnp.take_along_axis(lp_all, tokens[:, P:, None], -1)[..., 0], -(jnp.exp(lp_all) * lp_all).sum(-1))

  def policy_loss(p):
    logp, ent = logp_ent(p)
    if algo == "grpo":
      return BL.grpo_loss(logp, j(b["old_logp"]), j(b["ref_logp"]), j(b["resp_mask"]), j(b["adv"]), ent, clip_eps=0.2,
                          kl_coef=0.1, entropy_coef=0.01, loss_agg="seq_mean_token_mean")[0]
    return BL.ppo_policy_loss(logp, j(b["old_logp"]), j(b["resp_mask"]), j(b["adv"]), ent, entropy_coef=0.01)[0]

  sgd = optax.sgd(1e3)  # (old - new) / 1e3 keeps the gradient's digits
  state = _state(algo, params)
  if algo == "ppo":
    state = MS.init_state(state["params"], sgd, state["value_params"], sgd)
  else:
    state = MS.init_state(state["params"], sgd)
  old = jax.tree.map(np.asarray, state)
  new, _ = MS.jit_step(CFG, METHOD[algo], sgd, P, sgd if algo == "ppo" else None)(
      state, update.split_microbatches(b, 8))
  pairs = [(old["params"], new["params"], jax.grad(policy_loss)(params))]
  if algo == "ppo":
    value_loss = lambda vp: BL.ppo_value_loss(  # noqa: E731
        ppo_method.token_values(CFG, vp, tokens, mask, P), j(b["old_values"]), j(b["returns"]), j(b["resp_mask"]),
        value_clip=0.5)[0]
    pairs.append((old["value_params"], new["value_params"], jax.grad(value_loss)(old["value_params"])))
  for before, after, want in pairs:
    got = jax.tree.map(lambda a, c: (a - c) / 1e3, before, after)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, w, atol=1e-6 * float(jnp.abs(w).max()) + 1e-9, rtol=1e-4)


@pytest.mark.parametrize("algo", ["rebel"])  # shared scan code; each method's normalisation is checked above
def test_microbatch_accumulation_equals_full_batch_update(algo, params):
  b = _for(algo, _batch(seed=2))
  # Plain SGD at lr 1, so each param's change IS its accumulated gradient. (AdamW divides by |g|, which
  # turns float rounding in a near-zero gradient into a visible difference of the update.)
  sgd = optax.sgd(1.0)
  step = MS.jit_step(CFG, METHOD[algo], sgd, P)
  s1, m1 = step(MS.init_state(jax.tree.map(jnp.copy, params), sgd), update.split_microbatches(b, 16))
  s2, m2 = step(MS.init_state(jax.tree.map(jnp.copy, params), sgd), update.split_microbatches(b, 8))
  np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-5)
  np.testing.assert_allclose(float(m1["grad_norm"]), float(m2["grad_norm"]), rtol=1e-4)
  g1, g2 = (jax.tree.map(jnp.subtract, params, s["params"]) for s in (s1, s2))
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g2))
  assert scale > 1e-4  # the step moved the params
  jax.tree.map(lambda a, c: np.testing.assert_allclose(a, c, atol=1e-5 * scale), g1, g2)
  assert int(s1["step"]) == 1


@pytest.mark.parametrize("algo", ALGOS)
def test_padding_and_post_eos_entries_do_not_change_the_update(algo, params):
  b = _for(algo, _batch(seed=3))
  b2 = {k: v.copy() for k, v in b.items()}
  rng = np.random.default_rng(9)
  b2["tokens"] = np.where(b["mask"], b["tokens"], rng.integers(1, CFG.vocab_size, b["tokens"].shape)).astype(np.int32)
  for k in ("old_logp", "ref_logp", "old_values", "returns", "adv"):
    if k in b2 and b2[k].ndim == 2:
      b2[k] = np.where(b["resp_mask"], b[k], np.float32(1e4) if k != "adv" else np.nan).astype(np.float32)
  s1, m1 = _step(algo)(_state(algo, params), update.split_microbatches(b, 8))
  s2, m2 = _step(algo)(_state(algo, params), update.split_microbatches(b2, 8))
  assert bool(m2["finite"])
  np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-6)
  jax.tree.map(lambda a, c: np.testing.assert_allclose(a, c, atol=1e-6), s1, s2)


def test_non_finite_ppo_step_leaves_policy_and_critic_untouched(params):
  b = _for("ppo", _batch(seed=4))
  b["returns"][1, 0] = np.nan  # only the critic's loss sees it
  state = _state("ppo", params)
  before = jax.tree.map(np.asarray, state)
  new, m = _step("ppo")(state, update.split_microbatches(b, 8))
  assert not bool(m["finite"])
  assert int(new["step"]) == 0
  for k in ("params", "value_params", "opt_state", "value_opt_state"):
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, new[k]), before[k])


def test_ppo_targets_match_the_closed_form_for_gamma_lambda_one(params):
  # γ = λ = 1: return_t = r − kl_coef·Σ_{t' ≥ t}(old − ref)_t', advantage_t = return_t − V_t (then whitened).
  b = _batch(seed=5)
  vp = ppo_method.init_critic(CFG, params, seed=3)
  c = ppo_method.Config(kl_coef=0.05)
  values = ppo_method.critic_values(CFG, vp, jnp.asarray(b["tokens"]), jnp.asarray(b["mask"]), prompt_len=P)
  values = jnp.where(b["resp_mask"], values, 0.0)
  adv, returns = ppo_method.targets(c, values, b["resp_mask"], b["rewards"], b["old_logp"], b["ref_logp"])
  m = b["resp_mask"]
  kl = np.where(m, b["old_logp"].astype(np.float64) - b["ref_logp"], 0.0)
  want_ret = np.where(m, b["rewards"][:, None] - 0.05 * np.cumsum(kl[:, ::-1], -1)[:, ::-1], 0.0)
  want_v = np.where(m, _critic_values(vp, b), 0.0)
  raw = (want_ret - want_v)[m]
  want_adv = (raw - raw.mean()) / np.sqrt(raw.var(ddof=1) + 1e-8)
  np.testing.assert_allclose(np.asarray(values), want_v, atol=1e-5)
  np.testing.assert_allclose(np.asarray(returns), want_ret, atol=1e-5)
  np.testing.assert_allclose(np.asarray(adv)[m], want_adv, atol=1e-4)
  assert np.all(np.asarray(adv)[~m] == 0)


def test_config_refuses_bad_settings_naming_the_field():
  assert MS.method("grpo", group_size=0).responses_per_prompt() == 8
  assert MS.method("rebel").responses_per_prompt() == 2
  with pytest.raises(ValueError, match="group_size: REBEL .* exactly 2"):
    MS.method("rebel", group_size=4)
  with pytest.raises(ValueError, match="group_size: GRPO needs >= 2"):
    MS.method("grpo", group_size=1)
  with pytest.raises(ValueError, match="loss_agg"):
    MS.method("grpo", loss_agg="mean")
  with pytest.raises(ValueError, match="unknown method 'dpo'"):
    MS.method("dpo")


# ---------------------------------------------------------------------------------------------
# The loop on a tiny task: reward 1 when the response starts with one of a few characters.

SCFG = SamplingConfig(temperature=1.0, max_new_tokens=R, stop_ids=(TOK.eos_token_id,), pad_id=TOK.pad_token_id)
PROMPTS, _ = dataset.build_prompts(synthetic.load_synthetic(64, 0)[0], TOK, synthetic.PROMPT_TEMPLATE)
# Prompts per rollout / mini-batch / micro-batch such that every method samples 32 rows and updates
# on micro-batches of 8 rows, the shapes of the step tests.
SIZES = {"grpo": (8, 4, 2), "ppo": (32, 16, 8), "rebel": (16, 8, 4)}


def _starts_low_digit(texts, golds, truncated):
  return Graded(np.array([float(t[:1] in "0123") for t in texts], np.float32), {})


def _run_loop(algo, workdir, num_steps=10, grade=_starts_low_digit, checkpoint_every=4):
  _, p = decoder.init_params(CFG, seed=0)
  rollout_batch, mini_batch, micro_batch = SIZES[algo]
  settings = loop.LoopSettings(num_steps=num_steps, rollout_batch=rollout_batch, mini_batch=mini_batch,
                               micro_batch=micro_batch, checkpoint_every=checkpoint_every)
  ctx = loop.RunContext(CFG, p, TOK, grade, SCFG)
  result = loop.run(METHOD[algo], p, PROMPTS, ctx, settings, update.Optimizers(OPT, VOPT if algo == "ppo" else None),
                    loop.RunIO(str(workdir), log=lambda s: None))
  return result.params, result.last_eval


def _metrics(workdir):
  return [json.loads(s) for s in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("algo", ALGOS)
def test_loop_raises_the_reward_on_a_tiny_task(algo, tmp_path):
  _run_loop(algo, tmp_path)
  r = [m["train/reward_mean"] for m in _metrics(tmp_path)]
  assert len(r) == 10
  assert np.mean(r[-3:]) > np.mean(r[:3]) + 0.2, r


class Killed(Exception):
  pass


def test_ppo_loop_resumed_after_a_kill_reaches_the_same_policy_and_critic(tmp_path):
  calls = {"n": 0}

  def dies_in_rollout_4(texts, golds, truncated):
    calls["n"] += 1
    if calls["n"] == 4:
      raise Killed()
    return _starts_low_digit(texts, golds, truncated)

  straight, _ = _run_loop("ppo", tmp_path / "a", num_steps=4, checkpoint_every=2)
  with pytest.raises(Killed):
    _run_loop("ppo", tmp_path / "b", num_steps=4, grade=dies_in_rollout_4, checkpoint_every=2)
  resumed, _ = _run_loop("ppo", tmp_path / "b", num_steps=4, checkpoint_every=2)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), straight, resumed)
  a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
  assert [m["step"] for m in b] == [1, 2, 3, 3, 4]  # rollout 3 ran again from the checkpoint of step 2
  np.testing.assert_allclose(b[-1]["train/value_loss"], a[-1]["train/value_loss"], rtol=1e-5)  # the critic resumed too


# ---------------------------------------------------------------------------------------------
# Configs and the entry point.

@pytest.mark.parametrize("name,algo", [("grpo_qwen1p5b", "grpo"), ("ppo_qwen1p5b", "ppo"), ("rebel_qwen1p5b", "rebel")])
@pytest.mark.parametrize("variant", ["math", "gsm8k"])
def test_baseline_configs_validate_and_select_their_method(name, algo, variant):
  c = importlib.import_module(f"configs.{name}").get_config(variant)
  run_config.validate_config(c)
  assert c.algo.name == algo and c.model.name_or_path == "Qwen/Qwen2.5-1.5B"
  ref = importlib.import_module("configs.qwen1p5b").get_config(variant)
  assert (c.train.rollout_batch, c.train.mini_batch, c.data.train) == (ref.train.rollout_batch, ref.train.mini_batch,
                                                                       ref.data.train)  # same prompts per step
  assert run_config.build_method(c).responses_per_prompt() == {"grpo": 8, "ppo": 1, "rebel": 2}[algo]


def test_invalid_baseline_setting_is_refused_naming_the_config_field():
  c = importlib.import_module("configs.demo").get_config("tiny")
  c.algo.name = "rebel"
  c.algo.group_size = 4
  with pytest.raises(ValueError, match=r"config\.algo\.group_size: REBEL regresses on pairs"):
    run_config.validate_config(c)
  c.algo.name, c.algo.group_size, c.algo.value_lr = "ppo", 0, 0.0
  with pytest.raises(ValueError, match=r"config\.algo\.value_lr: must be > 0"):
    run_config.validate_config(c)


def test_main_trains_a_baseline_selected_by_algo_name_without_stage1(tmp_path):
  args = ["--config=configs/demo.py:tiny", f"--workdir={tmp_path}", "--config.algo.name=grpo", "--config.mode=train",
          "--config.algo.group_size=4", "--config.warmstart.steps=0", "--config.data.num_train=32",
          "--config.data.synthetic.num_test=8", "--config.data.avg_k_sets=()", "--config.train.num_steps=2",
          "--config.train.rollout_batch=8", "--config.train.mini_batch=4", "--config.train.micro_batch=2",
          "--config.sampling.max_new_tokens=8", "--config.export_hf=False"]
  run = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "main.py"), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.loads((tmp_path / "report.json").read_text())
  assert report["stage1_summary"] == {"skipped": "grpo needs no V*"} and not (tmp_path / "stage1").exists()
  lines = _metrics(tmp_path)
  train_lines = [m for m in lines if "train/reward_mean" in m]
  assert [m["step"] for m in train_lines] == [1, 2]
  assert all("train/no_signal_frac" in m and "train/clipfrac" in m for m in train_lines)  # GRPO's own metrics
  assert "synthetic/pass@1" in report["final_eval"]


def test_the_critic_of_an_untied_model_drops_its_lm_head_and_reads_values_from_the_body():
  """Qwen2.5-7B and Llama have an LM head apart from the embedding: the critic copies the body without it, and
  its values are still the head on the body's hidden states (it once looked up the missing `lm_head`)."""
  cfg = dataclasses.replace(CFG, tie_embeddings=False)
  params = decoder.init_params(cfg, seed=1)[1]
  assert "lm_head" in params
  vp = ppo_method.init_critic(cfg, params, seed=3)
  assert "lm_head" not in vp["body"]
  b = _batch(seed=5)
  mask = jnp.asarray(b["mask"])
  h, _ = decoder.hidden_states(cfg, vp["body"], jnp.asarray(b["tokens"]), decoder.positions_from_mask(mask), mask)
  want = np.asarray(h, np.float64)[:, P - 1:-1] @ np.asarray(vp["head"]["w"], np.float64) + float(vp["head"]["b"])
  got = ppo_method.critic_values(cfg, vp, jnp.asarray(b["tokens"]), mask, prompt_len=P)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
