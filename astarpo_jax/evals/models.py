"""Which model an evaluation reads: a run's work directory at a checkpoint step, an HF folder, or a hub id.

`--model=DIR` is a run's work directory when DIR/checkpoints exists (its latest step; `DIR@STEP` names one), an HF
folder when DIR/config.json exists (its tokenizer must be there too), and otherwise a hub id. A run's policy is
restored into the train state its method starts from (as training resumes), and only its params are kept.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from astarpo_jax.infra import checkpoint as ckpt_lib
from astarpo_jax.model import decoder, lora
from astarpo_jax.training import loop

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  kind: str  # "run", "hf" or "hub"
  path: str  # the work directory, the folder or the hub id
  step: int | None = None  # a run's checkpoint step; None = its latest

  @property
  def label(self) -> str:
    return self.path + (f"@{self.step}" if self.step is not None else "")


def parse(spec: str, flag: str = "--model") -> ModelSpec:
  """The ModelSpec of `spec` (see the module docstring); a clear error for a folder that is neither."""
  path, step = spec, None
  head, sep, tail = spec.rpartition("@")
  if sep and tail.isdigit():
    path, step = head, int(tail)
  if os.path.isdir(os.path.join(path, "checkpoints")):
    return ModelSpec("run", os.path.abspath(path), step)
  if step is not None:
    raise ValueError(f"{flag}={spec}: @{step} names a checkpoint step, but {path} has no checkpoints/ folder "
                     "(a run's work directory has one)")
  if os.path.isdir(path):
    if not os.path.exists(os.path.join(path, "config.json")):
      raise ValueError(f"{flag}={spec}: the folder is neither a run's work directory (no checkpoints/) nor an HF "
                       "model folder (no config.json)")
    if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
      raise ValueError(f"{flag}={spec}: the HF folder has no tokenizer (none of {TOKENIZER_FILES}); save the "
                       "tokenizer beside the weights (tokenizer.save_pretrained(folder); an export of this project "
                       "has one)")
    return ModelSpec("hf", os.path.abspath(path))
  if path.startswith((".", "/")) or path.count("/") > 1:
    raise ValueError(f"{flag}={spec}: no such folder (and not a hub id of the form owner/name)")
  return ModelSpec("hub", path)


def restore_policy(workdir: str, step: int | None, method, cfg, ref_params, optimizers, seed: int, mesh, tokenizer,
                   scfg, lora_cfg: lora.LoraConfig | None = None) -> tuple[object, int]:
  """(the policy params, the step) of a run's checkpoint, restored into the state `method` initialises from the
  reference (the tree, dtypes and shardings training resumes into). A LoRA run's checkpoint holds the adapter:
  it is restored into a fresh adapter's state and returned merged into the base, as the run's evaluations sample."""
  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
  try:
    steps = ckpt.all_steps()
    if not steps:
      raise FileNotFoundError(f"{workdir}/checkpoints holds no complete checkpoint: the run saved none yet")
    step = steps[-1] if step is None else step
    if step not in steps:
      raise ValueError(f"--model={workdir}@{step}: no checkpoint of step {step}; the run holds steps {steps}")
    if lora_cfg is not None:  # as run_training starts: a fresh adapter, the base is ref_params itself
      policy, cfg = lora.init_adapter(cfg, lora_cfg, seed), lora.model_config(cfg, lora_cfg)
    else:
      policy = decoder.cast_params(ref_params, cfg.param_dtype)
    state = method.init_state(cfg, policy, optimizers, seed)
    ctx = loop.RunContext(cfg, ref_params, tokenizer, None, scfg, mesh, lora=lora_cfg)
    state, _, _ = loop.place_state(method, ctx, optimizers, state)
    restored, _ = ckpt_lib.restore_train_state(ckpt, state, step)
  finally:
    ckpt.close()
  return ctx.sampling_params(restored["params"]), step


def identity(spec: ModelSpec, step: int | None = None) -> dict:
  """What names the evaluated weights: kind, path, step, and a digest of the files that hold them (an HF folder's
  config.json and weight files' names and sizes; a run's checkpoint folder listing)."""
  out = {"kind": spec.kind, "path": spec.path, "step": step if step is not None else spec.step}
  folder = (os.path.join(spec.path, "checkpoints", str(step)) if spec.kind == "run" and step is not None
            else spec.path if spec.kind == "hf" else None)
  if folder and os.path.isdir(folder):
    h = hashlib.sha256()
    for root, _, names in sorted(os.walk(folder)):
      for name in sorted(names):
        p = os.path.join(root, name)
        h.update(json.dumps([os.path.relpath(p, folder), os.path.getsize(p)]).encode())
        if name == "config.json":
          h.update(open(p, "rb").read())
    out["files_sha256"] = h.hexdigest()[:16]
  return out
