"""PPO with a learned critic (advantage=gae) beside GRPO on the default recipe (configs/guess.py, no evaluation), runs
interleaved over seeds: wall seconds of steps (time/step summed) until the k-step mean reward first reaches 0.3, the
final reward (last k steps), the critic's explained variance (k-step means); every run's metrics in --json.
    flock /tmp/nanomolt-cpu.lock python tests/gae_vs_grpo.py [--steps 120 --seeds 3] [--quick]"""
import argparse
import itertools
import json
import os
import sys
from statistics import mean

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from bench import run_train  # noqa: E402


def table(title, head, rows):
    print(f"\n{title}\n", " | ".join(head), " | ".join(["---"] * len(head)), *(" | ".join(map(str, r)) for r in rows),
          sep="\n")


ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=120)
ap.add_argument("--seeds", type=int, default=3)
ap.add_argument("--quick", action="store_true", help="a smoke run: 10 steps, one seed")
ap.add_argument("--json", default="/tmp/gae_vs_grpo.json", help="where every run's metrics go")
args = ap.parse_args()
steps, seeds, k = (10, 1, 5) if args.quick else (args.steps, args.seeds, 20)
os.chdir(ROOT)  # run_train runs train.py and configs/ from the repository root
runs, rows = {}, []
for i, a in itertools.product(range(seeds), ("gae", "grpo")):
    ms = runs[f"{a} {i}"] = run_train([f"--max_steps={steps}", f"--seed={i}", "--eval_every=0", f"--advantage={a}"])
    wall, r = list(itertools.accumulate(m["time/step"] for m in ms)), [m["reward/mean"] for m in ms]
    hit = next((f"{wall[j - 1]:.0f} s" for j in range(k, steps + 1) if mean(r[j - k:j]) >= 0.3), "-")
    ev = [mean(m["critic/explained_variance"] or 0 for m in ms[j:j + k]) for j in range(0, steps, k) if a == "gae"]
    rows.append((a, i, hit, f"{mean(r[-k:]):.3f}", f"{wall[-1]:.0f} s", " ".join(f"{e:.2f}" for e in ev) or "-"))
json.dump(runs, open(args.json, "w"))
table(f"PPO + GAE (critic: the initial weights) vs GRPO, configs/guess.py, {steps} steps, no evaluation",
      ["advantage", "seed", "to reward 0.3", f"final reward (last {k})", "wall (steps)",
       f"explained variance, {k}-step means"], rows)
