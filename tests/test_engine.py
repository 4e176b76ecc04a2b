"""Continuous batching: a row's result does not depend on the schedule (slots, refills, compaction),
checked against a stepwise full forward that draws each token from the same uniforms."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from astarpo_jax.model.config import ModelConfig
from astarpo_jax.sampling import decode_plan, sampler as sampler_lib, token_choice
from astarpo_jax.sampling.token_choice import SamplingConfig
from tests.test_sampler import PROMPTS, full_logits, response, tiny_model

SCFG = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=12, stop_ids=(1, 2))


def stepwise_reference(cfg, params, prompt, key, row, scfg, budget):
  """Row `row` sampled token by token from full-forward logits (no cache, no batch), with its
  uniforms uniform(fold_in(key, row), (T,)) and the sampler's token choice."""
  u = jax.random.uniform(jax.random.fold_in(key, row), (scfg.max_new_tokens,), jnp.float32)
  seq, toks, logps = list(prompt), [], []
  for t in range(budget):
    logits = jnp.asarray(full_logits(cfg, params, seq)[-1], jnp.float32)
    tok, logp = token_choice.choose_tokens(logits[:, None], u[t:t + 1], scfg)
    toks.append(int(tok[0]))
    logps.append(float(logp[0]))
    seq.append(toks[-1])
    if toks[-1] in scfg.stop_ids:
      break
  return toks, logps


@pytest.fixture(scope="module")
def mixed():
  """Ten prompts with budgets from 1 to 12 and two stop ids: rows end at different steps."""
  cfg, params = tiny_model(seed=9)
  prompts = (PROMPTS + [[2, 2, 5], [9], [4, 4, 4, 4], [30, 1], [11, 12, 13], [6, 6]])[:10]
  budgets = np.array([12, 3, 7, 1, 12, 5, 9, 2, 12, 6], np.int32)
  return cfg, params, prompts, budgets


def test_rows_equal_a_stepwise_full_forward_whatever_the_schedule(mixed):
  cfg, params, prompts, budgets = mixed
  key = jax.random.key(5)
  runs = {}
  for name, kw in {"2 slots, refills": dict(max_batch=2), "4 slots, ladder down to 1": dict(max_batch=4, min_slots=1),
                   "all rows at once": dict(max_batch=10), "static chunks of 3": dict(max_batch=3, schedule="static"),
                   "2 slots, windows of 2 columns": dict(max_batch=2, window_step=2),
                   "all rows at once, whole cache": dict(max_batch=10, window_step=None)}.items():
    stats = decode_plan.RunStats()
    runs[name] = jax.device_get(sampler_lib.sample(cfg, params, prompts, key, SCFG, max_new_tokens_B=budgets,
                                                   stats=stats, **kw))
    runs[name + " stats"] = stats
  assert runs["2 slots, refills stats"].segments > 5  # rows did take each other's slots
  assert runs["4 slots, ladder down to 1 stats"].compactions == [2, 1]
  assert len(runs["2 slots, windows of 2 columns stats"].windows) >= 4  # segments attended over growing windows
  assert len(runs["all rows at once, whole cache stats"].windows) == 1
  names = [n for n in runs if not n.endswith(" stats")]
  for i, prompt in enumerate(prompts):
    toks, logps = stepwise_reference(cfg, params, prompt, key, i, SCFG, int(budgets[i]))
    for name in names:
      out = runs[name]
      assert response(out, i) == toks, (name, i)
      np.testing.assert_allclose(out.logp_BT[i, :len(toks)], logps, atol=1e-4, err_msg=f"{name} row {i}")


def test_the_accelerators_decode_layout_gives_the_same_rows_under_refills_ladder_and_windows(mixed, monkeypatch):
  # TPU/GPU decode on the params as stored, one cache buffer per layer (model.decode_step's `_Rows` path),
  # forced on the CPU, against the same stepwise full forward
  from astarpo_jax.model import decoder as model_lib
  as_stored = model_lib.decode_params
  monkeypatch.setattr(model_lib, "decode_params", lambda cfg, params, backend=None: as_stored(cfg, params, "tpu"))
  cfg, params, prompts, budgets = mixed
  key = jax.random.key(5)
  assert not model_lib.is_fused(model_lib.decode_params(cfg, params))
  runs = {name: jax.device_get(sampler_lib.sample(cfg, params, prompts, key, SCFG, max_new_tokens_B=budgets, **kw))
          for name, kw in {"2 slots, refills": dict(max_batch=2), "4 slots, ladder down to 1": dict(max_batch=4, min_slots=1),
                           "2 slots, windows of 2 columns": dict(max_batch=2, window_step=2)}.items()}
  for i, prompt in enumerate(prompts):
    toks, logps = stepwise_reference(cfg, params, prompt, key, i, SCFG, int(budgets[i]))
    for name, out in runs.items():
      assert response(out, i) == toks, (name, i)
      np.testing.assert_allclose(out.logp_BT[i, :len(toks)], logps, atol=1e-4, err_msg=f"{name} row {i}")


def test_stop_and_budget_flags_and_padding_under_refills(mixed):
  cfg, params, prompts, budgets = mixed
  out = jax.device_get(sampler_lib.sample(cfg, params, prompts, jax.random.key(5), SCFG, max_batch=2,
                                          max_new_tokens_B=budgets))
  for i in range(len(prompts)):
    n = int(out.length_B[i])
    stopped = out.tokens_BT[i, n - 1] in SCFG.stop_ids
    assert out.finished_B[i] == stopped and out.truncated_B[i] == (not stopped)
    assert n == budgets[i] or stopped  # a row ends at its budget unless it stopped first
    assert n <= budgets[i] and not np.isin(out.tokens_BT[i, :n - 1], SCFG.stop_ids).any()
    assert out.mask_BT[i].tolist() == [t < n for t in range(SCFG.max_new_tokens)]
    assert (out.tokens_BT[i, n:] == SCFG.pad_id).all() and (out.logp_BT[i, n:] == 0).all()
  assert out.finished_B.any() and out.truncated_B.any()


def test_the_segment_log_counts_every_decode_step_of_a_one_slot_run(mixed):
  """Hand-worked: in one slot the rows run one after another, and a row of budget b takes b - 1 decode
  steps (its first token is drawn at prefill), so the log's steps add up to the sum of (b - 1)."""
  cfg, params, prompts, budgets = mixed
  scfg = SamplingConfig(temperature=1.0, max_new_tokens=9)  # no stop ids: every row runs to its budget
  budgets = np.minimum(budgets, 9)
  stats = decode_plan.RunStats()
  sampler_lib.sample(cfg, params, prompts, jax.random.key(2), scfg, max_batch=1, min_slots=1,
                     max_new_tokens_B=budgets, stats=stats)
  assert len(stats.segment_log) == stats.segments and {b for b, *_ in stats.segment_log} == {1}
  assert sum(steps for _, _, steps, _ in stats.segment_log) == int((budgets - 1).sum())
  assert all(sec > 0 for *_, sec in stats.segment_log)


def test_a_budget_truncates_a_row_exactly_where_the_global_cap_would(mixed):
  cfg, params, prompts, _ = mixed
  scfg = SamplingConfig(temperature=1.0, max_new_tokens=9)  # no stop ids: every row runs to its limit
  key = jax.random.key(2)
  free = jax.device_get(sampler_lib.sample(cfg, params, prompts, key, scfg, max_batch=3))
  budgets = np.arange(1, len(prompts) + 1).clip(1, 9).astype(np.int32)
  cut = jax.device_get(sampler_lib.sample(cfg, params, prompts, key, scfg, max_batch=3, max_new_tokens_B=budgets))
  for i, b in enumerate(budgets):
    assert cut.length_B[i] == b and cut.truncated_B[i] and not cut.finished_B[i]
    assert response(cut, i) == response(free, i)[:b]
    np.testing.assert_allclose(cut.logp_BT[i, :b], free.logp_BT[i, :b], atol=1e-5)


def test_samples_sharing_a_prefill_equal_separate_prefills_of_repeated_prompts(mixed):
  cfg, params, prompts, _ = mixed
  n, key = 3, jax.random.key(8)
  stats_shared, stats_repeated = decode_plan.RunStats(), decode_plan.RunStats()
  shared = jax.device_get(sampler_lib.sample(cfg, params, prompts[:4], key, SCFG, max_batch=4, num_samples=n,
                                             stats=stats_shared))
  repeated = jax.device_get(sampler_lib.sample(cfg, params, [p for p in prompts[:4] for _ in range(n)], key, SCFG,
                                               max_batch=4, stats=stats_repeated))
  assert shared.tokens_BT.shape[0] == 4 * n
  np.testing.assert_array_equal(shared.tokens_BT, repeated.tokens_BT)
  np.testing.assert_array_equal(shared.length_B, repeated.length_B)
  np.testing.assert_allclose(shared.logp_BT, repeated.logp_BT, atol=1e-5)
  assert stats_shared.prefill_rows == 4 and stats_repeated.prefill_rows == 4 * n  # prompts prefilled
  assert len({tuple(r) for r in shared.tokens_BT.tolist()}) > 4  # the samples of a prompt differ


def test_second_token_frequencies_under_refills_match_the_exact_distribution():
  # 6000 samples of one prompt through 16 slots with budgets of 1 or 2 tokens, so slots are refilled
  # after every step. Among rows whose first token is the most likely one, the second token must
  # follow the exact filtered softmax given prompt + that token.
  cfg, params = tiny_model(seed=6, head_scale=3.0)
  scfg = SamplingConfig(temperature=1.0, top_k=6, max_new_tokens=2)
  prompt, n = [4, 17, 2, 9], 6000
  budgets = np.where(np.arange(n) % 3 == 0, 1, 2).astype(np.int32)
  stats = decode_plan.RunStats()
  out = jax.device_get(sampler_lib.sample(cfg, params, [prompt], jax.random.key(3), scfg, max_batch=16,
                                          num_samples=n, max_new_tokens_B=budgets, stats=stats))
  assert stats.segments > 50
  from tests.test_sampler import exact_filtered_probs
  first = int(np.bincount(out.tokens_BT[:, 0], minlength=cfg.vocab_size).argmax())
  rows = (out.tokens_BT[:, 0] == first) & (out.length_B == 2)
  p = exact_filtered_probs(full_logits(cfg, params, prompt + [first])[-1], scfg)
  freq = np.bincount(out.tokens_BT[rows, 1], minlength=cfg.vocab_size) / rows.sum()
  assert rows.sum() > 600 and (freq[p == 0] == 0).all()
  tv = 0.5 * np.abs(freq - p).sum()
  assert tv < 0.08, f"total variation {tv:.3f} over {rows.sum()} samples"
  np.testing.assert_allclose(out.logp_BT[rows, 1], np.log(p[out.tokens_BT[rows, 1]]), atol=1e-4)


def test_bad_budgets_schedules_and_sample_counts_raise_errors_that_name_the_field(mixed):
  cfg, params, prompts, _ = mixed
  key = jax.random.key(0)
  with pytest.raises(ValueError, match="max_new_tokens_B"):
    sampler_lib.sample(cfg, params, prompts, key, SCFG, max_new_tokens_B=np.full(len(prompts), 13))
  with pytest.raises(ValueError, match="max_new_tokens_B"):
    sampler_lib.sample(cfg, params, prompts, key, SCFG, max_new_tokens_B=np.ones(3, np.int32))
  with pytest.raises(ValueError, match="num_samples"):
    sampler_lib.sample(cfg, params, prompts, key, SCFG, num_samples=0)
  with pytest.raises(ValueError, match="schedule"):
    sampler_lib.sample(cfg, params, prompts, key, SCFG, schedule="fifo")
  with pytest.raises(ValueError, match="window_step"):
    sampler_lib.sample(cfg, params, prompts, key, SCFG, window_step=0)


def test_accelerator_decode_params_are_the_compute_dtype_cast_once_or_the_params_themselves():
  import dataclasses

  from astarpo_jax.model import decoder as model_lib
  cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                    num_kv_heads=1, head_dim=8, dtype="bfloat16")
  _, params = model_lib.init_params(cfg, seed=1)  # fp32 storage, bf16 compute
  got = model_lib.decode_params(cfg, params, backend="tpu")
  flat, flat_got = jax.tree.leaves(params), jax.tree.leaves(got)
  assert all(x.dtype == jnp.bfloat16 for x in flat_got) and len(flat) == len(flat_got)
  for x, y in zip(flat, flat_got):  # the values every layer casts to before use
    np.testing.assert_array_equal(np.asarray(x.astype(jnp.bfloat16), np.float32), np.asarray(y, np.float32))
  bf16 = model_lib.cast_params(params, "bfloat16")  # a bf16-stored reference: no copy at all on TPU
  assert model_lib.decode_params(dataclasses.replace(cfg), bf16, backend="tpu") is bf16
  # on GPU the layers come unstacked (a list of per-layer trees), layer i holding row i of each stacked weight
  gpu = model_lib.decode_params(cfg, params, backend="gpu")
  assert isinstance(gpu["layers"], list) and len(gpu["layers"]) == cfg.num_layers
  for i, lp in enumerate(gpu["layers"]):
    for name, w in lp.items():
      np.testing.assert_array_equal(np.asarray(w, np.float32),
                                    np.asarray(params["layers"][name][i].astype(jnp.bfloat16), np.float32))
  assert model_lib.decode_params(cfg, gpu, backend="gpu") is gpu
