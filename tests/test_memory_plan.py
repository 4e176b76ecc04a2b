"""Memory plan: exact resident bytes per device, analytic phases against XLA's memory analysis,
clear refusals naming the settings to change, the device table and the command-line script."""
import dataclasses
import os
import subprocess
import sys

import pytest
from jax.sharding import AbstractMesh

from astarpo_jax import methods
from astarpo_jax.aot import chips, memory_plan as mp
from astarpo_jax.infra import sharding
from astarpo_jax.infra.sharding import MESH_AXES
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.training import update

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8)
RUN = mp.RunShape(prompt_len=16, response_len=8, rollout_batch=16, micro_batch=8, sample_batch=8, logp_chunk=4)


def _hand_param_count():
  V, D, F, L, N, K, H = 64, 32, 64, 2, 4, 2, 8
  layer = D * N * H * 2 + D * K * H * 2 + N * H + 2 * K * H + 3 * D * F + 2 * D
  return V * D + L * layer + D  # tied embedding, final norm


def test_resident_bytes_on_one_device_are_params_adam_moments_and_bf16_reference():
  res = mp.resident_bytes(TINY, "bfloat16", update.Optimizers(update.make_optimizer()), AbstractMesh((1, 1, 1), MESH_AXES),
                         methods.get("astarpo"))
  n = _hand_param_count()
  assert res["params"] == 4 * n
  assert 8 * n <= res["opt_state"] <= 8 * n + 64  # mu and nu in fp32, plus a few scalars (count, lr)
  assert res["ref_params"] == 2 * n


def test_resident_bytes_per_device_divide_by_the_shards_the_rule_table_allows():
  res = mp.resident_bytes(TINY, "float32", update.Optimizers(update.make_optimizer()), AbstractMesh((1, 4, 2), MESH_AXES),
                         methods.get("astarpo"))
  # per-device elements, leaf by leaf: embed over fsdp=4, vocab/heads/kv_heads/mlp over tensor=2
  local = {"embed": 64 * 32 // 8, "wq": 2 * 8 * 2 * 8, "wk": 2 * 8 * 1 * 8, "wv": 2 * 8 * 1 * 8,
           "wo": 2 * 2 * 8 * 8, "w_gate": 2 * 8 * 32, "w_up": 2 * 8 * 32, "w_down": 2 * 32 * 8,
           "attn_norm": 2 * 32, "mlp_norm": 2 * 32, "bq": 2 * 2 * 8, "bk": 2 * 1 * 8, "bv": 2 * 1 * 8, "final_norm": 32}
  assert res["params"] == 4 * sum(local.values())
  assert res["ref_params"] == res["params"]


def test_sample_phase_on_a_sampling_mesh_holds_the_bf16_copy_and_its_cache_split():
  cfg = dataclasses.replace(TINY, dtype="bfloat16")
  train = mp.plan_memory(cfg, RUN, (1, 8, 1), num_devices=8)
  plan = mp.plan_memory(cfg, RUN, (1, 8, 1), num_devices=8, sample_shape=(1, -1, 2))
  # the same leaves as the (1, 4, 2) fp32 layout above, in bf16 (2 bytes each)
  local = (64 * 32 // 8 + 2 * 8 * 2 * 8 + 2 * 2 * 8 * 1 * 8 + 2 * 2 * 8 * 8 + 3 * 2 * 8 * 32 + 2 * 2 * 32 + 2 * 2 * 8
           + 2 * 2 * 1 * 8 + 32)
  assert plan.phases["sample"].parts["sampling_copy"] == 2 * local
  assert "sampling_copy" not in train.phases["sample"].parts
  # the cache: rows over data x fsdp = 4 instead of 8, the 2 kv heads over tensor = 2: the same bytes
  assert plan.phases["sample"].parts["kv_cache"] == train.phases["sample"].parts["kv_cache"]
  assert mp.plan_memory(cfg, RUN, (1, 8, 1), num_devices=8, sample_shape=(1, 8, 1)).phases["sample"] == \
      train.phases["sample"]


def test_sampling_on_the_training_mesh_counts_the_copy_of_the_weights_the_decode_makes():
  """model.decode_params: the GPU unstacks the layers (a copy in any dtype), the CPU fuses them, a TPU casts a
  policy stored wider than it computes; a bf16 policy on TPU samples with itself."""
  n = _hand_param_count()

  def copy(param_dtype, dtype, backend):
    cfg = dataclasses.replace(TINY, param_dtype=param_dtype, dtype=dtype)
    return mp.plan_memory(cfg, RUN, (1, 1, 1), num_devices=1, backend=backend).phases["sample"].parts.get(
        "decode_copy", 0)
  assert copy("float32", "bfloat16", "gpu") == copy("bfloat16", "bfloat16", "gpu") == 2 * n
  assert copy("float32", "bfloat16", "tpu") == 2 * n and copy("bfloat16", "bfloat16", "tpu") == 0
  assert copy("float32", "float32", "cpu") == 4 * n and copy("float32", "float32", "tpu") == 0
  bf16 = dataclasses.replace(TINY, param_dtype="bfloat16", dtype="bfloat16")
  total = {b: mp.plan_memory(bf16, RUN, (1, 1, 1), num_devices=1, backend=b).phases["sample"].total
           for b in ("gpu", "tpu")}
  assert total["gpu"] - total["tpu"] == 2 * n  # in the phase's total, so in the peak check_fits judges


def test_kv_cache_is_rows_times_length_layers_kv_heads_head_dim_k_and_v():
  cfg = dataclasses.replace(TINY, dtype="bfloat16")
  one = mp.estimate_sample(cfg, RUN, {"data": 1, "fsdp": 1, "tensor": 1}, 0).parts["kv_cache"]
  assert one == 8 * (16 + 8) * 2 * 2 * 8 * 2 * 2
  # (2, 2, 2): rows split over data x fsdp = 4, the 2 kv heads over tensor = 2
  assert mp.estimate_sample(cfg, RUN, {"data": 2, "fsdp": 2, "tensor": 2}, 0).parts["kv_cache"] == one // 8


def test_sample_total_is_cache_pool_rows_and_the_larger_of_prefill_and_token_choice_work():
  # hand-worked for TINY in bf16 on one device, 4-token prompts and 60-token responses (decode dominates):
  # 8 slots x 64 columns x (2 layers x 2 kv heads x 8 x k,v x 2 B); the decode writes the cache in place
  cfg = dataclasses.replace(TINY, dtype="bfloat16")
  run = dataclasses.replace(RUN, prompt_len=4, response_len=60)
  kv, pool, rows = 8 * 64 * 128, 16 * 4 * 128, 16 * 60 * 9
  prefill, choice = 8 * 4 * 4 * 4 * 4 * 2, 8 * 64 * 4 * 4  # [slots, N, P, P] fp32 x2; [slots, V] fp32 x4
  phase = mp.estimate_sample(cfg, run, {"data": 1, "fsdp": 1, "tensor": 1}, 0)
  assert prefill < choice
  assert phase.total == kv + pool + rows + choice


def test_estimates_track_xla_memory_analysis_and_remat_shrinks_the_update():
  cfg = ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
                    num_kv_heads=2, head_dim=64, remat=True)
  run = mp.RunShape(prompt_len=64, response_len=192, rollout_batch=32, micro_batch=8, sample_batch=32, logp_chunk=64)
  plan = mp.plan_memory(cfg, run, (1, 1, 1), num_devices=1, compile=True, mini_batch=16)
  assert plan.phases["update"].source == plan.phases["reference"].source == "compiled (cpu)"
  estimate = mp.plan_memory(cfg, run, (1, 1, 1), num_devices=1)
  for phase in ("reference", "update"):
    ratio = estimate.phases[phase].total / plan.phases[phase].total
    assert 0.5 < ratio < 2.0, (phase, ratio)
  no_remat = dataclasses.replace(cfg, remat=False)
  compiled = mp.compiled_update_bytes(no_remat, methods.get("astarpo", {"logp_chunk": 64}),
                                     update.Optimizers(update.make_optimizer()), run,
                                      (1, 1, 1), 16)
  assert compiled.total > 2 * plan.phases["update"].total
  ratio = mp.estimate_update(no_remat, run, {"data": 1, "fsdp": 1, "tensor": 1}, plan.resident["params"]).total \
      / compiled.total
  assert 0.5 < ratio < 2.0, ratio


def test_compiling_a_plan_for_more_devices_than_the_process_has_says_how_to_fake_them():
  with pytest.raises(ValueError, match="xla_force_host_platform_device_count=4"):
    mp.plan_memory(TINY, RUN, (1, -1, 1), num_devices=4, compile=True)


def test_micro_batch_the_mesh_cannot_split_is_refused_before_planning():
  with pytest.raises(ValueError, match="micro_batch=8 .* multiple of 16"):
    mp.plan_memory(TINY, RUN, (1, -1, 1), num_devices=16)


def _with_phase(plan, name, total):
  phases = dict(plan.phases, **{name: mp.Phase(total, {"x": total}, "analytic")})
  return dataclasses.replace(plan, phases=phases)


def test_check_fits_names_the_settings_to_change_for_the_phase_that_overflows():
  plan = mp.plan_memory(TINY, RUN, (1, 1, 1), num_devices=1)
  small = {p: mp.Phase(0, {}, "analytic") for p in mp.PHASES}
  base = dataclasses.replace(plan, phases=small)
  limit = base.resident_total + 1000
  mp.check_fits(base, limit)  # fits: no error
  expected = {"update": ["train.micro_batch", "model.remat=True", "mesh.shape"],
              "reference": ["train.micro_batch"], "sample": ["sampling.max_batch", "sampling.max_new_tokens"]}
  for phase, words in expected.items():
    with pytest.raises(mp.MemoryPlanError, match=f"{phase} phase needs") as e:
      mp.check_fits(_with_phase(base, phase, 2000), limit)
    for w in words:
      assert w in str(e.value), (phase, w)
  with pytest.raises(mp.MemoryPlanError, match=r"resident state .*\(mesh.shape"):
    mp.check_fits(base, base.resident_total - 1)
  with pytest.raises(ValueError, match="no device memory known"):
    mp.check_fits(base)


def test_device_table_knows_tpu_slices_and_gpus():
  v4 = chips.device_spec("v4-8")
  assert (v4.num_devices, v4.bytes_per_device) == (4, 32 * mp.GiB)  # 8 TensorCores = 4 chips
  assert (chips.device_spec("v5e-8").num_devices, chips.device_spec("v5e-8").bytes_per_device) == (8, 16 * mp.GiB)
  assert chips.device_spec("v5litepod-16").num_devices == 16
  assert (chips.device_spec("v5p-8").num_devices, chips.device_spec("v5p-8").bytes_per_device) == (4, 95 * mp.GiB)
  h200 = chips.device_spec("h200")
  # 141 GiB: the device_memory_size of XLA's h200.txtpb target spec (the device's own figure), not 141 x 10^9
  assert (h200.num_devices, h200.bytes_per_device, h200.usable_bytes) == (1, 141 * mp.GiB, int(0.75 * 141 * mp.GiB))
  assert chips.device_spec("H100x8", gpu_mem_fraction=0.9).num_devices == 8
  assert chips.device_spec("a100-80x4").usable_fraction == 0.75
  with pytest.raises(ValueError, match="unknown device 'tpu9'"):
    chips.device_spec("tpu9")
  with pytest.raises(ValueError, match="is odd"):  # v4 names count TensorCores, two per chip
    chips.device_spec("v4-7")
  assert chips.device_spec("v5e:2x4").num_devices == 8  # a topology, as the compile-only path names it


@pytest.mark.skipif(not chips.libtpu_available(), reason="compile-only TPU devices need libtpu")
def test_one_v5e_chip_is_a_host_of_one_chip_that_the_tpu_compiler_compiles_for():
  """v5litepod-1 (Colab's TPU): libtpu refuses the topology v5e:1x1 under its default 2x2x1 chips per host."""
  import jax
  import jax.numpy as jnp
  one = chips.slice_spec("v5e-1")
  assert (one.topology, one.num_devices, one.host_bounds, one.num_hosts) == ("v5e:1x1", 1, (1, 1, 1), 1)
  (device,) = chips.topology_devices("v5e:1x1")
  assert device.device_kind == "TPU v5 lite"
  mesh = jax.sharding.Mesh([[[device]]], MESH_AXES)
  x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=jax.sharding.NamedSharding(mesh, jax.P()))
  compiled = jax.jit(lambda a: a @ a).lower(x).compile()
  assert compiled.memory_analysis().output_size_in_bytes == 1024 * 1024 * 2

def test_mesh_shape_minus_one_takes_the_remaining_devices():
  assert sharding.resolve_mesh_shape((1, -1, 1), 8) == (1, 8, 1)
  assert sharding.resolve_mesh_shape((2, -1, 2), 8) == (2, 2, 2)
  with pytest.raises(ValueError, match="needs 4 devices, found 8"):
    sharding.resolve_mesh_shape((1, 4, 1), 8)


def _script(*args):
  env = dict(os.environ, HF_HUB_OFFLINE="1")
  return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "memory_plan.py"), *args], env=env,
                        capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_script_compiles_the_plan_on_faked_devices_and_reports_a_fit():
  out = _script("--config=configs/demo.py:tiny", "--device=v5e-8")
  assert out.returncode == 0, out.stderr[-2000:]
  assert "mesh (data, fsdp, tensor) = (1, 8, 1)" in out.stdout
  assert "compiled (cpu)" in out.stdout and ": fits |" in out.stdout


def test_script_exits_nonzero_with_the_fix_when_the_model_does_not_fit():
  out = _script("--config=configs/qwen7b.py", "--device=a100-40", "--nocompile")
  assert out.returncode == 1, out.stderr[-2000:]
  assert "DOES NOT FIT" in out.stdout and "resident state" in out.stdout and "mesh.shape" in out.stdout


def test_advice_names_the_per_device_field_a_per_device_config_sets():
  """configs/qwen7b.py sizes micro-batches per device: 'lower train.micro_batch' would conflict with it."""
  out = _script("--config=configs/qwen7b.py", "--device=v5e-8", "--nocompile")
  assert out.returncode == 1, out.stderr[-2000:]
  assert "lower train.micro_batch_per_device (now 1: 8 prompts per micro-batch" in out.stdout
  assert "lower train.micro_batch (" not in out.stdout


def test_a_phase_the_tpu_compiler_refused_counts_the_bytes_its_message_names():
  """Both wordings of libtpu's out-of-memory error give the bytes the program needed (not a sentinel)."""
  import types
  temps = "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (38.87G) " \
          "exceeds available HBM (30.75G)."
  used = "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 20.5G of 15.75G hbm."
  assert mp.from_aot(types.SimpleNamespace(error=temps), 0).total == int(38.87 * 2**30)
  assert mp.from_aot(types.SimpleNamespace(error=used), 0).total == int(20.5 * 2**30)
  assert mp.from_aot(types.SimpleNamespace(error="no size in this message"), 0).total == 1 << 50
