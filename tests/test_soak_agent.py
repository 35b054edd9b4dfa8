"""Injected faults end to end (tests/soak_agent.py, the agent of the soak): agent faults are counted under
their counter and dropped, tool faults become error observations, nothing malformed is trained, no tool
process outlives the run; and a rollout process that dies takes its tool calls along and exits, never hangs."""
import json
import math
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from soak_agent import KINDS  # noqa: E402


def sandbox_processes_of(pids):
    """Live sandbox processes started by any of pids (as root each tool call runs as uid 2^20 + (pid << 8) + n)."""
    found = []
    for d in os.listdir("/proc"):
        try:
            status = dict(line.split(":", 1) for line in open(f"/proc/{d}/status"))
        except (OSError, ValueError):
            continue
        uid = int(status["Uid"].split()[0])
        if uid >= 1 << 20 and (uid - (1 << 20)) >> 8 in pids and not status["State"].strip().startswith("Z"):
            found.append(int(d))
    return found


def test_injected_faults_are_counted_dropped_and_never_trained(tmp_path):
    log = tmp_path / "faults.jsonl"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "SOAK_FAULT_EVERY": "3",
           "SOAK_FAULT_LOG": str(log)}
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "guess.py"),
           f"--out_dir={tmp_path}", f"--task={os.path.join(ROOT, 'tests', 'soak_agent.py')}", "--prompts_per_step=4",
           "--max_steps=6", "--episode_timeout=6", "--tool_timeout=2", "--ckpt_every=0", "--dump_every=0"]
    r = subprocess.run(cmd, env=env, cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    ms = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [m["step"] for m in ms] == list(range(1, 7))
    injected = {e["index"]: e for e in map(json.loads, open(log))}
    uncontained = [e for e in injected.values() if e.get("contained") is False]  # (named, should one ever be)
    # nothing malformed was trained: every trained episode says whether it carried an injected malformation
    for m in ms:
        assert math.isfinite(m["reward/mean"]) and math.isfinite(m["loss/policy"])
        assert m["episode/injected_malformed"] == 0 and m["episode/tool_uncontained"] == 0, uncontained
    drops = {int(i): key for i, key in re.findall(r"\[rollout\] episode (\d+) dropped \((\w+)\)", r.stderr)}
    for i, key in drops.items():  # each drop: an agent fault under its own counter, or a slow episode timing out
        expect = injected.get(i, {}).get("expect", "agent_timeouts")  # (not injected, or a tool fault: slow)
        assert key == expect or (expect == "trained" and key == "agent_timeouts"), (i, key, injected.get(i))
    agent_kinds = {k for k, v in KINDS.items() if v != "trained"}
    assert {injected[i]["kind"] for i in drops if i in injected} == agent_kinds  # each kind, dropped
    tools = [e for e in injected.values() if e["expect"] == "trained"]
    assert {e["kind"] for e in tools} == set(KINDS) - agent_kinds
    assert all(e["contained"] for e in tools), uncontained
    # a failed tool call is an observation, not a lost episode (unless it made the episode too slow)
    assert not any(drops.get(e["index"], "agent_timeouts") != "agent_timeouts" for e in tools)
    assert sum(m["episode/tool_calls"] for m in ms) > 0 and sum(m["episode/tool_errors"] for m in ms) > 0
    # metrics.jsonl counts what the rollout logged (as of the last trained episode, so at most that)
    for key in ("agent_errors", "malformed", "agent_timeouts"):
        assert ms[-1][f"rollout/{key}"] <= sum(k == key for k in drops.values())
    assert ms[-1]["rollout/agent_errors"] >= 3 and ms[-1]["rollout/malformed"] >= 3
    # the run ended with tool calls in flight (a 2 s hang every 39 episodes): none of them lives on
    if os.geteuid() == 0:
        deadline = time.time() + 10  # the parent-death SIGKILL is asynchronous: give them a moment to go
        while (left := sandbox_processes_of({e["pid"] for e in injected.values()})) and time.time() < deadline:
            time.sleep(0.1)
        assert left == []


def test_a_tool_call_dies_with_its_caller(tmp_path):
    """kill -9 of the process that runs a tool call (the rollout) takes the tool process with it."""
    marker = f"nmorphan{os.getpid() % 10**5}"
    code = f"import ctypes, time\nctypes.CDLL(None).prctl(15, b'{marker}')\ntime.sleep(3600)"
    caller = subprocess.Popen([sys.executable, "-c", f"import asyncio\nfrom tools.sandbox import run_tool\nasyncio.run(run_tool({code!r}, "
                               "timeout_s=600))"], env={**os.environ, "PYTHONPATH": ROOT})
    try:
        deadline = time.time() + 30
        while not (tool := named(marker)) and time.time() < deadline:
            time.sleep(0.05)
        assert tool, "the tool never started"
    finally:
        caller.kill()
        caller.wait()
    deadline = time.time() + 10
    while named(marker) and time.time() < deadline:
        time.sleep(0.05)
    assert named(marker) == []


def named(comm):
    pids = []
    for d in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{d}/stat").read()
        except OSError:
            continue
        if stat[stat.index("(") + 1:stat.rindex(")")] == comm and stat[stat.rindex(")") + 2] != "Z":
            pids.append(int(d))
    return pids


DYING_PRODUCER = """
import asyncio
from agent import load_agent

guess = load_agent("guess")
from servers import ServerError

async def run(task, llm):
    if task["index"] == 3:  # ignores cancellation, as a tool call cancelled at the wrong moment can (CPython 3.11)
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass
    if task["index"] == 40:  # the producer re-raises a ServerError: the rollout process must exit, not hang
        await asyncio.sleep(0.5)
        raise ServerError("injected: the server went away")
    return await guess(task, llm)
"""


def test_rollout_that_dies_exits_even_with_agents_that_ignore_cancellation(tmp_path):
    (tmp_path / "dying.py").write_text(DYING_PRODUCER)
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "guess.py"),
           f"--out_dir={tmp_path / 'run'}", f"--task={tmp_path / 'dying.py'}", "--max_steps=50", "--ckpt_every=0"]
    r = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}, cwd=ROOT, timeout=120,
                       capture_output=True, text=True)
    assert r.returncode != 0 and "rollout process died (exit code 1)" in r.stderr, r.stderr[-3000:]
    assert "injected: the server went away" in r.stderr


TOOL_AGENT = """
from agent import load_agent
from tools.sandbox import run_tool

guess = load_agent("guess")

async def run(task, llm):
    if task["index"] == 0:  # a tool call that is still running when the trainer is killed
        await run_tool(f"import ctypes, time\\nctypes.CDLL(None).prctl(15, {MARKER!r})\\ntime.sleep(3600)", timeout_s=600)
    return await guess(task, llm)
"""


def alive(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_kill_9_of_the_trainer_alone_takes_the_rollout_and_its_tools_along(tmp_path):
    """SIGKILL to the trainer's pid only (not its process group, as an OOM killer or `kill -9 PID` does): the
    rollout process and the tool call it runs die with it."""
    marker = f"nmkill{os.getpid() % 10**5}"
    (tmp_path / "tool.py").write_text(f"MARKER = {marker.encode()!r}\n" + TOOL_AGENT)
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "guess.py"),
           f"--out_dir={tmp_path / 'run'}", f"--task={tmp_path / 'tool.py'}", "--max_steps=100000",
           "--episode_timeout=1000", "--ckpt_every=0", "--dump_every=0"]
    p = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}, cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not named(marker):
            assert p.poll() is None and time.monotonic() < deadline, "the run died or the tool never started"
            time.sleep(0.1)
        children = [int(c) for t in os.listdir(f"/proc/{p.pid}/task")
                    for c in open(f"/proc/{p.pid}/task/{t}/children").read().split()]
        assert children and all(alive(c) for c in children)  # the rollout process (and its helpers)
    finally:
        os.kill(p.pid, 9)
        p.wait()
    deadline = time.monotonic() + 10  # the parent-death SIGKILL is asynchronous: give them a moment to go
    while (left := [c for c in children if alive(c)] + named(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:  # (a failing run leaves no orphans behind)
        os.kill(pid, 9)
    assert left == []
