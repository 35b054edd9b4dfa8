"""python bench.py SECTION [--quick] (--help lists them): the numbers README's "Performance" section quotes, each as
measured, baseline and ratio, on all cores (scale, memory, flops: commit 8482101; moe, publish: d207298; trainer:
290f213; endpoint, eval: b5d64a7; parity: 12c8717). One at a time on a shared machine:
flock /tmp/nanomolt-cpu.lock python bench.py X"""
import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import tempfile
import timeit
from statistics import mean, median as med

USER_ENV = dict(os.environ)  # train.py and TRL run in the caller's environment, as their users run them
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: spinning waiters fight for cores (~10x slower)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # generate() warns about flags it ignores on this model
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import config  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
from model_moe import Transformer, convert_gguf  # noqa: E402

GUESS = ["--config", "configs/guess.py", "--dump_every=0", "--ckpt_every=0"]  # the default recipe, no mid-run dumps
ARITH = ["--task=arith", "--max_turns=1", "--max_new_tokens=4", "--temperature=1"]  # issue 22's: 8 x 8, tiny MoE


def table(title, header, rows):
    lines = [header, ["---"] + ["---:"] * (len(header) - 1), *rows]
    print(f"\n{title}\n\n" + "\n".join("| " + " | ".join(map(str, r)) + " |" for r in lines), flush=True)


def timed(fns, n, best=False):
    """{name: call} -> {name: wall s}, the median (best: minimum) of n interleaved rounds."""
    rounds = [{k: timeit.timeit(f, number=1) for k, f in fns.items()} for _ in range(n + 1)]
    return {k: (min if best else med)(r[k] for r in rounds[1:]) for k in fns}  # round 0 warms up (lazy init)


def run_train(overrides, ranks=1, cwd=".", cmd=(sys.executable, "train.py")):
    """cwd's train.py (or cmd, writing metrics.jsonl as train.py does) + overrides in a temporary out_dir -> them."""
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] * (ranks > 1)
    with tempfile.TemporaryDirectory() as d:
        p = subprocess.run([cmd[0], *launch, *cmd[1:], *GUESS, f"--out_dir={d}", *overrides], cwd=cwd,
                           capture_output=True, text=True, env=USER_ENV)
        if p.returncode != 0:
            raise RuntimeError(f"{cmd[-1]} {overrides} failed ({p.returncode}):\n{p.stderr[-3000:]}")
        return [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]


def bench_fixed():
    """A step's parts (metrics.jsonl medians after warm-up); the baseline: commit --before's train.py (git archive)."""
    steps, warm = (6, 2) if args.quick else (100, 20)
    keys, rows = ("step", "train", "weight_sync", "handout", "wait_rollout", "other"), []
    with tempfile.TemporaryDirectory() as old:
        subprocess.run(f"git archive {args.before} | tar -x -C {old}", shell=True, check=True)
        for (name, over), ranks, (commit, cwd) in itertools.product(
                [("default", []), ("arith", ARITH)], (1, 2), [("now", "."), (args.before, old)]):
            ms = [m | {"time/other": 2 * m["time/step"] - sum(v for k, v in m.items() if k[:5] == "time/")}
                  for m in run_train([f"--max_steps={steps}", *over], ranks, cwd)[warm:]]  # the step less its parts
            t = {k: med(m[f"time/{k}"] for m in ms) for k in keys if f"time/{k}" in ms[0]}
            rows.append((name, ranks, commit, *(f"{t[k] * 1e3:.1f} ms" if k in t else "-" for k in keys),
                         f"{t['weight_sync'] / t['step']:.1%}", f"{len(ms) / sum(m['time/step'] for m in ms):.2f}"))
    table(f"a step's parts, medians of steps {warm + 1}..{steps} ({args.before} logs no handout: in other); arith "
          f"= {' '.join(ARITH)}", ["setting", "ranks", "commit", *keys, "weight_sync share", "steps/s"], rows)


def bench_checkpointing():
    """activation_checkpointing on the SmolLM2 recipe (evaluation off); the baseline: the same run keeping the blocks'
    activations. Trainer tokens/s (medians after step 1) and rank 0's peak resident memory at the end."""
    runs = {on: run_train(["--config", "configs/smollm2_cpu.py", "--adam_eps=1e-8", "--eval_every=0", f"--max_steps="
                           f"{3 if args.quick else 6}", f"--activation_checkpointing={on}"]) for on in (True, False)}
    peak = {on: ms[-1]["memory/peak_mb"] for on, ms in runs.items()}
    table("activation checkpointing, configs/smollm2_cpu.py", ["", "train tokens/s", "peak memory", "ratio to off"],
          [(f"activation_checkpointing={on}", f"{med(m['throughput/train_tokens_per_s'] for m in ms[1:]):.0f}",
            f"{peak[on]:,.0f} MB", f"{peak[on] / peak[False]:.2f}") for on, ms in runs.items()])


def bench_trl():
    """The baseline is TRL's GRPOTrainer (tests/trl_arith.py, under --trl_python) on the same initial weights, prompt
    ids, batch, sampling and lr as train.py at the arith setting; one process each, the same number of steps."""
    steps, warm = (4, 1) if args.quick else (300, 20)
    init = train.tiny_init(config.load([*GUESS, f"--out_dir={tempfile.mkdtemp()}"]), 0, False)  # train.py's own
    job = [*ARITH, f"--model={init}", f"--max_steps={steps}", "--eval_every=0"]  # TRL evaluates nothing either
    runs = {"TRL": run_train(job, cmd=(args.trl_python, "tests/trl_arith.py")), "nanomolt": run_train(job)}
    rate = {k: (len(ms) - warm) / sum(m["time/step"] for m in ms[warm:]) for k, ms in runs.items()}
    table(f"nanomolt train.py vs TRL {runs['TRL'][0]['trl_version']} GRPOTrainer: {' '.join(ARITH)}, 8 x 8 episodes a "
          f"step, {steps} steps, rates after step {warm}", ["", "steps/s", "episodes/s", "ratio to TRL", "reward, last "
          "50 steps"], [(k, f"{r:.2f}", f"{r * 64:.0f}", f"{r / rate['TRL']:.2f}x",
                         f"{mean(m['reward/mean'] for m in runs[k][-50:]):.3f}") for k, r in rate.items()])


def bench_engine():
    """The baseline: HF `generate` on the same weights (from our checkpoint), one left-padded batch per call. The
    bound: a decode step reads every weight and the rows' K and V at the bytes/s of a large copy (reads + writes)."""
    new, repeats = (16, 1) if args.quick else (32, 1) if args.model else (128, 3)  # new tokens per row
    d = args.model or train.tiny_init(config.load([*GUESS, f"--out_dir={tempfile.mkdtemp()}"]), 0, False)  # our dir
    ours = Transformer.from_pretrained(d).eval()
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    c, x, y = ours.config, torch.ones(1 << 27), torch.zeros(1 << 27)  # 512 MB each: far past the caches
    bw = 2 * x.nbytes / timed({"copy": lambda: y.copy_(x)}, 3, best=True)["copy"]
    kv = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4  # bytes of K and V at one position
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(c.vocab_size, (int(n),), generator=g) for n in torch.randint(16, 33, (64,), generator=g)]

    async def serve(ps):  # every request at once, as concurrent agents send them, while the engine's loop runs
        e = rollout.TorchEngine(ours, slots=64, max_len=32 + new, max_new_tokens=new, seed=0)
        loop = asyncio.create_task(e.run())
        outs = await asyncio.gather(*(e.generate(p.tolist()) for p in ps))
        loop.cancel()
        assert all(len(o.ids) == new and (o.routing is None) == (c.num_experts == 0) for o in outs)

    def generate(ps):  # -1 marks padding; min_new_tokens pins the length (there is no eos anyway)
        ids = torch.nn.utils.rnn.pad_sequence(ps, batch_first=True, padding_value=-1, padding_side="left")
        out = hf.generate(ids.clamp(min=0), attention_mask=(ids >= 0).long(), do_sample=True, max_new_tokens=new,
                          min_new_tokens=new, top_k=0, top_p=1.0, pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + new
    rows, weights = [], sum(p.numel() * p.element_size() for p in ours.parameters())  # bytes read by each step
    for n in (64, 1, 8):  # as many as the engine has slots, then one and a few concurrent agents
        t = timed({"engine": lambda: asyncio.run(serve(prompts[:n])), "hf": lambda: generate(prompts[:n])}, repeats)
        step_bytes = weights + kv * sum(len(p) + new / 2 for p in prompts[:n])  # the mean decode step's reads
        rows.append((n, f"{n * new / t['engine']:,.0f}", f"{n * new / t['hf']:,.0f}", f"{t['hf'] / t['engine']:.2f}x",
                     f"{n * bw / step_bytes:,.0f}", f"{n * new / t['engine'] / (n * bw / step_bytes):.0%}"))
    peak = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024  # MB: the peak resident set
    table(f"{os.path.basename(args.model) or 'tiny MoE, 8 experts top-2'}, {weights / 4e6:.2f}M params: random prompts "
          f"of 16..32 tokens, {new} new each at temperature 1, median of {repeats}, {torch.get_num_threads()} threads; "
          f"copy {bw / 1e9:.1f} GB/s; peak RSS {peak:,.0f} MB (both models)", ["requests at once", "engine tok/s "
          "(measured)", "HF generate tok/s (baseline)", "ratio", "memory bound tok/s", "engine / bound"], rows)


BENCHES = {"engine": bench_engine, "fixed": bench_fixed, "trl": bench_trl, "checkpointing": bench_checkpointing}
if __name__ == "__main__":  # not in a rollout process a section spawns
    ap = argparse.ArgumentParser(description="nanomolt benchmarks: measured, baseline and ratio of each README number")
    ap.add_argument("section", nargs="?", default="engine", choices=[*BENCHES, "all"], help="what to measure")
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer tokens, steps and repeats")
    ap.add_argument("--threads", type=int, default=0, help="engine: torch.set_num_threads (0: all cores)")
    ap.add_argument("--before", default="8482101", help="fixed: the baseline commit")
    ap.add_argument("--trl_python", default="python", help="trl: the interpreter of a venv with trl installed")
    ap.add_argument("--model", default="", help="engine: a model dir or .gguf (default: tiny MoE)")
    args = ap.parse_args()
    args.model = convert_gguf(args.model) if args.model.endswith(".gguf") else args.model  # once, beside it
    os.chdir(os.path.dirname(os.path.abspath(__file__)))  # train.py and configs/ are repository paths
    for name in [*list(BENCHES)[1:], "engine"] if args.section == "all" else [args.section]:
        torch.set_num_threads(args.threads or os.cpu_count())
        BENCHES[name]()
