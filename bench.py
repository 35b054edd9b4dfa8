"""python bench.py SECTION (--help lists them): the numbers README's "Performance" section quotes, each as
measured, baseline and ratio, in the caller's environment, as users run train.py and TRL (the README names each
retired section's last commit). One at a time on a shared machine: flock /tmp/nanomolt-cpu.lock python bench.py X"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from statistics import mean

import config
import train
from model_moe import convert_gguf

GUESS = ["--config", "configs/guess.py", "--dump_every=0", "--ckpt_every=0"]  # the default recipe, no mid-run dumps
ARITH = ["--task=arith", "--max_turns=1", "--max_new_tokens=4", "--temperature=1"]  # issue 22's: 8 x 8, tiny MoE


def table(title, header, rows):
    lines = [header, ["---"] + ["---:"] * (len(header) - 1), *rows]
    print(f"\n{title}\n\n" + "\n".join("| " + " | ".join(map(str, r)) + " |" for r in lines), flush=True)


def run_train(overrides, cmd=(sys.executable, "train.py")):
    """train.py (or cmd, writing metrics.jsonl as train.py does) + overrides in a temporary out_dir -> them."""
    with tempfile.TemporaryDirectory() as d:
        p = subprocess.run([*cmd, *GUESS, f"--out_dir={d}", *overrides], capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"{cmd[-1]} {overrides} failed ({p.returncode}):\n{p.stderr[-3000:]}")
        return [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]


def bench_trl():
    """TRL's GRPOTrainer (tests/trl_arith.py, --trl_python) vs train.py, one process each, as many steps, from the same
    weights, prompt ids, batch, sampling, lr, dtype: arith on the tiny MoE, or --smollm2 configs/smollm2_cpu.py's."""
    steps, warm = (12, 2) if args.smollm2 else (300, 20)
    work = ["--config", "configs/smollm2_cpu.py", "--max_turns=1", "--adam_eps=1e-8"] if args.smollm2 else ARITH
    cfg = config.load([*GUESS, f"--out_dir={tempfile.mkdtemp()}", *work])
    init = convert_gguf(cfg.model) if args.smollm2 else train.tiny_init(cfg, 0, False)  # train.py's own weights
    job = [*work, f"--model={init}", f"--max_steps={steps}", "--eval_every=0", f"--dtype={args.dtype}"]  # TRL: no eval
    runs = {"TRL": run_train(job, cmd=(args.trl_python, "tests/trl_arith.py")), "nanomolt": run_train(job),
            "nanomolt --compile": run_train([*job, "--compile=true"])}  # its first steps compile (not in the rates)
    rate = {k: (len(ms) - warm) / sum(m["time/step"] for m in ms[warm:]) for k, ms in runs.items()}
    last = min(50, steps - warm)
    table(f"nanomolt train.py vs TRL {runs['TRL'][0]['trl_version']} GRPOTrainer: {' '.join(work)}, {args.dtype}, "
          f"{cfg.batch_size} episodes a step, {steps} steps, rates after step {warm}", ["", "steps/s", "episodes/s",
          "ratio to TRL", f"reward, last {last} steps", "wall time"], [(k, f"{r:.3f}", f"{r * cfg.batch_size:.1f}",
          f"{r / rate['TRL']:.2f}x", f"{mean(m['reward/mean'] for m in runs[k][-last:]):.3f}",
          f"{sum(m['time/step'] for m in runs[k]):.0f} s") for k, r in rate.items()])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="nanomolt benchmarks: measured, baseline and ratio of each README number")
    ap.add_argument("section", choices=["trl"], help="what to measure (the others are retired: README)")
    ap.add_argument("--trl_python", default="python", help="trl: the interpreter of a venv with trl installed")
    ap.add_argument("--smollm2", action="store_true", help="trl: SmolLM2-135M on its recipe's work, not the tiny MoE")
    ap.add_argument("--dtype", default="float32", help="trl: float32, or bfloat16 (TRL's default bf16 autocast)")
    args = ap.parse_args()
    os.chdir(os.path.dirname(os.path.abspath(__file__)))  # train.py and configs/ are repository paths
    bench_trl()
