"""The update with the compute copy gathered once per optimizer step (gather_weights "per_step", and
"per_step_local" with the gradients accumulated per device) against the per-micro-batch gathers and one device, on
8 faked CPU devices; prints one JSON line (the test asserts).

Run by tests/test_update_gather.py in a fresh process (XLA reads the faked device count before JAX starts).
"""
import functools
import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0")
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from astarpo_jax.aot import hlo_cost  # noqa: E402
from astarpo_jax.infra.sharding import make_mesh  # noqa: E402
from astarpo_jax.model import decoder  # noqa: E402
from astarpo_jax.model.config import ModelConfig  # noqa: E402
from astarpo_jax.training import loop, packing, scoring, update  # noqa: E402
from tests import method_steps as MS  # noqa: E402
from tests.sharded_worker import MICRO, P, _batch  # noqa: E402

MESHES = [(1, 8, 1), (2, 2, 2)]
# (gather_weights, packed) per mesh: one compile each, run once. Packed = padded for every mode is
# test_sharded's; here packing meets the per-device scan, whose rows are each device's own packed shard.
VARIANTS = [("per_micro_batch", False), ("per_step", False), ("per_step_local", False), ("per_step_local", True)]
# tied embeddings: the unembedding's gradient accumulates beside the copy's (update.accumulate_gradients)
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, tie_embeddings=True)


def _max_diff(a, b) -> float:
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _step(cfg, method, opt, mesh=None, gather="per_micro_batch", bsh=None, shardings=None):
  return update.jit_update_step(cfg, functools.partial(method.loss, cfg, P), update.Optimizers(opt), shardings, bsh,
                                gather_weights=gather)


def _score(params, tokens, mask, mesh=None) -> tuple[np.ndarray, float]:
  """π_ref's scoring forward over all rows (scoring.logprobs_in_blocks, 8 rows a call) and one call's collective
  bytes."""
  out = scoring.logprobs_in_blocks(CFG, params, tokens, mask, P, MICRO)
  with jax.set_mesh(mesh) if mesh is not None else _null():
    text = scoring.logprobs.lower(CFG, params, tokens[:MICRO], mask[:MICRO], prompt_len=P).compile().as_text()
  return out, float(hlo_cost.analyze(text)[0].collective_bytes)


class _null:
  def __enter__(self):
    return None

  def __exit__(self, *a):
    return False


def scoring_placements(params, batch) -> dict:
  """π_ref's log-probs on (2, 2, 2) as placed for training (FSDP: each call gathers the weights) and on the copy a
  run scores with (loop.reference_copy: whole over the batch axes, the tensor split kept), against one device."""
  tokens, mask = (np.asarray(batch[k]).reshape(-1, batch[k].shape[-1]) for k in ("tokens", "mask"))
  one, _ = _score(jax.device_put(params, jax.devices()[0]), tokens, mask)
  mesh = make_mesh((2, 2, 2))
  placed = jax.device_put(params, decoder.param_shardings(CFG, mesh))
  ctx = loop.RunContext(CFG, placed, None, None, None, mesh=mesh)
  copy = loop.reference_copy("auto", ctx)(placed)
  out = {"copy_specs": sorted({str(x.sharding.spec) for x in jax.tree.leaves(copy)}),
         "copy_dtypes": sorted({str(x.dtype) for x in jax.tree.leaves(copy)}),
         "none_per_micro_batch": loop.reference_copy("per_micro_batch", ctx) is None}
  for name, p in (("training", placed), ("copy", copy)):
    logp, coll = _score(p, tokens, mask, mesh)
    out[name] = {"max_diff": float(np.max(np.abs(logp - one))), "collective_bytes": coll}
  return out


def main():
  params = jax.device_get(decoder.init_params(CFG, seed=3)[1])
  method = MS.method("astarpo", beta2=0.05, entropy_coef=0.01, logp_chunk=4)
  opt = update.make_optimizer(lr=1e-2, eps=1e-4)
  batch = update.split_microbatches(_batch(1, (3, 2)), MICRO)  # 2 micro-batches of 8 rows; short rows pack
  one = jax.devices()[0]
  ref, ref_m = _step(CFG, method, opt)(jax.device_put(MS.init_state(params, opt), one), jax.device_put(batch, one))
  out = {"device_count": jax.device_count(), "reference_metrics": {k: float(v) for k, v in ref_m.items()},
         "meshes": {}}
  for shape in MESHES:
    mesh = make_mesh(shape)
    shardings = update.state_shardings(CFG, update.Optimizers(opt), mesh)
    bsh = update.batch_sharding(mesh, MICRO)
    row = {}
    for gather, packed in VARIANTS:
      b = packing.pack_microbatches(batch, P, shards=mesh.shape["data"] * mesh.shape["fsdp"]) if packed else batch
      step = _step(CFG, method, opt, mesh, gather, bsh, shardings)
      with jax.set_mesh(mesh):
        state, placed = jax.device_put(MS.init_state(params, opt), shardings), jax.device_put(b, bsh)
        compiled = step.lower(state, placed).compile()  # one compile: its text read, then it runs
        text = compiled.as_text()
        new, m = compiled(state, placed)
        jax.block_until_ready(new)
      cost = hlo_cost.analyze(text)[0]
      row[f"{gather}{'_packed' if packed else ''}"] = {
          "metrics": {k: float(v) for k, v in m.items()},
          "params_max_diff": _max_diff(new["params"], ref["params"]),
          "moments_max_diff": _max_diff(jax.tree.leaves(new["opt_state"]), jax.tree.leaves(ref["opt_state"])),
          "state_out_shardings_match": all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in
                                           zip(jax.tree.leaves(new), jax.tree.leaves(shardings))),
          "collective_bytes": float(cost.collective_bytes)}
    out["meshes"][str(shape)] = row
  # the bytes one gather of the whole fp32 params moves per device on (1, 8, 1): 7/8 of them; and of the copy
  out["param_bytes"] = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  out["copy_bytes"] = sum(x.size for x in jax.tree.leaves(params)) * np.dtype(CFG.dtype).itemsize
  out["scoring"] = scoring_placements(params, batch)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
