"""plot.py: reward (held-out evaluation's too) and trainer-vs-engine mismatch, staleness and routing-flip curves from a
run's metrics.jsonl.
    python plot.py out/guess            # writes out/guess/curves.png"""
import json
import os
import sys

from matplotlib.figure import Figure  # not pyplot: no backend, no display needed

out_dir = sys.argv[1] if len(sys.argv) > 1 else "out/guess"
lines = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
ms = [m for m in lines if "reward/mean" in m]  # (an evaluation at step 0 has a line of its own)
t = [sum(m["time/step"] for m in ms[1:i + 1]) for i in range(len(ms))]  # wall seconds since the first step
evals, at = [m for m in lines if "eval/pass@1" in m], dict(zip((m["step"] for m in ms), t))
fig = Figure(figsize=(11, 4), layout="tight")
a, b = fig.subplots(1, 2)
a.plot(t, [m["reward/mean"] for m in ms], lw=0.8, label="reward/mean")
k = 10  # a moving average shows the trend through the batch-to-batch noise
avg = [sum(m["reward/mean"] for m in ms[i - k + 1:i + 1]) / k for i in range(k - 1, len(ms))]
a.plot(t[k - 1:], avg, label=f"mean of {k} steps")
for key in [key for key in (evals[0] if evals else {}) if key.startswith("eval/pass@")]:  # pass@1, pass@k
    a.plot([at.get(m["step"], 0) for m in evals], [m[key] for m in evals], "o-", ms=3, label=key + " (held-out)")
a.set(xlabel="seconds", ylabel="reward", title=f"reward ({out_dir})", ylim=(0, 1.05))
a.legend()
pts = [(m["step"], m["mismatch/logprob_abs_diff"]) for m in ms if m["mismatch/logprob_abs_diff"] is not None]
b.semilogy([s for s, _ in pts], [max(v, 1e-12) for _, v in pts], ".", ms=3, label="mismatch/logprob_abs_diff")
b.plot([m["step"] for m in ms], [m["staleness/mean"] + 1e-12 for m in ms], lw=0.8, label="staleness/mean (versions)")
flips = [(m["step"], m["routing/flip_frac"]) for m in ms if m.get("routing/flip_frac") is not None]  # MoE only
b.plot([s for s, _ in flips], [v + 1e-12 for _, v in flips], lw=0.8,
       label="routing/flip_frac (replayed experts\nthe trainer's router would not pick)")
b.set(xlabel="step", title="trainer vs engine", ylim=(1e-9, 10))
b.legend()
fig.savefig(os.path.join(out_dir, "curves.png"), dpi=110)
print(f"wrote {os.path.join(out_dir, 'curves.png')}")
