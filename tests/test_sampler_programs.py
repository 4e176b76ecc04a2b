"""The programs a sampling call compiles, which the CPU demo's time rests on (docs/lora.md): a short CPU decode keeps
one slot count (decode_plan.default_min_slots) and a LoRA run's merged policy runs the programs of its base config
(engine.program_config); neither changes a row, checked against a stepwise full forward."""
import jax
import pytest

from astarpo_jax.model import lora
from astarpo_jax.model.layer_forms import unstack_layers
from astarpo_jax.sampling import decode_plan, engine, sampler as sampler_lib
from tests.test_engine import SCFG, stepwise_reference
from tests.test_sampler import PROMPTS, response, tiny_model

N = 3  # samples per prompt: 18 rows in 16 slots, whose ladder would be [16, 8]


@pytest.fixture(scope="module")
def base_run():
  cfg, params = tiny_model(seed=9)
  prompts, key, stats = PROMPTS + [[9], [4, 4, 4, 4]], jax.random.key(5), decode_plan.RunStats()
  out = jax.device_get(sampler_lib.sample(cfg, params, prompts, key, SCFG, max_batch=16, num_samples=N, stats=stats))
  return cfg, params, prompts, key, out, stats


def test_a_short_cpu_decode_keeps_one_slot_count_and_samples_its_rows(base_run):
  cfg, params, prompts, key, out, stats = base_run
  assert SCFG.max_new_tokens <= decode_plan.CPU_ONE_RUNG_MAX_NEW_TOKENS and stats.compactions == []
  assert {b for b, *_ in stats.segment_log} == {16}
  r = 17  # the last prompt's last row, decoded in a slot refilled after other rows finished
  toks, _ = stepwise_reference(cfg, params, prompts[r // N], key, r, SCFG, SCFG.max_new_tokens)
  assert response(out, r) == toks


def test_the_ladder_stays_on_accelerators_and_for_long_cpu_decodes():
  assert decode_plan.default_min_slots(256, 24, backend="tpu") == decode_plan.default_min_slots(256, 24, backend="gpu") == 8
  assert decode_plan.default_min_slots(64, decode_plan.CPU_ONE_RUNG_MAX_NEW_TOKENS + 1, backend="cpu") == 8
  assert decode_plan.default_min_slots(64, 24, backend="cpu") == 64


def test_a_lora_config_with_merged_params_samples_with_its_base_configs_programs(base_run):
  cfg, params, prompts, key, out, _ = base_run
  lcfg = lora.model_config(cfg, lora.LoraConfig(rank=2, alpha=4.0))  # what a LoRA run's loop passes with its merge
  compiled = {f: f._cache_size() for f in (engine._prefill, engine._segment, engine._refill)}
  merged = jax.device_get(sampler_lib.sample(lcfg, params, prompts, key, SCFG, max_batch=16, num_samples=N))
  assert {f: f._cache_size() for f in compiled} == compiled  # no new program
  assert all(response(merged, r) == response(out, r) for r in range(len(prompts) * N))  # rows checked above
  attached = lora.attach(params, lora.init_adapter(cfg, lcfg.lora))  # an adapter in the params keeps its config
  assert engine.program_config(lcfg, attached) is lcfg and engine.program_config(lcfg, unstack_layers(attached)) is lcfg
