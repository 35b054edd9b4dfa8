"""python tools/bench.py SECTION (--help): README's "Performance" numbers, measured, baseline and ratio, in the caller's
environment as users run train.py and TRL (README: retired sections' last commits). Run alone on the machine."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from itertools import accumulate
from statistics import mean

CALLER = dict(os.environ)  # before train's import sets OMP_WAIT_POLICY for train.py: no job inherits it
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the framework's modules
import config  # noqa: E402
import train  # noqa: E402
from model_moe import convert_gguf  # noqa: E402

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


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="nanomolt benchmarks: measured, baseline and ratio of each README number")
    ap.add_argument("section", choices=["trl", *SCRIPTS], help="what to measure (the others are retired: README); "
                    "breakdown and vllm run their script (SCRIPTS) with the other arguments (its --help lists them)")
    ap.add_argument("--trl_python", default="python", help="trl: the interpreter of a venv with trl installed")
    ap.add_argument("--smollm2", action="store_true", help="trl: SmolLM2-135M on its recipe's work, not the tiny MoE")
    ap.add_argument("--dtype", default="float32", help="trl: float32, or bfloat16 (TRL's default bf16 autocast)")
    args = ap.parse_known_args()[0] if sys.argv[1:2] != ["trl"] else ap.parse_args()  # a script parses its own
    os.chdir(ROOT)  # train.py and configs/ are repository paths
    bench_trl() if args.section == "trl" else os.execv(sys.executable, ["python", SCRIPTS[args.section], *sys.argv[2:]])
