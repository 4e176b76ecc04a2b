"""Stage 2 in one of two JAX processes (CPU, gloo, a (1, 2, 2) mesh across them) with a preemption notice
sent to process 1 only.

Usage: preemption_worker.py PROCESS_ID NUM_PROCESSES PORT WORKDIR STEP. Both processes run loop.run (A*-PO,
4 rollout steps, checkpoints every 2) three times:
  straight     uninterrupted, in WORKDIR/straight;
  preempted    in WORKDIR/preempted with a preemption.Watch; process 1 sends itself SIGTERM while it grades
               rollout step STEP (1-based), process 0 gets nothing;
  resumed      the same call again, which resumes from what `preempted` saved.
Each process writes WORKDIR/result_<process>.json: what `preempted` raised, the checkpoint steps listed after
it, and whether `resumed` reached `straight`'s params bit for bit. tests/test_preemption.py reads them.
"""
import json
import os
import signal
import sys

PROCESS_ID, NUM_PROCESSES, PORT, WORKDIR, STEP = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                                   int(sys.argv[5]))
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
                           " --xla_backend_optimization_level=0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
jax.distributed.initialize(f"localhost:{PORT}", NUM_PROCESSES, PROCESS_ID, initialization_timeout=120)

import numpy as np  # noqa: E402

from astarpo_jax import methods  # noqa: E402
from astarpo_jax.data import dataset, synthetic  # noqa: E402
from astarpo_jax.infra import multihost, preemption, sharding  # noqa: E402
from astarpo_jax.model import decoder  # noqa: E402
from astarpo_jax.model.config import ModelConfig  # noqa: E402
from astarpo_jax.sampling.rollout import Graded  # noqa: E402
from astarpo_jax.sampling.token_choice import SamplingConfig  # noqa: E402
from astarpo_jax.stage1 import value_table as vt  # noqa: E402
from astarpo_jax.training import loop, update  # noqa: E402

TOK = synthetic.build_tokenizer()
CFG = ModelConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=64)
SCFG = SamplingConfig(temperature=1.0, max_new_tokens=8, stop_ids=(TOK.eos_token_id,), pad_id=TOK.pad_token_id)
PROMPTS, _ = dataset.build_prompts(synthetic.load_synthetic(64, 0)[0], TOK, synthetic.PROMPT_TEMPLATE)


def main():
  mesh = sharding.make_mesh((1, NUM_PROCESSES, 2))
  host = jax.device_get(decoder.init_params(CFG, seed=0)[1])
  params = jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: x[i]), host,
                        decoder.param_shardings(CFG, mesh))
  table = vt.ValueTable({p.uid: {"vstar": 0.3} for p in PROMPTS}, list(PROMPTS), "", {})
  settings = loop.LoopSettings(num_steps=4, rollout_batch=8, mini_batch=4, micro_batch=2, checkpoint_every=2)
  calls = {"n": 0}

  def grade(texts, golds, truncated):
    calls["n"] += 1
    if PROCESS_ID == 1 and calls["n"] == STEP and signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
      os.kill(os.getpid(), signal.SIGTERM)  # a notice to this process only, in the middle of rollout step STEP
    rewards = np.array([1.0 if g in t else float(len(t) % 2) for t, g in zip(texts, golds)], np.float32)
    return Graded(rewards, {})

  def train(name, watch=None):
    calls["n"] = 0
    ctx = loop.RunContext(CFG, params, TOK, grade, SCFG, mesh, value_table=table)
    io = loop.RunIO(os.path.join(WORKDIR, name), lambda s: None, PROCESS_ID == 0, preemption=watch)
    return loop.run(methods.get("astarpo", {"beta2": 0.1, "logp_chunk": 4}), params, table.prompts, ctx, settings,
                    update.Optimizers(update.make_optimizer(lr=1e-2, eps=1e-4)), io).params

  flat = lambda tree: [np.asarray(multihost.to_host(x)) for x in jax.tree.leaves(tree)]  # noqa: E731
  with jax.set_mesh(mesh):
    straight = flat(train("straight"))
    raised = None
    with preemption.Watch(grace_s=120) as watch:
      try:
        train("preempted", watch)
      except preemption.Preempted as e:
        raised = str(e)
    ckpt_dir = os.path.join(WORKDIR, "preempted", "checkpoints")
    listed = sorted(int(n) for n in os.listdir(ckpt_dir) if n.isdigit())
    multihost.barrier("listed")  # both processes have read the listing before either resumes
    resumed = flat(train("preempted"))
  result = {"raised": raised, "listed": listed, "equal": all(np.array_equal(a, b) for a, b in zip(straight, resumed)),
            "moved": not np.array_equal(straight[0], flat(params)[0])}
  with open(os.path.join(WORKDIR, f"result_{PROCESS_ID}.json"), "w") as f:
    json.dump(result, f)
  multihost.barrier("done")


if __name__ == "__main__":
  main()
