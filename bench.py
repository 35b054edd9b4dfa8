"""
bench.py: generation throughput of the embedded engine (rollout.TorchEngine) against transformers'
`generate`, on the same tiny MoE with the same weights, in the same process.

Both sides sample (temperature 1, no top-k / top-p, no stop token), so every row generates exactly
`new_tokens` tokens and tokens/s = rows * new_tokens / wall time. The engine additionally records a
logprob, a policy version and the routed experts for every token; `generate` records nothing.
Repeats are interleaved (engine, HF, engine, HF, ...) so a noisy neighbour hurts both sides alike,
and the median is reported.

Wall-clock tokens/s is what the table's first columns report; on a shared machine other processes
steal time from both sides, so the last column also gives the ratio in CPU time of this process.

    python bench.py            # the full run (about a minute on 2 CPU cores)
    python bench.py --quick    # a smoke run (< 60 s)
    python bench.py --threads 1
"""
import argparse
import asyncio
import os
import statistics
import tempfile
import time

# OpenMP workers that spin while waiting fight other processes for the cores: on a busy 2-core
# machine, 2 spinning threads made both generators ~10x slower. Must be set before torch starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from model_moe import ModelConfig, Transformer  # noqa: E402
from rollout import TorchEngine  # noqa: E402

# ---- options ----
ap = argparse.ArgumentParser(description="engine vs transformers generate, tokens/s")
ap.add_argument("--quick", action="store_true", help="fewer new tokens and one repeat: a smoke run")
ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: all cores)")
ap.add_argument("--seed", type=int, default=0, help="weights, prompts and sampling seed")
args = ap.parse_args()
new_tokens = 16 if args.quick else 128  # per row
repeats = 1 if args.quick else 3
batch = 64  # rows in the engine-vs-HF comparison (= engine slots)
torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
hf_logging.set_verbosity_error()  # generate() warns about generation flags it ignores on this model
hf_logging.disable_progress_bar()

# ---- the tiny MoE, once as ours and once as Hugging Face's ----
# the "tiny" preset of train.py (vocab of the made-up tokenizer, 128 wide, 4 layers, 8 experts top-2)
c = ModelConfig(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                max_position_embeddings=256)
ours = Transformer(c).init_weights(args.seed).eval()
with tempfile.TemporaryDirectory() as d:  # the HF copy is loaded from our own checkpoint: same weights
    ours.save_pretrained(d)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()

g = torch.Generator().manual_seed(args.seed)
prompts = [torch.randint(0, c.vocab_size, (int(torch.randint(16, 33, (1,), generator=g)),), generator=g).tolist()
           for _ in range(batch)]  # lengths 16..32
max_len = max(map(len, prompts)) + new_tokens  # the engine's per-slot KV length


# ---- the two generators: each returns (tokens/s of wall time, tokens/s of CPU time) ----

def run_engine(ps):
    """All requests submitted at once from concurrent coroutines, as agents do; the engine loop
    runs beside them (as in tests/test_rollout.py). Engine construction is outside the timer."""
    engine = TorchEngine(ours, slots=batch, max_len=max_len, temperature=1.0, max_new_tokens=new_tokens,
                         seed=args.seed)

    async def main():  # timed inside the event loop: asyncio.run's setup and teardown are not the engine's
        t0, c0 = time.perf_counter(), time.process_time()
        loop_task = asyncio.create_task(engine.run())
        outs = await asyncio.gather(*(engine.generate(p) for p in ps))
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        loop_task.cancel()
        return outs, dt, dc

    outs, dt, dc = asyncio.run(main())
    n = sum(len(o.ids) for o in outs)
    assert n == len(ps) * new_tokens and all(o.routing is not None and len(o.logprobs) == new_tokens for o in outs)
    return n / dt, n / dc


def run_hf(ps):
    """One left-padded batch through `generate`; min_new_tokens pins the length (there is no eos anyway)."""
    T = max(map(len, ps))
    ids = torch.zeros(len(ps), T, dtype=torch.long)
    mask = torch.zeros(len(ps), T, dtype=torch.long)
    for b, p in enumerate(ps):
        ids[b, T - len(p):], mask[b, T - len(p):] = torch.tensor(p), 1
    torch.manual_seed(args.seed)
    t0, c0 = time.perf_counter(), time.process_time()
    out = hf.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, top_k=0, top_p=1.0, pad_token_id=0)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    n = (out.shape[1] - T) * len(ps)
    assert n == len(ps) * new_tokens
    return n / dt, n / dc


def measure(ps):
    """-> engine (wall, CPU) tokens/s and HF (wall, CPU) tokens/s, each the median of interleaved repeats."""
    run_engine(ps[:4]), run_hf(ps[:4])  # first calls pay for lazy init (kernels, generation config)
    eng, ref = [], []
    for _ in range(repeats):
        eng.append(run_engine(ps))
        ref.append(run_hf(ps))
    return [statistics.median(x) for x in zip(*eng)], [statistics.median(x) for x in zip(*ref)]


# ---- engine vs HF generate: 64 prompts, all rows generating new_tokens ----
full = measure(prompts)
rows = [("engine vs HF generate", f"{batch} prompts", *full)]

# ---- concurrent agents: the engine with 1, 8 and 64 requests in flight ----
# the baseline is `generate` on the same prompts as one batch, so each ratio compares like with like;
# 64 in flight is the run above
for n in (1, 8):
    rows.append(("concurrent agents", f"{n} concurrent", *measure(prompts[:n])))
rows.append(("concurrent agents", f"{batch} concurrent (as above)", *full))

# ---- report ----
print(f"\ntiny MoE ({sum(p.numel() for p in ours.parameters()) / 1e6:.2f}M params, {c.num_experts} experts top-"
      f"{c.num_experts_per_tok}), prompts 16..32 tokens, {new_tokens} new tokens/row, sampled at temperature 1, "
      f"median of {repeats}, torch threads {torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}\n")
print("| section | setting | engine tok/s (measured) | HF generate tok/s (baseline) | ratio | ratio, CPU time |")
print("| --- | --- | ---: | ---: | ---: | ---: |")
for section, setting, (eng, eng_cpu), (ref, ref_cpu) in rows:
    print(f"| {section} | {setting} | {eng:,.0f} | {ref:,.0f} | {eng / ref:.2f}x | {eng_cpu / ref_cpu:.2f}x |")
