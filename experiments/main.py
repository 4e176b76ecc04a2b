"""A*-PO entry point: flags -> config -> Stage 1 (V*) -> Stage 2 (training) -> evaluation -> export.

  python experiments/main.py --config=configs/qwen1p5b.py --workdir=/tmp/run
  python experiments/main.py --config=configs/demo.py --workdir=/tmp/astarpo_demo   # CPU demo
  python experiments/main.py --config=configs/qwen1p5b.py:gsm8k --config.algo.beta2=2e-3 --config.mode=stage1

Rerunning the same command resumes: Stage 1 from its finished chunks, Stage 2 from its latest
checkpoint. SIGTERM or SIGINT (a preemption): the Stage-2 step or Stage-1 chunk in flight finishes and is
saved, and the run exits with code 75 (infra/preemption.EXIT_CODE), the signal to rerun the same command.
The config is read here only; the library gets plain arguments.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # configs/ and the package

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from astarpo_jax import (
  experiment as run_setup,  # noqa: E402
  run_config,  # noqa: E402
  run_inputs,  # noqa: E402
)
from astarpo_jax.infra import files, preemption  # noqa: E402
from astarpo_jax.training import warmstart  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py[:variant]).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Work directory: V* file, checkpoints, logs, export.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  config = _CONFIG.value
  run_config.validate_config(config)
  run_setup.maybe_initialize_distributed()  # before anything starts a JAX backend
  run_config.resolve_micro_batch(config, jax.device_count())  # train.micro_batch_per_device, if set
  workdir = files.abspath(_WORKDIR.value)  # a local path, or a bucket (gs://...) via etils.epath
  files.path(workdir).mkdir(parents=True, exist_ok=True)
  ref_key = reference_key(config)
  if ref_key:  # a reference copied or left here by another run: refused up front when built otherwise
    warmstart.check_cached(reference_dir(workdir), ref_key)
  say = run_setup.printer()
  try:
    with preemption.Watch(config.preemption_grace_s) as watch:  # after the JAX processes joined: ours, not JAX's
      run(config, workdir, say, watch)
  except preemption.Preempted as e:
    say(f"preempted ({e}); exit code {preemption.EXIT_CODE}: rerun the same command to resume")
    sys.exit(preemption.EXIT_CODE)


def reference_key(config) -> dict | None:
  """The settings a random model's warm-started reference is built from (run_inputs.build_reference), flat; None
  for a loaded model. The LoRA adapter, the optimizer and the RL settings are not among them."""
  if config.model.name_or_path != "random":
    return None
  task = config.data.train
  parts = {"model.random": config.model.random, "warmstart": config.warmstart,
           f"data.{task}": config.data.get(task) if "." not in task else None}
  key = {f"{name}.{k}": v for name, d in parts.items() if d is not None for k, v in d.to_dict().items()}
  key.update({"model.dtype": config.model.dtype, "model.attention_block": config.model.attention_block,
              "data.train": task, "data.template": config.data.template, "data.problem_field":
              config.data.problem_field, "task_seed": run_inputs.task_seed(config)})
  return key


def reference_dir(workdir: str) -> str:
  return os.path.join(run_inputs.local_dir(workdir), "reference")  # run_inputs.build_reference's cache


def run(config, workdir: str, say, watch: preemption.Watch) -> None:
  """Every phase the config's mode names; a phase a notice interrupts is redone by the next run."""
  times: dict[str, float] = {}
  t = time.perf_counter()
  setup = run_setup.build(config, workdir, log=say)
  if reference_key(config) and jax.process_index() == 0:
    warmstart.write_key(reference_dir(workdir), reference_key(config))
  times.update(setup.times)  # e.g. the demo's warm-start, part of setting up
  times["setup"] = time.perf_counter() - t - sum(setup.times.values())
  report: dict = {"config": json.loads(config.to_json_best_effort()), "times_s": times}
  with setup, jax.set_mesh(setup.mesh):  # activations and the KV cache follow the logical-axis rules
    if config.mode in ("eval", "all"):
      t = time.perf_counter()
      report["reference_eval"] = run_setup.evaluate_all(setup, setup.ref_params, label="reference", log=say)
      times["eval_reference"] = time.perf_counter() - t
    if config.mode in ("stage1", "train", "all"):
      t = time.perf_counter()
      table = run_setup.run_stage1(setup, workdir, log=say, watch=watch)
      times["stage1"] = time.perf_counter() - t
      report["stage1_summary"] = table.summary
    if config.mode in ("train", "all"):
      t = time.perf_counter()
      result = run_setup.run_training(setup, table, workdir, log=say, watch=watch)
      final_params, report["final_eval"] = result.params, result.last_eval
      times["stage2"] = time.perf_counter() - t  # includes the evaluations during and after training
      if config.export_hf:
        run_setup.export(setup, final_params, os.path.join(workdir, "export"), log=say)
  run_setup.write_report(workdir, report, log=say)


if __name__ == "__main__":
  logging.set_verbosity(logging.WARNING)
  app.run(main)
