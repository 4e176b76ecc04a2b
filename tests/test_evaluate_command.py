"""experiments/evaluate.py on a tiny demo run: on the run's checkpoint (and pi_ref), on its HF export with a user's
file of the same problems, and regrading its kept samples, it gives the run report's own figures; bad input is
refused by name."""
import json
import os
import subprocess
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The demo's CI variant, cut to seconds: a short warm-start, 2 rollout steps, 12 held-out sums (greedy + avg@2)
RUN = ["--config=configs/demo.py:tiny", "--config.warmstart.steps=100", "--config.train.num_steps=2",
       "--config.train.rollout_batch=16", "--config.train.mini_batch=16", "--config.train.micro_batch=16",
       "--config.data.num_train=32", "--config.stage1.n_samples=2", "--config.stage1.chunk_prompts=32",
       "--config.data.synthetic.num_test=12", "--config.train.checkpoint_every=1", "--config.export_hf=True",
       "--config.reward.num_workers=1", "--config.reward.eval_graders=('math_verify','hendrycks_lenient')"]


def _py(script, *args, timeout=600):
  env = dict(os.environ, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")  # compile-bound: conftest's XLA level 0 kept
  return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", script), *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  work = tmp_path_factory.mktemp("run")
  r = _py("main.py", *RUN, f"--workdir={work}")
  assert r.returncode == 0, r.stderr[-3000:]
  return work, json.loads((work / "report.json").read_text())


def _rows(path):
  return json.loads(path.read_text())


def test_the_command_on_a_run_gives_its_report_for_the_policy_and_pi_ref_and_regrades_the_same(run, tmp_path):
  work, report = run
  out = tmp_path / "ev"
  r = _py("evaluate.py", f"--model={work}", "--baseline=ref", f"--out={out}")
  assert r.returncode == 0, r.stderr[-3000:]
  ev = _rows(out / "eval.json")
  assert ev["model"]["kind"] == "run" and ev["model"]["step"] == 2
  assert ev["run_report_rows"] == report["final_eval"]  # the same checkpoint, the same figures
  assert ev["baseline_run_report_rows"] == report["reference_eval"]
  acc = [v["accuracy"] for v in report["final_eval"].values()]
  assert 0 < max(acc) and min(acc) < 1  # figures that could differ
  assert set(report["final_eval"]) == {"synthetic/pass@1", "synthetic/avg@2", "synthetic/pass@1/hendrycks_lenient",
                                       "synthetic/avg@2/hendrycks_lenient"}
  assert {"pass@1", "pass@2", "maj@1", "maj@2"} <= set(report["final_eval"]["synthetic/avg@2"])
  lines = (out / "samples.jsonl").read_text().splitlines()
  assert len(lines) == 12 + 12 * 2 and {"response", "answers", "rewards", "uid"} <= set(json.loads(lines[0]))
  assert (out / "pass_at_k.png").stat().st_size > 0 and "difference [95% CI]" in (out / "eval.md").read_text()
  r = _py("evaluate.py", f"--model={work}", "--baseline=ref", f"--out={out}", "--regrade")
  assert r.returncode == 0, r.stderr[-3000:]
  again = _rows(out / "eval.json")
  assert again["sets"] == ev["sets"] and again["paired"] == ev["paired"] and again["model"]["regraded_from"]


def test_the_command_on_the_export_and_a_user_file_of_the_same_problems_gives_the_run_report(run, tmp_path):
  work, report = run
  from astarpo_jax import run_inputs
  from configs import demo
  c = demo.get_config("tiny")
  c.data.synthetic.num_test = 12
  rows = [{"q": ex.problem, "a": ex.gold} for ex in run_inputs.load_set(c, "synthetic", "test")]
  data = tmp_path / "sums.jsonl"
  data.write_text("".join(json.dumps(x) + "\n" for x in rows))
  out = tmp_path / "ev"
  r = _py("evaluate.py", f"--model={work}/export", *RUN[:1], *RUN[-1:], f"--sets={data}", "--problem_field=q",
          "--answer_field=a", "--n=2", f"--out={out}")
  assert r.returncode == 0, r.stderr[-3000:]
  got = _rows(out / "eval.json")["run_report_rows"]
  assert got == {k.replace("synthetic", str(data)): v for k, v in report["final_eval"].items()}


@pytest.mark.parametrize("args,message", [
    (["--sets=math5000"], "--sets: unknown set 'math5000'"),
    (["--sets=DATA", "--problem_field=q", "--answer_field=answer"], "answer field 'answer' not found; available"),
])
def test_bad_input_is_refused_naming_it(run, tmp_path, args, message):
  work, _ = run
  data = tmp_path / "d.jsonl"
  data.write_text('{"q": "1+1", "a": "2"}\n')
  r = _py("evaluate.py", f"--model={work}", f"--out={tmp_path}/ev", *[a.replace("DATA", str(data)) for a in args])
  assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]
