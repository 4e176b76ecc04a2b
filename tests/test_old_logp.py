"""Old log-probs from the training forward (verl's way) by default, the sampler-vs-trainer mismatch metric, truncated
importance sampling: the metric ~0 on the CPU's fp32 dense decode and non-zero on the bf16 paged decode (the TPU
kernel in interpret mode); a sampler whose log-probs are shifted leaves GRPO's loss unchanged under "trainer" and
moves it under "sampler"; the metric and the TIS weights against hand-worked numbers; the options refused when wrong."""
import dataclasses
import importlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from astarpo_jax import run_config
from astarpo_jax.data import dataset, synthetic
from astarpo_jax.model import decoder
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.sampling import rollout as rollout_lib
from astarpo_jax.sampling.rollout import Graded
from astarpo_jax.sampling.token_choice import SamplingConfig
from astarpo_jax.training import baseline_losses as BL, loop, scoring, update
from tests import method_steps as MS

TOK = synthetic.build_tokenizer()
CFG = ModelConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, max_position_embeddings=64)
R = 8
SCFG = SamplingConfig(temperature=1.0, max_new_tokens=R, stop_ids=(TOK.eos_token_id,), pad_id=TOK.pad_token_id,
                      kv_layout="dense")
PROMPTS, _ = dataset.build_prompts(synthetic.load_synthetic(16, 0)[0], TOK, synthetic.PROMPT_TEMPLATE)


def _grade(texts, golds, truncated):
  return Graded(np.array([float(t[:1] in "0123") for t in texts], np.float32), {})


@pytest.fixture(scope="module")
def params():
  return decoder.init_params(CFG, seed=0)[1]


def _rollout(cfg, params, scfg, prompts=PROMPTS[:8], num_samples=1, seed=0):
  return rollout_lib.rollout(cfg, params, [p.ids for p in prompts], [p.target for p in prompts], jax.random.key(seed),
                             scfg, TOK, _grade, num_samples=num_samples)


def _mismatch(cfg, params, scfg, ro, **kw):
  tokens, mask, resp = rollout_lib.trim_response(ro)
  return scoring.policy_mismatch(cfg, params, scfg, ro, tokens, mask, resp, rows=4, blocks=kw.pop("blocks", 100), **kw)


def test_the_metric_on_a_hand_worked_case():
  trainer = np.array([[-1.0, -2.0, -0.5], [-0.1, 0.0, 0.0]])
  sampler = np.array([[-1.5, -1.0, -9.0], [-0.3, 0.0, 0.0]])
  mask = np.array([[True, True, False], [True, False, False]])
  m = scoring.logprob_mismatch(trainer, sampler, mask)  # Δ = 0.5, -1 (row 0), 0.2 (row 1); the masked -9 unseen
  assert m["mismatch_abs_mean"] == pytest.approx((0.5 + 1.0 + 0.2) / 3)
  assert m["mismatch_abs_max"] == pytest.approx(1.0)
  k3 = lambda d: np.exp(d) - 1 - d  # noqa: E731
  assert m["mismatch_seq_kl_k3"] == pytest.approx(((k3(0.5) + k3(-1.0)) + k3(0.2)) / 2)
  assert m["mismatch_tokens"] == 3


def test_the_mismatch_is_zero_on_the_cpu_fp32_dense_decode(params):
  ro = _rollout(CFG, params, SCFG)
  m = _mismatch(CFG, params, SCFG, ro)
  tokens, mask, resp = rollout_lib.trim_response(ro)
  assert m["mismatch_tokens"] == resp.sum() > 0
  assert m["mismatch_abs_max"] < 1e-5 and m["mismatch_abs_mean"] < 1e-6 and abs(m["mismatch_seq_kl_k3"]) < 1e-9, m
  # the trainer's numbers are a float64 full forward's; so are the sampler's
  want, _ = MS.full_forward_logp_entropy(CFG, params, {"tokens": tokens, "mask": mask}, ro.prompt_len)
  np.testing.assert_allclose(np.where(resp, ro.sample_logp_BR[:, :resp.shape[1]], 0), np.where(resp, want, 0),
                             atol=1e-5)


def test_the_mismatch_is_reported_non_zero_on_the_bf16_paged_decode_in_interpret_mode(params):
  from jax.experimental.pallas import tpu as pltpu
  bf16 = dataclasses.replace(CFG, dtype="bfloat16")  # fp32 params, bf16 compute: the trainer's and the sampler's
  paged = dataclasses.replace(SCFG, kv_layout="paged", page_size=8, paged_attention="pallas")
  with pltpu.force_tpu_interpret_mode():
    ro = _rollout(bf16, params, paged)
  m = _mismatch(bf16, params, paged, ro)
  print("bf16 paged decode vs the bf16 trainer:", {k: float(f"{v:.3g}") for k, v in m.items()})
  assert m["mismatch_abs_mean"] > 1e-4 and m["mismatch_seq_kl_k3"] > 0, m
  assert m["mismatch_abs_max"] < 0.5, m  # rounding, not a different model
  # the first block only (A*-PO's default: one fixed-score call of 4 rows)
  tokens, mask, resp = rollout_lib.trim_response(ro)
  assert _mismatch(bf16, params, paged, ro, blocks=1)["mismatch_tokens"] == resp[:4].sum()
  assert _mismatch(bf16, params, paged, ro, blocks=0) == {}
  # sampling at another temperature: the sampler's numbers are another distribution's, no metric
  assert _mismatch(bf16, params, dataclasses.replace(paged, temperature=0.7), ro) == {}


def _ctx(params, scfg=SCFG):
  return loop.RunContext(CFG, params, TOK, _grade, scfg)


@pytest.fixture(scope="module")
def grpo_rollout(params):
  return _rollout(CFG, params, SCFG, prompts=PROMPTS[:4], num_samples=4, seed=3)


def _grpo_step(params, method, ro, shift=0.0):
  """GRPO's prepare on the rollout with its sampler log-probs moved by `shift`, then one update: (batch, metrics,
  the step's loss)."""
  # rewards set so that every group has signal (a random model's own would often leave a group without any)
  shifted = dataclasses.replace(ro, sample_logp_BR=ro.sample_logp_BR + np.float32(shift),
                                rewards_B=np.tile(np.float32([1, 0, 0, 1]), len(ro.rewards_B) // 4))
  state = MS.init_state(jax.tree.map(jnp.copy, params), optax.sgd(0.0))
  batch, metrics = method.prepare(_ctx(params), state, shifted, PROMPTS[:4], scoring.Blocks(rows=8))
  step = MS.jit_step(CFG, method, optax.sgd(0.0), ro.prompt_len)
  _, m = step(state, update.split_microbatches(batch, 8))
  return batch, metrics, float(m["loss"])


def test_grpo_takes_its_old_logprobs_from_the_training_forward_by_default(params, grpo_rollout):
  ro = grpo_rollout
  trainer = MS.method("grpo", group_size=4, kl_coef=0.1)
  assert trainer.config.old_logp == "trainer" and "policy" in trainer.footprint().scored
  b0, m0, loss0 = _grpo_step(params, trainer, ro)
  b1, m1, loss1 = _grpo_step(params, trainer, ro, shift=-0.5)
  tokens, mask, resp = rollout_lib.trim_response(ro)
  want, _ = MS.full_forward_logp_entropy(CFG, params, {"tokens": tokens, "mask": mask}, ro.prompt_len)
  np.testing.assert_allclose(b1["old_logp"], np.where(resp, want, 0.0), atol=1e-5)  # the trainer's, not shifted
  assert loss1 == pytest.approx(loss0, abs=1e-7)
  assert "sec_old_logp" in m1 and m0["mismatch_abs_max"] < 1e-5
  # the metric sees the shift: |Δ| = 0.5 on every token, k3 = e^0.5 - 1.5 per token summed per response
  n_B = resp.sum(-1)
  assert m1["mismatch_abs_mean"] == pytest.approx(0.5, abs=1e-5)
  assert m1["mismatch_abs_max"] == pytest.approx(0.5, abs=1e-5)
  assert m1["mismatch_seq_kl_k3"] == pytest.approx((np.exp(0.5) - 1.5) * n_B.mean(), rel=1e-4)
  # under "sampler" the shifted numbers are the old log-probs: the ratio moves, and so does the loss
  sampler = MS.method("grpo", group_size=4, kl_coef=0.1, old_logp="sampler")
  assert "policy" not in sampler.footprint().scored
  b2, m2, loss2 = _grpo_step(params, sampler, ro, shift=-0.5)
  np.testing.assert_allclose(b2["old_logp"], np.where(resp, want - 0.5, 0.0), atol=1e-5)
  assert abs(loss2 - loss0) > 1e-3 and "sec_old_logp" not in m2
  assert m2["mismatch_abs_mean"] == pytest.approx(0.5, abs=1e-5)  # one block of the trainer's forward for it
  assert m2["mismatch_tokens"] == resp[:8].sum()


def test_tis_weights_and_the_weighted_surrogate_on_a_hand_worked_case():
  old = np.array([[-1.0, -2.0, -0.5]], np.float32)
  sampler = np.array([[-1.5, -1.0, -9.0]], np.float32)  # Δ = 0.5, -1, and a masked-out token
  mask = np.array([[True, True, False]])
  w = np.asarray(BL.tis_weights(old, sampler, mask, cap=1.5))
  np.testing.assert_allclose(w, [[1.5, np.exp(-1.0), 0.0]], rtol=1e-6)  # e^0.5 = 1.65 truncated at 1.5
  np.testing.assert_allclose(np.asarray(BL.tis_weights(old, sampler, mask, cap=2.0)), [[np.exp(0.5), np.exp(-1), 0]],
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(BL.tis_weights(old, sampler, mask, 2.0, per="sequence")), [np.exp(-0.5)],
                             rtol=1e-6)
  # GRPO at ratio 1 (logp = old), advantage 2, token mean over 2 tokens: loss = -2·(w0 + w1)/2, and each token's
  # gradient -2·w_t/2; the weight is a constant
  adv = jnp.array([2.0])
  loss = lambda lp, tis: BL.grpo_loss(lp, jnp.asarray(old), None, jnp.asarray(mask), adv, tis_BT=tis)[0]  # noqa: E731
  assert float(loss(jnp.asarray(old), jnp.asarray(w))) == pytest.approx(-(1.5 + np.exp(-1.0)), rel=1e-6)
  assert float(loss(jnp.asarray(old), None)) == pytest.approx(-2.0, rel=1e-6)
  np.testing.assert_allclose(np.asarray(jax.grad(loss)(jnp.asarray(old), jnp.asarray(w))),
                             [[-1.5, -np.exp(-1.0), 0.0]], rtol=1e-5)
  with pytest.raises(ValueError, match="cap must be > 0"):
    BL.tis_weights(old, sampler, mask, cap=0.0)


def test_grpo_with_tis_weighs_each_token_by_the_truncated_ratio(params, grpo_rollout):
  method = MS.method("grpo", group_size=4, kl_coef=0.1, tis_cap=2.0)
  b_shift, _, _ = _grpo_step(params, method, grpo_rollout, shift=-0.5)  # the sampler 0.5 below: w = e^0.5 < 2
  resp = b_shift["resp_mask"]
  np.testing.assert_allclose(b_shift["tis_w"], np.where(resp, np.exp(0.5), 0.0), rtol=1e-4)
  assert method.batch_shapes(8, 16, 8)["tis_w"] == ((8, 8), np.float32)


def test_the_mismatch_metrics_reach_the_runs_log(params, tmp_path):
  settings = loop.LoopSettings(num_steps=1, rollout_batch=4, mini_batch=4, micro_batch=2, checkpoint_every=1)
  loop.run(MS.method("grpo", group_size=4, kl_coef=0.1), params, PROMPTS, _ctx(params), settings,
           update.Optimizers(update.make_optimizer(lr=1e-3)), loop.RunIO(str(tmp_path), log=lambda s: None))
  row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
  assert row["train/mismatch_abs_max"] < 1e-5 and row["train/mismatch_tokens"] > 0  # fp32 dense: ~0
  assert "train/sec_old_logp" in row
  # TensorBoard's events (read back as TFRecords of Event protos) hold the same scalars; W&B gets the dict that
  # metrics.jsonl does (tests/test_metrics.py: its offline history equals metrics.jsonl)
  tb = {v.tag: v.simple_value for e in _tb_events(tmp_path / "tb") for v in e.summary.value}
  for k in ("train/mismatch_abs_mean", "train/mismatch_abs_max", "train/mismatch_seq_kl_k3"):
    assert tb[k] == pytest.approx(row[k], rel=1e-6, abs=1e-12), k


def _tb_events(folder):
  """Every Event in a folder's event files: TFRecords (length u64, its crc u32, the bytes, their crc u32)."""
  import struct

  from tensorboardX.proto import event_pb2
  out = []
  for f in sorted(folder.glob("events.out.tfevents.*")):
    data = f.read_bytes()
    i = 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      out.append(event_pb2.Event.FromString(data[i + 12:i + 12 + n]))
      i += 12 + n + 4
  return out


def _demo(**algo):
  c = importlib.import_module("configs.demo").get_config("tiny")
  c.algo.update(algo)
  return c


@pytest.mark.parametrize("algo,match", [
    (dict(name="grpo", old_logp="vllm"), r"config\.algo\.old_logp: not one of \('trainer', 'sampler'\).*got 'vllm'"),
    (dict(name="astarpo", old_logp="vllm"), r"config\.algo\.old_logp: 'vllm'"),
    (dict(name="grpo", tis_cap=-1.0), r"config\.algo\.tis_cap: must be >= 0"),
    (dict(name="grpo", tis_cap=2.0, old_logp="sampler"), r"config\.algo\.tis_cap: .*set old_logp='trainer'"),
    (dict(name="astarpo", tis_cap=2.0), r"config\.algo\.tis_cap: 2\.0: .*astarpo has none"),
    (dict(name="rebel", tis_cap=2.0), r"config\.algo\.tis_cap: 2\.0: .*rebel has none"),
    (dict(name="ppo", mismatch_blocks=-1), r"config\.algo\.mismatch_blocks: must be an int >= 0"),
    (dict(name="astarpo", mismatch_blocks=-1), r"config\.algo\.mismatch_blocks: .*an int >= 0"),
])
def test_the_options_are_refused_naming_the_field(algo, match):
  with pytest.raises(ValueError, match=match):
    run_config.validate_config(_demo(**algo))


def test_tis_needs_the_policys_own_samples_and_the_defaults_validate():
  c = _demo(name="rloo", tis_cap=2.0)
  run_config.validate_config(c)
  assert run_config.build_method(c).config.tis_cap == 2.0
  c.sampling.temperature = 0.7
  with pytest.raises(ValueError, match=r"config\.algo\.tis_cap: 2\.0 weighs by pi_old / pi_sampler.*temperature 1"):
    run_config.validate_config(c)
  for name in ("astarpo", "grpo", "ppo", "rloo", "rebel"):
    c = _demo(name=name)
    run_config.validate_config(c)
    m = run_config.build_method(c)
    assert getattr(m.config, "old_logp", "trainer") == "trainer" and m.config.mismatch_blocks == 1


def test_rloo_with_tis_weighs_each_responses_clipped_term_by_its_weight(params):
  # the step's loss against the hand formula: mean_b w_b·max(−ρ_b·A_b, −clip(ρ_b)·A_b), ρ from a float64 full forward
  rng = np.random.default_rng(4)
  B, P = 8, 16
  tokens = rng.integers(1, CFG.vocab_size, (B, P + R)).astype(np.int32)
  mask = np.zeros((B, P + R), bool)
  resp = np.zeros((B, R), bool)
  for i, n in enumerate(rng.integers(1, R + 1, B)):
    mask[i, 4:P + n] = True
    resp[i, :n] = True
  logp, _ = MS.full_forward_logp_entropy(CFG, params, {"tokens": tokens, "mask": mask}, P)
  old = np.where(resp, logp + rng.normal(0, 0.05, logp.shape), 0.0).astype(np.float32)
  b = {"tokens": tokens, "mask": mask, "resp_mask": resp, "old_logp": old, "rewards": np.zeros(B, np.float32),
       "adv": rng.normal(0, 1, B).astype(np.float32), "tis_w": np.float32([0.5, 2.0, 1.0, 0.1, 1.5, 1.0, 0.0, 0.7])}
  method = MS.method("rloo", group_size=4, kl_coef=0.0, tis_cap=2.0)
  assert method.batch_shapes(B, P, R)["tis_w"] == ((B,), np.float32)
  state = MS.init_state(jax.tree.map(jnp.copy, params), optax.sgd(0.0))
  _, m = MS.jit_step(CFG, method, optax.sgd(0.0), P)(state, update.split_microbatches(b, 8))
  ratio = np.exp(np.where(resp, logp - old, 0.0).sum(-1))
  adv = b["adv"].astype(np.float64)
  want = (b["tis_w"] * np.maximum(-ratio * adv, -np.clip(ratio, 0.8, 1.2) * adv)).mean()
  np.testing.assert_allclose(float(m["loss"]), want, rtol=1e-4)


def test_on_the_fp32_dense_path_grpo_trains_the_same_from_the_trainers_or_the_samplers_old_logprobs(params, tmp_path):
  # where sampler and trainer agree (~1e-6), the default's extra forward changes nothing a run computes: two rollouts
  # of two optimizer steps each (the second off-policy, its ratio != 1), the same losses and final policy. Plain SGD
  # at lr 1, so the change of each param is its summed gradient (AdamW divides by |g|, which turns rounding in a
  # near-zero gradient into a visible difference: 3e-6 after these 4 steps at lr 1e-2)
  settings = loop.LoopSettings(num_steps=2, rollout_batch=4, mini_batch=2, micro_batch=1, checkpoint_every=10)
  runs = {}
  for source in ("trainer", "sampler"):
    result = loop.run(MS.method("grpo", group_size=4, kl_coef=0.1, old_logp=source), params, PROMPTS, _ctx(params),
                      settings, update.Optimizers(optax.sgd(1.0)),
                      loop.RunIO(str(tmp_path / source), log=lambda s: None))
    rows = [json.loads(s) for s in (tmp_path / source / "metrics.jsonl").read_text().splitlines()]
    runs[source] = (result.params, rows)
  (p_t, rows_t), (p_s, rows_s) = runs["trainer"], runs["sampler"]
  for a, b in zip(rows_t, rows_s):
    assert a["train/reward_mean"] == b["train/reward_mean"]  # the same samples
    assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-6)
  moved = max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(p_t), jax.tree.leaves(params)))
  assert moved > 1e-3  # the policy trained
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-5 * moved), p_t, p_s)
