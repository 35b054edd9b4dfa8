"""The tool sandbox turns hangs, crashes, memory blow-ups, fork bombs and escapes into error observations."""

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tools.sandbox as sandbox  # noqa: E402
from tools.sandbox import run_tool  # noqa: E402

ROOT = os.geteuid() == 0
LANDLOCK = ctypes.CDLL(None, use_errno=True).syscall(444, None, 0, 1) >= 1  # same probe as the prelude


def run(code, **kw):
    return asyncio.run(run_tool(code, **kw))


def alive_with_comm(marker):
    """Pids of live (non-zombie) processes whose name is `marker`, found by scanning /proc."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text()
        except (OSError, ValueError):
            continue
        name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
        if name == marker and state != "Z":
            pids.append(int(d.name))
    return pids


def test_normal_code_returns_its_output():
    assert run("print(sum(range(10)))") == (True, "45\n")


def test_files_inside_the_temp_dir_work_and_the_dir_is_removed():
    ok, out = run("import os\nopen('f.txt', 'w').write('hi')\nprint(open('f.txt').read(), os.getcwd())")
    assert ok, out
    text, cwd = out.split()
    assert text == "hi" and not Path(cwd).exists()


def test_exception_is_an_error_with_the_traceback():
    ok, out = run("print('before')\nraise ValueError('boom')")
    assert not ok and out.startswith("error: exit code 1")
    assert out.index("before") < out.index("ValueError: boom")  # stdout and stderr merged in order


def test_crash_by_signal_is_an_error():
    ok, out = run("import os; os.abort()")
    assert not ok and out.startswith("error: killed by signal 6")


def test_sleep_is_cut_at_the_time_limit():
    t0 = time.monotonic()
    ok, out = run("print('started')\nimport time; time.sleep(100)", timeout_s=1.0)
    assert time.monotonic() - t0 < 1.0 + 2.0
    assert not ok and out.startswith("error: timed out after 1.0s") and "started" in out



def test_code_that_ended_in_time_is_not_called_timed_out_when_the_event_loop_ran_late():
    """The rollout's loop is shared with the engine and every agent: busy past a call's deadline (tests/soak_agent.py
    saw it under load), it must still report the crash that ended the code before the deadline, not a time-out."""
    async def main():
        async def busy():  # from 0.3 s to 2.3 s: the code aborts at ~0.5 s, the deadline is at 1 s
            await asyncio.sleep(0.3)
            time.sleep(2.0)
        (ok, out), _ = await asyncio.gather(run_tool("import os, time\ntime.sleep(0.5)\nos.abort()", timeout_s=1.0),
                                            busy())
        return ok, out
    ok, out = asyncio.run(main())
    assert not ok and out.startswith("error: killed by signal 6"), out

def test_memory_hog_fails_with_an_error():
    ok, out = run("x = bytearray(2 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert not ok and "MemoryError" in out and "allocated" not in out


BOMB = """
import ctypes, os, time
ctypes.CDLL(None).prctl(15, b"{marker}")  # PR_SET_NAME, inherited by every fork
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(100)
            os._exit(0)
        n += 1
except OSError:
    print("fork refused after", n)
time.sleep(100)
"""
ESCAPE = """
import ctypes, os, time
ctypes.CDLL(None).prctl(15, b"{marker}")
for _ in range(3):
    if os.fork() == 0:
        os.setsid()  # new session and process group: killpg on the parent's group misses it
        time.sleep(100)
print("forked")
"""


def test_fork_bomb_is_capped_and_leaves_no_processes():
    marker = f"nmbomb{os.getpid() % 10**6}"
    ok, out = run(BOMB.format(marker=marker), timeout_s=1.5, max_procs=16)
    assert not ok and "timed out" in out
    assert "fork refused after" in out and 8 <= int(out.split()[-1]) < 16  # forks work, up to the limit
    assert alive_with_comm(marker) == []


def test_children_that_leave_the_process_group_are_killed_too():
    marker = f"nmsetsid{os.getpid() % 10**6}"
    assert run(ESCAPE.format(marker=marker)) == (True, "forked\n")
    assert alive_with_comm(marker) == []


def test_children_that_leave_the_process_group_die_with_the_caller():
    # kill -9 of the caller (the rollout): no killpg runs, the tool's death alone must take its escaped children along
    marker = f"nmorph{os.getpid() % 10**6}"
    code = ESCAPE.format(marker=marker).replace('print("forked")', 'print("forked")\ntime.sleep(100)')
    caller = subprocess.Popen([sys.executable, "-c", f"import asyncio\nfrom tools.sandbox import run_tool\nasyncio.run(run_tool({code!r}, "
                               "timeout_s=100))"], env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    try:
        deadline = time.monotonic() + 30
        while len(alive_with_comm(marker)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(alive_with_comm(marker)) == 4, "the tool and its 3 children never started"
    finally:
        caller.kill()
        caller.wait()
    deadline = time.monotonic() + 10
    while alive_with_comm(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive_with_comm(marker) == []


def test_bytes_written_are_capped_per_call():
    # each file stays under RLIMIT_FSIZE (memory_mb); together they are 2.5 times the call's quota
    code = """
chunk = b"x" * (1 << 20)
for i in range(4):
    with open(f"f{i}", "wb") as f:
        for _ in range(40):
            f.write(chunk)
print("WRO" + "TE")
"""
    ok, out = run(code, memory_mb=64)
    assert not ok and "No space left on device" in out and "WROTE" not in out


@pytest.mark.skipif(not ROOT, reason="throwaway uids are allocated only as root")
def test_a_uid_is_never_shared_by_two_live_calls():
    marker = f"nmslow{os.getpid() % 10**6}"

    async def wrap():
        slow = asyncio.ensure_future(run_tool(f"import ctypes, time; ctypes.CDLL(None).prctl(15, b'{marker}'); "
                                              "time.sleep(300)", timeout_s=300))
        while not (pids := alive_with_comm(marker)):
            await asyncio.sleep(0.05)
        uid, limit = os.stat(f"/proc/{pids[0]}").st_uid, asyncio.Semaphore(8)

        async def quick():
            async with limit:
                return await run_tool("import os; print(os.getuid())")
        quick = await asyncio.gather(*[quick() for _ in range(300)])  # more calls than a process has uids
        alive = not slow.done()
        slow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await slow
        return uid, alive, quick, slow

    uid, alive, quick, slow = asyncio.run(wrap())
    assert alive, slow.result()  # no other call's end killed it
    assert all(ok for ok, _ in quick) and uid not in {int(out) for _, out in quick}
    assert alive_with_comm(marker) == []


@pytest.mark.parametrize("abi, missing", [(5, "Landlock ABI 5 < 6"), (0, "no Landlock")])
def test_a_missing_wall_is_refused_naming_it_and_the_opt_out(abi, missing, monkeypatch):
    monkeypatch.setattr(sandbox, "LANDLOCK_ABI_MAX", abi)  # play an older kernel
    with pytest.raises(RuntimeError) as e:
        run("print('RAN')")
    assert missing in str(e.value) and "sandbox_unsafe" in str(e.value)
    assert run("print('RAN')", unsafe=True) == (True, "RAN\n")  # the explicit opt-out runs it without that wall


def test_huge_output_is_capped():
    ok, out = run("print('a' * 10_000_000, end='')\nprint('END')", max_output=4096)
    assert ok and "... [output truncated]" in out
    assert len(out) < 4096 + 100 and out.startswith("aaa") and out.endswith("END\n")


def test_parent_environment_is_not_visible():
    os.environ["NANOMOLT_SECRET"] = "x"
    try:
        ok, out = run("import os; print(os.environ.get('NANOMOLT_SECRET'))")
    finally:
        del os.environ["NANOMOLT_SECRET"]
    assert (ok, out) == (True, "None\n")


@pytest.mark.skipif(not (ROOT or LANDLOCK), reason="needs Landlock (Linux >= 5.13) or root")
def test_cannot_write_outside_its_temp_dir():
    probe = Path(f"/tmp/nanomolt_sandbox_probe_{os.getpid()}")
    ok, out = run(f"open({str(probe)!r}, 'w').write('x')")
    assert not ok and "PermissionError" in out
    assert not probe.exists()


def test_cannot_use_the_parents_open_fds():
    with open(__file__) as f:
        ok, out = run(f"import os; os.fstat({f.fileno()}); print('LEAK' + 'ED')")
    assert not ok and "Bad file descriptor" in out and "LEAKED" not in out


def test_calls_run_concurrently():
    """Eight tools, each reporting when its own code started and ended: all eight were running at one moment (not a
    wall-clock bound, which 8 interpreters starting on 2 busy cores may miss)."""
    code = "import time; t = time.time(); time.sleep(2); print({i}, t, time.time())"

    async def many():
        return await asyncio.gather(*[run_tool(code.format(i=i)) for i in range(8)])
    results = asyncio.run(many())
    assert all(ok for ok, _ in results) and [int(out.split()[0]) for _, out in results] == list(range(8))
    starts, ends = zip(*[map(float, out.split()[1:]) for _, out in results])
    assert max(starts) < min(ends), (starts, ends)  # one after another, each would start after the last ended


# ---- escapes: no network of any kind, reads only from the tool's dir, its Python and system libraries ----
def test_harmless_code_still_works():
    code = """
import asyncio, json, math, os
open("out.json", "w").write(json.dumps({"pi": round(math.pi, 3)}))
asyncio.run(asyncio.sleep(0))  # the event loop's self-pipe is a socketpair: that one still works
print(json.load(open("out.json"))["pi"], sorted(os.listdir(".")), sum(i * i for i in range(10)))
"""
    assert run(code) == (True, "3.142 ['main.py', 'out.json'] 285\n")


def test_cannot_connect_to_a_tcp_port_on_loopback():
    with socket.create_server(("127.0.0.1", 0)) as srv:
        ok, out = run(f"import socket; socket.create_connection(('127.0.0.1', {srv.getsockname()[1]}), 2); "
                      "print('CONN' + 'ECTED')")
        srv.setblocking(False)
        with pytest.raises(BlockingIOError):
            srv.accept()[0].close()  # nothing reached the listener
    assert not ok and "CONNECTED" not in out and "Error" in out


@pytest.mark.parametrize("kind", ["udp", "unix_stream", "unix_dgram", "socketpair_dgram"])
def test_cannot_send_udp_or_reach_a_unix_socket(kind, tmp_path):
    tmp_path.chmod(0o755)  # so file permissions are not what stops it
    if kind == "udp":
        srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        srv.bind(("127.0.0.1", 0))
        code = f"import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'hi', {srv.getsockname()})"
    else:
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM if kind == "unix_stream" else socket.SOCK_DGRAM)
        srv.bind(str(tmp_path / "s.sock"))
        os.chmod(tmp_path / "s.sock", 0o777)
        code = {"unix_stream": f"import socket; socket.socket(socket.AF_UNIX).connect({str(tmp_path / 's.sock')!r})",
                "unix_dgram": "import socket; socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)"
                              f".sendto(b'hi', {str(tmp_path / 's.sock')!r})",
                "socketpair_dgram": "import socket; a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
                                    f"a.sendto(b'hi', {str(tmp_path / 's.sock')!r})"}[kind]
    with srv:
        if kind == "unix_stream":
            srv.listen()
        ok, out = run(code + "\nprint('SE' + 'NT')")
        srv.setblocking(False)
        with pytest.raises(BlockingIOError):
            srv.accept() if kind == "unix_stream" else srv.recv(10)  # nothing arrived
    assert not ok and "SENT" not in out and "Error" in out


@pytest.fixture
def secret(tmp_path):
    """A root-owned (when root) 0600 file outside the tool's dir: (path, its content)."""
    path, text = tmp_path / "secret.txt", f"s3cret-{os.getpid()}"
    path.write_text(text)
    path.chmod(0o600)
    return path, text


@pytest.mark.skipif(not LANDLOCK, reason="a read allowlist needs Landlock (Linux >= 5.13)")
@pytest.mark.parametrize("target", ["/etc/shadow", "secret", "train.py", "/proc/{pid}/environ", "/proc/{pid}/cmdline"])
def test_cannot_read_files_outside_the_allowlist(target, secret):
    path = {"secret": str(secret[0]), "train.py": str(Path(__file__).parents[1] / "train.py")}.get(target, target)
    path = path.format(pid=os.getpid())
    if not Path(path).exists():
        pytest.skip(f"{path} does not exist here")
    ok, out = run(f"print(repr(open({path!r}, 'rb').read()[:200]))")
    assert not ok and "PermissionError" in out and secret[1] not in out and "import" not in out


@pytest.mark.skipif(not LANDLOCK, reason="a read allowlist needs Landlock (Linux >= 5.13)")
@pytest.mark.parametrize("target", ["/root", "tmp_path", "/"])
def test_cannot_list_directories_outside_the_allowlist(target, tmp_path, secret):
    path = str(tmp_path) if target == "tmp_path" else target
    ok, out = run(f"import os; print(os.listdir({path!r}))")
    assert not ok and "PermissionError" in out and "secret.txt" not in out


@pytest.mark.skipif(not (ROOT and LANDLOCK), reason="CAP_DAC_READ_SEARCH (open_by_handle_at) is kept only as root")
def test_cannot_open_a_file_by_handle(secret):
    """The classic escape with CAP_DAC_READ_SEARCH: a file handle opens a file without walking its path. The handle
    is decoded against a mount fd on the secret's own filesystem (a directory the tool may read: its Python's), so
    that only Landlock stands in the way (EACCES); a mount fd on another filesystem fails with ESTALE whatever the
    sandbox does."""
    code = f"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)

def handle_of(path):
    handle, mount_id = ctypes.create_string_buffer(136), ctypes.c_int()
    handle[0] = 128  # handle_bytes
    assert libc.name_to_handle_at(-100, path.encode(), handle, ctypes.byref(mount_id), 0) == 0, ctypes.get_errno()
    return handle, mount_id.value

handle, mount = handle_of({str(secret[0])!r})
readable = os.path.dirname(sys.executable)
assert handle_of(readable)[1] == mount, "the mount fd must be on the secret's filesystem"
fd = libc.open_by_handle_at(os.open(readable, os.O_RDONLY), handle, os.O_RDONLY)
if fd < 0: raise OSError(ctypes.get_errno(), "open_by_handle_at")
print(os.read(fd, 100))
"""
    ok, out = run(code)
    assert not ok and "PermissionError: [Errno 13]" in out and secret[1] not in out, out


SYSCALLS = {"x86_64": (41, 425), "aarch64": (198, 425)}.get(os.uname().machine)  # socket, io_uring_setup


@pytest.mark.skipif(SYSCALLS is None, reason=f"no syscall numbers here for {os.uname().machine}")
def test_raw_socket_and_io_uring_syscalls_fail():
    # io_uring can open and connect sockets itself (IORING_OP_SOCKET), so setting one up is refused too.
    code = f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
for args in [({SYSCALLS[0]}, 2, 1, 0), ({SYSCALLS[1]}, 8, None)]:
    print(libc.syscall(*args), ctypes.get_errno())
"""
    assert run(code) == (True, "-1 1\n-1 1\n")  # EPERM both times


def test_tool_runs_in_its_own_network_namespace():
    marker = f"nmnetns{os.getpid() % 10**6}"

    async def look():
        task = asyncio.ensure_future(run_tool(f"import ctypes, time; ctypes.CDLL(None).prctl(15, b'{marker}'); "
                                              "time.sleep(3)"))
        for _ in range(50):
            await asyncio.sleep(0.1)
            if pids := alive_with_comm(marker):
                return os.readlink(f"/proc/{pids[0]}/ns/net"), await task
        return None, await task

    netns, (ok, _) = asyncio.run(look())
    assert ok and netns is not None and netns != os.readlink("/proc/self/ns/net")


NOBODY_PYTHON = next((p for p in ["/usr/bin/python3", "/usr/local/bin/python3"] if os.access(p, os.X_OK)), None)


@pytest.mark.skipif(not (ROOT and NOBODY_PYTHON), reason="needs root to become nobody and a Python nobody can run")
def test_as_a_non_root_user_the_sandbox_still_holds():
    # The uid -1 path: run_tool's own code (tools/sandbox.py, as source: nobody may not read the checkout) under a
    # system Python as nobody, beside 20 threads as a trainer has: the tool gets a user, network, mount and pid
    # namespace of its own where the kernel allows them unprivileged, and is refused where it does not.
    userns = subprocess.run([NOBODY_PYTHON, "-I", "-c", "import ctypes; exit(ctypes.CDLL(None).unshare(0x50000000))"],
                            user=65534, group=65534, extra_groups=[]).returncode == 0  # CLONE_NEWUSER | NEWNET
    abi = ctypes.CDLL(None, use_errno=True).syscall(444, None, 0, 1)
    src = (Path(__file__).parents[1] / "tools" / "sandbox.py").read_text()
    tools = src[:src.index('if __name__ == "__main__":')]
    public, bomb, escape = Path(tempfile.mkdtemp(prefix="nanomolt_public_")), *(f"nm{k}{os.getpid() % 10**6}" for k in "be")
    try:
        public.chmod(0o755)
        (public / "notes.txt").write_text("public-but-not-for-tools")
        (public / "notes.txt").chmod(0o644)
        with socket.create_server(("127.0.0.1", 0)) as srv:
            probes = {"print": "print(6 * 7)",
                      "tcp": f"import socket; socket.create_connection(('127.0.0.1', {srv.getsockname()[1]}), 2)",
                      "read": f"print(open({str(public / 'notes.txt')!r}).read())",
                      "write": f"open({str(public / 'w.txt')!r}, 'w')",
                      "signal the caller": "import os; os.kill(os.getppid(), 0)",
                      "netns": "import os; print(os.readlink('/proc/self/ns/net'))",
                      "bomb": BOMB.format(marker=bomb), "escape": ESCAPE.format(marker=escape)}
            driver = f"""
import asyncio, contextlib, itertools, json, math, os, signal, sys, tempfile, threading, time
from pathlib import Path
{tools}
for _ in range(20):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print(open({str(public / 'notes.txt')!r}).read())  # nobody itself can read it: only the sandbox stops the tool
print(os.readlink('/proc/self/ns/net'))
out = {{}}
for k, c in {probes!r}.items():
    try:
        out[k] = asyncio.run(run_tool(c, timeout_s=2.0))
    except RuntimeError as e:
        out[k] = ["refused", str(e)]
print(json.dumps(out))
"""
            res = subprocess.run([NOBODY_PYTHON, "-I", "-c", driver], user=65534, group=65534, extra_groups=[],
                                 cwd="/", capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(public)
    assert res.returncode == 0, res.stderr
    first, netns, last = res.stdout.splitlines()
    out = json.loads(last)
    assert first == "public-but-not-for-tools" and alive_with_comm(bomb) == alive_with_comm(escape) == []
    if not (userns and abi >= 6):  # a wall is missing: every call refused, naming it and the opt-out
        assert all(ok == "refused" and "sandbox_unsafe" in text for ok, text in out.values()), out
        return
    assert out["print"] == [True, "42\n"] and out["escape"] == [True, "forked\n"]
    assert not out["tcp"][0] and "PermissionError" in out["tcp"][1]
    assert not out["read"][0] and "public-but" not in out["read"][1] and not out["write"][0], out
    # Landlock's signal scope: the tool can't signal processes outside its domain, its caller included
    assert not out["signal the caller"][0] and "PermissionError" in out["signal the caller"][1]
    assert out["netns"][0] and out["netns"][1].strip() != netns  # a network namespace of its own, without root
    assert "fork refused after" in out["bomb"][1] and 8 <= int(out["bomb"][1].split()[-1]) < 16  # the caller's
    # threads do not count against the tool's process limit


@pytest.mark.skipif(not LANDLOCK, reason="a read allowlist needs Landlock (Linux >= 5.13)")
def test_its_own_proc_entry_stays_readable():
    # tests/soak_agent.py's escape check lists the tool's fds this way; the environment it sees is empty anyway
    ok, out = run("import os; print(sorted(os.listdir('/proc/self/fd'))[:3], repr(open('/proc/self/environ').read()))")
    assert (ok, out) == (True, "['0', '1', '2'] ''\n")
