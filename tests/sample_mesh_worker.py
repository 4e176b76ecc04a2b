"""Sampling on a sampling mesh (config mesh.sample_shape) versus on the training mesh, 8 faked CPU
devices; prints one JSON line. Run by tests/test_sample_mesh.py in a fresh process (XLA reads the
faked device count only before JAX starts). This script only measures; the test asserts.
"""
import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0")
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from astarpo_jax.infra import sharding  # noqa: E402
from astarpo_jax.model import decoder
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.sampling import rollout, sampler
from astarpo_jax.sampling.token_choice import SamplingConfig

TRAIN = (1, 8, 1)
SAMPLE = [(2, 4, 1), (8, 1, 1), (1, 2, 4), (2, -1, 1)]
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)


def _spec(x) -> list:
  return [None if s is None else list(s) if isinstance(s, tuple) else s for s in x.sharding.spec]


def main():
  mesh = sharding.make_mesh(TRAIN)
  params = jax.device_put(decoder.init_params(CFG, seed=3)[1], decoder.param_shardings(CFG, mesh))
  before = jax.tree.map(lambda x: x.sharding, params)
  scfg = SamplingConfig(temperature=1.0, max_new_tokens=6, pad_id=0)
  prompts = [list(np.random.default_rng(i).integers(1, CFG.vocab_size, 1 + i % 5)) for i in range(12)]
  tokens_BP, mask_BP = sampler.left_pad(prompts, scfg.pad_id)
  key = jax.random.key(5)
  draw = lambda sample_mesh: rollout.sample_shares(CFG, params, tokens_BP, mask_BP, key, scfg, 8, mesh, 2,  # noqa: E731
                                                   sample_mesh)[0]
  with jax.set_mesh(mesh):  # as experiments/main.py runs
    ref = draw(None)
    out = {"rows": int(ref.tokens_BT.shape[0]), "meshes": {}}
    for shape in SAMPLE:
      sm = sharding.sample_mesh(shape, mesh)
      got = draw(sm)
      placed = sampler.sampling_params(CFG, params, sm)
      inner = sampler.sample_padded(CFG, params, tokens_BP, mask_BP, key, scfg, 8, num_samples=2, mesh=sm)
      out["meshes"][str(shape)] = {
          "mesh_shape": list(sm.devices.shape),
          "tokens_equal": bool(np.array_equal(got.tokens_BT, ref.tokens_BT)),
          "lengths_equal": bool(np.array_equal(got.length_B, ref.length_B)),
          "logp_max_diff": float(np.max(np.abs(got.logp_BT - ref.logp_BT))),
          "sampled_wq_spec": _spec(placed["layers"]["wq"]),
          "output_mesh_shape": list(inner.tokens_BT.sharding.mesh.devices.shape),
          "train_params_kept": all(x.sharding == s and not x.is_deleted() for x, s in
                                   zip(jax.tree.leaves(params), jax.tree.leaves(before))),
      }
    out["same_mesh_is_none"] = sharding.sample_mesh(TRAIN, mesh) is None and sharding.sample_mesh((), mesh) is None
  print(json.dumps(out))


if __name__ == "__main__":
  main()
