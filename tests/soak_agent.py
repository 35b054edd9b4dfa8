"""The guess agent with faults injected: for the soak (tests/soak.py) and the fault test (tests/test_soak_agent.py).

  train.py --config configs/guess.py --task=tests/soak_agent.py

Which episodes get a fault is a pure function of the episode index, set by environment variables (they reach
the rollout process; the sandboxed tool code must never see them):
  SOAK_FAULT_RATE=0.05   each episode gets a fault with this probability, the kind drawn uniformly
  SOAK_FAULT_EVERY=N     instead: every Nth episode gets one, the kinds in turn (tests: each kind, quickly)
  SOAK_FAULT_KINDS=a,b   only these kinds (default: all of KINDS)
  SOAK_FAULT_LOG=path    append one JSON line per injected fault: {"index", "kind", "expect", "pid", "contained"}
Agent faults must be counted (under KINDS[kind]) and dropped by the rollout; tool faults must come back
as an error observation (checked here: "contained") while the episode is trained as usual. Every
episode reports info tool_calls, tool_errors, tool_uncontained and injected_malformed, so a malformed
episode that reached the trainer would show as episode/injected_malformed > 0 in metrics.jsonl.
"""
import ast
import asyncio
import contextlib
import json
import os
import random
import tempfile

from agent import load_agent
from tools.sandbox import run_tool

guess = load_agent("guess")

KINDS = {  # kind -> the rollout counter it must land in ("trained": the episode is fine, the tool failed)
    "raise": "agent_errors",  # the agent raises mid-episode
    "hang": "agent_timeouts",  # the agent awaits forever mid-episode
    "bad_prompt": "agent_errors",  # the agent asks the engine to continue a prompt with an id outside the vocab
    "not_an_episode": "agent_errors",  # returns None
    "id_outside_vocab": "malformed",
    "nan_reward": "malformed",
    "lengths": "malformed",  # ids and loss_mask of different lengths
    "tool_hang": "trained",
    "tool_crash": "trained",
    "tool_memory": "trained",
    "tool_fork_bomb": "trained",
    "tool_output": "trained",
    "tool_escape": "trained",  # write outside its directory, read our environment and fds
    # requests to the episode's endpoint (an agent program's): refused with the promised status, the episode as usual
    "http_wrong_key": "trained",
    "http_malformed": "trained",  # a body that is not JSON
    "http_huge": "trained",  # over the endpoint's 64 MiB
    "http_disconnect": "trained",  # a chat request whose client hangs up before the answer: a chat episode then
}
HTTP_STATUS = {"http_wrong_key": 401, "http_malformed": 400, "http_huge": 413}
BOMB = "soakbomb"  # the process name of fork-bomb processes: tests/soak.py checks none outlive the run


def _own_fds(out: str) -> bool:
    """The tool's open fds are its pipes, /dev/null, its own directory and Landlock's: none of the trainer's files."""
    if "FDS" not in out:
        return False
    own = ("pipe:", "anon_inode:", "/dev/null", os.path.join(tempfile.gettempdir(), "nanomolt_tool_"))
    return all(f.startswith(own) for f in ast.literal_eval(out.split("FDS", 1)[1].split("\n", 1)[0]))


ESCAPE = os.path.join(tempfile.gettempdir(), "nanomolt_soak_escaped")  # outside the tool's directory
TOOL_CODE = {  # kind -> (model-written code, is the observation what the sandbox promises?)
    "tool_hang": ("import time\ntime.sleep(3600)", lambda ok, out: not ok and "timed out" in out),
    "tool_crash": ("import os\nprint('about to crash', flush=True)\nos.abort()",
                   lambda ok, out: not ok and "killed by signal 6" in out),
    "tool_memory": ("chunks = []\nwhile True:\n    chunks.append(b'x' * (1 << 20))",
                    lambda ok, out: not ok and "MemoryError" in out),
    "tool_fork_bomb": (f"import ctypes, os\nctypes.CDLL(None).prctl(15, b'{BOMB}')\nwhile True:\n    os.fork()",
                       lambda ok, out: not ok),
    # 10 MB: capped either way; on a busy rollout the reads (one per engine step) may not finish within the time limit
    "tool_output": ("print('x' * 10_000_000)", lambda ok, out: "[output truncated]" in out and len(out) < 5000),
    "tool_escape": ("import os\nfds = []\nfor n in os.listdir('/proc/self/fd'):\n    try:\n"
                    "        fds.append(os.readlink(f'/proc/self/fd/{n}'))\n    except OSError:\n        pass\n"
                    f"print('ENV', sorted(os.environ), 'FDS', fds)\nopen({ESCAPE!r}, 'w').write('x')",
                    lambda ok, out: not ok and "PermissionError" in out and "SOAK_" not in out and _own_fds(out)
                    and not os.path.exists(ESCAPE)),
}


def fault_for(index: int) -> str | None:
    kinds = [k for k in os.environ.get("SOAK_FAULT_KINDS", "").split(",") if k] or list(KINDS)
    every = int(os.environ.get("SOAK_FAULT_EVERY", "0"))
    if every:
        return kinds[(index // every) % len(kinds)] if index % every == every - 1 else None
    rng = random.Random(index * 7919 + 17)
    return rng.choice(kinds) if rng.random() < float(os.environ.get("SOAK_FAULT_RATE", "0.05")) else None


def log(entry: dict) -> None:
    if path := os.environ.get("SOAK_FAULT_LOG"):
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


class FaultyLLM:
    """The agent's llm, with a fault at its second generate call (mid-episode, after one model turn)."""

    def __init__(self, llm, kind):
        self.llm, self.kind, self.tokenizer, self.n, self.fired = llm, kind, llm.tokenizer, 0, False

    async def generate(self, ids, **kw):
        self.n += 1
        if self.n == 2 and self.kind in ("raise", "hang", "bad_prompt"):
            return await self.fire(ids)
        return await self.llm.generate(ids, **kw)

    async def fire(self, ids):
        self.fired = True
        if self.kind == "raise":
            raise RuntimeError("soak: injected agent error")
        if self.kind == "hang":
            await asyncio.sleep(10**6)
        return await self.llm.generate(list(ids) + [10**6])  # bad_prompt: must fail in this agent only


async def post(llm, body: bytes, key=None, hang_up=False):
    """A raw HTTP POST of body to the episode's chat endpoint -> the status (hang_up: close once sent -> None)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", int(llm.base_url.split(":")[2].split("/")[0]))
    path = llm.base_url.split(":", 2)[2].split("/", 1)[1]
    writer.write(f"POST /{path}/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Authorization: Bearer {key or llm.api_key}\r\nContent-Length: {len(body)}\r\n"
                 "Connection: close\r\n\r\n".encode() + body)
    with contextlib.suppress(ConnectionError):  # a server may answer (413) and close before it read everything
        await writer.drain()
    status = None if hang_up else int((await reader.readline()).split()[1])
    writer.close()
    return status


async def http_fault(kind, llm):
    """-> (the endpoint answered as promised, a chat-level result or None: the token-level game follows)."""
    chat = json.dumps({"model": llm.model, "messages": [{"role": "user", "content": "Guess a number."}]}).encode()
    if kind in HTTP_STATUS:
        # (the 65 MiB only for http_huge: built for every kind, it stalled the rollout's loop 0.1-0.5 s a fault)
        body = b"{not json" if kind == "http_malformed" else b'{"x": "' + b"x" * (65 << 20) + b'"}' \
            if kind == "http_huge" else chat
        return await post(llm, body, key="wrong" if kind == "http_wrong_key" else None) == HTTP_STATUS[kind], None
    await post(llm, chat, hang_up=True)  # the endpoint still samples the answer and records it
    for _ in range(3000):
        if llm.calls:
            break
        await asyncio.sleep(0.01)
    ok = bool(llm.calls) and await post(llm, chat) == 200  # and it still serves the episode
    return ok and len(llm.segs) == 2, 0.0  # two segments (the same prompt twice), both trained


async def run(task, llm):
    kind = fault_for(task["index"])
    if kind is None:
        ep = await guess(task, llm)
        ep.info.update(tool_calls=0, tool_errors=0, tool_uncontained=0, injected_malformed=0)
        return ep
    entry = {"index": task["index"], "kind": kind, "expect": KINDS[kind], "pid": os.getpid()}  # the rollout's pid
    calls = errors = uncontained = 0
    if kind in TOOL_CODE:  # a tool call with hostile code, then the game as usual
        code, promised = TOOL_CODE[kind]
        ok, out = await run_tool(code, timeout_s=task["tool_timeout"], memory_mb=task["tool_memory_mb"])
        calls, errors, uncontained = 1, int(not ok), int(not promised(ok, out))
        entry.update(contained=not uncontained, observation=out[:200])
    if kind in HTTP_STATUS or kind == "http_disconnect":
        ok, result = await http_fault(kind, llm)
        uncontained = int(not ok)
        entry.update(contained=ok)
        if result is not None:
            log(entry)
            return {"reward": result, "info": {"tool_calls": 0, "tool_errors": 0, "tool_uncontained": int(not ok),
                                               "injected_malformed": 0}}
    log(entry)  # agent faults: before the fault (a hang never comes back to log it)
    llm = FaultyLLM(llm, kind)
    ep = await guess(task, llm)
    if llm.kind in ("raise", "hang", "bad_prompt") and not llm.fired:  # found it in one turn: fault now
        await llm.fire(ep.ids)
    if kind == "not_an_episode":
        return None
    if kind == "id_outside_vocab":
        ep.append([10**6])  # mask 0: never trained, but it would index past the embedding
    elif kind == "nan_reward":
        ep.reward = float("nan") if task["index"] % 2 else float("inf")
    elif kind == "lengths":
        ep.loss_mask.append(0)
    ep.info.update(tool_calls=calls, tool_errors=errors, tool_uncontained=uncontained,
                   injected_malformed=int(KINDS[kind] == "malformed"))
    return ep
