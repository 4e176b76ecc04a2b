"""Evaluate a policy as math-reasoning papers report it: greedy pass@1, avg@n, pass@k, maj@k per set, with samples.

  python experiments/evaluate.py --model=/tmp/run --baseline=ref                    # a run (latest step) vs its pi_ref
  python experiments/evaluate.py --model=/tmp/run@50 --sets=paper --out=/tmp/ev     # the paper's sets, step 50
  python experiments/evaluate.py --model=Qwen/Qwen2.5-1.5B --sets=math500:8,gsm8k --out=/tmp/ev
  python experiments/evaluate.py --model=/tmp/run --regrade --graders=hendrycks       # grade the kept samples again

--model / --baseline: a run's work directory (`DIR@STEP` for a checkpoint step), an HF folder or a hub id; the
baseline may also be `ref` (a run's pi_ref). A run is evaluated under its own config (DIR/report.json, or --config):
its sets, sampling and graders unless a flag says otherwise, so with no flags the command gives the run report's
figures for the same checkpoint. Writes OUT/eval.json, OUT/eval.md, OUT/pass_at_k.png, OUT/samples.jsonl (and
baseline_samples.jsonl); rerunning resumes from OUT/chunks. Formulas and choices: docs/evaluation.md.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # configs/ and the package

import jax  # noqa: E402
import ml_collections  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from astarpo_jax import experiment, run_config  # noqa: E402
from astarpo_jax.evals import (  # noqa: E402
  models, report, run as evals_run, samples as samples_lib, sets as sets_lib, summary,
)
from astarpo_jax.model import decoder, hf  # noqa: E402
from configs import base  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "A run config (configs/*.py[:variant]); default: the "
                                          "run's own (DIR/report.json) or configs/base.py for a model folder.",
                                          lock_config=False)
_MODEL = flags.DEFINE_string("model", None, "A run's work directory[@STEP], an HF folder or a hub id.")
_BASELINE = flags.DEFINE_string("baseline", "", "Compared per problem: `ref`, a run[@STEP], an HF folder, a hub id.")
_SETS = flags.DEFINE_string("sets", "", "NAME[:N],...: presets, `paper`, `gsm8k`, data files; default: the run's.")
_N = flags.DEFINE_integer("n", -1, "Samples per problem for every set without its own :N (-1: the set's own).")
_TEMPERATURE = flags.DEFINE_float("temperature", -1.0, "Sampling temperature (-1: the config's).")
_TOP_P = flags.DEFINE_float("top_p", -1.0, "Top-p (-1: the config's).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", -1, "New tokens per response (-1: the config's).")
_GRADERS = flags.DEFINE_string("graders", "", "Comma-separated; the first is the headline (default: the config's).")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "Local copies of the presets (e.g. ../shared/data).")
_LIMIT = flags.DEFINE_integer("limit", -1, "At most this many problems per set (-1: the config's data.num_test).")
_PROBLEM_FIELD = flags.DEFINE_string("problem_field", None, "A data file's problem field.")
_ANSWER_FIELD = flags.DEFINE_string("answer_field", None, "A data file's answer field.")
_ANSWER_FORMAT = flags.DEFINE_string("answer_format", None, "plain | gsm8k | boxed | latex_list | json.")
_EXTRA_FIELDS = flags.DEFINE_list("extra_fields", None, "A data file's fields passed to a user's reward function.")
_DTYPE = flags.DEFINE_string("dtype", "", "Compute and param dtype of a model folder (default: the config's).")
_OUT = flags.DEFINE_string("out", "", "Output folder (default: DIR/eval for a run).")
_CHUNK_ROWS = flags.DEFINE_integer("chunk_rows", 256, "Responses per rollout call and per resumable chunk.")
_REGRADE = flags.DEFINE_bool("regrade", False, "Grade OUT's kept samples again (--graders) without sampling.")


def _config(spec: models.ModelSpec) -> ml_collections.ConfigDict:
  """The run's config with the flags applied (see the module docstring)."""
  if _CONFIG.value is not None:
    c = _CONFIG.value
  elif spec.kind == "run":
    path = os.path.join(spec.path, "report.json")
    if not os.path.exists(path):
      raise ValueError(f"--model={spec.label}: {path} is missing (the run has not finished once); pass the run's "
                       "config as --config=configs/....py[:variant] with its overrides")
    with open(path) as f:
      c = ml_collections.ConfigDict(json.load(f)["config"])
  else:
    c = base.get_config()
  if spec.kind != "run":
    c.model.name_or_path = spec.path
  if _DTYPE.value:
    c.model.dtype = c.model.param_dtype = c.model.ref_param_dtype = _DTYPE.value
  s = c.sampling
  s.temperature = s.temperature if _TEMPERATURE.value < 0 else _TEMPERATURE.value
  s.top_p = s.top_p if _TOP_P.value < 0 else _TOP_P.value
  s.max_new_tokens = s.max_new_tokens if _MAX_TOKENS.value < 0 else _MAX_TOKENS.value
  if _GRADERS.value:
    c.reward.eval_graders = tuple(g.strip() for g in _GRADERS.value.split(",") if g.strip())
  d = c.data
  for field, flag in (("data_dir", _DATA_DIR), ("problem_field", _PROBLEM_FIELD), ("answer_field", _ANSWER_FIELD),
                      ("answer_format", _ANSWER_FORMAT)):
    if flag.value is not None:
      d[field] = flag.value
  if _EXTRA_FIELDS.value is not None:
    d.extra_fields = tuple(_EXTRA_FIELDS.value)
  if _LIMIT.value >= 0:
    d.num_test = _LIMIT.value
  if _SETS.value:
    specs = sets_lib.parse(_SETS.value, None if _N.value < 0 else _N.value)
    d.test_sets, d.avg_k_sets = tuple(x.name for x in specs), ()
  if d.train not in run_config.OFFLINE_TASKS:  # build() loads training prompts: one, of the first set
    d.train, d.num_train = (list(d.test_sets) + list(d.avg_k_sets))[0], 1
  c.mode = "eval"
  return c


def _runs(setup) -> list[samples_lib.SetRun]:
  """--sets' set runs over the setup's prompts, or the run's own (experiment.evaluate_all's)."""
  if not _SETS.value:
    if _N.value < 0:
      return evals_run.runs_of(setup.test_sets, setup.avg_k_sets, setup.avg_k)
    sampled = {**setup.avg_k_sets, **setup.test_sets} if _N.value else {}
    return evals_run.runs_of(setup.test_sets, sampled, _N.value)
  out = []
  for x in sets_lib.parse(_SETS.value, None if _N.value < 0 else _N.value):
    out.append(samples_lib.SetRun(x.name, "greedy", 1, tuple(setup.test_sets[x.name])))
    if x.n:
      out.append(samples_lib.SetRun(x.name, "sampled", x.n, tuple(setup.test_sets[x.name])))
  return out


def _params(setup, spec: models.ModelSpec, run_spec: models.ModelSpec, flag: str):
  """(params, identity) of --model or --baseline."""
  if spec.kind == "run":
    if spec.path != run_spec.path and run_spec.kind == "run":
      raise ValueError(f"{flag}={spec.label}: a checkpoint of another run; compare two runs' exports (HF folders)")
    if run_spec.kind != "run":
      raise ValueError(f"{flag}={spec.label}: a run's checkpoint needs that run's config: give the run as --model")
    policy_cfg = dataclasses.replace(setup.cfg, param_dtype=setup.policy_param_dtype)
    params, step = models.restore_policy(spec.path, spec.step, setup.method, policy_cfg, setup.ref_params,
                                         setup.optimizers, setup.seed, setup.mesh, setup.tokenizer, setup.scfg,
                                         setup.lora)
    return params, models.identity(spec, step)
  if spec == run_spec:  # the folder or hub id the setup loaded as its reference
    return setup.ref_params, models.identity(spec)
  tok = hf.load_tokenizer(spec.path)
  if tok.get_vocab() != setup.tokenizer.get_vocab():
    raise ValueError(f"{flag}={spec.label}: its tokenizer differs from the model's; both must read the same prompts")
  _, params = hf.load_hf(hf.resolve_checkpoint_dir(spec.path), dtype=setup.cfg.dtype,
                         param_dtype=setup.cfg.param_dtype, shardings=decoder.param_shardings(setup.cfg, setup.mesh))
  return params, models.identity(spec)


def _commit() -> str:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                         check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                           text=True).stdout.strip()
    return rev + ("+changes" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def main(argv):
  del argv
  say = experiment.printer()
  spec = models.parse(_MODEL.value)
  base_spec = None
  if _BASELINE.value and _BASELINE.value != "ref":
    base_spec = (models.ModelSpec("run", spec.path, int(_BASELINE.value[1:])) if _BASELINE.value.startswith("@")
                 else models.parse(_BASELINE.value, "--baseline"))
  if _BASELINE.value == "ref" and spec.kind != "run":
    raise ValueError(f"--baseline=ref: pi_ref is a run's reference; --model={spec.label} is not a run")
  out = _OUT.value or (os.path.join(spec.path, "eval") if spec.kind == "run" else "")
  if not out:
    raise ValueError("--out: where to write eval.json and the samples (required unless --model is a run)")
  c = _config(spec)
  run_config.validate_config(c)
  setup = experiment.build(c, spec.path if spec.kind == "run" else os.path.join(out, "build"), log=say)
  with setup, jax.set_mesh(setup.mesh):
    runs = _runs(setup)
    meta = {r.name: sets_lib.problem_meta(r.name, c.data.data_dir or None) for r in runs}
    graders = [g for g, _ in setup.graders.eval]
    who = [("model", spec, "samples.jsonl")]
    if _BASELINE.value:
      who.append(("baseline", base_spec, "baseline_samples.jsonl"))
    evals, ids = {}, {}
    for label, which, fname in who:
      path = os.path.join(out, fname)
      if _REGRADE.value:
        if not os.path.exists(path):
          raise FileNotFoundError(f"--regrade: {path} is missing; evaluate first (without --regrade)")
        evals[label] = evals_run.regrade(samples_lib.read_jsonl(path), runs, setup.graders.eval,
                                         pass_threshold=setup.pass_threshold, meta=meta)
        prev = os.path.join(out, "eval.json")
        prev = json.load(open(prev)).get(label, {}) if os.path.exists(prev) else {}
        ids[label] = {**prev, "regraded_from": path}
      else:
        if which is None:  # --baseline=ref
          params, ids[label] = setup.ref_params, {"kind": "reference", "path": spec.path}
        else:
          params, ids[label] = _params(setup, which, spec, f"--{label}")
        engine = dataclasses.replace(experiment.eval_engine(setup), chunk_rows=_CHUNK_ROWS.value)
        evals[label] = evals_run.evaluate(engine, params, runs, setup.seed, pass_threshold=setup.pass_threshold,
                                          meta=meta, model_id=json.dumps(ids[label], sort_keys=True),
                                          out_dir=os.path.join(out, label), log=say)
      if jax.process_index() == 0:
        samples_lib.write_jsonl(path, evals[label].records)
    if jax.process_index() == 0:
      _write(out, c, spec, evals, ids, graders, runs)
    say(f"eval.json, eval.md, samples in {out}")


def _write(out: str, c, spec, evals: dict, ids: dict, graders: list[str], runs) -> None:
  head = graders[0]
  model_name = os.path.basename(spec.path.rstrip("/")) + (f"@{ids['model'].get('step')}" if spec.kind == "run" else "")
  base_name = "pi_ref" if _BASELINE.value == "ref" else os.path.basename(_BASELINE.value.rstrip("/")) or "baseline"
  res = {"commit": _commit(), "model": ids["model"], "graders": graders, "headline_grader": head,
         "settings": {"sets": [{"set": r.name, "mode": r.mode, "n": r.n, "problems": len(r.prompts)} for r in runs],
                      "temperature": c.sampling.temperature, "top_p": c.sampling.top_p, "top_k": c.sampling.top_k,
                      "max_tokens": c.sampling.max_new_tokens, "greedy": "temperature 0, top_p 1, top_k 0",
                      "template": run_config.OFFLINE_TASKS[c.data.train].PROMPT_TEMPLATE
                      if c.data.train in run_config.OFFLINE_TASKS else c.data.template, "chat": c.data.chat, "eos_required": c.reward.eval_eos_required,
                      "pass_threshold": c.reward.pass_threshold, "seed": c.seed, "chunk_rows": _CHUNK_ROWS.value,
                      "bootstrap": {"resamples": 2000, "seed": 0, "level": 0.95}},
         "sets": evals["model"].results, "overall": summary.overall(evals["model"].results),
         "run_report_rows": summary.run_report_rows(evals["model"].results, graders)}
  paired = None
  if "baseline" in evals:
    b = evals["baseline"].results
    paired = {g: summary.compare(evals["model"].results, b, g) for g in graders}
    res.update({"baseline": ids["baseline"], "baseline_sets": b, "baseline_overall": summary.overall(b),
                "baseline_run_report_rows": summary.run_report_rows(b, graders), "paired": paired})
  report.write_json(os.path.join(out, "eval.json"), res)
  table = report.markdown(evals["model"].results, head, model_name, evals.get("baseline") and evals["baseline"].results,
                          paired and paired[head], base_name)
  with open(os.path.join(out, "eval.md"), "w") as f:
    f.write(f"{head} figures, mean ± standard error over problems (commit {res['commit']})\n\n{table}")
  report.plot(os.path.join(out, "pass_at_k.png"), evals["model"].results, head, model_name,
              evals.get("baseline") and evals["baseline"].results, base_name)
  print(table)


if __name__ == "__main__":
  logging.set_verbosity(logging.WARNING)
  flags.mark_flags_as_required(["model"])
  app.run(main)
