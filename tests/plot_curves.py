"""Reward (and held-out pass@1 where evaluated) against minutes of training, one line per run, from each run's
metrics.jsonl; how README's assets/smollm2_curves.png is drawn (matplotlib is not a requirement: pip install it):
    python tests/plot_curves.py OUT.png "title" out/run_seed0 out/run_seed1 ..."""
import json
import os
import sys
from itertools import accumulate

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

if __name__ == "__main__":
    png, title, runs = sys.argv[1], sys.argv[2], sys.argv[3:]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, run in enumerate(runs):
        ms = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
        minutes = [t / 60 for t in accumulate(m.get("time/step", 0.0) for m in ms)]
        trained = [(t, m["reward/mean"]) for t, m in zip(minutes, ms) if "reward/mean" in m]
        ax.plot(*zip(*trained), ".-", color=f"C{i}", label=f"{os.path.basename(run.rstrip('/'))}: reward (8 x 8)")
        evals = [(t, m["eval/pass@1"]) for t, m in zip(minutes, ms) if "eval/pass@1" in m]
        if evals:
            ax.plot(*zip(*evals), "s--", color=f"C{i}", alpha=0.6, label="held-out pass@1")
    ax.set(title=title, xlabel="minutes of training steps (start-up excluded)", ylabel="reward / pass@1", ylim=(0, 1.05))
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
