"""The comparison's runs: a run's spec (task, method, seed, lr multiple, overrides), one run in its own
process (Stage 1 where the method needs it, training, evaluation, KL and memory measured, result.json), and
the cache of finished runs in a work directory. experiments/compare.py is the command line over these.

Every run starts from one warm-started reference (built once per task, copied into each run's work
directory), trains on the same prompts (the task's problems are fixed by config.data.seed; config.seed
varies the rollouts, Stage 1 and the data order), and is evaluated the same way. A run is a subprocess
(`python -m astarpo_jax.comparison.runs --run=SPEC --workdir=DIR`), so its peak RSS is its own; a run whose
result.json exists is reused (fresh=True reruns).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import importlib
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: configs/ lives there

METHODS = ("astarpo", "grpo", "ppo", "rebel", "rloo")
LABELS = {"astarpo": "A*-PO", "grpo": "GRPO", "ppo": "PPO", "rebel": "REBEL", "rloo": "RLOO"}
# task -> (config module, held-out metric, the config variant of --quick). Chains: avg@8 at the sampling
# temperature (the config's data.avg_k), where RL's gains show (docs/chains.md at 8a436ea, run 4); sums: greedy pass@1.
TASKS = {"chains": ("configs.chains", "chains/avg@8", "quick"), "sums": ("configs.demo", "synthetic/pass@1", "tiny")}
LR_SCALES = (1 / 3, 1.0, 3.0)
QUICK_METHODS, QUICK_STUDIES = ("astarpo", "grpo"), ("main", "falsifier")  # --quick: within ~5 minutes


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """One training run: task and size, method, seed, learning-rate multiple and config overrides."""
  task: str
  size: str  # the task config's variant: "full", "quick" or "test"
  method: str = "astarpo"
  seed: int = 0
  lr_scale: float = 1.0
  overrides: tuple[tuple[str, object], ...] = ()  # ("stage1.n_samples", 16), ...

  @property
  def name(self) -> str:
    """A readable, unique directory name."""
    extra = "".join(f"_{k.split('.')[-1]}{v}" for k, v in self.overrides)
    digest = hashlib.sha1(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:6]
    return f"{self.method}_s{self.seed}_lr{self.lr_scale:.3g}{extra}_{digest}"

  def config(self):
    """The task's config with this run's method, seed, lr and overrides."""
    module = TASKS[self.task][0]
    c = importlib.import_module(module).get_config(self.size)
    c.data.seed = 0 if c.data.seed < 0 else c.data.seed  # the same problems and reference for every seed
    c.seed = self.seed
    c.algo.name = self.method
    from astarpo_jax.run_config import policy_lr
    c.optim.lr = policy_lr(c) * self.lr_scale  # the task's lr for this method (optim.lr_by_algo where it has one)
    c.algo.value_lr = 10 * c.optim.lr  # PPO's critic at 10x the policy's (verl: 1e-5 vs 1e-6)
    if "/avg@" not in TASKS[self.task][1]:
      c.data.avg_k_sets = ()  # greedy pass@1 only: the curves need many cheap evaluations
    c.train.checkpoint_every = c.train.num_steps  # one save at the end: checkpoint I/O is not compared
    c.export_hf = True  # the final policy, for the falsifier's evaluation
    for field, value in self.overrides:  # "section.key" or deeper ("data.chains.heldout")
      *path, key = field.split(".")
      node = c
      for part in path:
        node = node[part]
      node[key] = value
    metric = TASKS[self.task][1]
    if "/avg@" in metric and (metric.split("/")[0] not in c.data.avg_k_sets or metric != f"{metric.split('/')[0]}/avg@{c.data.avg_k}"):
      raise ValueError(f"comparison: the task's metric {metric} needs data.avg_k_sets to hold "
                       f"{metric.split('/')[0]!r} and data.avg_k = {metric.split('@')[1]} (the config has "
                       f"{tuple(c.data.avg_k_sets)}, {c.data.avg_k})")
    return c


# ---------------------------------------------------------------------------------------------
# A run, in its own process.

def _peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def kl_to_reference(setup, params, prompts, key, k: int = 4) -> dict:
  """KL(π ‖ π_ref) on held-out prompts: over k sampled responses per prompt, the mean of
  Σ_t log π(y_t)/π_ref(y_t) (the sequence-level k1 estimate), both log-probs from a full forward."""
  import jax.numpy as jnp
  import numpy as np

  from astarpo_jax.sampling import rollout as rollout_lib
  from astarpo_jax.training import scoring
  ro = rollout_lib.rollout(setup.cfg, params, [p.ids for p in prompts], [p.target for p in prompts], key, setup.scfg,
                           setup.tokenizer, setup.graders.eval[0][1], num_samples=k)
  tokens, mask, resp = rollout_lib.trim_response(ro)
  lp = lambda p: np.asarray(scoring.logprobs(setup.cfg, p, jnp.asarray(tokens), jnp.asarray(mask),  # noqa: E731
                                             prompt_len=ro.prompt_len), np.float64)
  diff = np.where(resp, lp(params) - lp(setup.ref_params), 0.0)
  return {"kl_seq": float(diff.sum(-1).mean()), "kl_token": float(diff.sum() / max(resp.sum(), 1))}


def compiled_bytes(c, setup) -> dict:
  """Per-device bytes of the run's compiled phases on this backend (memory_plan: the scoring forward and
  the update step compiled, the sampler by its formula), beside the process's RSS."""
  from astarpo_jax.aot import memory_plan as mp
  from astarpo_jax.run_config import run_shape
  method, t = setup.method, c.train
  run = run_shape(c, backend=None)  # the sampler's slots on this backend
  plan = mp.plan_memory(setup.cfg, run, (1, 1, 1), num_devices=1, ref_param_dtype=c.model.ref_param_dtype,
                        optimizers=setup.optimizers, method=method, mini_batch=t.mini_batch, compile=True)
  return {"resident": plan.resident_total, **{f"{k}": v.total for k, v in plan.phases.items()},
          "sources": {k: v.source for k, v in plan.phases.items()}}


def per_problem_rewards(setup, params, metric: str) -> list[float]:
  """Each held-out problem's summed reward over its k samples, by the evaluation's own draws (evaluate.evaluate's
  key, chunks and prompt-major groups), so their mean over problems x k is the metric's accuracy; the paired
  analysis per problem reads them."""
  import jax
  import numpy as np

  from astarpo_jax.sampling import rollout as rollout_lib
  name, k = metric.split("/")[0], setup.avg_k
  prompts, key, per_chunk = setup.avg_k_sets[name], jax.random.key(setup.seed + 1), 256 // k
  if 256 % k:
    raise ValueError(f"per_problem_rewards: data.avg_k = {k} must divide evaluate's batch of 256")
  sums = []
  for start in range(0, len(prompts), per_chunk):
    chunk = prompts[start:start + per_chunk]
    ro = rollout_lib.rollout(setup.cfg, params, [p.ids for p in chunk], [p.target for p in chunk],
                             jax.random.fold_in(key, start * k), setup.scfg, setup.tokenizer, setup.graders.eval[0][1],
                             setup.loop.sample_max_batch, num_samples=k, sample_mesh=setup.sample_mesh)
    sums += np.asarray(ro.rewards_B, np.float64).reshape(len(chunk), k).sum(-1).tolist()
  return sums


def _cpu_s() -> float:
  t = os.times()
  return t.user + t.system


def run_one(spec: RunSpec, workdir: str) -> None:
  """Builds, runs Stage 1 (A*-PO) and the training, evaluates, measures; writes result.json with the run's
  cache key (cache_key.run_key)."""
  import jax

  from astarpo_jax import experiment, run_config
  from astarpo_jax.comparison import cache_key
  c = spec.config()
  run_config.validate_config(c)
  key = cache_key.run_key(c.to_dict(), _code_hash(), os.path.join(workdir, "reference", "model.safetensors"))
  out: dict = {"spec": dataclasses.asdict(spec), "key": key, "lr": c.optim.lr, "times_s": {}, "cpu_s": {},
               "loadavg_start": os.getloadavg()[0]}
  t, cpu = time.perf_counter(), _cpu_s()
  setup = experiment.build(c, workdir, log=lambda s: None)
  out["times_s"]["setup"], out["cpu_s"]["setup"] = time.perf_counter() - t, _cpu_s() - cpu
  metric = _metric(spec)
  with setup, jax.set_mesh(setup.mesh):
    out["reference_acc"] = experiment.evaluate_all(setup, setup.ref_params, "reference")[metric]["accuracy"]
    if "/avg@" in metric:
      out["reference_per_problem"] = per_problem_rewards(setup, setup.ref_params, metric)
    t, cpu = time.perf_counter(), _cpu_s()
    table = experiment.run_stage1(setup, workdir)
    out["times_s"]["stage1"], out["cpu_s"]["stage1"] = time.perf_counter() - t, _cpu_s() - cpu
    out["needs_stage1"] = setup.method.needs_value_table
    out["stage1_tokens"] = table.summary.get("num_tokens") or 0
    out["stage1_summary"] = table.summary
    t, cpu = time.perf_counter(), _cpu_s()
    result = experiment.run_training(setup, table, workdir)
    out["times_s"]["training"], out["cpu_s"]["training"] = time.perf_counter() - t, _cpu_s() - cpu
    out["cpu_s"]["eval"] = result.eval_cpu_seconds
    out["final_acc"] = result.last_eval[metric]["accuracy"]
    if "/avg@" in metric:  # the final evaluation's draws again, per problem (its mean is final_acc: checked)
      out["final_per_problem"] = per_problem_rewards(setup, result.params, metric)
      mean = sum(out["final_per_problem"]) / (len(out["final_per_problem"]) * setup.avg_k)
      out["per_problem_matches_eval"] = math.isclose(mean, out["final_acc"], abs_tol=1e-6)
    out["rows_per_step"] = setup.loop.rollout_batch * setup.method.responses_per_prompt()
    test = next(iter(setup.test_sets.values()))
    out["extra"] = {"peak_rss_mb": _peak_rss_mb(), **kl_to_reference(setup, result.params, test, jax.random.key(7)),
                    "compiled_bytes": compiled_bytes(c, setup), "eval_s": result.eval_seconds}
    experiment.export(setup, result.params, os.path.join(workdir, "export"))
  out["loadavg_end"] = os.getloadavg()[0]
  with open(os.path.join(workdir, "result.json"), "w") as f:
    json.dump(out, f, indent=1, default=str)


_CODE: dict[str, str] = {}


def _code_hash() -> str:
  """This checkout's training-code hash (cache_key.code_hash), once per process."""
  if ROOT not in _CODE:
    from astarpo_jax.comparison import cache_key
    _CODE[ROOT] = cache_key.code_hash(ROOT)
  return _CODE[ROOT]


def key_now(spec: RunSpec, workdir: str) -> dict | None:
  """The key `spec`'s run would carry from this checkout (None before the task's reference exists)."""
  from astarpo_jax.comparison import cache_key
  weights = os.path.join(workdir, f"reference_{spec.task}_{spec.size}", "reference", "model.safetensors")
  if not os.path.exists(weights):
    return None
  return cache_key.run_key(spec.config().to_dict(), _code_hash(), weights)


def _metric(spec: RunSpec) -> str:
  return TASKS[spec.task][1]


# ---------------------------------------------------------------------------------------------
# The driver: runs (cached), then the study's tables.

def reference_dir(workdir: str, task: str, size: str, log) -> str:
  """The task's warm-started reference, built once (by a short A*-PO run's setup) and reused."""
  ref_root = os.path.join(workdir, f"reference_{task}_{size}")
  if not os.path.exists(os.path.join(ref_root, "reference", "config.json")):
    from astarpo_jax import experiment
    spec = RunSpec(task, size)
    os.makedirs(ref_root, exist_ok=True)
    t = time.perf_counter()
    experiment.build(spec.config(), ref_root, log=lambda s: None).pool.close()
    log(f"reference for {task}/{size}: built in {time.perf_counter() - t:.0f}s")
  return ref_root


def compile_cache_env(cache_dir: str) -> dict:
  """Environment for a run's process: JAX's persistent compilation cache in `cache_dir` ("" = none), so
  only the first run of each program compiles it (the sweep's, on seed 0), and the timed runs load it."""
  if not cache_dir:
    return {}
  return {"JAX_COMPILATION_CACHE_DIR": cache_dir, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


def run_dir_of(spec: RunSpec, workdir: str, code_id: str = "") -> str:
  """Where a run lives in a work directory (its result.json there means it is done): a finished run of this spec
  at this spec's lr whose key matches the key it would have now (cache_key.matches; `code_id`: a foreign code's
  result, for reprinting that code's tables). A sweep's choice written into the config turns x3 of 1e-5 into x1
  of 3e-5: the run is the same, so lr_scale itself is not compared. Without one: the directory a new run gets."""
  from astarpo_jax.comparison import cache_key
  wanted = key_now(spec, workdir)
  found = _finished_run(spec, workdir, wanted, code_id) if wanted is not None or code_id else None
  if found:
    return found
  suffix = f"_{cache_key.short(wanted)}" if wanted is not None else ""
  return os.path.join(workdir, "runs", spec.name + suffix)


def _finished_run(spec: RunSpec, workdir: str, wanted: dict | None, code_id: str) -> str | None:
  """A finished run whose result records this spec but for lr_scale, this spec's lr, and a matching key."""
  from astarpo_jax.comparison import cache_key
  runs_dir = os.path.join(workdir, "runs")
  if not os.path.isdir(runs_dir):
    return None
  lr, mine = spec.config().optim.lr, {k: v for k, v in dataclasses.asdict(spec).items() if k != "lr_scale"}
  mine = json.loads(json.dumps(mine))  # tuples as the result's lists
  wanted = wanted or {"code": ""}
  for name in sorted(os.listdir(runs_dir)):
    if not name.startswith(f"{spec.method}_s{spec.seed}_lr"):
      continue
    try:
      with open(os.path.join(runs_dir, name, "result.json")) as f:
        done = json.load(f)
    except (OSError, ValueError):
      continue
    theirs = {k: v for k, v in done.get("spec", {}).items() if k != "lr_scale"}
    if (theirs == mine and "lr" in done and math.isclose(done["lr"], lr, rel_tol=1e-6)
        and cache_key.matches(done.get("key"), wanted, code_id)):
      return os.path.join(runs_dir, name)
  return None


def ensure_run(spec: RunSpec, workdir: str, fresh: bool, log, cache_dir: str = "",
               code_id: str = "") -> tuple[str, dict]:
  """The run's directory and result, running it in a subprocess unless a result with a matching key exists
  (with a foreign `code_id`, a missing run is an error: this checkout cannot run that code)."""
  reference_dir(workdir, spec.task, spec.size, log)  # the key needs the reference's weights
  run_dir = run_dir_of(spec, workdir, "" if fresh else code_id)
  result_path = os.path.join(run_dir, "result.json")
  found = os.path.exists(result_path) and not fresh
  if not found and code_id and code_id != _code_hash():
    raise RuntimeError(f"run {spec.name} has no result under code {code_id} in {workdir}/runs; drop --code_id to run "
                       f"it under this checkout's code ({_code_hash()})")
  if not found:
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: resumed timings would not be comparable
    shutil.copytree(os.path.join(reference_dir(workdir, spec.task, spec.size, log), "reference"),
                    os.path.join(run_dir, "reference"))
    cmd = [sys.executable, "-m", "astarpo_jax.comparison.runs", f"--run={json.dumps(dataclasses.asdict(spec))}",
           f"--workdir={run_dir}"]
    t = time.perf_counter()
    with open(os.path.join(run_dir, "worker.log"), "w") as logf:
      rc = subprocess.call(cmd, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT,
                           env=dict(os.environ, HF_HUB_OFFLINE="1", TQDM_DISABLE="1", **compile_cache_env(cache_dir)))
    if rc != 0:
      raise RuntimeError(f"run {spec.name} failed (exit {rc}); see {run_dir}/worker.log")
    log(f"{os.path.basename(run_dir)}: {time.perf_counter() - t:.0f}s")
  with open(result_path) as f:
    return run_dir, json.load(f)


def summary_of(spec: RunSpec, run_dir: str, result: dict):
  from astarpo_jax.comparison import summary
  train, evals = summary.read_metrics(run_dir)
  lr = result.get("lr", spec.config().optim.lr)  # the lr it ran at (results before it was kept: the config's)
  return summary.summarize(LABELS[spec.method], spec.seed, lr, result, train, evals,
                              _metric(spec), result["rows_per_step"])


def write_csv(path: str, rows: list[dict]) -> None:
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)


def parse_sweep_seeds(text: str, eval_seeds: list[int]) -> tuple[int, ...]:
  """--sweep_seeds: distinct non-negative integers, none of them an evaluation seed (an lr chosen on the seeds
  it is then evaluated on would be chosen on the test set)."""
  try:
    seeds = tuple(int(x) for x in text.split(",") if x.strip())
  except ValueError:
    raise SystemExit(f"--sweep_seeds={text!r}: comma-separated integers, e.g. 0,7,8") from None
  if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
    raise SystemExit(f"--sweep_seeds={text!r}: distinct non-negative seeds, at least one")
  if set(seeds) & set(eval_seeds):
    raise SystemExit(f"--sweep_seeds={text!r} overlaps the evaluation seeds {eval_seeds} (--seeds/--first_seed): "
                     "choose the lr on other seeds")
  return seeds




def _worker_main(argv: list[str]) -> None:
  """A run's process: `--run=<RunSpec as JSON> --workdir=DIR`."""
  ap = argparse.ArgumentParser()
  ap.add_argument("--run", required=True)
  ap.add_argument("--workdir", required=True)
  args = ap.parse_args(argv)
  spec = RunSpec(**{k: (tuple(tuple(x) for x in v) if k == "overrides" else v) for k, v in json.loads(args.run).items()})
  run_one(spec, os.path.abspath(args.workdir))


if __name__ == "__main__":
  sys.path.insert(0, ROOT)  # configs/
  _worker_main(sys.argv[1:])
