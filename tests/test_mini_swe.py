"""mini-swe-agent (agents/mini_swe.py), unchanged: its DefaultAgent and litellm model on the episode's endpoint, its
shell commands run in nanomolt's tool sandbox. Nothing here is mocked but the engine where a test needs a model that
writes a bash tool call (ScriptEngine); train.py runs the tiny random model."""
import asyncio
import base64
import io
import json
import os
import re
import runpy
import socket
import sys
import tarfile
import tempfile
import time
import traceback

import pytest
import torch
from test_endpoint import ScriptEngine, chat_episode, dense_engine
from test_rollout import collect
from test_train import ROOT, metrics, run_train

import config
import endpoint
from rollout import check_tokens

TASK = {"max_turns": 4, "tool_timeout": 10.0, "tool_memory_mb": 256}
SANDBOX_DIR = re.escape(os.path.join(tempfile.gettempdir(), "nanomolt_tool_")) + r"\w+/work"  # run_tool's own


@pytest.fixture(scope="module")
def mini():
    """The agent file's globals (its environment class, run)."""
    return runpy.run_path(os.path.join(ROOT, "agents", "mini_swe.py"), run_name="nanomolt_agent_mini_swe")


def execute(mini, commands, **env_config):
    """Each command through SandboxEnvironment.execute, called from a thread as the agent calls it, while the event
    loop runs -> (the outputs, the environment); an exception mini-swe-agent's flow uses (Submitted) is the output."""
    async def main():
        env = mini["SandboxEnvironment"](asyncio.get_running_loop(), **env_config)
        outputs = []
        for command in commands:
            try:
                outputs.append(await asyncio.to_thread(env.execute, {"command": command}))
            except Exception as e:
                outputs.append(e)
        return outputs, env
    return asyncio.run(main())


def files(env):
    """The paths in the episode's work/, read from its tar's index (nothing is unpacked)."""
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(env.tree))) as tar:
        return sorted(name.removeprefix("work/") for name in tar.getnames() if name != "work")


def test_commands_run_in_the_episodes_sandbox_and_nowhere_else(mini, tmp_path, monkeypatch):
    """A file a command writes is in the episode's tree (the next command sees it), not in the host's cwd; reads and
    writes outside the sandbox's directory, and the network, are refused; python runs there."""
    monkeypatch.chdir(tmp_path)
    escape = tmp_path / "escaped"
    outs, env = execute(mini, [
        "pwd", "echo made here > made.txt && mkdir -p pkg && echo x > pkg/deep.txt", "cat made.txt && ls",
        f"echo out > {escape}", "cat /etc/hostname", f"ls {ROOT}", "echo up > ../../up.txt",
        "python -c 'import socket; socket.create_connection((\"127.0.0.1\", 1))'",
        "python -c 'import os; print(os.getuid() != 0, os.getcwd())'", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"],
        timeout=10)
    where, made, seen, *escapes, py, submitted = outs
    assert where["returncode"] == 0 and re.fullmatch(SANDBOX_DIR + r"\n", where["output"]), where
    assert made["returncode"] == 0 and seen["returncode"] == 0, (made, seen)
    assert seen["output"] == "made here\nmade.txt\npkg\n"  # the earlier command's files, carried to this sandbox
    assert files(env) == ["made.txt", "pkg", "pkg/deep.txt"]
    assert os.listdir(tmp_path) == []  # nothing landed in the host's cwd
    for out in escapes:
        assert out["returncode"] != 0 and re.search("Permission denied|PermissionError", out["output"]), out
    assert not escape.exists() and not os.path.exists(os.path.join(tempfile.gettempdir(), "up.txt"))
    assert py["returncode"] == 0 and re.fullmatch(r"True " + SANDBOX_DIR + r"\n", py["output"]), py
    assert type(submitted).__name__ == "Submitted"  # mini-swe-agent's own way to end
    assert len(env.ran) == len(outs) and all(re.fullmatch(SANDBOX_DIR, cwd) for _, cwd in env.ran)


def test_a_command_past_its_timeout_is_killed_and_its_files_are_kept(mini):
    """As on the host (mini-swe-agent's LocalEnvironment): the command is killed, what it wrote stays."""
    t0 = time.monotonic()
    sleep = "python -c 'import time; time.sleep(60)'"
    commands = ["echo a > a.txt", f"echo b > b.txt; echo started; {sleep}", "cat a.txt b.txt"]
    outs, env = execute(mini, commands, timeout=2)
    assert time.monotonic() - t0 < 30
    assert outs[1]["returncode"] == -1 and "timed out" in outs[1]["exception_info"], outs[1]
    assert outs[1]["output"] == "started\n" and outs[2]["output"] == "a\nb\n" and files(env) == ["a.txt", "b.txt"]


def bash_call(command):
    """A bash tool call as the chat template writes it (and so as the endpoint parses it back)."""
    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    return f"<tool_call>\n{call}\n</tool_call><|im_end|>"


SUBMIT = bash_call("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")


@pytest.mark.parametrize("fix,reward", [("a + b", 1.0), ("a * b", 0.0)])
def test_a_scripted_episode_is_one_token_exact_segment_rewarded_by_the_check(mini, tok, tmp_path, monkeypatch, fix,
                                                                            reward):
    """mini-swe-agent's litellm model through the endpoint: each call extends the last (one segment, token-exact), the
    commands' output comes back as tool results, and the reward is the check run in the sandbox after the agent. Every
    connection made (litellm's among them, watched as they go through) is to this host."""
    monkeypatch.chdir(tmp_path)
    connect = socket.socket.connect
    addresses = []

    def watched(sock, address):
        addresses.append(address)
        return connect(sock, address)
    monkeypatch.setattr(socket.socket, "connect", watched)
    replies = [bash_call("pwd && cat sol.py"), bash_call(f"sed -i 's/a - b/{fix}/' sol.py && cat sol.py"), SUBMIT]
    llm, result = chat_episode(ScriptEngine(tok, replies), tok, lambda client, llm: mini["run"](TASK, llm))
    assert result == {"reward": reward, "info": {"calls": 3, "commands": 3, "submitted": 1.0}}
    [(ep, calls)] = endpoint.segments(llm, result)
    check_tokens(ep, calls)
    assert len(calls) == 3 and ep.info["tool_calls"] == 3 and ep.info["sampling_overridden"] == 0
    text = tok.decode(ep.ids)
    assert "You are a helpful assistant that can interact with a computer." in text  # mini-swe-agent's own prompt
    assert re.search(SANDBOX_DIR + r"\\ndef add\(a, b\):\\n    return a - b", text)  # the first command's output
    assert f"return {fix}" in text and os.listdir(tmp_path) == []
    assert addresses and all(a[0] in ("127.0.0.1", "::1") for a in addresses), addresses  # litellm's, kept alive


def test_a_reply_without_a_tool_call_is_a_format_error_and_a_new_segment(mini, tok):
    """mini-swe-agent drops a reply it cannot parse from its history and asks again: the next call does not extend
    it, so it starts a new segment (what the random model of the train.py test does every turn)."""
    replies = ["I will look around.<|im_end|>", bash_call("sed -i 's/a - b/a + b/' sol.py"), SUBMIT]
    llm, result = chat_episode(ScriptEngine(tok, replies), tok, lambda client, llm: mini["run"](TASK, llm))
    assert result == {"reward": 1.0, "info": {"calls": 3, "commands": 2, "submitted": 1.0}}
    segments = endpoint.segments(llm, result)
    assert [len(calls) for _, calls in segments] == [1, 2]
    for ep, calls in segments:
        check_tokens(ep, calls)
    assert "Tool call error" in tok.decode(segments[1][0].ids)


def processes_running(marker):
    """Pids of the processes (those in sandboxes too: their pid namespaces are below ours) whose command line holds
    marker."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            line = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:  # it ended meanwhile
            continue
        if marker.encode() in line:
            pids.append(pid)
    return pids


def agent_running():
    """A thread is inside mini-swe-agent's DefaultAgent.run."""
    return any(frame.f_code.co_filename.endswith(os.path.join("minisweagent", "agents", "default.py"))
               for top in sys._current_frames().values() for frame, _ in traceback.walk_stack(top))


def test_a_cancelled_episode_kills_its_command_and_its_thread_ends(mini, tok):
    """The episode timeout cancels run(): the sandboxed command in flight is killed and the agent's thread ends."""
    task = dict(TASK, tool_timeout=60.0)
    marker = f"mini_swe_{os.getpid()}_{time.monotonic_ns()}"
    engine = ScriptEngine(tok, [bash_call(f"python -c 'import time; time.sleep(60)' {marker}")] + [SUBMIT] * 3)

    async def cancel_soon(client, llm):
        episode = asyncio.ensure_future(mini["run"](task, llm))
        t0 = time.monotonic()
        while not processes_running(marker):  # the command has started in its sandbox
            assert time.monotonic() - t0 < 60 and not episode.done()
            await asyncio.sleep(0.1)
        assert agent_running()
        t0 = time.monotonic()
        episode.cancel()
        await asyncio.wait([episode])
        while processes_running(marker) or agent_running():
            assert time.monotonic() - t0 < 10, "still running 10 s after the cancellation"
            await asyncio.sleep(0.05)
        return episode
    llm, episode = chat_episode(engine, tok, cancel_soon)
    assert episode.cancelled() and len(llm.calls) == 1  # nothing asked the endpoint after it


def test_a_conversation_that_outgrows_the_engine_is_trained_as_truncated(tok):
    """The second call's prompt (~2,860 tokens: the first, ~2,680, and a format error) does not fit max_len: litellm
    raises ContextWindowExceededError from the endpoint's 400, mini-swe-agent re-raises it, and the rollout trains the
    episode as it stands (reward 0, truncated), as for any chat agent."""
    cfg = config.load(["--task=mini_swe", "--group_size=2", "--prompts_per_step=2", "--max_turns=3"])
    msgs = collect(cfg, dense_engine(tok, max_len=2760), tok, 4)  # produce() ran check_tokens on each
    assert len(msgs) >= 4 and all(m["reward"] == 0.0 and m["info"]["truncated"] == 1 for m in msgs)
    for m in msgs:
        assert torch.equal(m["ids"][m["loss_mask"].bool()], m["engine_ids"]) and len(m["ids"]) <= 2760
        assert tok.decode(m["ids"]).count("<|im_start|>assistant") == 1 and m["info"]["segments"] == 1


def test_litellm_uses_its_local_cost_map(mini):
    """No network: litellm's model cost map is its packaged copy, never fetched."""
    from litellm.litellm_core_utils.get_model_cost_map import get_model_cost_map_source_info
    info = get_model_cost_map_source_info()
    assert info["source"] == "local" and info["is_env_forced"] and info["url"] is None


@pytest.mark.slow
def test_mini_swe_trains_with_train_py(tmp_path):
    """train.py on mini-swe-agent with the tiny random model: it never writes a tool call, so each of an episode's
    max_turns calls is a format error and its own segment; every episode is built token-exactly from the engine's
    record (nothing malformed, mismatch ~0) and trained. ~2,700-token prompts (mini-swe-agent's, the tiny tokenizer)."""
    r = run_train(tmp_path, "--task=mini_swe", "--max_steps=2", "--prompts_per_step=1", "--group_size=2",
                  "--max_turns=2", "--max_new_tokens=16", "--engine_max_len=4096", "--max_staleness=0",
                  "--dump_every=1", "--eval_every=0")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = metrics(tmp_path)
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["rollout/agent_errors"] == m["rollout/malformed"] == m["rollout/agent_timeouts"] == 0, m
        assert m["tokens/trained"] > 0 and m["reward/mean"] == 0.0 and m["episode/commands"] == 0
        assert m["episode/calls"] == 2 and m["episode/segments"] == 2
        assert m["mismatch/logprob_abs_diff"] < 1e-4, m
    rows = [json.loads(line) for line in open(tmp_path / "episodes.jsonl")]
    episodes = {(row["step"], row["index"]) for row in rows}
    assert len(episodes) == 4  # two steps of one group of two
    for step, index in episodes:
        texts = [row["text"] for row in rows if (row["step"], row["index"]) == (step, index)]
        # the second call's prompt holds the format error mini-swe-agent answered the first with: a user turn
        assert [t.count("<|im_start|>user") for t in texts] == [1, 2]
        assert all("You are a helpful assistant that can interact with a computer." in t for t in texts)
