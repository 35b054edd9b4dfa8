import os
import subprocess

import pytest

import agent

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL = {}  # --install-servers: the background install's process and log


def pytest_addoption(parser):
    parser.addoption("--install-servers", action="store_true",
                     help="install the CLI harnesses, verifiers, vLLM and SGLang (tests/install_*.sh) in the background "
                          "while the other tests run; the server tests (tests/test_servers.py, run last) wait for it")


def pytest_configure(config):
    if config.getoption("--install-servers"):
        INSTALL["log"] = os.path.join(ROOT, ".venv-install.log")
        # niced: the tests running meanwhile keep the cores (on 2 cores, the calc warm-start run took 423 s beside a
        # normal-priority install, 204 s alone); the server tests run last and wait for it
        with open(INSTALL["log"], "wb") as log:
            cmd = ("nice -n 19 bash -c 'bash tests/install_harnesses.sh && bash tests/install_verifiers.sh && "
                   "bash tests/install_vllm.sh && bash tests/install_sglang.sh'")
            INSTALL["proc"] = subprocess.Popen(cmd, shell=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL)


def pytest_collection_modifyitems(items):
    # stable: the tests that wait for the background install last (the servers' the very last), all else as is
    items.sort(key=lambda item: {"test_verifiers.py": 1, "test_servers.py": 2}.get(item.path.name, 0))


def pytest_unconfigure(config):
    if "proc" in INSTALL:  # no run leaves an install behind, half done
        INSTALL["proc"].wait()


@pytest.fixture(scope="session")
def servers_installed():
    """Waits for --install-servers' install (nothing without it); a failed install fails every test that asked."""
    if "proc" in INSTALL and INSTALL["proc"].wait() != 0:
        tail = open(INSTALL["log"], errors="replace").read()[-3000:]
        pytest.fail(f"the server install failed (exit code {INSTALL['proc'].returncode}); {INSTALL['log']}:\n{tail}")


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """The tokenizer made here from scratch (agent.make_tokenizer), shared by every test that needs one."""
    from transformers import AutoTokenizer
    path = tmp_path_factory.mktemp("tok")
    agent.make_tokenizer(str(path))
    return AutoTokenizer.from_pretrained(str(path))
