"""The memory plan knows LoRA: resident bytes are the adapter's (and its AdamW moments) plus one frozen base,
the sample phase holds the merged compute-dtype copy, and the update step compiles on the adapter alone."""
import jax.numpy as jnp
import numpy as np

from astarpo_jax import methods
from astarpo_jax.aot import memory_plan as mp
from astarpo_jax.model import lora
from astarpo_jax.model.config import ModelConfig

CFG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, dtype="bfloat16", param_dtype="float32")
LCFG = lora.LoraConfig(targets=("q", "o", "down"), rank=4, alpha=8.0, base_dtype="bfloat16")
RUN = mp.RunShape(prompt_len=16, response_len=16, rollout_batch=8, micro_batch=4, sample_batch=8, mini_batch=8,
                  ref_param_dtype="bfloat16")


def _plan(run, compile=False):
  return mp.plan_memory(CFG, run, (1, 1, 1), num_devices=1, ref_param_dtype=run.ref_param_dtype,
                        method=methods.get("astarpo", {}), mini_batch=run.mini_batch, compile=compile, backend="tpu")


def test_lora_resident_state_is_the_adapter_and_one_bf16_base_hand_counted():
  import dataclasses
  plan = _plan(dataclasses.replace(RUN, lora=LCFG))
  D, N, H, F, L, r = 32, 4, 8, 64, 2, 4
  adapter = L * r * ((D + N * H) + (N * H + D) + (F + D))  # q: D -> N*H, o: N*H -> D, down: F -> D
  assert plan.resident["params"] == 4 * adapter
  assert 8 * adapter <= plan.resident["opt_state"] <= 8 * adapter + 64  # mu, nu (+ AdamW's scalar counts)
  assert plan.resident["ref_params"] == 2 * CFG.num_params  # the base, once, in bf16: also pi_ref
  full = _plan(RUN)
  assert full.resident["params"] == 4 * CFG.num_params and plan.resident_total < full.resident_total / 2
  # sampling: the adapter merged into a bf16 copy of the base, as big as the TPU's cast of an fp32 policy
  assert plan.phases["sample"].parts["lora_merged_copy"] == 2 * CFG.num_params
  assert plan.phases["update"].total < full.phases["update"].total


def test_lora_update_step_compiles_on_the_adapter_with_fewer_temporaries():
  import dataclasses
  lora_plan = _plan(dataclasses.replace(RUN, lora=LCFG), compile=True)
  full = _plan(RUN, compile=True)
  assert lora_plan.phases["update"].source.startswith("compiled")
  assert 0 < lora_plan.phases["update"].parts["temporaries"] < full.phases["update"].parts["temporaries"]
  assert np.isfinite(lora_plan.peak) and jnp.dtype(RUN.ref_param_dtype).itemsize == 2


def test_lora_phases_resident_beside_them_hand_counted_and_rollout_compiles_on_the_merged_bf16_copy():
  """aot.compiling.resident_other with LoRA: a rollout's prefill / decode / reshard keep the adapter, its moments and
  the base resident (they take the merged copy), plus that merged copy on the training mesh when they run on a
  sampling mesh's copy; the update takes the base as its argument; the reference phase is the base's forward."""
  import dataclasses

  import jax
  from jax.sharding import Mesh

  from astarpo_jax.aot import compiling, phases
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
  lcfg_model, run = lora.model_config(CFG, LCFG), dataclasses.replace(RUN, lora=LCFG)
  method = methods.get("astarpo", {})
  D, N, H, F, L, r = 32, 4, 8, 64, 2, 4
  adapter = 4 * L * r * ((D + N * H) + (N * H + D) + (F + D))  # fp32 A and B of q, o, down
  base = merged = 2 * CFG.num_params  # bf16
  other = lambda phase, copy=False: compiling.resident_other(phase, lcfg_model, run, mesh, method, copy)  # noqa: E731
  for phase in ("rollout_prefill", "rollout_decode", "rollout_reshard"):
    assert 3 * adapter + base <= other(phase) <= 3 * adapter + base + 64  # + AdamW's scalar counts
  assert 3 * adapter + base + merged <= other("rollout_decode", True) <= 3 * adapter + base + merged + 64
  assert other("astarpo_update") == 0  # adapter, moments and base are all the step's arguments
  assert 3 * adapter <= other("reference") <= 3 * adapter + 64
  assert other("stage1_decode") == 0 and other("stage1_decode", True) == base
  full = compiling.resident_other("rollout_decode", CFG, RUN, mesh, method)
  assert 8 * CFG.num_params + base <= full <= 8 * CFG.num_params + base + 64  # full FT: the fp32 policy is its argument
  for build in (phases.build_rollout_prefill, phases.build_rollout_reshard):
    settings = {"sample_mesh": mesh} if build is phases.build_rollout_reshard else {}
    _, args = build(lcfg_model, run, mesh, settings)
    assert {x.dtype for x in jax.tree.leaves(args[0])} == {jnp.dtype("bfloat16")}  # lora.sampling_params' copy



def test_in_decode_adapter_phase_reads_the_base_and_a_bf16_adapter_and_keeps_only_the_trained_state_beside():
  """phases.build_rollout_decode_adapter: the decode segment runs x W + s (x A) B on the base and the adapter cast to
  bf16 (it compiles here, on the CPU); beside it stay the fp32 adapter and its moments, not the base (its argument)
  nor a merged copy."""
  import dataclasses

  import jax
  from jax.sharding import Mesh

  from astarpo_jax.aot import compiling, phases
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
  lcfg_model, run = lora.model_config(CFG, LCFG), dataclasses.replace(RUN, lora=LCFG)
  D, N, H, F, L, r = 32, 4, 8, 64, 2, 4
  adapter_elems = L * r * ((D + N * H) + (N * H + D) + (F + D))
  fn, (params, slots) = phases.build_rollout_decode_adapter(lcfg_model, run, mesh, {"page_size": 8})
  leaves = params["layers"]
  assert {k for k in leaves if lora.is_adapter_leaf(k)} == {f"{w}{s}" for w in ("wq", "wo", "w_down")
                                                             for s in ("_lora_a", "_lora_b")}
  assert sum(leaves[k].size for k in leaves if lora.is_adapter_leaf(k)) == adapter_elems
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("bfloat16")}
  other = compiling.resident_other("rollout_decode_adapter", lcfg_model, run, mesh, methods.get("astarpo", {}))
  assert 3 * 4 * adapter_elems <= other <= 3 * 4 * adapter_elems + 64  # fp32 adapter, mu, nu (+ AdamW's counts)
  with jax.set_mesh(mesh):
    assert fn.lower(params, slots).compile() is not None


import importlib  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from astarpo_jax import run_config  # noqa: E402


@pytest.mark.parametrize("name,variant,rank", [("qwen7b", "lora", 64), ("qwen7b", "gsm8k_lora", 64),
                                               ("qwen1p5b", "lora_v5e1", 64), ("demo", "tiny_lora", 16),
                                               ("qwen1p5b", "math", 0)])
def test_lora_configs_load_validate_and_name_their_adapter(name, variant, rank):
  c = importlib.import_module(f"configs.{name}").get_config(variant)
  run_config.validate_config(c)
  lcfg = run_config.lora_settings(c)
  assert (lcfg.rank if lcfg else 0) == rank
  if lcfg is not None:
    assert run_config.ref_param_dtype(c) == lcfg.base_dtype and c.optim.lr > 1e-6  # a deviation, said in docs


@pytest.mark.parametrize("field,value,message", [
    ("model.lora.rank", -1, "config.model.lora.rank"),
    ("model.lora.targets", "q,x", "config.model.lora.targets"),
    ("model.lora.base_dtype", "int8", "config.model.lora.base_dtype"),
    ("model.lora.alpha", 0.0, "config.model.lora.alpha"),
])
def test_bad_lora_settings_in_a_config_are_refused_naming_the_field(field, value, message):
  c = importlib.import_module("configs.qwen7b").get_config("lora")
  section, key = field.rsplit(".", 1)
  node = c
  for part in section.split("."):
    node = node[part]
  node[key] = value
  with pytest.raises(ValueError, match=message):
    run_config.validate_config(c)
