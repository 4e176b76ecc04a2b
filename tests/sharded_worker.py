"""Sharded train step and sampler on 8 faked CPU devices versus one device; prints one JSON line.

Run by tests/test_sharded.py in a fresh process: XLA reads the faked device count only before
JAX initialises, and the pytest process has already initialised it with one device. This script
only measures; the assertions live in the test.
"""
import json
import os
import re
import sys

# Backend optimisation level 0 halves the CPU compile time of these tiny programs; both the
# one-device reference and the sharded runs use it.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0")
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from astarpo_jax.infra.sharding import batch_ways, make_mesh  # noqa: E402
from astarpo_jax.model import decoder  # noqa: E402
from astarpo_jax.model.config import ModelConfig
from astarpo_jax.sampling import sampler
from astarpo_jax.sampling.token_choice import SamplingConfig
from astarpo_jax.training import packing, update
from tests import method_steps as MS  # noqa: E402

MESHES = [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4)]
# heads 4 / kv heads 2: tensor=2 splits both, tensor=4 splits the query heads and replicates the kv heads.
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)
P, R, B, MICRO = 6, 5, 16, 8
WATCHED = {"embed": ("embed",), "wq": ("layers", "wq"), "wk": ("layers", "wk"), "bq": ("layers", "bq"),
           "w_gate": ("layers", "w_gate"), "w_down": ("layers", "w_down"), "attn_norm": ("layers", "attn_norm")}


def _batch(seed=0, longest=(P, R)):
  """B rows of prompts and responses of random lengths up to `longest` (short ones pack two to a row)."""
  rng = np.random.default_rng(seed)
  prompt_len = rng.integers(1, longest[0] + 1, B)
  resp_len = rng.integers(1, longest[1] + 1, B)
  mask = np.zeros((B, P + R), bool)
  resp_mask = np.zeros((B, R), bool)
  for i in range(B):
    mask[i, P - prompt_len[i]:P + resp_len[i]] = True
    resp_mask[i, :resp_len[i]] = True
  return {"tokens": rng.integers(1, CFG.vocab_size, (B, P + R)).astype(np.int32), "mask": mask,
          "resp_mask": resp_mask, "ref_logp": rng.normal(-3.0, 0.5, (B, R)).astype(np.float32),
          "rewards": rng.integers(0, 2, B).astype(np.float32), "vstar": rng.uniform(0, 1, B).astype(np.float32)}


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def _spec(x) -> list:
  return [None if s is None else list(s) if isinstance(s, tuple) else s for s in x.sharding.spec]


def _max_diff(a, b) -> float:
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
             zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _moments(opt_state):
  """AdamW's mu and nu trees (param-shaped leaves of the optimizer state)."""
  return [x for x in jax.tree.leaves(opt_state) if np.ndim(x) > 0]


def _collectives(step, state, batch) -> dict:
  """Cross-device ops in the compiled step's HLO: all of them, and those partitioning the packed rows'
  gather back (scoring._gather_in_shards' scope), and how many ops that scope has."""
  text = step.lower(state, batch).compile().as_text()
  ops = [line for line in text.splitlines()
         if re.search(r"\b(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)(-start)?\(", line)]
  return {"all": len(ops), "packed_gather": sum("packed_gather" in line for line in ops),
          "packed_gather_ops": sum("packed_gather" in line for line in text.splitlines())}


def _packed_step(params, opt, method, batch, mesh, shardings, bsh) -> dict:
  """The step on each batch shard's rows packed apart (train.pack_rows), and its collectives: the gather
  back to the [B, R] layout must need none (each shard reads its own rows)."""
  packed = packing.pack_microbatches(batch, P, shards=batch_ways(mesh))
  step = MS.jit_step(CFG, method, opt, P, state_shardings=shardings, batch_sharding=bsh)
  with jax.set_mesh(mesh):
    state = jax.device_put(MS.init_state(params, opt), shardings)
    packed_ops = _collectives(step, state, jax.device_put(packed, bsh))
    new, m = step(state, jax.device_put(packed, bsh))
    jax.block_until_ready(new)
  return {"loss": float(m["loss"]), "params": new["params"], "rows": packed["pack_tokens"].shape[1:3],
          "packed_collectives": packed_ops}


def main():
  params = jax.device_get(decoder.init_params(CFG, seed=3)[1])  # host copies: the step donates device ones
  method = MS.method("astarpo", beta2=0.05, entropy_coef=0.01, logp_chunk=4)
  # eps 1e-4 keeps Adam's first step g/(|g|+eps) smooth: with the default 1e-8, gradients near zero turn
  # reduction-order noise of 1e-9 into parameter differences of order lr.
  opt = update.make_optimizer(lr=1e-2, eps=1e-4)
  batch = update.split_microbatches(_batch(), MICRO)
  scfg = SamplingConfig(temperature=0.0, max_new_tokens=6, pad_id=0)
  prompts = [list(np.random.default_rng(i).integers(1, CFG.vocab_size, 1 + i % 5)) for i in range(8)]
  tokens_BP, mask_BP = sampler.left_pad(prompts, scfg.pad_id)
  key = jax.random.key(0)

  one = jax.devices()[0]
  ref_state = jax.device_put(MS.init_state(params, opt), one)
  ref_state, ref_m = MS.jit_step(CFG, method, opt, P)(ref_state, jax.device_put(batch, one))
  short = update.split_microbatches(_batch(1, (3, 2)), MICRO)  # rows of at most 5 of 11 columns: they pack
  short_state, short_m = MS.jit_step(CFG, method, opt, P)(jax.device_put(MS.init_state(params, opt), one),
                                                           jax.device_put(short, one))
  ref_out = jax.device_get(sampler.sample_padded(CFG, jax.device_put(params, one), tokens_BP, mask_BP, key, scfg))

  results = {"device_count": jax.device_count(), "reference_loss": float(ref_m["loss"]), "meshes": {}}
  for shape in MESHES:
    mesh = make_mesh(shape)
    shardings = update.state_shardings(CFG, update.Optimizers(opt), mesh)
    bsh = update.batch_sharding(mesh, MICRO)
    state = jax.device_put(MS.init_state(params, opt), shardings)
    in_specs = {name: _spec(_get(state["params"], path)) for name, path in WATCHED.items()}
    moment_specs = [_spec(x) for x in _moments(state["opt_state"])]
    param_specs = [_spec(x) for x in jax.tree.leaves(state["params"])]
    step = MS.jit_step(CFG, method, opt, P, state_shardings=shardings, batch_sharding=bsh)
    with jax.set_mesh(mesh):
      new, m = step(state, jax.device_put(batch, bsh))
      jax.block_until_ready(new)
      sharded_params = jax.device_put(params, shardings["params"])
      tokens_in = jax.device_put(tokens_BP, NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))
      out = sampler.sample_padded(CFG, sharded_params, tokens_in, mask_BP, key, scfg)
      out_spec = _spec(out.tokens_BT)
      out = jax.device_get(out)
    pk = _packed_step(params, opt, method, short, mesh, shardings, bsh)
    results["meshes"][str(shape)] = {
        "packed_loss": pk["loss"],
        "packed_reference_loss": float(short_m["loss"]),
        "packed_params_max_diff": _max_diff(pk["params"], short_state["params"]),
        "packed_shards_rows": list(pk["rows"]),
        "packed_collectives": pk["packed_collectives"],
        "loss": float(m["loss"]),
        "grad_norm": float(m["grad_norm"]),
        "reference_grad_norm": float(ref_m["grad_norm"]),
        "params_max_diff": _max_diff(new["params"], ref_state["params"]),
        "moments_max_diff": _max_diff(_moments(new["opt_state"]), _moments(ref_state["opt_state"])),
        "num_moments": len(_moments(new["opt_state"])),
        "num_params": len(jax.tree.leaves(params)),
        "param_specs_in": in_specs,
        "moment_specs_match_params": moment_specs == param_specs + param_specs,
        "state_out_shardings_match": all(
            x.sharding.is_equivalent_to(s, x.ndim) for x, s in
            zip(jax.tree.leaves(new), jax.tree.leaves(shardings))),
        "state_donated": all(x.is_deleted() for x in jax.tree.leaves(state)),
        "sample_tokens_equal": bool(np.array_equal(out.tokens_BT, ref_out.tokens_BT)),
        "sample_logp_max_diff": float(np.max(np.abs(out.logp_BT - ref_out.logp_BT))),
        "sample_tokens_spec": out_spec,
        "sampled_param_wq_spec": _spec(sharded_params["layers"]["wq"]),
    }
  print(json.dumps(results))


if __name__ == "__main__":
  main()
