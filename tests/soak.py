"""The soak: the default run (configs/guess.py, torchrun, 2 ranks) for N minutes with agent and tool faults
injected into a fraction of the episodes (tests/soak_agent.py). Is the reward still rising, is every
process's memory flat, was every fault counted and dropped (or, for tools, turned into an error
observation), and does nothing outlive the run? Writes <out>/soak_summary.md (the README's soak section),
<out>/soak_rss.csv (every sample) and <out>/train.log.

  python tests/soak.py --minutes 20 --rate 0.05 --out out/soak [-- extra train.py arguments]

The run is stopped with SIGTERM to the trainer ranks (it writes a checkpoint and exits); RSS is read from
/proc every --sample_every seconds for each process of the run, by role: torchrun, rank0, rank1, rollout,
resource_tracker; tool subprocesses are short-lived and only counted.
"""
import argparse
import collections
import csv
import json
import os
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from soak_agent import BOMB, KINDS  # noqa: E402


# ---- processes of the run, by role, from /proc ----

def proc_table():
    """{pid: (ppid, comm, cmdline)} of every live process."""
    table = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = open(f"/proc/{d}/stat").read()
            cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2:].split()
        if rest[0] == "Z":
            continue
        table[int(d)] = (int(rest[1]), stat[stat.index("(") + 1:stat.rindex(")")], cmd)
    return table


def descendants(root, table):
    kids = collections.defaultdict(list)
    for pid, (ppid, _, _) in table.items():
        kids[ppid].append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids[pid]
    return out


def role(pid, table, launcher):
    ppid, comm, cmd = table[pid]
    if pid == launcher:
        return "torchrun"
    if " -I -S " in cmd or comm == BOMB:  # the sandbox's interpreter (and the reaper), or a fork bomb
        return "tool"
    if "train.py" in cmd and "multiprocessing" not in cmd:
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            rank = next(e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"RANK="))
        except (OSError, StopIteration):
            rank = "?"
        return f"rank{rank}"
    if ("resource_tracker" in cmd or "spawn_main" in cmd) and "train.py" not in table.get(ppid, (0, "", ""))[2]:
        return f"server:{comm}"  # a server engine's own (SGLang's scheduler before it renames itself, its tracker)
    if "resource_tracker" in cmd:
        return "resource_tracker"
    if "spawn_main" in cmd:
        return "rollout"
    return f"other:{comm}"


def memory_kb(pid):
    """(VmRSS, RssAnon, RssShmem) in kB."""
    fields = {}
    try:
        for line in open(f"/proc/{pid}/status"):
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssShmem"):
                fields[key] = int(value.split()[0])
    except OSError:
        return None
    return fields.get("VmRSS", 0), fields.get("RssAnon", 0), fields.get("RssShmem", 0)


def leftovers(table, run_pids):
    """Sandbox processes (or fork-bomb children) of this run alive now: none may outlive it. As root each tool
    call runs as uid 2^20 + (pid of the caller << 8) + n (tools/sandbox.run_tool), which names the run's process."""
    left = []
    for pid, (ppid, comm, cmd) in table.items():
        if comm == BOMB or ("-I -S -u -c" in cmd and "resource" in cmd):
            try:
                uid = int(next(l for l in open(f"/proc/{pid}/status") if l.startswith("Uid:")).split()[1])
            except (OSError, StopIteration):
                continue
            if (uid - (1 << 20)) >> 8 in run_pids or (uid == os.geteuid() != 0 and ppid in run_pids | {1}):
                left.append(pid)
    return left


# ---- the summary ----

def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(args, out, samples, wall, rc, stop_step, left):
    ms = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    rewards = [m["reward/mean"] for m in ms]
    batch = json.load(open(os.path.join(out, "config.json")))["batch_size"]
    last = ms[-1]
    w = 25

    def total(key):  # episodes over the run: metrics hold the batch mean of each episode/ key
        return sum(m.get(f"episode/{key}", 0) for m in ms) * batch

    means = [mean(rewards[i - w:i]) for i in range(w, len(rewards) + 1)]
    first_09 = next((i + w for i, r in enumerate(means) if r >= 0.9), None)
    lines = [f"# soak: {args.minutes:g} min, fault rate {args.rate:g}", "",
             f"- run: `torchrun --nproc_per_node={args.nproc} train.py --config configs/guess.py "
             f"--task=tests/soak_agent.py {' '.join(args.train_args)}`, SOAK_FAULT_RATE={args.rate:g}; "
             f"stopped by SIGTERM after {wall / 60:.1f} min (exit code {rc}, checkpoint of step {stop_step})",
             f"- steps: {len(ms)} ({wall / max(len(ms), 1):.2f} s/step); batch {batch} episodes",
             f"- reward (25-step mean): first {mean(rewards[:w]):.3f}, last {mean(rewards[-w:]):.3f}, "
             f"best {max(means) if means else float('nan'):.3f}; first >= 0.9 at step {first_09}",
             f"- skipped (non-finite) steps: {last.get('train/skipped_steps')}; staleness max "
             f"{max(m['staleness/max'] for m in ms)}; mismatch max "
             f"{max((m['mismatch/logprob_abs_diff'] or 0) for m in ms):.1e}",
             "- counters at the last step: " + ", ".join(f"{k} {last.get(k)}" for k in (
                 "rollout/agent_errors", "rollout/agent_timeouts", "rollout/malformed", "rollout/dropped_stale")),
             f"- trained episodes: tool calls {total('tool_calls'):.0f}, tool errors {total('tool_errors'):.0f}, "
             f"uncontained {total('tool_uncontained'):.0f}, "
             f"with an injected malformation {total('injected_malformed'):.0f}",
             ""]
    # faults: what the agent injected vs what the rollout said it dropped (its stderr lines)
    injected = [json.loads(line) for line in open(os.path.join(out, "faults.jsonl"))] \
        if os.path.exists(os.path.join(out, "faults.jsonl")) else []
    drops, reasons = {}, collections.Counter()
    for line in open(os.path.join(out, "train.log"), errors="replace"):
        m = re.match(r"\[rollout\] episode (\d+) dropped \((\w+)\): (.*)", line)
        if m:
            drops[int(m.group(1))] = m.group(2)
            reasons[(m.group(2), re.sub(r"\d+", "N", m.group(3))[:90])] += 1
    by_kind = collections.defaultdict(list)
    for e in injected:
        by_kind[e["kind"]].append(e)
    lines += ["| injected fault | count | expected | dropped as expected | other outcome |",
              "| --- | --- | --- | --- | --- |"]
    for kind, expect in KINDS.items():
        es = by_kind.get(kind, [])
        if expect == "trained":
            ok = sum(e.get("contained", False) for e in es)
            lines.append(f"| {kind} | {len(es)} | error observation, episode trained | - | "
                         f"contained {ok}/{len(es)}, dropped {sum(e['index'] in drops for e in es)} |")
        else:
            right = sum(drops.get(e["index"]) == expect for e in es)
            lines.append(f"| {kind} | {len(es)} | {expect} | {right} | "
                         f"in flight at the end {sum(e['index'] not in drops for e in es)} |")
    fault_idx = {e["index"] for e in injected}
    lines += ["", f"Episodes dropped that had no injected fault: {sum(i not in fault_idx for i in drops)} "
              f"({dict(collections.Counter(k for i, k in drops.items() if i not in fault_idx))})", "",
              "| dropped as | reason (rollout's log line) | count |", "| --- | --- | --- |"]
    lines += [f"| {k} | `{r}` | {n} |" for (k, r), n in sorted(reasons.items())]
    # memory: per role, minute 2 vs the last sample before the stop
    lines += ["", "| process | RSS at min 2 (MB) | RSS at end (MB) | growth | max (MB) | anon at min 2 / end (MB) |",
              "| --- | --- | --- | --- | --- | --- |"]
    flat = True
    for name in sorted({s["role"] for s in samples if s["role"] != "tool"}):
        ss = [s for s in samples if s["role"] == name]
        at2 = min(ss, key=lambda s: abs(s["t"] - 120))
        end = ss[-1]
        g = (end["rss"] - at2["rss"]) / max(at2["rss"], 1)
        flat &= g < 0.05 or name == "torchrun"
        lines.append(f"| {name} (pid {end['pid']}{', restarted' if len({s['pid'] for s in ss}) > 1 else ''}) | "
                     f"{at2['rss'] / 1024:.0f} | {end['rss'] / 1024:.0f} | {100 * g:+.1f}% | "
                     f"{max(s['rss'] for s in ss) / 1024:.0f} | {at2['anon'] / 1024:.0f} / {end['anon'] / 1024:.0f} |")
    per_sample = collections.Counter(s["t"] for s in samples if s["role"] == "tool")
    lines += ["", f"Tool processes alive at a sample: at most {max(per_sample.values(), default=0)}; "
              f"left alive after the run: {len(left)}. Memory flat (< 5% growth from minute 2, every process): "
              f"{'yes' if flat else 'NO'}. Reward rising (last 25 > first 25): "
              f"{'yes' if mean(rewards[-w:]) > mean(rewards[:w]) else 'NO'}."]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--rate", type=float, default=0.05, help="fraction of episodes with an injected fault")
    p.add_argument("--out", default="out/soak")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--sample_every", type=float, default=10.0)
    p.add_argument("train_args", nargs="*", help="more train.py arguments (after --)")
    args = p.parse_args()
    args.train_args = args.train_args or ["--max_steps=1000000", "--episode_timeout=30"]
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    for f in ("metrics.jsonl", "faults.jsonl", "train.log", "soak_rss.csv"):  # a fresh run, not a resume
        if os.path.exists(os.path.join(out, f)):
            os.remove(os.path.join(out, f))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), ROOT])),
           "SOAK_FAULT_RATE": str(args.rate),
           "SOAK_FAULT_LOG": os.path.join(out, "faults.jsonl")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "guess.py"),
           f"--task={os.path.join(ROOT, 'tests', 'soak_agent.py')}", f"--out_dir={out}", *args.train_args]
    log = open(os.path.join(out, "train.log"), "w")
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    samples, writer = [], csv.writer(open(os.path.join(out, "soak_rss.csv"), "w", newline=""))
    writer.writerow(["t", "role", "pid", "rss_kb", "anon_kb", "shmem_kb"])
    print(f"soak: {' '.join(cmd)}\n  for {args.minutes:g} min, log {out}/train.log", flush=True)
    while proc.poll() is None and time.time() - t0 < args.minutes * 60:
        t = round(time.time() - t0, 1)
        table = proc_table()
        for pid in descendants(proc.pid, table):
            if pid in table and (mem := memory_kb(pid)):
                s = {"t": t, "role": role(pid, table, proc.pid), "pid": pid, "rss": mem[0], "anon": mem[1]}
                samples.append(s)
                writer.writerow([t, s["role"], pid, *mem])
        if int(t) % 60 < args.sample_every:
            steps = sum(1 for _ in open(os.path.join(out, "metrics.jsonl"))) if os.path.exists(
                os.path.join(out, "metrics.jsonl")) else 0
            print(f"  {t / 60:5.1f} min: {steps} steps", flush=True)
        time.sleep(args.sample_every)
    wall = time.time() - t0
    rc = proc.poll()
    stop_step = None
    if rc is None:  # the planned stop: SIGTERM to the trainer ranks, which checkpoint and exit
        table = proc_table()
        for pid in descendants(proc.pid, table):
            if pid in table and role(pid, table, proc.pid).startswith("rank"):
                os.kill(pid, signal.SIGTERM)
        try:
            rc = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
        log_text = open(os.path.join(out, "train.log"), errors="replace").read()
        m = re.search(r"SIGTERM: checkpoint of step (\d+)", log_text)
        stop_step = int(m.group(1)) if m else None
    time.sleep(2)  # let the kernel deliver the parent-death signals
    left = leftovers(proc_table(), {s["pid"] for s in samples if s["role"] != "tool"})
    summary = summarize(args, out, samples, wall, rc, stop_step, left)
    open(os.path.join(out, "soak_summary.md"), "w").write(summary)
    print(summary, flush=True)


if __name__ == "__main__":
    main()
