"""The copy onto the sampling mesh (sampler.sampling_params) as the run makes it, a small program a leaf, and its
compile-only peak (aot.compiling's reshard phases): resident + the tree as stored + the copy + the largest one
leaf's temporaries, counted here by hand from the model's shapes on a v5e:2x2 compile-only topology."""

import pytest

from astarpo_jax.aot import chips
from astarpo_jax.aot.memory_plan import RunShape
from astarpo_jax.model.config import ModelConfig

needs_libtpu = pytest.mark.skipif(not chips.libtpu_available(),
                                  reason="libtpu not installed: pip install -e '.[test]' brings it (jax[tpu])")
TINY = ModelConfig(vocab_size=512, hidden_size=512, intermediate_size=512, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=128, dtype="bfloat16", remat=True)
RUN = RunShape(prompt_len=128, response_len=128, rollout_batch=16, micro_batch=8, sample_batch=16,
               logp_chunk=64, mini_batch=16, stage1_batch=16)
PAD = 16384  # TPU tiles pad a small leaf to <= 1 KiB


def _hand(cfg: ModelConfig):
  """(elements of every matrix, of the q/k/v biases, of the norms, of the largest leaf) of the model."""
  V, D, F, L, N, K, H = (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
                         cfg.num_kv_heads, cfg.head_dim)
  matrices = V * D + L * (D * N * H + 2 * D * K * H + N * H * D + 3 * D * F)
  return matrices, L * (N * H + 2 * K * H), L * 2 * D + D, max(V * D, L * D * F, L * D * N * H)


@needs_libtpu
def test_reshard_peak_is_the_stored_tree_the_copy_and_one_leafs_temporaries_by_hand():
  """Training mesh (1, 4, 1) -> sampling mesh (2, 1, 2). π_ref's bf16 tree as stored: every matrix split 4 ways
  over fsdp, biases and norms whole. The copy: matrices and biases split 2 ways over tensor; the norms, whole on
  both meshes, are kept as they are (no new bytes). Temporaries: at most the largest leaf whole, not the tree's.
  With an fp32 policy the cast to bf16 on the training mesh stays live beside the copy."""
  from astarpo_jax.aot import compiling, layouts
  devices = chips.topology_devices("v5e:2x2")
  mesh, sample = layouts.abstract_mesh_devices(devices, (1, 4, 1)), layouts.abstract_mesh_devices(devices, (2, 1, 2))
  matrices, biases, norms, largest = _hand(TINY)
  stored_bf16 = 2 * (matrices // 4 + biases + norms)
  copy = 2 * (matrices + biases) // 2
  res = compiling.compile_phase("stage1_reshard", TINY, RUN, mesh, sample_mesh=sample)  # π_ref in bf16
  assert not res.error, res.error
  assert stored_bf16 <= res.memory["argument"] <= stored_bf16 + PAD
  assert copy <= res.memory["output"] <= copy + PAD
  assert res.memory["temp"] == res.memory["largest_leaf_temp"] <= 2 * largest
  assert res.resident_other == 0
  code = res.memory["code"]
  assert stored_bf16 + copy <= res.peak - res.memory["temp"] - code <= stored_bf16 + copy + 2 * PAD
  policy = compiling.compile_phase("rollout_reshard", TINY, RUN, mesh, sample_mesh=sample)  # fp32, cast first
  assert not policy.error, policy.error
  assert 2 * stored_bf16 <= policy.memory["argument"] <= 2 * stored_bf16 + PAD  # fp32 as stored
  assert copy <= policy.memory["output"] <= copy + PAD
  cast = policy.memory["temp"] - policy.memory["largest_leaf_temp"]
  assert stored_bf16 <= cast <= stored_bf16 + PAD  # the bf16 cast on the training mesh, live until the copy ends


_COPY_ON_4_DEVICES = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from astarpo_jax.sampling import sampler
devices = np.array(jax.devices())
a, b = Mesh(devices.reshape(1, 4), ("x", "y")), Mesh(devices.reshape(2, 2), ("x", "y"))
value = jnp.arange(32 * 6, dtype=jnp.float32).reshape(32, 6)
x = jax.device_put(value, NamedSharding(a, PartitionSpec("y", None)))
target = NamedSharding(b, PartitionSpec(None, "y"))
y = sampler.copy_to(x, target)
assert y.sharding.is_equivalent_to(target, 2) and np.array_equal(np.asarray(y), np.asarray(value))
assert x._npy_value is None, "copied through the host"
assert sampler.copy_to(y, target) is y
assert jax.device_put(x, target).sharding.is_equivalent_to(target, 2) and x._npy_value is not None
print("ok")
"""


def test_copy_to_moves_a_leaf_between_meshes_of_the_same_devices_without_the_host():
  """sampler.copy_to on 4 faked CPU devices: rows split 4 ways on a (1, 4) mesh come out with columns split 2 ways
  on a (2, 2) mesh of the same devices, equal, with no host copy cached on the source, where jax.device_put's
  slow path (jax 0.10.2) leaves one (`_npy_value`); a leaf already so placed comes back as it is."""
  import os
  import subprocess
  import sys
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
  run = subprocess.run([sys.executable, "-c", _COPY_ON_4_DEVICES], env=env, capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]
