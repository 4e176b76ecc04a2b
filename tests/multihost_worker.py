"""Stage 1 and Stage 2 end to end in one of N JAX processes (CPU, gloo), or in a single process.

Usage: multihost_worker.py PROCESS_ID NUM_PROCESSES PORT WORKDIR. With NUM_PROCESSES > 1 each
process has 2 faked CPU devices and joins a (data, fsdp, tensor) = (1, N, 2) mesh; with 1 it is
a plain one-device run without a mesh (the reference). Every process runs the same commands:

  Stage 1 (experiment.run_stage1: adaptive N, kept responses, a ragged last chunk), then again
  after deleting one chunk file and vstar.jsonl (a resume);
  Stage 2 (loop.run with A*-PO) for one rollout step, then the same command for two steps, which
  resumes from the checkpoint of the first; a greedy evaluation at the end of each;
  with several processes, Stage 1 once more on a (1, 1, 2N) mesh, where every process holds every row,
  and Stage 1 and one A*-PO step sampling on a mesh of their own (mesh.sample_shape = (N, 1, 2): rows
  split over the processes, the params copied from the (1, N, 2) training mesh once per sampling call).

Process 0 writes WORKDIR/result.npz (final params, evaluation); each process writes the log lines
it was given to WORKDIR/log_<process>.json. tests/test_multihost.py compares the runs.
"""
import dataclasses
import json
import os
import sys

PROCESS_ID, NUM_PROCESSES, PORT, WORKDIR = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count="
                           f"{2 if NUM_PROCESSES > 1 else 1} --xla_backend_optimization_level=0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

if NUM_PROCESSES > 1:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
  jax.distributed.initialize(f"localhost:{PORT}", NUM_PROCESSES, PROCESS_ID, initialization_timeout=120)

import contextlib  # noqa: E402

import numpy as np  # noqa: E402

from astarpo_jax import experiment, methods, run_config  # noqa: E402
from astarpo_jax.data import dataset, synthetic  # noqa: E402
from astarpo_jax.infra import multihost, sharding  # noqa: E402
from astarpo_jax.model import decoder  # noqa: E402
from astarpo_jax.model.config import ModelConfig  # noqa: E402
from astarpo_jax.sampling.rollout import Graded  # noqa: E402
from astarpo_jax.sampling.token_choice import SamplingConfig  # noqa: E402
from astarpo_jax.training import evaluate, loop, update  # noqa: E402
from configs import base  # noqa: E402

TOK = synthetic.build_tokenizer()
CFG = ModelConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=64)
SCFG = SamplingConfig(temperature=1.0, max_new_tokens=8, stop_ids=(TOK.eos_token_id,), pad_id=TOK.pad_token_id)
PROMPTS, _ = dataset.build_prompts(synthetic.load_synthetic(64, 0)[0], TOK, synthetic.PROMPT_TEMPLATE)
LOGS: list[str] = []


def grade(texts, golds, truncated):
  """Deterministic and varied: 1 for a text holding the answer, else the parity of its length."""
  rewards = np.array([1.0 if g in t else float(len(t) % 2) for t, g in zip(texts, golds)], np.float32)
  return Graded(rewards, {"num_timeouts": 0, "num_errors": len(texts)})  # counts summed over processes


def stage1_config():
  c = base.get_config()
  c.seed = 3
  c.stage1.n_samples = 4
  c.stage1.adaptive_n_min = 2
  c.stage1.chunk_prompts = 5  # 12 prompts: chunks of 5, 5, 2; 5 x 2 = 10 rows do not split evenly on 4 devices
  c.stage1.keep_responses = True
  return c


def stage1_setup(params, mesh, grader) -> experiment.Setup:
  """A Setup around this file's model and prompts, with stage1_config()'s Stage-1 settings."""
  c = stage1_config()
  method = run_config.build_method(c)
  loop_settings, optimizers, s1 = experiment.settings(c, method)
  return experiment.Setup(cfg=CFG, tokenizer=TOK, ref_params=params, train_prompts=PROMPTS[:12], test_sets={},
                          avg_k_sets={}, avg_k=1, graders=experiment.Graders(grader, grader, (("g", grader),)),
                          pass_threshold=c.reward.pass_threshold, scfg=SCFG, mesh=mesh, method=method,
                          loop=loop_settings, optimizers=optimizers, stage1=s1, policy_param_dtype="float32",
                          seed=c.seed, times={})


def main():
  mesh = sharding.make_mesh((1, NUM_PROCESSES, 2)) if NUM_PROCESSES > 1 else None
  _, params = decoder.init_params(CFG, seed=0)
  if mesh is not None:  # each process places only its shards of the same host values
    host = jax.device_get(params)
    params = jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: x[i]), host,
                          decoder.param_shardings(CFG, mesh))
  log = LOGS.append
  with (jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()):
    setup = stage1_setup(params, mesh, grade)
    s1_dir = os.path.join(WORKDIR, "s1")
    first = experiment.run_stage1(setup, s1_dir, log=log)
    multihost.barrier("stage1_first")
    if PROCESS_ID == 0:  # lose one chunk and the merged file: the rerun must redo exactly that chunk
      os.remove(os.path.join(s1_dir, "stage1", "chunks", "chunk_00001.jsonl"))
      os.remove(os.path.join(s1_dir, "stage1", "vstar.jsonl"))
    multihost.barrier("stage1_damaged")
    again = experiment.run_stage1(setup, s1_dir, log=log)
    assert again.records == first.records

    def eval_fn(p, step):
      r = evaluate.evaluate(CFG, p, PROMPTS[48:56], TOK, grade, evaluate.greedy(SCFG), jax.random.key(7))
      return {"accuracy": r["accuracy"], "response_length": r["response_length"]}

    finals = []
    ctx = loop.RunContext(CFG, params, TOK, grade, SCFG, mesh, value_table=first)
    opt = lambda: update.make_optimizer(lr=1e-2, eps=1e-4)  # noqa: E731
    for steps in (1, 2):  # the second call resumes from the first one's checkpoint
      settings = loop.LoopSettings(num_steps=steps, rollout_batch=8, mini_batch=4, micro_batch=2, checkpoint_every=1)
      io = loop.RunIO(os.path.join(WORKDIR, "s2"), log, PROCESS_ID == 0, eval_fn)
      result = loop.run(methods.get("astarpo", {"beta2": 0.1, "logp_chunk": 4}), params, first.prompts, ctx,
                        settings, update.Optimizers(opt()), io)
      finals.append((result.params, result.last_eval))
    # A baseline through the same machinery: PPO (sampler log-probs, reference and critic forwards in
    # row blocks, a critic in the state), two rollout steps of 4 prompts x 1 response.
    ppo = methods.get("ppo", {"kl_coef": 0.1, "entropy_coef": 0.01, "logp_chunk": 4})
    settings = loop.LoopSettings(num_steps=2, rollout_batch=4, mini_batch=2, micro_batch=2, checkpoint_every=1)
    ppo_params = loop.run(ppo, params, first.prompts, ctx, settings, update.Optimizers(opt(), opt()),
                          loop.RunIO(os.path.join(WORKDIR, "ppo"), log, PROCESS_ID == 0)).params
  if mesh is not None:  # rows not split over processes (tensor across both): process 0 alone grades every row
    mesh_t = sharding.make_mesh((1, 1, 2 * NUM_PROCESSES))
    params_t = jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: x[i]), host,
                            decoder.param_shardings(CFG, mesh_t))
    counted = []

    def grade_counting(texts, golds, truncated):
      counted.append(len(texts))
      return grade(texts, golds, truncated)
    with jax.set_mesh(mesh_t):
      experiment.run_stage1(stage1_setup(params_t, mesh_t, grade_counting), os.path.join(WORKDIR, "s1_tensor"),
                            log=log)
    LOGS.append(f"graded rows on a tensor-only mesh: {sum(counted)}")
    s_mesh = sharding.sample_mesh((NUM_PROCESSES, 1, 2), mesh)
    with jax.set_mesh(mesh):
      setup_s = dataclasses.replace(stage1_setup(params, mesh, grade), sample_mesh=s_mesh)
      table_s = experiment.run_stage1(setup_s, os.path.join(WORKDIR, "s1_sample_mesh"), log=log)
      ctx_s = loop.RunContext(CFG, params, TOK, grade, SCFG, mesh, value_table=table_s, sample_mesh=s_mesh)
      settings = loop.LoopSettings(num_steps=1, rollout_batch=8, mini_batch=4, micro_batch=2, checkpoint_every=1)
      sampled_apart = loop.run(methods.get("astarpo", {"beta2": 0.1, "logp_chunk": 4}), params, table_s.prompts,
                               ctx_s, settings, update.Optimizers(opt()),
                               loop.RunIO(os.path.join(WORKDIR, "s2_sample_mesh"), log, PROCESS_ID == 0)).params
  final, last_eval = finals[-1]
  flat = {"/".join(str(k.key) for k in path): multihost.to_host(v)
          for path, v in jax.tree_util.tree_flatten_with_path(final)[0]}
  trees = {"ppo": ppo_params, "step1": finals[0][0]}
  if mesh is not None:
    trees["sample_mesh_step1"] = sampled_apart
  for prefix, tree in trees.items():
    flat.update({f"{prefix}:" + "/".join(str(k.key) for k in path): multihost.to_host(v)
                 for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]})
  with open(os.path.join(WORKDIR, f"log_{PROCESS_ID}.json"), "w") as f:
    json.dump(LOGS, f)
  if PROCESS_ID == 0:
    np.savez(os.path.join(WORKDIR, "result.npz"), eval_accuracy=last_eval["accuracy"],
             eval_response_length=last_eval["response_length"], **flat)
  multihost.barrier("done")


if __name__ == "__main__":
  main()
