"""agent.py: agents are ordinary async Python programs; tasks, tools, rewards."""
import asyncio
import contextlib
import functools
import inspect
import itertools
import json
import math
import os
import random
import runpy
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

# ---- tokenizer: a tiny byte-level BPE for models trained from scratch ----
ASSETS = Path(__file__).with_name("assets")
# ChatML as in Qwen3's template, minus thinking: a system turn, tools, tool calls and tool results in its
# <tool_call> / <tool_response> format (what endpoint.py parses). Frozen, as the tokenizer's merges are.
CHAT_TEMPLATE = ASSETS.joinpath("chat_template.jinja").read_text()
IMAGE_PAD = "<|image_pad|>"  # an image is one IMAGE_PAD per 2 x 2 patches


def make_tokenizer(path: str) -> None:
    """Save the tiny models' tokenizer, no download: assets' 384-id BPE (tools/make_tokenizer.py), one token a digit."""
    os.makedirs(path, exist_ok=True)
    shutil.copy(ASSETS / "tiny_tokenizer.json", os.path.join(path, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": 4096,
              "clean_up_tokenization_spaces": False}
    Path(path, "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def stop_ids(tok, model_dir):
    """Every end-of-turn id: the tokenizer's eos, <|im_end|> if it has one, and generation_config.json's eos ids."""
    ids = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else None}
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        eos = json.load(open(path)).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos])
    return sorted(i for i in ids if i is not None)


@functools.lru_cache(maxsize=4)
def load_tokenizer(path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def save_tokenizer(src, dst):
    """The tokenizer (its chat template too, in whatever file it came) and generation_config.json beside weights."""
    load_tokenizer(src).save_pretrained(dst)
    if os.path.isfile(os.path.join(src, "generation_config.json")):
        shutil.copy(os.path.join(src, "generation_config.json"), dst)


# ---- the episode: one typed record from rollout to loss ----
@dataclass
class Episode:
    """What the agent decides; sampled tokens' logprobs, versions and experts are the engine's (check_tokens)."""
    ids: list[int] = field(default_factory=list)  # the whole conversation, exactly the tokens the engine saw
    loss_mask: list[int] = field(default_factory=list)  # 1 on tokens the policy sampled, 0 on everything else
    reward: float = 0.0
    info: dict = field(default_factory=dict)  # numbers to log (turns, tool_errors, ...)
    images: list = field(default_factory=list)  # (C, H, W) float tensors in [0, 1], in the order of their placeholders

    def append(self, ids: list[int]) -> None:
        """Prompt, tool or environment tokens: in the sequence, never trained on."""
        self.ids += ids
        self.loss_mask += [0] * len(ids)

    def append_image(self, image: torch.Tensor, ids: list[int]) -> None:
        """An image observation, (3, H, W) floats in [0, 1]; ids hold its placeholders (<|image_pad|>s), mask 0."""
        self.append(ids)
        self.images.append(image)

    def append_completion(self, completion) -> None:
        """An engine result for prompt = self.ids: its sampled ids completion.ids, trained on."""
        self.ids += completion.ids
        self.loss_mask += [1] * len(completion.ids)

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError on an episode the trainer must not see."""
        if len(self.ids) != len(self.loss_mask):
            raise ValueError(f"lengths differ: ids {len(self.ids)}, loss_mask {len(self.loss_mask)}")
        if any(not 0 <= i < vocab_size for i in self.ids):
            raise ValueError(f"token id outside vocab [0, {vocab_size})")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask must be 0 or 1")
        if not any(self.loss_mask):
            raise ValueError("no sampled token (loss_mask is all 0)")
        if not math.isfinite(self.reward):
            raise ValueError(f"non-finite reward {self.reward}")


@dataclass
class Completion:
    ids: list  # sampled token ids (the stop token included when it was sampled)
    logprobs: list  # logprob of each sampled id under the distribution it was drawn from
    versions: list  # policy version of the weights that sampled each id
    routing: torch.Tensor | None  # (len(prompt) + len(ids), n_moe_layers, top_k) int16, -1 where not computed


class ContextFull(ValueError):
    """The conversation has reached the engine's max_len: the rollout trains the episode so far as truncated."""


# ---- turns: conversations grow by appending token ids, never by re-rendering ----
def prompt_ids(tok, text: str) -> list[int]:
    """The opening user turn and the assistant header, as the chat template renders it."""
    s = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok.encode(s, add_special_tokens=False)


def turn_suffix(tok, text: str, role: str = "user") -> list[int]:
    """Ids that continue a chat after an assistant turn that ended with <|im_end|>: a new turn + assistant header."""
    # Special tokens split the text before BPE runs, so these ids equal what a full render would give here.
    return tok.encode(f"\n<|im_start|>{role}\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


async def model_turn(llm, ep: Episode) -> str:
    """One model turn appended to ep; returns its text, decoded only to show the environment."""
    completion = await (llm.generate(ep.ids, images=ep.images) if ep.images else llm.generate(ep.ids))
    ep.append_completion(completion)
    end = llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    if not completion.ids or completion.ids[-1] != end:  # cut off at max_new_tokens: we close the turn (mask 0)
        ep.append([end])
    return llm.tokenizer.decode(completion.ids, skip_special_tokens=True)


# ---- tools: untrusted code in a sandboxed subprocess ----
# The child locks itself down in this prelude and only then runs the model's code (main.py in its cwd).
# We do not use preexec_fn: it runs Python between fork and exec, which can deadlock in a threaded
# parent (and the rollout process has threads); the prelude runs in a fresh single-threaded interpreter.
_PRELUDE = """
import ctypes, os, resource, select, struct, sys
uid, mem, nproc, cpu, parent, abi_max, unsafe = map(int, sys.argv[1:8]); sys.argv = ["main.py"]
libc = ctypes.CDLL(None, use_errno=True)
def check(r):
    if r < 0: raise OSError(ctypes.get_errno(), "sandbox setup failed")
check(libc.prctl(38, 1, 0, 0, 0))  # PR_SET_NO_NEW_PRIVS: needed by Landlock and seccomp; exec can't regain privileges
me, gid, code = os.getuid(), os.getgid(), open("main.py", "rb").read()
# Its own network (no loopback even), mount (the quota) and pid namespaces; without root, a user namespace grants them
err = libc.unshare(0x40000000 | 0x20000 | 0x20000000 | (uid < 0) << 28) and os.strerror(ctypes.get_errno())
abi = min(libc.syscall(444, None, 0, 1), abi_max)  # landlock_create_ruleset(VERSION); < 0 on kernels without Landlock
missing = [f"no user/network/pid namespace (unshare: {err})"] * bool(err) + ["no Landlock: files unfenced"] * (abi < 1)
missing += [f"Landlock ABI {abi} < 6 (Linux 6.12): signals to the trainer are not scoped"] * (1 <= abi < 6)
if missing and not unsafe: sys.exit("; ".join(missing) + ". sandbox_unsafe=True runs tool code without it anyway")
if not err:  # without root: its ids mapped to themselves, RLIMIT_NPROC counts this namespace's, caps dropped below
    for f, m in [("setgroups", "deny"), ("uid_map", f"{me} {me} 1"), ("gid_map", f"{gid} {gid} 1")] * (uid < 0):
        open(f"/proc/self/{f}", "w").write(m)
    check(libc.mount(None, b"/", None, 1 << 14 | 1 << 18, None))  # MS_REC | MS_PRIVATE: nothing propagates out
    opts = b"size=%dm,nr_inodes=4096,mode=777" % mem  # the disk quota; 777: only this call's processes see it
    check(libc.mount(b"tmpfs", os.getcwd().encode(), b"tmpfs", 6, opts))  # MS_NOSUID | MS_NODEV
    os.chdir(os.getcwd()); open("main.py", "wb").write(code)
    pfd = os.pidfd_open(os.getpid())  # the pid namespace's init exits with us, and the kernel then kills all in it;
    if os.fork() == 0:  # it waits on a pidfd: a PDEATHSIG from us would be refused (our new uid, Landlock's scope)
        select.select([pfd], [], []); os._exit(0)
    os.close(pfd)  # the model's code sees no fds but 0, 1, 2
if abi >= 1:  # Landlock (Linux >= 5.13): writes only in the cwd; reads only there, in the Python it runs, system libs
    fs = (1 << 13) - 1 | (abi >= 2) << 13 | (abi >= 3) << 14 | (abi >= 5) << 15  # every fs right this ABI knows
    # (fs rights, TCP bind+connect from ABI 4: all denied, scoped from ABI 6: abstract unix sockets and signals)
    fd = libc.syscall(444, struct.pack("3Q", fs, 3 * (abi >= 4), 3 * (abi >= 6)), 24, 0); check(fd)
    libs = [*sys.path, sys.executable, "/lib", "/lib64", "/usr/lib", "/usr/lib64", "/etc/ld.so.cache", "/dev/urandom",
            f"/proc/{os.getpid()}"]  # its own /proc/self, not other processes' (main.py runs in this process)
    for p, r in [(".", fs), ("/dev/null", 0xc006), *((p, 0b1101) for p in libs if os.path.exists(p))]:
        r &= fs & (-1 if os.path.isdir(p) else 0xc007)  # a file takes file rights only: exec, r/w, truncate, ioctl
        check(libc.syscall(445, fd, 1, struct.pack("=Qi", r, o := os.open(p, os.O_PATH)), 0)); os.close(o)
    check(libc.syscall(446, fd, 0)); os.close(fd)  # closed: the model's code must see no fds but 0, 1, 2
for res, n in [(resource.RLIMIT_AS, mem << 20), (resource.RLIMIT_FSIZE, mem << 20),
               (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_CORE, 0)]:  # cpu: backstop
    resource.setrlimit(res, (n, n))
if uid >= 0:  # drop root; keep CAP_DAC_READ_SEARCH (a Python under /root, pyenv) only where Landlock fences reads
    check(libc.prctl(8, 1, 0, 0, 0))  # PR_SET_KEEPCAPS
    os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)
check(libc.capset(struct.pack("Ii", 0x20080522, 0), struct.pack("6I", *[(abi >= 1 and uid >= 0) << 2] * 2, 0, 0, 0, 0)))
check(libc.prctl(1, 9, 0, 0, 0))  # PR_SET_PDEATHSIG: SIGKILL when the caller dies (after setresuid: it clears it)
if os.getppid() != parent: os._exit(137)  # the caller died before that line
# seccomp: socket(), io_uring_setup() and socketpair() but of SOCK_STREAM (asyncio's self-pipe; a datagram pair
# could sendto() a path socket) fail with EPERM, and so does every syscall of another ABI (x32, i386 on x86_64).
arch, sock, pair = {"x86_64": (0xC000003E, 41, 53), "aarch64": (0xC00000B7, 198, 199)}[os.uname().machine]
bpf = [(0x20, 0, 0, 4), (0x15, 0, 9, arch), (0x20, 0, 0, 0), (0x35, 7, 0, 1 << 30), (0x15, 6, 0, sock),
       (0x15, 5, 0, 425), (0x15, 0, 3, pair), (0x20, 0, 0, 24), (0x54, 0, 0, 0xf), (0x15, 0, 1, 1),
       (0x06, 0, 0, 0x7fff0000), (0x06, 0, 0, 0x50001)]  # (op, jump if, jump if not, k); nr @0, arch @4, args[1] @24
prog = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in bpf))
check(libc.prctl(22, 2, struct.pack("HxxxxxxP", len(bpf), ctypes.addressof(prog)), 0, 0))  # SECCOMP_MODE_FILTER
os.write(1, b"\\0")  # the walls stand: what follows is the model's; a refusal above never starts with this byte
exec(compile(code, "main.py", "exec"), {"__name__": "__main__"})
"""
LANDLOCK_ABI_MAX = 1 << 20  # tests lower it to play an older kernel
_calls, _uids = itertools.count(), set()  # throwaway uids of this process's live calls: two calls never share one


async def run_tool(code: str, *, timeout_s: float = 5.0, memory_mb: int = 256, max_procs: int = 16,
                   max_output: int = 4096, unsafe: bool = False) -> tuple[bool, str]:
    """Run untrusted Python `code` in a locked-down subprocess; return (ok, observation text). Writes are capped at
    memory_mb in all. Raises RuntimeError naming what is missing where a wall can't be built, unless `unsafe`."""
    # RLIMIT_NPROC is never enforced for uid 0 and counts every process of a uid, so as root each call gets a throwaway
    # uid: pid-derived (ranks never share one), the least recently used (a killed process counts until it is reaped).
    start = next(_calls)
    ring = [(1 << 20) + (os.getpid() << 8) + (start + i) % 256 for i in range(256)]  # least recently used first
    uid = next((u for u in ring if u not in _uids), None) if os.geteuid() == 0 else -1
    if uid is None:
        raise RuntimeError("256 tool calls are running in this process: no throwaway uid is free")
    with tempfile.TemporaryDirectory(prefix="nanomolt_tool_", ignore_cleanup_errors=True) as tmp, \
            contextlib.ExitStack() as held:
        _uids.add(uid)
        held.callback(_uids.discard, uid)  # released once the call is over and its processes are dead
        Path(tmp, "main.py").write_text(code)
        if uid >= 0:
            os.chown(tmp, uid, uid)
        # -I -S: ignore PYTHON* variables, cwd and site-packages; -u: keep prints and tracebacks in order.
        args = map(str, (uid, memory_mb, max_procs, int(timeout_s) + 2, os.getpid(), LANDLOCK_ABI_MAX, int(unsafe)))
        # our own pipe: asyncio's proc.wait() also waits for the pipes it made, which a background child may hold open
        rfd, wfd = os.pipe()
        out = open(rfd, "rb", buffering=0)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", "-u", "-c", _PRELUDE, *args, cwd=tmp, env={}, stdout=wfd, stderr=wfd,
                stdin=asyncio.subprocess.DEVNULL, close_fds=True, start_new_session=True)  # one killpg reaches forks
        finally:
            os.close(wfd)  # else we would never see EOF
        stream = asyncio.StreamReader()
        pipe, _ = await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stream), out)
        half = max_output // 2
        head = tail = b""  # the first half + 1 bytes (+ 1: the prelude's byte that says the walls stand), the last half
        total = 0

        async def drain():  # keep the first and last max_output/2 bytes, drop the middle as it streams by
            nonlocal head, tail, total
            while chunk := await stream.read(1 << 16):
                total += len(chunk)
                keep = max(half + 1 - len(head), 0)
                head += chunk[:keep]
                tail = (tail + chunk[keep:])[-half:]
        reader, timed_out = asyncio.ensure_future(drain()), False
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:  # unless it ended meanwhile: a loop busy past the deadline sees both at once
            timed_out = proc.returncode is None
        finally:  # runs on success, timeout and cancellation alike: nothing may outlive the main process
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)  # the group leader can't leave it; its forks die with the pid ns
            await proc.wait()
            # EOF comes once every writer is dead; without a pid namespace an escapee from the group may hold it: 1 s
            await asyncio.wait([reader], timeout=1.0)
            reader.cancel()
            pipe.close()
    marker = 1 if head.startswith(b"\0") else 0  # the prelude's byte, not the model's output: the walls stand
    cut = b"\n... [output truncated] ...\n" if total - marker > 2 * half else b""
    text = (head[marker:] + cut + tail).decode(errors="replace")
    if not (marker or timed_out):  # the prelude stopped before the model's code: a wall is missing, or its setup failed
        raise RuntimeError(f"tool sandbox: {text.strip()}")
    if timed_out:
        return False, f"error: timed out after {timeout_s}s\n{text}"
    rc = proc.returncode  # < 0: a signal, e.g. SIGKILL from RLIMIT_CPU, SIGXFSZ from RLIMIT_FSIZE, SIGABRT
    if rc == 0:
        return True, text
    error = f"exit code {rc}" if rc > 0 else f"killed by signal {-rc} ({signal.strsignal(-rc)})"
    return False, f"error: {error}\n{text}"


def openai_client(llm):
    """An `openai.AsyncOpenAI` on this episode's endpoint, for chat agents. verify=False: the endpoint is plain HTTP
    on loopback, and a default client loads the CA certificates (blocking the rollout's loop) each time one is made."""
    import openai  # here: only chat agents need it
    # no client timeout: the episode's is episode_timeout
    return openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0, timeout=None,
                              http_client=openai.DefaultAsyncHttpxClient(verify=False))


AGENTS_DIR = Path(__file__).with_name("agents")  # the built-in tasks: agent files, as a user writes one


@functools.lru_cache(maxsize=16)
def load_agent(name: str):
    """`run` of an agent file (a path, or a name in agents/): `async def run(task, llm)` -> an Episode or a reward."""
    path = AGENTS_DIR / f"{name}.py"
    if not path.is_file():
        path = Path(name)
    if not path.is_file():
        builtin = ", ".join(sorted(p.stem for p in AGENTS_DIR.glob("*.py")))
        raise FileNotFoundError(f"agent {name!r} is neither a task in agents/ ({builtin}) nor an existing file")
    run = runpy.run_path(str(path), run_name=f"nanomolt_agent_{path.stem}").get("run")
    if not inspect.iscoroutinefunction(run):
        raise ValueError(f"agent file {name!r} does not define `async def run(task, llm)`")
    return run


@functools.lru_cache(maxsize=4)
def load_task_file(path: str) -> list[dict]:
    """JSONL, one JSON object per prompt, merged into its task dict; a bad line names the file and line."""
    rows = []
    for n, line in filter(lambda nl: nl[1].strip(), enumerate(Path(path).read_text().splitlines(), 1)):  # not blank
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no tasks in the file")
    return rows


def make_task(name_or_path: str, index: int, *, seed: int, group_size: int, guess_max: int = 7, max_turns: int = 3,
              tool_timeout: float = 5.0, tool_memory_mb: int = 256, task_file: str = "", **knobs) -> dict:
    """The task dict of episode `index`. A pure function of (seed, index): a resumed run continues the same stream."""
    group = index // group_size  # a group shares one prompt, so its baseline compares like with like
    rng = random.Random(seed * 1_000_003 + group)
    # Every field is drawn for every task, left to right (seed last: for user agents' own draws): none shifts another
    task = dict(knobs, task=name_or_path, index=index, group=group, guess_max=guess_max, max_turns=max_turns,
                tool_timeout=tool_timeout, tool_memory_mb=tool_memory_mb, secret=rng.randint(1, guess_max),
                a=rng.randint(1, 9), b=rng.randint(1, 9), c=rng.randint(1, 9), seed=rng.getrandbits(32))
    rows = load_task_file(task_file) if task_file else [{}]  # a data set: its rows, one per group, override the draws
    return task | rows[group % len(rows)]
