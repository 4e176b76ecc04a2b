"""The paged layout on 8 faked CPU devices: rows sampled on four meshes (data, fsdp, tensor) against the dense
layout on one device; prints one JSON line. Run by tests/test_paged.py in a fresh process (XLA reads the
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
from astarpo_jax.model import decoder  # noqa: E402
from astarpo_jax.model.config import ModelConfig  # noqa: E402
from astarpo_jax.sampling import decode_plan, sampler  # noqa: E402
from astarpo_jax.sampling.token_choice import SamplingConfig  # noqa: E402

MESHES = [(8, 1, 1), (2, 2, 2)]  # rows over 8 devices; rows over 4 with kv heads over 2
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)


def main():
  _, params = decoder.init_params(CFG, seed=3)
  scfg = SamplingConfig(temperature=1.0, max_new_tokens=6, pad_id=0)
  prompts = [list(np.random.default_rng(i).integers(1, CFG.vocab_size, 1 + i % 5)) for i in range(12)]
  key = jax.random.key(5)
  ref = jax.device_get(sampler.sample(CFG, params, prompts, key, scfg, 8, num_samples=2, layout="dense"))
  out = {}
  for shape in MESHES:
    mesh = sharding.make_mesh(shape)
    placed = jax.device_put(params, decoder.param_shardings(CFG, mesh))
    stats = decode_plan.RunStats()
    with jax.set_mesh(mesh):
      got = jax.device_get(sampler.sample(CFG, placed, prompts, key, scfg, 8, num_samples=2, layout="paged",
                                          page_size=4, attention="xla", stats=stats))
    out[str(shape)] = {"tokens_equal": bool(np.array_equal(got.tokens_BT, ref.tokens_BT)),
                       "logp_max_diff": float(np.abs(got.logp_BT - ref.logp_BT).max()),
                       "pages_returned": stats.pages_returned}
  print(json.dumps(out))


if __name__ == "__main__":
  main()
