"""The tool sandbox turns hangs, crashes, memory blow-ups and fork bombs into error observations."""

import asyncio
import ctypes
import os
import socket
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from agent import run_tool  # noqa: E402

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


def test_memory_hog_fails_with_an_error():
    ok, out = run("x = bytearray(2 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert not ok and "MemoryError" in out and "allocated" not in out


def test_fork_bomb_is_capped_and_leaves_no_processes():
    marker = f"nmbomb{os.getpid() % 10**6}"
    code = f"""
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
    ok, out = run(code, timeout_s=1.5, max_procs=16)
    assert not ok and "timed out" in out
    assert "fork refused after" in out and int(out.split()[-1]) < 16
    assert alive_with_comm(marker) == []


@pytest.mark.skipif(not ROOT, reason="escaping the process group is only reaped when running as root")
def test_children_that_leave_the_process_group_are_killed_too():
    marker = f"nmsetsid{os.getpid() % 10**6}"
    code = f"""
import ctypes, os, time
ctypes.CDLL(None).prctl(15, b"{marker}")
for _ in range(3):
    if os.fork() == 0:
        os.setsid()  # new session and process group: killpg on the parent's group misses it
        time.sleep(100)
print("forked")
"""
    ok, out = run(code)
    assert ok and out == "forked\n"
    assert alive_with_comm(marker) == []


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
    async def many():
        return await asyncio.gather(*[run_tool(f"import time; time.sleep(1); print({i})") for i in range(8)])

    t0 = time.monotonic()
    results = asyncio.run(many())
    assert results == [(True, f"{i}\n") for i in range(8)]
    assert time.monotonic() - t0 < 4.0  # sequentially this would take 8 s


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
    # The classic escape with CAP_DAC_READ_SEARCH: a file handle opens a file without walking its path.
    code = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
handle, mount_id = ctypes.create_string_buffer(136), ctypes.c_int()
handle[0] = 128  # handle_bytes
assert libc.name_to_handle_at(-100, {str(secret[0]).encode()!r}, handle, ctypes.byref(mount_id), 0) == 0
fd = libc.open_by_handle_at(os.open('.', os.O_RDONLY), handle, os.O_RDONLY)  # any fd on the same mount (/tmp)
if fd < 0: raise OSError(ctypes.get_errno(), "open_by_handle_at")
print(os.read(fd, 100))
"""
    ok, out = run(code)
    assert not ok and "Error" in out and secret[1] not in out
