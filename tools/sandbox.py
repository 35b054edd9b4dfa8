"""tools/sandbox.py: model-written code run in a locked-down subprocess, `ok, text = await run_tool(code)`: what
agents give their tools (agents/calc.py, agents/mini_swe.py). The standard library only, so that an agent program in
any environment can import it. `python tools/sandbox.py [CODE]` runs CODE (by default a print) once and shows the
result: whether this machine can build every wall (docs/faults.md#the-tool-sandbox)."""
import asyncio
import contextlib
import itertools
import os
import signal
import sys
import tempfile
from pathlib import Path

# The child locks itself down in this prelude and only then runs the model's code (main.py in its cwd).
# We do not use preexec_fn: it runs Python between fork and exec, which can deadlock in a threaded
# parent (and the rollout process has threads); the prelude runs in a fresh single-threaded interpreter.
_PRELUDE = """
import ctypes, os, resource, select, struct, sys

uid, mem, nproc, cpu, parent, abi_max, unsafe = map(int, sys.argv[1:8])
sys.argv = ["main.py"]
libc = ctypes.CDLL(None, use_errno=True)


def check(r):
    if r < 0:
        raise OSError(ctypes.get_errno(), "sandbox setup failed")


check(libc.prctl(38, 1, 0, 0, 0))  # PR_SET_NO_NEW_PRIVS: needed by Landlock and seccomp; exec can't regain privileges
me, gid = os.getuid(), os.getgid()
code = open("main.py", "rb").read()
# Its own network (no loopback even), mount (the quota) and pid namespaces; without root, a user namespace grants them
err = libc.unshare(0x40000000 | 0x20000 | 0x20000000 | (uid < 0) << 28) and os.strerror(ctypes.get_errno())
abi = min(libc.syscall(444, None, 0, 1), abi_max)  # landlock_create_ruleset(VERSION); < 0 on kernels without Landlock
missing = [f"no user/network/pid namespace (unshare: {err})"] * bool(err) + ["no Landlock: files unfenced"] * (abi < 1)
missing += [f"Landlock ABI {abi} < 6 (Linux 6.12): signals to the trainer are not scoped"] * (1 <= abi < 6)
if missing and not unsafe:
    sys.exit("; ".join(missing) + ". sandbox_unsafe=True runs tool code without it anyway")
if not err:  # without root: its ids mapped to themselves, RLIMIT_NPROC counts this namespace's, caps dropped below
    for f, m in [("setgroups", "deny"), ("uid_map", f"{me} {me} 1"), ("gid_map", f"{gid} {gid} 1")] * (uid < 0):
        open(f"/proc/self/{f}", "w").write(m)
    check(libc.mount(None, b"/", None, 1 << 14 | 1 << 18, None))  # MS_REC | MS_PRIVATE: nothing propagates out
    opts = b"size=%dm,nr_inodes=4096,mode=777" % mem  # the disk quota; 777: only this call's processes see it
    check(libc.mount(b"tmpfs", os.getcwd().encode(), b"tmpfs", 6, opts))  # MS_NOSUID | MS_NODEV
    os.chdir(os.getcwd())
    open("main.py", "wb").write(code)
    pfd = os.pidfd_open(os.getpid())  # the pid namespace's init exits with us, and the kernel then kills all in it;
    if os.fork() == 0:  # it waits on a pidfd: a PDEATHSIG from us would be refused (our new uid, Landlock's scope)
        select.select([pfd], [], [])
        os._exit(0)
    os.close(pfd)  # the model's code sees no fds but 0, 1, 2
if abi >= 1:  # Landlock (Linux >= 5.13): writes only in the cwd; reads only there, in the Python it runs, system libs
    fs = (1 << 13) - 1 | (abi >= 2) << 13 | (abi >= 3) << 14 | (abi >= 5) << 15  # every fs right this ABI knows
    # (fs rights, TCP bind+connect from ABI 4: all denied, scoped from ABI 6: abstract unix sockets and signals)
    fd = libc.syscall(444, struct.pack("3Q", fs, 3 * (abi >= 4), 3 * (abi >= 6)), 24, 0)
    check(fd)
    libs = [*sys.path, sys.executable, "/lib", "/lib64", "/usr/lib", "/usr/lib64", "/etc/ld.so.cache", "/dev/urandom",
            f"/proc/{os.getpid()}"]  # its own /proc/self, not other processes' (main.py runs in this process)
    for p, r in [(".", fs), ("/dev/null", 0xc006), *((p, 0b1101) for p in libs if os.path.exists(p))]:
        r &= fs & (-1 if os.path.isdir(p) else 0xc007)  # a file takes file rights only: exec, r/w, truncate, ioctl
        o = os.open(p, os.O_PATH)
        check(libc.syscall(445, fd, 1, struct.pack("=Qi", r, o), 0))
        os.close(o)
    check(libc.syscall(446, fd, 0))
    os.close(fd)  # closed: the model's code must see no fds but 0, 1, 2
for res, n in [(resource.RLIMIT_AS, mem << 20), (resource.RLIMIT_FSIZE, mem << 20),
               (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_CORE, 0)]:  # cpu: backstop
    resource.setrlimit(res, (n, n))
if uid >= 0:  # drop root; keep CAP_DAC_READ_SEARCH (a Python under /root, pyenv) only where Landlock fences reads
    check(libc.prctl(8, 1, 0, 0, 0))  # PR_SET_KEEPCAPS
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
keep = (abi >= 1 and uid >= 0) << 2  # CAP_DAC_READ_SEARCH, effective and permitted; nothing inheritable
check(libc.capset(struct.pack("Ii", 0x20080522, 0), struct.pack("6I", keep, keep, 0, 0, 0, 0)))
check(libc.prctl(1, 9, 0, 0, 0))  # PR_SET_PDEATHSIG: SIGKILL when the caller dies (after setresuid: it clears it)
if os.getppid() != parent:  # the caller died before that line
    os._exit(137)
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


if __name__ == "__main__":
    print(asyncio.run(run_tool(sys.argv[1] if len(sys.argv) > 1 else "print('the walls stand')")))
