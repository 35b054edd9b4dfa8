"""mini_swe: mini-swe-agent (https://github.com/SWE-agent/mini-swe-agent, 2.4.6), unchanged, fixes a bug in a one-file
repository: its DefaultAgent with the `mini` command's own config (mini.yaml: prompts, bash tool calls), its
LitellmModel on the episode's endpoint, its shell commands in nanomolt's tool sandbox (tools/sandbox.py).

That sandbox executes only its Python, files in /lib* and /usr/lib* and its own directory: no shell of the host's. So
each command runs in a fresh sandbox holding a shell (dash) and coreutils copied from the host, `python` (the
sandbox's) and the episode's files, which come back as a tar after each command and go into the next: the host never
unpacks them. Reward: 1.0 if `python -c 'import sol; assert sol.add(2, 3) == 5'` passes there once the agent ended.
mini-swe-agent is synchronous: it runs in a thread and hands each command to the rollout's event loop (run_tool's)."""
import asyncio
import base64
import functools
import io
import json
import math
import os
import shutil
import tarfile
from concurrent.futures import ThreadPoolExecutor

# before litellm loads: its model cost map is the one in its package (else fetched at import), an error is not retried
# (the endpoint is on this host: a retry would wait 4-60 s and sample again), no banner
os.environ.setdefault("LITELLM_OFFLINE_MODE", "true")
os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")

import litellm
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import get_config_from_spec
from minisweagent.environments.local import LocalEnvironment
from minisweagent.models.litellm_model import LitellmModel

from tools.sandbox import run_tool

litellm.suppress_debug_info = True  # no "Give Feedback / Get Help" on the rollout's console for each error
CONFIG = get_config_from_spec("mini")  # {"agent", "environment", "model"}, as the `mini` command runs
ISSUE = "sol.add(2, 3) returns -1. Make `python -c 'import sol; assert sol.add(2, 3) == 5'` pass."
SETUP = "printf 'def add(a, b):\\n    return a - b\\n' > sol.py"  # the repository: one file, one bug
CHECK = "python -c 'import sol; assert sol.add(2, 3) == 5'"
TOOLS = ("cat", "cp", "cut", "diff", "env", "find", "grep", "head", "ls", "mkdir", "mv", "nl", "rm", "sed", "sleep",
         "sort", "tail", "tee", "touch", "tr", "uniq", "wc", "xargs")
MARK = "\0mini_swe:"  # before the driver's JSON line; JSON escapes a NUL, so no command output can hold it
# the loop's default pool has min(32, cores + 4) threads, fewer than concurrent_agents: episodes would wait for one
THREADS = ThreadPoolExecutor(max_workers=256, thread_name_prefix="mini_swe")

# In the sandbox (cwd: its empty directory): unpack bin/ and work/, run the command in work/, print MARK + JSON.
DRIVER = r'''
import base64, ctypes, io, json, os, struct, subprocess, sys, tarfile


def unpack(blob):
    tarfile.open(fileobj=io.BytesIO(base64.b64decode(blob))).extractall(filter="fully_trusted")


def main(a):
    unpack(a["tools"])
    os.symlink(sys.executable, "bin/python")
    os.mkdir("work")
    if a["tree"]:
        unpack(a["tree"])
    # as root the sandbox keeps CAP_DAC_READ_SEARCH where Landlock fences reads (for a Python under /root); an exec
    # drops it, and `python` run by the shell could not reach its own files: ambient, the commands keep it
    libc = ctypes.CDLL(None, use_errno=True)
    head = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    caps = ctypes.create_string_buffer(24)
    libc.capget(head, caps)
    effective, permitted = struct.unpack("6I", caps.raw)[:2]
    if permitted & 4:
        libc.capset(head, struct.pack("6I", effective, permitted, permitted, 0, 0, 0))
        libc.prctl(47, 2, 2, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_DAC_READ_SEARCH
    cwd = os.path.abspath(os.path.join("work", a["cwd"]))
    env = dict(a["env"], PATH=os.path.abspath("bin"), HOME=os.path.abspath("work"))
    with open("out", "wb") as out:  # a file, not a pipe: a command's background child can't hold it open
        proc = subprocess.Popen([os.path.abspath("bin/sh"), "-c", a["command"]], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    info = ""
    try:
        returncode = proc.wait(a["timeout"])
    except subprocess.TimeoutExpired:  # left running: run_tool kills what the sandbox holds once this ends
        info = f"Command timed out after {a['timeout']} seconds"
        returncode = -1
    with open("out", "rb") as f:  # its first and last 50 kB (mini-swe-agent shows 5,000 characters of each)
        output = f.read(50_000)
        f.seek(max(f.tell(), os.path.getsize("out") - 50_000))
        output += f.read()
    tree = io.BytesIO()
    with tarfile.open(fileobj=tree, mode="w:gz") as tar:
        tar.add("work")
    result = {"output": output.decode(errors="replace"), "returncode": returncode, "exception_info": info}
    print(MARK + json.dumps(result | {"cwd": cwd, "tree": base64.b64encode(tree.getvalue()).decode()}))
'''


@functools.cache
def tools() -> str:
    """bin/: the host's dash (its sh otherwise) and coreutils, a base64 tar.gz, made once (~1 MB)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(os.path.realpath(shutil.which("dash") or shutil.which("sh")), arcname="bin/sh")
        for name in filter(shutil.which, TOOLS):
            tar.add(os.path.realpath(shutil.which(name)), arcname=f"bin/{name}")
    return base64.b64encode(buf.getvalue()).decode()


class SandboxEnvironment(LocalEnvironment):
    """mini-swe-agent's LocalEnvironment (config, templates, the submit command), its commands run in the sandbox."""

    def __init__(self, loop, memory_mb: int = 256, unsafe: bool = False, **kwargs):
        super().__init__(**kwargs)  # cwd, env, timeout (s)
        self.loop = loop  # the rollout's: run_tool runs there, execute() is called in the agent's thread
        self.memory_mb = memory_mb  # the sandbox's address space and disk (task["tool_memory_mb"])
        self.unsafe = unsafe  # run where a wall of the sandbox is missing (task["sandbox_unsafe"]): trusted code only
        self.tree = ""  # work/ as the last command left it, a base64 tar.gz
        self.ran = []  # (command, the directory it ran in) of each command, in order
        self.pending = None  # the command in flight (a concurrent.futures.Future)
        self.closed = False

    async def run(self, command: str, cwd: str = "", timeout: int | None = None) -> dict:
        """One command in a fresh sandbox holding the episode's files -> mini-swe-agent's output dict."""
        c = self.config
        args = {"tools": tools(), "tree": self.tree, "command": command, "cwd": cwd, "timeout": timeout or c.timeout,
                "env": c.env}
        # run_tool's limit is a backstop: the driver stops waiting for the command, and keeps what it wrote
        _, text = await run_tool(f"MARK = {MARK!r}\n{DRIVER}\nmain({args!r})", timeout_s=args["timeout"] + 10,
                                 memory_mb=self.memory_mb, max_output=self.memory_mb << 21, unsafe=self.unsafe)
        try:
            result = json.loads(text[text.rindex(MARK) + len(MARK):])
        except ValueError:  # no JSON line (the sandbox ended first: memory, time) or a cut one (work/ too big)
            return {"output": text[-10_000:], "returncode": -1, "exception_info": "the sandbox failed"}
        self.tree = result.pop("tree")
        self.ran.append((command, result.pop("cwd")))
        return result

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict:
        """In the agent's thread: the command runs on the loop; this thread waits for its output."""
        self.pending = asyncio.run_coroutine_threadsafe(self.run(action.get("command", ""), cwd, timeout), self.loop)
        if self.closed:  # the episode was cancelled before this command came: it never runs (result() raises)
            self.pending.cancel()
        output = self.pending.result()
        self._check_finished(output)  # mini-swe-agent's: the submit command's output raises Submitted
        return output

    def close(self):
        """The episode was cancelled: the command in flight dies (run_tool kills it), none starts after it."""
        self.closed = True
        if self.pending is not None:
            self.pending.cancel()


async def run(task: dict, llm) -> dict:
    loop = asyncio.get_running_loop()
    env = SandboxEnvironment(loop, timeout=math.ceil(task["tool_timeout"]), memory_mb=task["tool_memory_mb"],
                             unsafe=task.get("sandbox_unsafe", False), **CONFIG["environment"])
    await env.run(SETUP)
    # the episode's endpoint as an OpenAI-compatible server; its cost is unknown to litellm: 0, no error
    model_kwargs = CONFIG["model"]["model_kwargs"] | {"api_base": llm.base_url, "api_key": llm.api_key}
    model = LitellmModel(**CONFIG["model"] | {"model_kwargs": model_kwargs}, model_name=f"openai/{llm.model}",
                         cost_tracking="ignore_errors")
    limits = {"step_limit": task["max_turns"], "cost_limit": 0}  # model calls; 0: no cost limit
    # "mode" is the interactive agent's (confirm each command), not DefaultAgent's
    agent = DefaultAgent(model, env, **{k: v for k, v in CONFIG["agent"].items() if k != "mode"} | limits)
    try:
        result = await loop.run_in_executor(THREADS, agent.run, ISSUE)  # {"exit_status", "submission"}
    except asyncio.CancelledError:  # the episode timed out
        env.close()
        raise
    passed = (await env.run(CHECK))["returncode"] == 0
    commands = len(env.ran) - 2  # the agent's: not the setup, not the check
    submitted = float(result.get("exit_status") == "Submitted")
    return {"reward": float(passed), "info": {"calls": agent.n_calls, "commands": commands, "submitted": submitted}}
