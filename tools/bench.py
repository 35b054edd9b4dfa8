"""python tools/bench.py SECTION (--help): README's "Performance" numbers, measured, baseline and ratio, in the caller's
environment as users run train.py and TRL (README: retired sections' last commits). Run alone on the machine."""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from itertools import accumulate
from statistics import mean, median_high

CALLER = dict(os.environ)  # before train's import sets OMP_WAIT_POLICY for train.py: no job inherits it
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the framework's modules
import torch  # noqa: E402

import config  # noqa: E402
import train  # noqa: E402
from model_moe import ModelConfig, Transformer, convert_gguf  # noqa: E402

GUESS = ["--config", "configs/guess.py", "--dump_every=0", "--ckpt_every=0"]  # the default recipe, no mid-run dumps
ARITH = ["--task=arith", "--max_turns=1", "--max_new_tokens=4", "--temperature=1"]  # issue 22's: 8 x 8, tiny MoE
SCRIPTS = {"breakdown": "tests/step_breakdown.py", "vllm": "tests/engine_vs_vllm.py"}  # issue 32's: a SmolLM2 step


def run_train(overrides, cmd=(sys.executable, "train.py")):
    """train.py (or cmd, writing metrics.jsonl as train.py does) + overrides in a temporary out_dir -> them."""
    with tempfile.TemporaryDirectory() as d:
        p = subprocess.run([*cmd, *GUESS, f"--out_dir={d}", *overrides], capture_output=True, text=True, env=CALLER)
        if p.returncode != 0:
            raise RuntimeError(f"{cmd[-1]} {overrides} failed ({p.returncode}):\n{p.stderr[-3000:]}")
        return [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]


def bench_trl():
    """TRL's GRPOTrainer (tests/trl_arith.py) vs train.py: as many steps from the same weights, ids, batch, lr, dtype"""
    steps, warm, last = (12, 2, 10) if args.smollm2 else (300, 20, 50)
    work = ["--config", "configs/smollm2_cpu.py", "--max_turns=1", "--adam_eps=1e-8"] if args.smollm2 else ARITH
    cfg = config.load([*GUESS, f"--out_dir={tempfile.mkdtemp()}", *work])
    init = convert_gguf(cfg.model) if args.smollm2 else train.tiny_init(cfg, 0, False)  # train.py's own weights
    job = [*work, f"--model={init}", f"--max_steps={steps}", "--eval_every=0", f"--dtype={args.dtype}"]  # TRL: no eval
    runs = {"TRL": run_train(job, cmd=(args.trl_python, "tests/trl_arith.py")), "nanomolt": run_train(job)}
    rate = {k: (len(ms) - warm) / sum(m["time/step"] for m in ms[warm:]) for k, ms in runs.items()}
    wall = min(sum(m["time/step"] for m in ms) for ms in runs.values())  # the faster side's; the other's reward by then
    by = lambda ms: [m for m, t in zip(ms, accumulate(m["time/step"] for m in ms)) if t <= wall * 1.001][-last:]
    head = ("run", "steps/s", "episodes/s", "ratio to TRL", f"reward, last {last} steps", f"the same by {wall:.0f} s")
    rows = [head + ("wall time",), ["---"] + ["---:"] * 6] + [(k, f"{r:.3f}", f"{r * cfg.batch_size:.1f}",
            f"{r / rate['TRL']:.2f}x", *(f"{mean(m['reward/mean'] for m in ms):.3f}" for ms in (runs[k][-last:],
            by(runs[k]))), f"{sum(m['time/step'] for m in runs[k]):.0f} s") for k, r in rate.items()]
    print(f"\nnanomolt train.py vs TRL {runs['TRL'][0]['trl_version']} GRPOTrainer: {' '.join(work)}, {args.dtype}, "
          f"{cfg.batch_size} episodes/step, {steps} steps, rates after step {warm}\n", *map(" | ".join, rows), sep="\n")


# the shapes of `trainer --model=NAME`: a model initialised at random (no download)
SHAPES = {"qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                             num_attention_heads=16, num_key_value_heads=8, head_dim=128),
          "small": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16)}
PEAK_TFLOPS = {"H100": 989, "H200": 989, "B200": 2250, "A100": 312, "A6000": 155}  # dense bf16, per GPU


def synthetic_batch(vocab, seq_len, n):
    """n episodes of seq_len random tokens, every one after the first trained, as the rollout hands them over."""
    g = torch.Generator().manual_seed(0)
    msgs = []
    for i in range(n):
        ids = torch.randint(vocab, (seq_len,), generator=g)
        mask = torch.ones(seq_len)
        mask[0] = 0
        msgs.append({"ids": ids, "loss_mask": mask, "versions": torch.zeros(seq_len, dtype=torch.long),
                     "logprobs": -torch.rand(seq_len, generator=g) * mask, "routing": None,
                     "engine_ids": ids[1:], "index": i, "group": i, "reward": float(i % 2)})
    return msgs


def bench_trainer():
    """train.train_step alone on synthetic sequences, measured as prime-rl's trainer benchmark is (one sequence of
    seq_len tokens a micro-batch, bf16, activation recompute, one device), in its units. MFU = tokens/s x (6 N +
    6 L heads head_dim T) / peak: N all parameters, the second term causal attention's two matmuls (prime-rl's
    formula: its 11.1% at 11.9k tokens/s on an H100 is this)."""
    path = args.model
    if path in SHAPES:
        path = os.path.join(tempfile.mkdtemp(), path)
        Transformer(ModelConfig(**SHAPES[args.model], max_position_embeddings=args.seq_len)).init_weights(0) \
            .save_pretrained(path)
    cfg = config.load([f"--model={path}", f"--dtype={args.dtype}", "--activation_checkpointing=True",
                       f"--micro_batch_tokens={args.seq_len}", f"--engine_max_len={args.seq_len}", "--group_size=1",
                       f"--prompts_per_step={args.batch}", f"--out_dir={tempfile.mkdtemp()}"])
    rank, world, device, fsdp = train.compute_init(cfg)
    model = train.build_model(cfg, rank, device, fsdp, path)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6, fused=True)
    c = model.config
    msgs = synthetic_batch(c.vocab_size, args.seq_len, args.batch)
    share = train.make_shares(msgs, [1.0 - 2 * (i % 2) for i in range(args.batch)], world, cfg)[rank]
    times = []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        _, norms = train.train_step(model, opt, share, cfg, 0, world)  # norms are read: the device has finished
        times.append(time.perf_counter() - t0)
    step = median_high(times[args.warmup:])
    tokens_per_s = args.seq_len * args.batch / step
    n_params = sum(p.numel() for p in model.parameters())
    flops = 6 * n_params + 6 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * args.seq_len
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in gpu), None)
    if device.type == "cuda":
        memory = torch.cuda.max_memory_allocated() / 2**30
    else:
        memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # the process's resident peak
    mfu = f"{tokens_per_s * flops / (peak * 1e12):.1%}" if peak else "-"
    head = ("Type", "SeqLen", "AC", "Attn", "Hardware", "MFU", "TPS", "Step Time", "Peak Mem")
    row = ("RL Full", args.seq_len, "Recompute", "SDPA", f"1x{gpu}", mfu, f"{tokens_per_s / 1e3:.2f}k",
           f"{step:.2f}s", f"{memory:.1f} GiB")
    title = (f"nanomolt train_step, {args.model}, {n_params / 1e9:.3f}B parameters, {args.dtype}, batch {args.batch}, "
             f"median of {args.steps} steps after {args.warmup}")
    print("", title, *(" | ".join(map(str, r)) for r in (head, row)), sep="\n")
    print(json.dumps({"tokens_per_s": tokens_per_s, "mfu": tokens_per_s * flops / (peak * 1e12) if peak else None,
                      "step_s": step, "peak_mem_gib": memory, "params": n_params, "device": gpu,
                      "grad_norm": norms[0]}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="nanomolt benchmarks: measured, baseline and ratio of each README number")
    ap.add_argument("section", choices=["trl", "trainer", *SCRIPTS], help="what to measure (the others are retired: "
                    "README); "
                    "breakdown and vllm run their script (SCRIPTS) with the other arguments (its --help lists them)")
    ap.add_argument("--trl_python", default="python", help="trl: the interpreter of a venv with trl installed")
    ap.add_argument("--smollm2", action="store_true", help="trl: SmolLM2-135M on its recipe's work, not the tiny MoE")
    ap.add_argument("--dtype", default=None, help="trl: float32 (default), or bfloat16 (TRL's default bf16 "
                    "autocast); trainer: bfloat16 (default) or float32")
    ap.add_argument("--model", default="qwen3-0.6b", help=f"trainer: a HF directory, or {', '.join(SHAPES)}: "
                    "that shape initialised at random")
    ap.add_argument("--seq_len", type=int, default=16384, help="trainer: tokens a sequence (a micro-batch)")
    ap.add_argument("--batch", type=int, default=1, help="trainer: sequences a step")
    ap.add_argument("--steps", type=int, default=5, help="trainer: steps timed, after --warmup ones")
    ap.add_argument("--warmup", type=int, default=2, help="trainer: steps not timed (allocation, kernel choice)")
    ap.add_argument("--peak_tflops", type=float, default=0, help="trainer: the device's dense bf16 peak for MFU; "
                    "0: known GPUs' (PEAK_TFLOPS)")
    args = ap.parse_known_args()[0] if sys.argv[1] not in ("trl", "trainer") else ap.parse_args()  # scripts parse
    args.dtype = args.dtype or ("bfloat16" if args.section == "trainer" else "float32")
    os.chdir(ROOT)  # train.py and configs/ are repository paths
    if args.section in SCRIPTS:
        os.execv(sys.executable, ["python", SCRIPTS[args.section], *sys.argv[2:]])
    {"trl": bench_trl, "trainer": bench_trainer}[args.section]()
