"""Exports load in vLLM as in transformers: tiny random Qwen2 and Llama models written with
`hf.save_hf`, greedy-decoded by transformers and by vLLM; the tokens and their log-probs must agree.

vLLM is not a dependency of the project (nor of its tests): it runs from its own environment, given
by --vllm-python (a venv with `pip install vllm`, CPU or GPU build), in a child process; the export
and the transformers reference run in this one.

  python experiments/check_vllm_export.py --vllm-python=/work/vllm_venv/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from astarpo_jax.model.config import ModelConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPTS = ["3+4+5=", "9+8=17 17+6=", "What is 2+7? \\boxed{"]
# (name, arch, tied): Qwen2.5-1.5B-like (tied, qkv bias) and Llama-3.x-like (untied, llama3 rope scaling)
MODELS = [("qwen2_tied", "qwen2", True), ("qwen2_untied", "qwen2", False), ("llama_untied", "llama", False),
          ("llama_tied", "llama", True)]


def export_models(out_dir: str, models) -> dict[str, str]:
  """Random models of the synthetic tokenizer's vocabulary, peaked logits, random norms and biases."""
  import jax
  import numpy as np

  from astarpo_jax.data import synthetic
  from astarpo_jax.model import decoder, hf
  tok = synthetic.build_tokenizer()
  dirs = {}
  for k, (name, arch, tied) in enumerate(models):
    cfg = ModelConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=32, arch=arch, qkv_bias=(arch == "qwen2"), tie_embeddings=tied, max_position_embeddings=256,
        rope_theta=10000.0 if arch == "qwen2" else 500000.0,
        rope_llama3_scaling=(8.0, 1.0, 4.0, 64) if arch == "llama" else None)
    _, params = decoder.init_params(cfg, seed=k)
    rng = np.random.default_rng(k)
    flat = jax.tree_util.tree_flatten_with_path(params)

    def redraw(path, x):  # weights ~ 1/sqrt(fan-in): logits neither flat (near-ties) nor saturated
      name = jax.tree_util.keystr(path)
      if "norm" in name:
        return (1.0 + 0.1 * rng.standard_normal(x.shape)).astype(np.float32)
      if "'b" in name:  # bq, bk, bv
        return (0.1 * rng.standard_normal(x.shape)).astype(np.float32)
      fan_in = cfg.hidden_size if "w_down" not in name else cfg.intermediate_size
      scale = 0.25 if ("embed" in name or "lm_head" in name) else fan_in ** -0.5  # logits of std ~3
      return (scale * rng.standard_normal(x.shape)).astype(np.float32)

    params = jax.tree_util.tree_unflatten(flat[1], [redraw(p, x) for p, x in flat[0]])
    dirs[name] = os.path.join(out_dir, name)
    hf.save_hf(cfg, params, dirs[name], tokenizer=tok)
  return dirs


def transformers_greedy(ckpt_dir: str, new_tokens: int) -> list[dict]:
  """Greedy continuation of each prompt by transformers: prompt ids, new ids, their log-probs, top-2 gap.

  EOS does not stop it (nor vLLM, with ignore_eos), and the log-probs come from the raw logits, so both
  see the same distributions.
  """
  import torch
  import transformers
  tok = transformers.AutoTokenizer.from_pretrained(ckpt_dir)
  mdl = transformers.AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32).eval()
  mdl.generation_config.eos_token_id = None  # decode past EOS, as vLLM with ignore_eos
  out = []
  for text in PROMPTS:
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
      gen = mdl.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=tok.pad_token_id, output_logits=True, return_dict_in_generate=True)
    new = gen.sequences[0, ids.shape[1]:].tolist()
    assert len(new) == new_tokens, (ckpt_dir, text, new)
    logp = [torch.log_softmax(s[0].float(), -1) for s in gen.logits]
    top2 = [torch.topk(lp, 2).values for lp in logp]
    out.append({"prompt_ids": ids[0].tolist(), "tokens": new, "logprobs": [float(lp[t]) for lp, t in zip(logp, new)],
                "min_top2_gap": min(float(v[0] - v[1]) for v in top2)})
  return out


def vllm_greedy(dirs: dict[str, str], prompt_ids: dict[str, list[list[int]]], new_tokens: int) -> dict:
  """In the vLLM environment: each export loaded by vLLM and decoded greedily from the same prompt ids."""
  import torch
  import transformers
  import vllm
  from vllm import LLM, SamplingParams
  result = {"versions": {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__}}
  params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=1)
  for name, d in dirs.items():
    llm = LLM(model=d, dtype="float32", gpu_memory_utilization=0.5, max_model_len=256, enforce_eager=True, seed=0)
    tok = llm.get_tokenizer()
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids[name]], params)
    result[name] = [{"tokens": list(o.outputs[0].token_ids),
                     "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
                     "prompt_ids_from_vllm_tokenizer": tok.encode(text)}
                    for o, text in zip(outs, PROMPTS)]
    del llm
  return result


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--vllm-python", default=sys.executable, help="a Python with vllm installed")
  ap.add_argument("--out", default="", help="folder for the exports (default: a temporary one)")
  ap.add_argument("--new-tokens", type=int, default=12)
  ap.add_argument("--atol", type=float, default=1e-3, help="log-prob tolerance")
  ap.add_argument("--vllm-child", default="", help=argparse.SUPPRESS)  # a JSON request file
  args = ap.parse_args()
  if args.vllm_child:
    with open(args.vllm_child) as f:
      req = json.load(f)
    print("VLLM_RESULT " + json.dumps(vllm_greedy(req["dirs"], req["prompt_ids"], req["new_tokens"])), flush=True)
    return 0

  import torch
  import transformers
  out_dir = args.out or tempfile.mkdtemp(prefix="vllm_export_")
  dirs = export_models(out_dir, MODELS)
  ref = {name: transformers_greedy(d, args.new_tokens) for name, d in dirs.items()}
  req_path = os.path.join(out_dir, "request.json")
  with open(req_path, "w") as f:
    json.dump({"dirs": dirs, "new_tokens": args.new_tokens,
               "prompt_ids": {n: [r["prompt_ids"] for r in rs] for n, rs in ref.items()}}, f)
  env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
  env.pop("PYTHONPATH", None)  # the vLLM environment imports its own packages only
  proc = subprocess.run([args.vllm_python, os.path.abspath(__file__), "--vllm-child", req_path], env=env,
                        capture_output=True, text=True)
  line = next((s for s in proc.stdout.splitlines() if s.startswith("VLLM_RESULT ")), None)
  if proc.returncode or line is None:
    print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n")
    print(f"vLLM failed (exit {proc.returncode})")
    return 1
  got = json.loads(line.removeprefix("VLLM_RESULT "))
  print(f"export side: transformers {transformers.__version__}, torch {torch.__version__}; "
        f"vLLM side: vllm {got['versions']['vllm']}, torch {got['versions']['torch']}, "
        f"transformers {got['versions']['transformers']}")
  ok = True
  print("| model | prompt | same tokens | same prompt ids | max abs log-prob diff | min top-2 gap |")
  print("|---|---|---|---|---|---|")
  for name in dirs:
    for text, r, v in zip(PROMPTS, ref[name], got[name]):
      same = r["tokens"] == v["tokens"]
      same_ids = r["prompt_ids"] == v["prompt_ids_from_vllm_tokenizer"]
      diff = max(abs(a - b) for a, b in zip(r["logprobs"], v["logprobs"])) if same else float("nan")
      ok &= same and same_ids and diff <= args.atol
      print(f"| {name} | {text!r} | {same} | {same_ids} | {diff:.2e} | {r['min_top2_gap']:.3f} |")
      if not same:
        print(f"    transformers {r['tokens']}\n    vllm         {v['tokens']}")
  print("PASS: vLLM and transformers agree on every export" if ok else "FAIL: see the rows above")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
