"""The training loop (A*-PO through it): resume after a kill reaches the same parameters; a non-finite step
stops the run, detected with metrics fetched one step late, and the last good checkpoint is kept."""
import json

import jax
import numpy as np
import pytest

from astarpo_jax import methods
from astarpo_jax.data import dataset, synthetic
from astarpo_jax.model import decoder
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.rewards import grading
from astarpo_jax.sampling.rollout import Graded
from astarpo_jax.sampling.token_choice import SamplingConfig
from astarpo_jax.stage1 import value_table as vt
from astarpo_jax.training import loop, packing, update

TOK = synthetic.build_tokenizer()
CFG = ModelConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=64)
SCFG = SamplingConfig(temperature=1.0, max_new_tokens=8, stop_ids=(TOK.eos_token_id,), pad_id=TOK.pad_token_id)
PROMPTS, _ = dataset.build_prompts(synthetic.load_synthetic(64, 0)[0], TOK, synthetic.PROMPT_TEMPLATE)
LOOP = loop.LoopSettings(num_steps=4, rollout_batch=8, mini_batch=4, micro_batch=2, checkpoint_every=2)


class Killed(Exception):
  pass


def _grade(kill_on_call=None):
  calls = {"n": 0}

  def grade(texts, golds, truncated):
    calls["n"] += 1
    if calls["n"] == kill_on_call:
      raise Killed()
    # Half credit by a deterministic rule on the text, so rewards vary and gradients are non-zero.
    r = grading.grade_batch(texts, golds, "math_verify", truncated).rewards
    return Graded(np.maximum(r, np.array([len(t) % 2 for t in texts], np.float32)), {})
  return grade


def _run(workdir, grade, settings=LOOP, preemption=None):
  _, params = decoder.init_params(CFG, seed=0)
  table = vt.ValueTable({p.uid: {"vstar": 0.3} for p in PROMPTS}, list(PROMPTS), "", {})
  ctx = loop.RunContext(CFG, params, TOK, grade, SCFG, value_table=table)
  result = loop.run(methods.get("astarpo", {"beta2": 0.1}), params, PROMPTS, ctx, settings,
                    update.Optimizers(update.make_optimizer(lr=1e-2)),
                    loop.RunIO(str(workdir), log=lambda s: None, preemption=preemption))
  return result.params, result.last_eval


def test_killed_run_resumed_reaches_the_same_parameters(tmp_path):
  straight, _ = _run(tmp_path / "a", _grade())
  with pytest.raises(Killed):
    _run(tmp_path / "b", _grade(kill_on_call=4))  # dies in rollout 4, after the checkpoint of rollout 2
  resumed, _ = _run(tmp_path / "b", _grade())
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), straight, resumed)
  lines = [json.loads(s) for s in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
  assert [m["step"] for m in lines] == [1, 2, 3, 1 + 2, 2 + 2]  # rollouts 3-4 logged again after the resume
  _, init = decoder.init_params(CFG, seed=0)
  assert not np.allclose(np.asarray(init["embed"]), np.asarray(straight["embed"]))  # training moved the params


def test_every_step_logs_the_papers_metrics(tmp_path):
  _run(tmp_path, _grade(), loop.LoopSettings(num_steps=1, rollout_batch=8, mini_batch=4, micro_batch=4))
  m = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
  for k in ("loss", "reward_mean", "vstar_mean", "advantage_mean", "kl", "entropy", "response_length",
            "truncation_rate", "grad_norm", "lr", "sec_sample", "sec_grade", "sec_ref", "sec_update", "tokens_per_sec"):
    assert f"train/{k}" in m, k
  assert m["train/lr"] == pytest.approx(1e-2)
  assert m["train/vstar_mean"] == pytest.approx(0.3)


# Rollout 3 holds optimizer steps 5 (rows 0-3) and 6 (rows 4-7); a NaN reward in one row poisons its step.
@pytest.mark.parametrize("row,step,mini", [(0, 5, 0), (6, 6, 1)])
def test_non_finite_step_stops_the_run_there_and_keeps_the_checkpoint_before_it(tmp_path, row, step, mini):
  calls = {"n": 0}

  def grade(texts, golds, truncated):
    calls["n"] += 1
    r = np.zeros(len(texts), np.float32)
    if calls["n"] == 3:
      r[row] = np.nan
    return Graded(r, {})

  with pytest.raises(FloatingPointError, match=rf"non-finite loss or gradient at step {step} \(rollout 2, mini-batch "
                     rf"{mini}\).*last good checkpoint \(step 2\)"):
    _run(tmp_path, grade)
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]
  logged = [json.loads(s)["step"] for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert logged == [1, 2]  # the poisoned rollout is neither logged nor saved


def test_batch_sizes_that_do_not_divide_are_refused():
  with pytest.raises(ValueError, match="rollout_batch=10 is not divisible by mini_batch=4"):
    loop.LoopSettings(rollout_batch=10, mini_batch=4, micro_batch=2)
  with pytest.raises(ValueError, match="mini_batch=4 is not divisible by micro_batch=3"):
    loop.LoopSettings(rollout_batch=8, mini_batch=4, micro_batch=3)


def test_epochs_give_the_official_number_of_rollout_steps():
  # verl: len(DataLoader(drop_last=True)) * epochs, and its loop runs one fewer (docs/fidelity.md).
  assert loop.steps_for_epochs(7473, 256, 25) == 29 * 25 - 1  # GSM8K train: 29 rollouts per epoch
  assert loop.steps_for_epochs(7473, 256, 25, official_step_count=False) == 725
  assert loop.steps_for_epochs(len(PROMPTS), 8, 3) == (64 // 8) * 3 - 1
  with pytest.raises(ValueError, match="do not fill one rollout of 256"):
    loop.steps_for_epochs(100, 256, 25)


def test_packed_micro_batches_train_to_the_parameters_of_padded_ones(tmp_path, monkeypatch):
  """train.pack_rows: the update and π_ref's forward skip response padding (packing.py) and reach the padded
  run's parameters."""
  settings = dict(num_steps=2, rollout_batch=8, mini_batch=4, micro_batch=4)
  padded, _ = _run(tmp_path / "a", _grade(), loop.LoopSettings(**settings))
  packed_rows, real = [], packing.pack_microbatches

  def pack(mb, prompt_len, shards):
    out = real(mb, prompt_len, shards)
    packed_rows.append(out["pack_tokens"].shape[2])  # [M, shards, Q, S]
    return out
  monkeypatch.setattr(loop.packing, "pack_microbatches", pack)
  packed, _ = _run(tmp_path / "b", _grade(), loop.LoopSettings(**settings, pack_rows=True))
  # every mini-batch of the two rollouts packed, π_ref's forward (blocks of a micro-batch, packed at once) and the
  # trainer's forward of the mismatch metric (its one block, algo.mismatch_blocks)
  assert len(packed_rows) == 2 * (2 + 1 + 1) and max(packed_rows) <= 4
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-5), padded, packed)
  _, init = decoder.init_params(CFG, seed=0)
  assert not np.allclose(np.asarray(init["embed"]), np.asarray(packed["embed"]))


def test_scoring_two_micro_batches_a_call_trains_to_the_same_parameters_in_half_the_calls(tmp_path, monkeypatch):
  """train.score_micro_batches = 2: π_ref's forward takes 2 micro-batches of rows a call (half the calls, each
  of twice the rows) and the run reaches the parameters of scoring one micro-batch a call."""
  settings = dict(num_steps=2, rollout_batch=8, mini_batch=4, micro_batch=2)
  calls, real = [], loop.scoring.in_packed_blocks

  def counted(fn, rows, tokens_BS, *args, **kw):
    calls.append((rows, len(tokens_BS)))
    return real(fn, rows, tokens_BS, *args, **kw)
  monkeypatch.setattr(loop.scoring, "in_packed_blocks", counted)
  one, _ = _run(tmp_path / "a", _grade(), loop.LoopSettings(**settings))
  # A*-PO scores π_ref once a rollout, 2 rows (prompts x 1) a call, then one block of rows for the mismatch metric
  assert calls == [(2, 8), (2, 2)] * 2
  calls.clear()
  two, _ = _run(tmp_path / "b", _grade(), loop.LoopSettings(**settings, score_micro_batches=2))
  assert calls == [(4, 8), (4, 4)] * 2
  # float32 forwards of 2 and 4 rows round differently (~1e-7 in a log-prob), AdamW carries it to ~3e-6
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-5), one, two)
  with pytest.raises(ValueError, match="score_micro_batches"):
    loop.LoopSettings(**settings, score_micro_batches=0)


def test_gather_weights_auto_gathers_once_per_step_on_the_cpu_and_trains_as_per_micro_batch(tmp_path, monkeypatch):
  """train.gather_weights reaches the update: "auto" resolves to "per_step_local" where no device limit is known
  (the CPU) and, on one device, gives the per-micro-batch run's parameters (the compute copy is the same cast)."""
  settings = dict(num_steps=1, rollout_batch=8, mini_batch=4, micro_batch=2)
  modes, real = [], update.jit_update_step

  def jit(*a, gather_weights="per_micro_batch", **kw):
    modes.append(gather_weights)
    return real(*a, gather_weights=gather_weights, **kw)
  monkeypatch.setattr(loop.update, "jit_update_step", jit)
  per_mb, _ = _run(tmp_path / "a", _grade(), loop.LoopSettings(**settings))
  auto, _ = _run(tmp_path / "b", _grade(), loop.LoopSettings(**settings, gather_weights="auto"))
  assert modes[0] == "per_micro_batch" and set(modes[1:]) == {"per_step_local"}, modes
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), per_mb, auto)


def test_auto_modes_follow_what_fits_and_what_the_run_trains(monkeypatch):
  """"auto" by the device's free bytes (loop._free_bytes): the copy, its gradient and a whole fp32 accumulator ->
  per_step_local; without room for the accumulator, or with a critic (no local accumulation) -> per_step; without
  room for the copy and its gradient -> per_micro_batch. π_ref's scoring copy (loop.reference_copy) where the copy
  fits, in the compute dtype; none without a mesh or under per_micro_batch."""
  _, params = decoder.init_params(CFG, seed=0)
  n = sum(x.size for x in jax.tree.leaves(params))
  c = n * np.dtype(CFG.dtype).itemsize  # the compute copy's bytes
  acc = 4 * (n + params["embed"].size)  # the fp32 accumulator's, with the tied unembedding's [D, V] gradient
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
  params = jax.device_put(params, decoder.param_shardings(CFG, mesh))  # as a run places π_ref
  ctx = loop.RunContext(CFG, params, TOK, None, SCFG, mesh=mesh)
  state = {"params": params}
  assert CFG.tie_embeddings
  for free, want in ((2 * c + acc, "per_step_local"), (2 * c + acc - 1, "per_step"), (2 * c - 1, "per_micro_batch")):
    monkeypatch.setattr(loop, "_free_bytes", lambda: free)
    assert loop.gather_mode("auto", ctx, state) == want, free
  monkeypatch.setattr(loop, "_free_bytes", lambda: 2 * c + acc)
  assert loop.gather_mode("auto", ctx, dict(state, value_params=params)) == "per_step"
  assert loop.gather_mode("per_step", ctx, state) == "per_step"
  copy = loop.reference_copy("auto", ctx)(params)
  assert {x.dtype for x in jax.tree.leaves(copy)} == {np.dtype(CFG.dtype)}
  monkeypatch.setattr(loop, "_free_bytes", lambda: c - 1)
  assert loop.reference_copy("auto", ctx) is None and loop.reference_copy("per_step", ctx) is not None
  assert loop.reference_copy("per_micro_batch", ctx) is None
  assert loop.reference_copy("per_step", loop.RunContext(CFG, params, TOK, None, SCFG)) is None
