"""The prepared run for a lent GPU: the first measured figures beside the projections, in one call of the device tool.

  PYTHON=.venv/bin/python bash experiments/device_wheels.sh   # here, first: .whl/ (what the H200 image lacks)
  python experiments/device_check.py --dry_run                # what it would run and measure; runs nothing
  python experiments/device_check.py --tiny --out=/tmp/dc     # the CPU, tiny shapes, every part (its test)

The device tool's command (carry [".whl"], timeout_s 330), from the repository root; DEVICE_COMMAND below and
docs/tpu.md 3.3 hold it on one line:

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; nvidia-smi -L; \
    python3 experiments/device_check.py --out=$OUT

Parts, in this order, each a process of its own with its own timeout (TIMEOUTS, plus what the parts before it
left unused; SIGINT at the end, SIGKILL 15 s later), each writing OUT/<part>.json as soon as it ends and its
output to OUT/<part>.log, so a part that hangs costs only its timeout (7 files: the tool brings back 8):
  env      versions and the devices
  measure  experiments/measure_step.py at Qwen2.5-1.5B shapes (configs/qwen1p5b.py, random weights, one device,
           mesh (1, 1, 1)): the Stage-1 prefill (bf16 reference), the rollout decode step at 64 and 256 slots
           (bf16), the reference forward and the A*-PO update (fp32 policy, bf16 compute), each beside its
           roofline on the chip the env part found (jax.devices()[0].device_kind -> chips.CHIPS: an H100 or an
           H200, whichever the tool lent; h200's figures where the table has none, e.g. the CPU), read from the
           program compiled there; MFU and tokens/s
  mix      experiments/bench_sampler.py's length mix (256 rows of 64-token prompts, cap 512, lognormal lengths)
           through the sampler at Qwen2.5-1.5B shapes in bf16, 64 slots: useful tokens/s of the continuous
           run, the fixed-length rate (every row at the mix's mean, same cap), the engine's ms per decode step
           at each slot count
  tests    the tests that say the GPU computes what the CPU does: model parity against HF (the logits
           recorded in .whl/hf_golden: the image has no PyTorch), the engine's and the sampler's rows against
           the stepwise full forward, the losses and the update step, the checkpoint round trip; fp32 matmuls
           at full precision (JAX_DEFAULT_MATMUL_PRECISION=highest: Hopper runs them in TF32 by default, the
           tests compare to 1e-5) and XLA's default optimisation level (tests/conftest.py keeps a level set)
`--tiny` runs every part on this machine's backend at tiny shapes (configs/demo.py, a few tests):
tests/test_device_check.py, so the entry point does not rot before a device runs it.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEVICE_COMMAND = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "
                  "/tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; nvidia-smi -L; "
                  "python3 experiments/device_check.py --out=$OUT")
DEVICE_CARRY, DEVICE_TIMEOUT_S = [".whl"], 330
PARTS = ("env", "measure", "mix", "tests")
TIMEOUTS = {"env": 30, "measure": 140, "mix": 75, "tests": 55}  # seconds; 300 at most on the device
TINY_TIMEOUT = 300  # each part's with --tiny: a loaded CPU, not the device's budget
GPU_TESTS = ["tests/test_model_parity.py", "tests/test_engine.py", "tests/test_sampler.py", "tests/test_losses.py",
             "tests/test_update_step.py", "tests/test_checkpoint.py",
             "tests/test_paged.py::test_the_gpu_kernel_compiled_equals_dense_attention"]
TINY_TESTS = ["tests/test_model_parity.py::test_logits_match_hf_with_left_padding[qwen2-tied-one-attention-block]",
              "tests/test_losses.py::test_astarpo_loss_hand_worked_value_and_metrics"]


@dataclasses.dataclass(frozen=True)
class Shapes:
  """What the measure and mix parts run at: the device's (Qwen2.5-1.5B) or the CPU test's."""
  config: str  # configs/<name>.py[:variant]
  overrides: tuple  # --config.* flags for measure_step.py
  decode_slots: str
  decode_steps: int
  reps: int
  mix_rows: int
  mix_cap: int
  mix_prompt: int
  mix_slots: int
  mix_reps: int
  tests: tuple


DEVICE = Shapes("configs/qwen1p5b.py", ("--config.mesh.shape=(1,1,1)",
                                        "--phases=rollout_decode,stage1_prefill,reference,astarpo_update"),
                "64,256", 32, 3, 256, 512, 64, 64, 1, tuple(GPU_TESTS))
TINY = Shapes("configs/demo.py:tiny", ("--config.mesh.shape=(1,1,1)", "--config.train.rollout_batch=8",
                                       "--config.train.mini_batch=8", "--config.train.micro_batch=4",
                                       "--config.stage1.chunk_prompts=2", "--config.sampling.max_batch=8"),
              "4,8", 4, 1, 16, 32, 8, 8, 1, tuple(TINY_TESTS))


DEFAULT_CHIP = "h200"  # the chip whose figures a run takes where the device found is not in chips.CHIPS


def chip_found(out: str) -> tuple[str, str]:
  """(chips.CHIPS entry, how it was chosen) from the env part's devices ("platform:device_kind" in env.json):
  the first device whose kind the table knows, else DEFAULT_CHIP, said."""
  from astarpo_jax.aot import chips
  path = os.path.join(out, "env.json")
  devices = json.load(open(path)).get("devices", []) if os.path.exists(path) else []
  for d in devices:
    kind = chips.chip_of_device(d.partition(":")[2])
    if kind:
      return kind, f"{kind}: the device found, {d}"
  return DEFAULT_CHIP, f"{DEFAULT_CHIP}: no chip of the table among the devices found ({devices or 'none'})"


def load_config(spec: str):
  """configs/<name>.py[:variant] -> its ConfigDict (configs is a package beside astarpo_jax)."""
  path, _, variant = spec.partition(":")
  module = importlib.import_module("configs." + os.path.splitext(os.path.basename(path))[0])
  return module.get_config(variant) if variant else module.get_config()


def _write(path: str, record: dict) -> None:
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(record, f, indent=1, default=str)
  os.replace(tmp, path)


# ----------------------------------------------------------------------------- the parts run in their own process


def part_env(out: str) -> None:
  from importlib import metadata

  import jax
  import jaxlib
  devices = jax.devices()
  versions = {}
  for name in ("flax", "optax", "orbax-checkpoint", "transformers", "numpy", "ml-collections", "math-verify",
               "tensorboardX", "torch", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin"):
    try:
      versions[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      versions[name] = None
  memory = {}
  try:
    memory = {k: v for k, v in (devices[0].memory_stats() or {}).items() if k in ("bytes_limit", "bytes_in_use")}
  except Exception:  # noqa: BLE001  the CPU has none
    pass
  record = dict(python=sys.version.split()[0], jax=jax.__version__, jaxlib=jaxlib.__version__,
                backend=jax.default_backend(), devices=[f"{d.platform}:{d.device_kind}" for d in devices],
                memory=memory, versions=versions, commit=_commit())
  _write(os.path.join(out, "env.json"), record)
  print(json.dumps(record, indent=1))


def _commit() -> str | None:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          timeout=10).stdout.strip() or None
  except (OSError, subprocess.SubprocessError):
    return None


def part_mix(out: str, shapes: Shapes) -> None:
  """The length mix through the sampler with random bf16 weights of the config's model."""
  import bench_sampler  # experiments/, beside this file: the mix's one definition
  import jax
  import numpy as np

  from astarpo_jax import experiment
  from astarpo_jax.aot import layouts, measure
  from astarpo_jax.sampling import decode_plan, sampler
  from astarpo_jax.sampling.token_choice import SamplingConfig
  cfg = dataclasses.replace(experiment.model_config(load_config(shapes.config)), dtype="bfloat16",
                            param_dtype="bfloat16")
  mesh = layouts.abstract_mesh_devices(jax.devices()[:1], (1, 1, 1))
  params = jax.block_until_ready(measure.random_params(cfg, mesh))
  rows, cap, slots = shapes.mix_rows, shapes.mix_cap, shapes.mix_slots
  budgets = bench_sampler.mix_budgets(rows, cap)
  mean = int(round(budgets.mean()))
  prompts = np.random.default_rng(0).integers(1, cfg.vocab_size, (rows, shapes.mix_prompt)).tolist()
  scfg = SamplingConfig(temperature=1.0, max_new_tokens=cap, stop_ids=())
  # The fixed-length rate: every row at the mix's mean, under the same cap (the same cache and programs: the
  # accelerators attend over the whole cache, so a smaller cap would be a different step, and a compile).
  systems = {"continuous": (dict(max_batch=slots, max_new_tokens_B=budgets), int(budgets.sum())),
             f"fixed length {mean}": (dict(max_batch=slots, max_new_tokens_B=np.full(rows, mean)), rows * mean)}
  record = dict(model=dict(params=cfg.num_params, dtype=cfg.dtype), rows=rows, cap=cap, prompt_len=shapes.mix_prompt,
                slots=slots, mean_length=float(budgets.mean()), at_cap=int((budgets == cap).sum()), systems={})
  for name, (kw, tokens) in systems.items():
    seconds, stats = [], None
    for rep in range(shapes.mix_reps + 1):  # the first run compiles every program the timed ones use
      stats = decode_plan.RunStats()
      t = time.perf_counter()
      with jax.set_mesh(mesh):
        jax.block_until_ready(sampler.sample(cfg, params, prompts, jax.random.key(rep), scfg, stats=stats, **kw))
      seconds.append(time.perf_counter() - t)
    per_slots = {}
    for b, _, steps, sec in stats.segment_log:
      agg = per_slots.setdefault(b, [0, 0.0])
      agg[0], agg[1] = agg[0] + steps, agg[1] + sec
    timed = float(np.median(seconds[1:]))
    record["systems"][name] = dict(
        tokens=tokens, first_run_s=seconds[0], seconds=seconds[1:], tokens_per_s=tokens / timed,
        segments=stats.segments, compactions=stats.compactions, prefill_s=stats.prefill_seconds,
        ms_per_step={b: 1e3 * sec / max(steps, 1) for b, (steps, sec) in sorted(per_slots.items(), reverse=True)})
    print(f"{name}: {tokens} tokens, {tokens / timed:.0f} tokens/s (runs {[round(s, 2) for s in seconds]} s)",
          flush=True)
    _write(os.path.join(out, "mix.json"), record)
  names = list(record["systems"])
  record["continuous_over_fixed"] = (record["systems"][names[0]]["tokens_per_s"]
                                     / record["systems"][names[1]]["tokens_per_s"])
  _write(os.path.join(out, "mix.json"), record)


# ----------------------------------------------------------------------------- the parent: one process per part


def _commands(args, shapes: Shapes) -> dict:
  """part -> (argv, extra environment)."""
  me = [sys.executable, os.path.abspath(__file__), f"--out={args.out}"] + (["--tiny"] if args.tiny else [])
  measure = [sys.executable, os.path.join(ROOT, "experiments", "measure_step.py"), f"--config={shapes.config}",
             f"--chip={DEFAULT_CHIP}", f"--decode_slots={shapes.decode_slots}", f"--decode_steps={shapes.decode_steps}",
             f"--reps={shapes.reps}", f"--json_out={os.path.join(args.out, 'measure.json')}", *shapes.overrides]
  tests_env = {"JAX_DEFAULT_MATMUL_PRECISION": "highest", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  golden = os.path.join(ROOT, ".whl", "hf_golden")
  if os.path.isdir(golden):
    tests_env["ASTARPO_HF_GOLDEN"] = golden
  if not args.tiny:  # XLA's default level on the device (the conftest adds 0, for CPU compiles, where none is set)
    tests_env["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=3").strip()
  pytest = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--junitxml", _junit_path(args.out),
            *shapes.tests]
  if not args.tiny:
    pytest[3:3] = ["-n", "8", "--timeout=60"]  # the image has pytest-xdist and pytest-timeout
  return {"env": (me + ["--part=env"], {}), "measure": (measure, {}), "mix": (me + ["--part=mix"], {}),
          "tests": (pytest, tests_env)}


def _junit_path(out: str) -> str:
  return os.path.join(out, ".tests.xml")  # read into tests.json and removed: the tool brings back 8 files


def _run(argv, env_extra: dict, timeout: float, log_path: str) -> dict:
  """Run argv in its own process group, output to log_path; SIGINT at the timeout, SIGKILL 15 s later."""
  env = dict(os.environ, **env_extra)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), ROOT) if p)
  t, timed_out = time.perf_counter(), False
  with open(log_path, "w") as log:
    log.write("$ " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env_extra.items()) + " "
              + " ".join(shlex.quote(a) for a in argv) + "\n")
    log.flush()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
      proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      timed_out = True
      os.killpg(proc.pid, signal.SIGINT)  # pytest and measure_step write what they have on KeyboardInterrupt
      try:
        proc.wait(timeout=15)
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
  return dict(returncode=proc.returncode, seconds=round(time.perf_counter() - t, 1), timed_out=timed_out,
              timeout_s=timeout)


def tests_record(out: str, log_path: str) -> dict:
  """Counts and failures from the junit XML pytest writes (also on an interrupt), else from its -v lines."""
  record = dict(passed=0, failed=0, errors=0, skipped=0, failures=[], skips={})
  junit = _junit_path(out)
  if os.path.exists(junit):
    for case in ET.parse(junit).getroot().iter("testcase"):
      name = f"{case.get('classname')}::{case.get('name')}"
      outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
      if outcome is None:
        record["passed"] += 1
      elif outcome.tag == "skipped":
        record["skipped"] += 1
        reason = (outcome.get("message") or "")[:200]
        record["skips"][reason] = record["skips"].get(reason, 0) + 1
      else:
        record["failed" if outcome.tag == "failure" else "errors"] += 1
        record["failures"].append(dict(test=name, message=(outcome.get("message") or "")[:500],
                                       text=(outcome.text or "")[-3000:]))
    os.remove(junit)
    return record
  with open(log_path, errors="replace") as f:  # killed before the XML: the -v lines (xdist's or plain)
    words, outcomes = "(PASSED|FAILED|ERROR|SKIPPED)", {}
    for m in re.finditer(rf"{words}\s+(tests/\S+)|(tests/\S+::\S+)\s+{words}", f.read()):
      word, name = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
      outcomes[name] = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped"}[word]
  for name, key in outcomes.items():  # once per test: the short summary repeats a failure's line
    record[key] += 1
    if key in ("failed", "errors"):
      record["failures"].append(dict(test=name))
  record["from_log"] = True
  return record


def _highlights(out: str, part: str) -> list[str]:
  """The lines of a part's log (or its JSON) worth seeing in the tool's output tail."""
  if part == "env":
    path = os.path.join(out, "env.json")
    if not os.path.exists(path):
      return ["no env.json"]
    with open(path) as f:
      return [json.dumps({k: v for k, v in json.load(f).items() if k != "status"})]
  with open(os.path.join(out, f"{part}.log"), errors="replace") as f:
    lines = f.read().splitlines()
  if part == "tests":
    keep = [s for s in lines if re.search(r"FAILED|ERROR|Timeout|\d+ (passed|failed|skipped)", s)]
  else:
    keep = [s for s in lines if s.startswith(("|", "continuous", "fixed", "Traceback")) or "Error" in s]
  return keep[-30:]


def dry_run(args, shapes: Shapes, commands: dict) -> None:
  print(f"the prepared run ({'tiny, this machine' if args.tiny else 'one H100 or H200'}): parts {list(args.parts)}, "
        f"outputs under {args.out}\n")
  for part in args.parts:
    argv, env = commands[part]
    print(f"[{part}] timeout {args.timeouts[part]} s: " + " ".join(f"{k}={v}" for k, v in env.items()) + " "
          + " ".join(shlex.quote(a) for a in argv))
  if "measure" in args.parts:
    print("\n[measure] what it measures, and the floors the measured times will be set beside:")
    argv = [a for a in commands["measure"][0] if not a.startswith("--json_out")] + ["--dry_run"]
    subprocess.run(argv, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"), check=True)
  if "mix" in args.parts:
    import bench_sampler
    import numpy as np

    from astarpo_jax import experiment
    from astarpo_jax.aot import chips, measure
    from astarpo_jax.aot.memory_plan import RunShape
    cfg = dataclasses.replace(experiment.model_config(load_config(shapes.config)), dtype="bfloat16",
                              param_dtype="bfloat16")
    budgets = bench_sampler.mix_budgets(shapes.mix_rows, shapes.mix_cap)
    run = RunShape(prompt_len=shapes.mix_prompt, response_len=shapes.mix_cap, rollout_batch=shapes.mix_rows,
                   micro_batch=1, sample_batch=shapes.mix_slots)
    floor = measure.floors("rollout_decode", cfg, run, {}, chips.CHIPS[DEFAULT_CHIP])
    print(f"\n[mix] {shapes.mix_rows} rows of {shapes.mix_prompt}-token prompts, cap {shapes.mix_cap}, lengths median "
          f"{np.median(budgets):.0f} mean {budgets.mean():.1f} ({(budgets == shapes.mix_cap).sum()} at the cap), "
          f"{int(budgets.sum())} useful tokens, {shapes.mix_slots} slots, {cfg.num_params / 1e9:.2f}B params in bf16; "
          f"an {DEFAULT_CHIP} decode step at {shapes.mix_slots} slots reads >= {floor['hbm_floor_s'] * 1e3:.3g} ms of HBM "
          f"(weights + the whole cache): <= {shapes.mix_slots / floor['hbm_floor_s']:.0f} tokens/s at full slots")
  if "tests" in args.parts:
    print(f"\n[tests] {' '.join(shapes.tests)}")
  print(f"\nthe device tool's run: carry={DEVICE_CARRY}, timeout_s={DEVICE_TIMEOUT_S}, command:")
  print(DEVICE_COMMAND)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/device_check"), help="folder of the JSON and logs")
  ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
  ap.add_argument("--timeouts", default="",
                  help=f"part:seconds,... over the defaults {TIMEOUTS} (--tiny: {TINY_TIMEOUT} each)")
  ap.add_argument("--tiny", action="store_true", help="tiny shapes on this machine's backend (the CPU test)")
  ap.add_argument("--dry_run", action="store_true", help="print what each part runs and measures; run nothing")
  ap.add_argument("--part", default="", help=argparse.SUPPRESS)  # a part's own process
  args = ap.parse_args()
  shapes = TINY if args.tiny else DEVICE
  os.makedirs(args.out, exist_ok=True)
  if args.part == "env":
    return part_env(args.out)
  if args.part == "mix":
    return part_mix(args.out, shapes)
  args.parts = [p for p in args.parts.split(",") if p]
  if set(args.parts) - set(PARTS):
    raise SystemExit(f"--parts: {sorted(set(args.parts) - set(PARTS))} unknown; the parts are {PARTS}")
  defaults = {k: TINY_TIMEOUT for k in TIMEOUTS} if args.tiny else TIMEOUTS
  args.timeouts = dict(defaults, **{k: float(v) for k, v in (kv.split(":") for kv in args.timeouts.split(",") if kv)})
  commands = _commands(args, shapes)
  if args.dry_run:
    return dry_run(args, shapes, commands)
  summary, spare = {}, 0.0
  for part in args.parts:  # a part may use its own timeout and what the parts before it left unused
    argv, env = commands[part]
    if part == "measure":  # the roofline of the chip env found
      chip, why = chip_found(args.out)
      argv = [f"--chip={chip}" if a.startswith("--chip=") else a for a in argv]
      print(f"[measure] chip {why}", flush=True)
    log_path = os.path.join(args.out, f"{part}.log")
    status = _run(argv, env, round(args.timeouts[part] + spare, 1), log_path)
    spare = max(0.0, status["timeout_s"] - status["seconds"])
    path = os.path.join(args.out, f"{part}.json")
    record = tests_record(args.out, log_path) if part == "tests" else {}
    if os.path.exists(path):
      with open(path) as f:
        record.update(json.load(f))
    record["status"] = status
    if part == "measure":
      record["chip"] = chip_found(args.out)[1]
    _write(path, record)
    summary[part] = status
    print(f"[{part}] {status}", flush=True)
  for part in args.parts:  # the figures, for the tool's output tail
    print(f"\n== {part}\n" + "\n".join(_highlights(args.out, part)))
  return 0 if all(s["returncode"] == 0 and not s["timed_out"] for s in summary.values()) else 1


if __name__ == "__main__":
  sys.exit(main())
