"""Preemption notices (SIGTERM / SIGINT): the step or Stage-1 chunk in flight finishes and is saved, the run
exits with code 75, and the same command resumes to what an uninterrupted run reaches, logging each step once.

The demo test runs experiments/main.py (configs/demo.py:tiny, shrunk) as a launcher would: SIGTERM to its
process at a seeded random step, then to its whole process group (the grader workers included), then an
uninterrupted rerun; it is compared with a run nobody interrupted. The two-process test is
tests/preemption_worker.py under jax.distributed on the CPU.
"""
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from astarpo_jax import methods
from astarpo_jax.data.dataset import Prompt
from astarpo_jax.infra import checkpoint as ckpt_lib, preemption
from astarpo_jax.model import decoder
from astarpo_jax.stage1 import estimate, value_table as vt
from astarpo_jax.training import loop, update
from tests.test_loop import CFG, PROMPTS, SCFG, TOK, _grade, _run
from tests.wandb_logs import offline_env, wandb_history
from tests.worker_processes import ROOT, free_port, run_workers


def _exit_into(codes):
  """An exit function that records the code instead of ending the process."""
  return codes.append


def _notice(sig=signal.SIGTERM):
  os.kill(os.getpid(), sig)
  time.sleep(0.05)  # the handler runs in this (main) thread at the next bytecode; give the kernel a moment


def test_a_notice_outside_a_step_raises_at_once_and_inside_one_waits_for_the_boundary():
  before = signal.getsignal(signal.SIGINT)
  with preemption.Watch(grace_s=0):
    with pytest.raises(preemption.Preempted, match="SIGINT received; the phase it interrupted is redone"):
      _notice(signal.SIGINT)
  assert signal.getsignal(signal.SIGINT) is before  # the previous handlers are back
  boundaries = []
  with preemption.Watch(grace_s=0) as watch:
    with pytest.raises(preemption.Preempted, match="SIGTERM: step 2 saved"):
      with watch.finishing("the step"):
        for step in range(1, 6):
          if step == 2:
            _notice()  # in the middle of step 2: nothing raised, the step goes on to its boundary
          boundaries.append(step)
          if watch.stop_requested():
            raise watch.preempted(f"step {step} saved")
  assert boundaries == [1, 2]
  assert not preemption.Watch().stop_requested()  # not installed: never stops a loop


def test_a_second_notice_exits_at_once_and_a_step_past_the_grace_period_exits_unsaved():
  codes = []
  with preemption.Watch(grace_s=0, exit_fn=_exit_into(codes)) as watch:
    with pytest.raises(preemption.Preempted, match="after the last step"), watch.finishing("step"):
      _notice()
      assert codes == []
      _notice()
      assert codes == [preemption.EXIT_CODE]
  for disarmed in (False, True):
    codes.clear()
    with preemption.Watch(grace_s=0.3, exit_fn=_exit_into(codes)) as watch:
      with pytest.raises(preemption.Preempted), watch.finishing("step"):
        _notice()
        if disarmed:
          watch.disarm()  # saved in time
        time.sleep(1.0)  # the step is still in flight: the grace period runs out unless disarmed
        assert codes == ([] if disarmed else [preemption.EXIT_CODE])


def _fake_draw(prompts, n, key):
  """Rewards drawn from the chunk's key, so a chunk redone with another key would show in the file."""
  r = np.asarray(jax.random.bernoulli(key, 0.4, (len(prompts), n)), np.float32)
  return estimate.Drawn(r, np.zeros(r.shape, bool), [["x"] * n for _ in prompts])


def test_sigterm_during_stage1_writes_the_chunk_in_flight_and_the_rerun_gives_the_uninterrupted_file(tmp_path):
  prompts = [Prompt(f"p/{i}", f"problem {i}", (i + 1, 7), "1") for i in range(10)]
  run = lambda out, draw, watch=None: estimate.run_stage1(  # noqa: E731
      prompts, draw, out_dir=str(out), n_samples=4, chunk_prompts=3, seed=5, log=lambda s: None, progress=False,
      watch=watch)
  run(tmp_path / "straight", _fake_draw)
  calls = []

  def draw(prompts_, n, key):
    calls.append(len(prompts_))
    if len(calls) == 2:
      _notice()  # while chunk 1 is being sampled
    return _fake_draw(prompts_, n, key)
  with preemption.Watch(grace_s=60) as watch, pytest.raises(preemption.Preempted, match="Stage-1 chunk 1 finished"):
    run(tmp_path / "cut", draw, watch)
  chunks = tmp_path / "cut" / "stage1" / "chunks"
  assert sorted(os.listdir(chunks)) == ["chunk_00000.jsonl", "chunk_00001.jsonl"]  # nothing half-written
  run(tmp_path / "cut", draw)
  assert len(calls) == 4  # chunks 0 and 1 were not drawn again
  for name in ("vstar.jsonl", "chunks/chunk_00001.jsonl", "chunks/chunk_00003.jsonl"):
    assert (tmp_path / "cut" / "stage1" / name).read_text() == (tmp_path / "straight" / "stage1" / name).read_text()


def test_sigterm_during_a_checkpoint_save_lets_it_complete_then_saves_the_next_step(tmp_path, monkeypatch):
  straight, _ = _run(tmp_path / "a", _grade())
  real_save = ckpt_lib.Checkpointer.save

  def save_then_notice(self, step, *args, **kwargs):
    saved = real_save(self, step, *args, **kwargs)
    if saved and step == 2:
      _notice()  # the async write of step 2 is in flight
    return saved
  monkeypatch.setattr(ckpt_lib.Checkpointer, "save", save_then_notice)
  with preemption.Watch(grace_s=60) as watch, pytest.raises(preemption.Preempted, match="rollout step 3 finished"):
    _run(tmp_path / "b", _grade(), preemption=watch)
  monkeypatch.undo()
  listed = sorted(os.listdir(tmp_path / "b" / "checkpoints"))
  assert listed == ["2", "3"]  # step 2's save completed; no unfinished (tmp) step is listed or left
  resumed, _ = _run(tmp_path / "b", _grade())
  jax.tree.map(np.testing.assert_array_equal, straight, resumed)
  logged = [json.loads(s)["step"] for s in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
  assert logged == [1, 2, 3, 4]  # each step once: nothing repeated after the resume


def test_a_run_resumed_after_its_last_step_redoes_the_final_evaluation_without_logging_it_twice(tmp_path):
  """As after a notice during the export: the rerun finds the last checkpoint, evaluates for its report, and
  leaves the logs as they were."""
  settings = loop.LoopSettings(num_steps=2, rollout_batch=8, mini_batch=4, micro_batch=4, checkpoint_every=2)
  _, params = decoder.init_params(CFG, seed=0)
  calls = []

  def evaluate(p, step):
    calls.append(step)
    return {"accuracy": float(np.asarray(p["embed"]).sum())}  # a function of the params alone
  results = []
  for _ in range(2):
    ctx = loop.RunContext(CFG, params, TOK, _grade(), SCFG, value_table=vt.ValueTable(
        {p.uid: {"vstar": 0.3} for p in PROMPTS}, list(PROMPTS), "", {}))
    results.append(loop.run(methods.get("astarpo", {"beta2": 0.1}), params, PROMPTS, ctx, settings,
                            update.Optimizers(update.make_optimizer(lr=1e-2)),
                            loop.RunIO(str(tmp_path), log=lambda s: None, evaluate_fn=evaluate)))
  assert calls == [2, 2] and results[0].last_eval == results[1].last_eval
  rows = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [(m["step"], "eval/accuracy" in m) for m in rows] == [(1, False), (2, False), (2, True)]


# ---------------------------------------------------------------------------------------------
# The demo through experiments/main.py, as a launcher runs it.

DEMO = ["--config=configs/demo.py:tiny", "--config.mode=train", "--config.data.num_train=64",
        "--config.train.rollout_batch=16", "--config.train.mini_batch=8", "--config.train.micro_batch=8",
        "--config.train.num_steps=8", "--config.train.checkpoint_every=4", "--config.warmstart.steps=60",
        "--config.data.synthetic.min_terms=2", "--config.data.synthetic.max_terms=2",  # some rewards are 1
        "--config.data.synthetic.num_test=16", "--config.stage1.n_samples=4", "--config.export_hf=True",
        "--config.wandb.mode=offline", "--config.wandb.project=test"]


def _main(workdir, env, signal_at=None, group=False, timeout=600):
  """Runs main.py in a session of its own; with `signal_at`, SIGTERM once train step `signal_at` is logged.
  Returns (exit code, merged stdout and stderr)."""
  proc = subprocess.Popen([sys.executable, "experiments/main.py", *DEMO, f"--workdir={workdir}"], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
  out, deadline = b"", time.monotonic() + timeout
  try:
    while chunk := proc.stdout.read1(1 << 16):
      out += chunk
      if signal_at is not None and f"[train/step {signal_at}]".encode() in out:
        (os.killpg if group else os.kill)(proc.pid, signal.SIGTERM)
        signal_at = None
      if time.monotonic() > deadline:
        raise TimeoutError(out.decode(errors="replace")[-3000:])
    return proc.wait(timeout=60), out.decode(errors="replace").replace("\r", "\n")
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)


def _tb_scalars(tb_dir, tag):
  """Every (step, value) of `tag` in the TensorBoard event files, read with the record format and the Event
  proto, not tensorboardX's writer."""
  from tensorboardX.proto import event_pb2
  out = []
  for name in sorted(os.listdir(tb_dir)):
    data, pos = open(os.path.join(tb_dir, name), "rb").read(), 0
    while pos < len(data):
      (n,) = struct.unpack("<Q", data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
      pos += 12 + n + 4  # length, its crc, the record, its crc
      out += [(event.step, v.simple_value) for v in event.summary.value if v.tag == tag]
  return out


def test_demo_sigterm_to_the_process_then_its_group_exits_75_and_resumes_to_the_uninterrupted_run(tmp_path):
  env = dict(offline_env(tmp_path), PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
  straight, cut = tmp_path / "straight", tmp_path / "cut"
  rc, out = _main(straight, env)
  assert rc == 0, out[-3000:]
  cut.mkdir()
  for cached in ("reference", "tokenizer", "stage1"):  # the same reference and V*; Stage 2 starts afresh
    shutil.copytree(straight / cached, cut / cached)
  rng = random.Random(40)
  resumed_at = 0
  for group in (False, True):
    step = resumed_at + rng.randint(1, 2)
    print(f"SIGTERM to the {'process group' if group else 'process'} once train step {step} is logged")
    rc, out = _main(cut, env, signal_at=step, group=group)
    assert rc == preemption.EXIT_CODE, out[-3000:]
    after = out[out.index("preemption: SIGTERM received"):]
    steps_after = [int(s.split("]")[0]) for s in after.split("[train/step ")[1:]]
    assert len(steps_after) <= 1, after  # within one step: at most the step in flight is finished
    saved = steps_after[0] if steps_after else step
    assert f"rollout step {saved} finished and saved" in after and "exit code 75" in after, after
    assert step <= saved < 8
    assert str(saved) in os.listdir(cut / "checkpoints") and not [
        n for n in os.listdir(cut / "checkpoints") if "tmp" in n]
    if resumed_at:
      assert f"resumed after rollout step {resumed_at}" in out
    resumed_at = saved
  rc, out = _main(cut, env)
  assert rc == 0 and f"resumed after rollout step {resumed_at}" in out, out[-3000:]

  # The same final params, bit for bit, and the same evaluation.
  assert (cut / "export" / "model.safetensors").read_bytes() == (straight / "export" / "model.safetensors").read_bytes()
  want, got = (json.loads((d / "report.json").read_text())["final_eval"] for d in (straight, cut))
  assert got == want and want["synthetic/pass@1"]["num_prompts"] == 16
  # Each step logged once, with the uninterrupted run's figures, in every sink.
  rows = lambda d: [json.loads(s) for s in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
  train = lambda d: [m for m in rows(d) if "train/loss" in m]  # noqa: E731
  assert [m["step"] for m in train(cut)] == list(range(1, 9))
  for g, w in zip(train(cut), train(straight)):
    for k in ("train/loss", "train/reward_mean", "train/kl", "train/grad_norm", "train/response_length"):
      assert g[k] == w[k], (g["step"], k)
  assert sum(m["train/reward_mean"] for m in train(cut)) > 0  # rewards came from live graders
  assert [m["step"] for m in rows(cut) if "train/loss" not in m] == [8]  # the final evaluation, once
  assert sorted(s for s, _ in _tb_scalars(cut / "tb", "train/loss")) == list(range(1, 9))
  assert sorted(_tb_scalars(cut / "tb", "train/loss")) == sorted(_tb_scalars(straight / "tb", "train/loss"))
  history = wandb_history(cut)
  assert len(history) == 3  # three segments of one W&B run, which `wandb sync` joins
  steps = [s for segment in history for s in segment if "train/loss" in segment[s]]
  assert sorted(steps) == list(range(1, 9))


def test_two_processes_save_the_same_step_when_only_one_receives_the_notice(tmp_path):
  step = random.Random(41).choice([1, 3])  # not a multiple of checkpoint_every: the notice forces that save
  print(f"SIGTERM to process 1 while it grades rollout step {step}")
  port = str(free_port())
  run_workers([[os.path.join(ROOT, "tests", "preemption_worker.py"), str(i), "2", port, str(tmp_path), str(step)]
               for i in range(2)], timeout=500)
  results = [json.loads((tmp_path / f"result_{i}.json").read_text()) for i in range(2)]
  assert results[0]["raised"] == f"a notice on another process: rollout step {step} finished and saved in " \
                                 f"{tmp_path}/preempted/checkpoints"
  assert results[1]["raised"].startswith(f"SIGTERM: rollout step {step} finished and saved")
  assert results[0]["listed"] == results[1]["listed"] == sorted({2, step} if step > 2 else {step})
  assert all(r["equal"] and r["moved"] for r in results)  # the resumed run reaches the straight one's params
