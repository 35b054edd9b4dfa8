"""python bench.py SECTION [--quick] (--help lists them): the numbers README's "Performance" section quotes, each as
measured, baseline and ratio, in the caller's environment, as users run train.py and TRL (the README names each
retired section's last commit). One at a time on a shared machine: flock /tmp/nanomolt-cpu.lock python bench.py X"""
import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from statistics import mean, median as med

import config
import train
from model_moe import convert_gguf

GUESS = ["--config", "configs/guess.py", "--dump_every=0", "--ckpt_every=0"]  # the default recipe, no mid-run dumps
ARITH = ["--task=arith", "--max_turns=1", "--max_new_tokens=4", "--temperature=1"]  # issue 22's: 8 x 8, tiny MoE


def table(title, header, rows):
    lines = [header, ["---"] + ["---:"] * (len(header) - 1), *rows]
    print(f"\n{title}\n\n" + "\n".join("| " + " | ".join(map(str, r)) + " |" for r in lines), flush=True)


def run_train(overrides, ranks=1, cwd=".", cmd=(sys.executable, "train.py")):
    """cwd's train.py (or cmd, writing metrics.jsonl as train.py does) + overrides in a temporary out_dir -> them."""
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] * (ranks > 1)
    with tempfile.TemporaryDirectory() as d:
        p = subprocess.run([cmd[0], *launch, *cmd[1:], *GUESS, f"--out_dir={d}", *overrides], cwd=cwd,
                           capture_output=True, text=True)
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
    """TRL's GRPOTrainer (tests/trl_arith.py, --trl_python) vs train.py, one process each, as many steps, from the same
    weights, prompt ids, batch, sampling, lr, dtype: arith on the tiny MoE, or --smollm2 configs/smollm2_cpu.py's."""
    steps, warm = [[(300, 20), (4, 1)], [(12, 2), (3, 1)]][args.smollm2][args.quick]
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


BENCHES = {"fixed": bench_fixed, "trl": bench_trl, "checkpointing": bench_checkpointing}
if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="nanomolt benchmarks: measured, baseline and ratio of each README number")
    ap.add_argument("section", choices=[*BENCHES, "all"], help="what to measure")
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer steps")
    ap.add_argument("--before", default="8482101", help="fixed: the baseline commit")
    ap.add_argument("--trl_python", default="python", help="trl: the interpreter of a venv with trl installed")
    ap.add_argument("--smollm2", action="store_true", help="trl: SmolLM2-135M on its recipe's work, not the tiny MoE")
    ap.add_argument("--dtype", default="float32", help="trl: float32, or bfloat16 (TRL's default bf16 autocast)")
    args = ap.parse_args()
    os.chdir(os.path.dirname(os.path.abspath(__file__)))  # train.py and configs/ are repository paths
    for name in BENCHES if args.section == "all" else [args.section]:
        BENCHES[name]()
