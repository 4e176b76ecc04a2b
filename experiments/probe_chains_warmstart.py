"""How many supervised steps the chains reference needs: greedy held-out accuracy during the warm-start.

  flock /work/cpu.lock python experiments/probe_chains_warmstart.py --config=configs/chains.py \
      --segments=4 --config.warmstart.steps=200 --config.warmstart.lr=1e-2

Runs `segments` warm-starts of config.warmstart.steps each (each segment its own warmup + cosine to
lr/10, continuing from the last params) and after each prints the seconds so far, the last NLL and the
greedy exact-match accuracy (the boxed answer and EOS) on config.data.chains.num_test held-out problems,
by chain length. It answers "is the warm-start long enough" before a full calibrate_chains.py run.

  python experiments/probe_chains_warmstart.py --config=configs/chains.py --pass_prompts=512 \
      --reference=/work/cmp4/reference_chains_full/reference

With --reference, no warm-start: the saved reference's greedy accuracy and its Stage-1 pass counts on the
config's RL prompts, overall and by number of operations (docs/chains.md at 8a436ea, run 5).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from astarpo_jax import experiment as run_setup  # noqa: E402
from astarpo_jax.data import chains, dataset  # noqa: E402
from astarpo_jax.model import decoder, hf
from astarpo_jax.sampling import sampler
from astarpo_jax.sampling.token_choice import SamplingConfig
from astarpo_jax.training import warmstart

_CONFIG = config_flags.DEFINE_config_file("config", "configs/chains.py", "A chains config.")
_SEGMENTS = flags.DEFINE_integer("segments", 4, "Warm-start segments of config.warmstart.steps each.")
_PASS_PROMPTS = flags.DEFINE_integer("pass_prompts", 0, "Also sample N = 8 responses at temperature 1 for this many "
                                     "training prompts (Stage 1's draw): the zero-pass share and mean pass rate.")
_REFERENCE = flags.DEFINE_string("reference", "", "A saved reference (HF folder) to probe instead of warm-starting.")


def _solved(tok, e, toks, n, fin) -> bool:
  return bool(fin) and tok.decode(list(toks[:n]), skip_special_tokens=True).endswith(f"{chains.BOX}{e.gold}}}")


def greedy_accuracy(cfg, params, tok, examples, max_new_tokens) -> tuple[float, dict]:
  prompts = [tok(dataset.format_prompt(e.problem, chains.PROMPT_TEMPLATE))["input_ids"] for e in examples]
  scfg = SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens, stop_ids=(tok.eos_token_id,),
                        pad_id=tok.pad_token_id)
  out = jax.device_get(sampler.sample(cfg, params, prompts, jax.random.key(0), scfg))
  ok, by = [], {}
  for e, toks, n, fin in zip(examples, out.tokens_BT, out.length_B, out.finished_B):
    good = _solved(tok, e, toks, n, fin)
    ok.append(good)
    k = len(chains.parse_steps(e.problem)[1])
    by.setdefault(k, []).append(good)
  return float(np.mean(ok)), {k: f"{np.mean(v):.2f}/{len(v)}" for k, v in sorted(by.items())}


def pass_counts(cfg, params, tok, examples, max_new_tokens, n: int = 8) -> str:
  """Stage 1's draw (temperature 1, top_p 1, N samples per prompt): pass-count histogram and zero-pass share."""
  prompts = [tok(dataset.format_prompt(e.problem, chains.PROMPT_TEMPLATE))["input_ids"] for e in examples]
  scfg = SamplingConfig(temperature=1.0, max_new_tokens=max_new_tokens, stop_ids=(tok.eos_token_id,),
                        pad_id=tok.pad_token_id)
  out = jax.device_get(sampler.sample(cfg, params, [p for p in prompts for _ in range(n)], jax.random.key(1), scfg))
  ok = np.array([_solved(tok, examples[i // n], t, m, f) for i, (t, m, f) in
                 enumerate(zip(out.tokens_BT, out.length_B, out.finished_B))]).reshape(-1, n)
  k = ok.sum(1)
  by = {}
  for e, passes in zip(examples, k):
    by.setdefault(len(chains.parse_steps(e.problem)[1]), []).append(passes == 0)
  return (f"N={n} pass counts {np.bincount(k, minlength=n + 1).tolist()}, zero-pass {np.mean(k == 0):.3f}, "
          f"mean pass {ok.mean():.3f}, mean length {out.length_B.mean():.0f}; zero-pass by operations "
          + ", ".join(f"{s}: {np.mean(v):.2f}/{len(v)}" for s, v in sorted(by.items())))


def main(argv):
  del argv
  c = _CONFIG.value
  s = c.data.chains
  tok = chains.build_tokenizer()
  cfg = dataclasses.replace(run_setup.model_config(c), param_dtype="float32")
  train = run_setup._load_set(c, "chains", "train")[:c.data.num_train]  # the RL prompts (Stage 1's)
  test = run_setup._load_set(c, "chains", "test")
  if _REFERENCE.value:  # a saved reference: no warm-start, so no corpus to build
    _, params = hf.load_hf(_REFERENCE.value, dtype="float32", param_dtype="float32", remat=False)
    acc, by = greedy_accuracy(cfg, params, tok, test, c.sampling.max_new_tokens)
    print(f"{_REFERENCE.value}: greedy acc {acc:.3f} by steps {by}; "
          f"{pass_counts(cfg, params, tok, train[:_PASS_PROMPTS.value or len(train)], c.sampling.max_new_tokens)}")
    return
  _, params = decoder.init_params(cfg, 0)
  rng = np.random.default_rng(0)
  corpus = run_setup._load_set(c, "chains", "warmstart")
  pairs = [chains.supervised_pair(tok, e.problem, boxed=bool(rng.random() >= s.unboxed_fraction)) for e in corpus]
  print(f"load {os.getloadavg()}; {len(pairs)} pairs, {len(test)} test; model {cfg}", flush=True)
  t0 = time.perf_counter()
  for seg in range(_SEGMENTS.value):
    params, hist = warmstart.warm_start(cfg, params, pairs, pad_id=tok.pad_token_id, steps=c.warmstart.steps,
                                        batch_size=c.warmstart.batch_size, lr=c.warmstart.lr, seed=seg, log=None)
    t = time.perf_counter() - t0
    acc, by = greedy_accuracy(cfg, params, tok, test, c.sampling.max_new_tokens)
    stage1 = pass_counts(cfg, params, tok, train[:_PASS_PROMPTS.value], c.sampling.max_new_tokens) \
        if _PASS_PROMPTS.value else ""
    print(f"steps {(seg + 1) * c.warmstart.steps}: {t:.0f}s, nll {np.mean(hist[-20:]):.3f}, greedy acc {acc:.3f} "
          f"by steps {by}; {stage1} (eval {time.perf_counter() - t0 - t:.0f}s); load {os.getloadavg()[0]:.2f}",
          flush=True)
    t0 += time.perf_counter() - t0 - t


if __name__ == "__main__":
  app.run(main)
