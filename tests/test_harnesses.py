"""Real CLI harnesses trained unchanged: Claude Code (Anthropic Messages) and Codex (OpenAI Responses) each run
headless against one episode's endpoint on a scripted engine, call their own shell tool in a temp work dir, and
answer; the endpoint's record is token-exact. Their network traffic goes to a proxy that refuses it, so a harness
that talks to anything but the endpoint fails here. The CLIs come from tests/install_harnesses.sh (into .harnesses/);
the tests skip without them."""
import asyncio
import json
import os
import subprocess
import time

import pytest
from test_endpoint import ScriptEngine, chat_episode, qwen3_tokenizer
from test_wires import anthropic_client

import endpoint
from rollout import check_tokens
from tools import agentkit

HARNESSES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".harnesses")
INSTALL_WAIT_S = 300  # the install took 20 s on 2 cores (a cold npm cache); niced beside the tests, longer
ASK = "Write hi into made_by_agent.txt, then say that you are done."
FINAL = "Done: made_by_agent.txt says hi."
THINK = "<think>\nI should run a command.\n</think>\n\n"  # on Qwen3's template: thinking the harness sends back


def harness(name):
    """-> the CLI's path, once an install running in the background (it marks itself .installing) has ended"""
    deadline = time.monotonic() + INSTALL_WAIT_S
    while os.path.exists(os.path.join(HARNESSES, ".installing")) and time.monotonic() < deadline:
        time.sleep(1)
    if not os.path.exists(os.path.join(HARNESSES, ".installed")):  # written last: a half-done install is none
        pytest.skip("the CLI harnesses are not installed in .harnesses/ (bash tests/install_harnesses.sh)")
    return os.path.join(HARNESSES, "node_modules", ".bin", name)


def script(template, tok, tool, args):
    """-> (the tokenizer, the engine's two replies: a call of the harness's shell tool, then the answer); on Qwen3's
    template each reply thinks first"""
    call = "<tool_call>\n" + json.dumps({"name": tool, "arguments": args}) + "\n</tool_call><|im_end|>"
    if template == "tiny":
        return tok, [call, FINAL + "<|im_end|>"]
    return qwen3_tokenizer(), [THINK + call, THINK + FINAL + "<|im_end|>"]


async def refusing_proxy():
    """An HTTP(S) proxy that refuses every request and keeps its first line (CONNECT host:443 ...) -> (server, log)"""
    log = []

    async def refuse(reader, writer):
        log.append((await reader.readline()).decode(errors="replace").strip())
        writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()
    return await asyncio.start_server(refuse, "127.0.0.1", 0), log


async def run_cli(cmd, env, cwd, home, timeout_s=60):
    """Run a harness with only env (and PATH), HOME a temp dir, all traffic but 127.0.0.1's to the refusing proxy;
    -> (exit code, stdout, stderr, the proxy's log)"""
    proxy, log = await refusing_proxy()
    url = f"http://127.0.0.1:{proxy.sockets[0].getsockname()[1]}"
    env = dict(env, PATH=os.environ["PATH"], HOME=str(home), LANG="C.UTF-8", HTTPS_PROXY=url, HTTP_PROXY=url,
               https_proxy=url, http_proxy=url, NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    proc = await asyncio.create_subprocess_exec(*cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    finally:
        if proc.returncode is None:  # timed out
            proc.kill()
            await proc.wait()
        proxy.close()
    return proc.returncode, out.decode(), err.decode(), log


def harness_episode(tmp_path, tok, texts, command):
    """One episode on a ScriptEngine that samples texts, the harness run in tmp_path/work with HOME tmp_path/home;
    command(llm, home) -> (its argv, its env) -> (llm, engine, what run_cli returned)"""
    engine = ScriptEngine(tok, texts)
    (tmp_path / "work").mkdir()
    (tmp_path / "home").mkdir()

    async def run(_, llm):
        argv, env = command(llm, tmp_path / "home")
        return await run_cli(argv, env, tmp_path / "work", tmp_path / "home")
    llm, result = chat_episode(engine, tok, run)
    return llm, engine, result


def check_episode(llm, engine, result, work, n_calls=2):
    """The harness ran the command and printed the answer; the record is one token-exact segment of all calls."""
    code, out, err, outside = result
    assert code == 0, err[-3000:]
    assert outside == [], f"the harness talked to more than the endpoint: {outside}"
    assert (work / "made_by_agent.txt").read_text() == "hi\n"
    assert FINAL in out and engine.texts == []
    # each request's rendering extends the one before: one segment, every reply sampled in it
    [(ep, calls)] = endpoint.segments(llm, 1.0)
    check_tokens(ep, calls)
    assert len(calls) == len(llm.calls) == n_calls


# ---- Claude Code ----


def claude_code(llm, home):
    """agents/claude_code.py's command (tools/agentkit.py), with this test's question"""
    return agentkit.claude_code_cli(llm, ASK)


@pytest.mark.parametrize("template", ["tiny", "qwen3"])
def test_claude_code_runs_its_bash_tool_through_the_endpoint(tok, tmp_path, template):
    harness("claude")
    chat_tok, texts = script(template, tok, "Bash", {"command": "echo hi > made_by_agent.txt"})
    llm, engine, result = harness_episode(tmp_path, chat_tok, texts, claude_code)
    check_episode(llm, engine, result, tmp_path / "work")


def test_claude_code_loads_a_deferred_tool_then_calls_bash_in_one_segment(tok, tmp_path):
    """Its ToolSearch tool loads deferred tools by tool_reference blocks, and the second tool call's id is new: both
    were refused or rewritten before (see the wire tests below), each costing a segment."""
    harness("claude")
    search = '<tool_call>\n{"name": "ToolSearch", "arguments": {"query": "select:WebFetch"}}\n</tool_call><|im_end|>'
    _, [bash, answer] = script("tiny", tok, "Bash", {"command": "echo hi > made_by_agent.txt"})
    llm, engine, result = harness_episode(tmp_path, tok, [search, bash, answer], claude_code)
    check_episode(llm, engine, result, tmp_path / "work", n_calls=3)


# ---- Codex ----


def codex(llm, home):
    """agents/codex.py's command (tools/agentkit.py), with this test's question; its CODEX_HOME the test's HOME"""
    return agentkit.codex_cli(llm, ASK, home)


@pytest.mark.parametrize("template", ["tiny", "qwen3"])
def test_codex_runs_its_exec_command_tool_through_the_endpoint(tok, tmp_path, template):
    harness("codex")
    chat_tok, texts = script(template, tok, "exec_command", {"cmd": "echo hi > made_by_agent.txt"})
    llm, engine, result = harness_episode(tmp_path, chat_tok, texts, codex)
    check_episode(llm, engine, result, tmp_path / "work")


# ---- what the harnesses sent that the endpoint had to learn ----


def test_responses_namespace_tools_are_functions_called_with_their_namespace(tok):
    """Codex groups tools in namespaces ({"type": "namespace", "name", "tools": [functions]}): the model sees each
    function as a flat one would render, and a call of one carries its namespace, which Codex routes on."""
    call = '<tool_call>\n{"name": "wait_agent", "arguments": {"targets": ["a1"]}}\n</tool_call><|im_end|>'
    params = {"type": "object", "properties": {"targets": {"type": "array", "items": {"type": "string"}}}}
    wait = {"type": "function", "name": "wait_agent", "description": "Wait for agents.", "parameters": params}
    space = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [wait]}

    async def two_turns(client, llm, tools):
        items = [{"role": "user", "content": [{"type": "input_text", "text": "Wait for a1."}]}]
        first = await client.responses.create(model=llm.model, input=items, tools=tools)
        items += [item.model_dump(exclude_none=True) for item in first.output]  # the namespace goes back too
        items.append({"type": "function_call_output", "call_id": first.output[0].call_id, "output": "done"})
        await client.responses.create(model=llm.model, input=items, tools=tools)
        return first.output[0]
    texts = [call, "ok<|im_end|>"]
    llm, fc = chat_episode(ScriptEngine(tok, texts), tok, lambda c, llm: two_turns(c, llm, [space]))
    flat_llm, flat = chat_episode(ScriptEngine(tok, texts), tok, lambda c, llm: two_turns(c, llm, [wait]))
    assert (fc.type, fc.name, fc.namespace) == ("function_call", "wait_agent", "multi_agent_v1")
    assert flat.namespace is None
    [(ep, calls)] = endpoint.segments(llm, 1.0)
    check_tokens(ep, calls)
    [(flat_ep, _)] = endpoint.segments(flat_llm, 1.0)
    assert len(calls) == 2 and ep.ids == flat_ep.ids  # rendered as the flat function: token for token


def test_anthropic_deferred_tools_load_by_tool_reference_in_one_segment(tok):
    """Claude Code defers tools (defer_loading) and loads one when its ToolSearch tool returns a tool_reference block
    in a tool_result: the deferred tool stays out of the rendered tools, its definition is that block's text, and
    the conversation stays one segment (the refused block made Claude Code retry three times, then re-send the whole
    conversation with every tool declared: a new segment)."""
    schema = {"type": "object", "properties": {"url": {"type": "string"}}}
    fetch = {"name": "WebFetch", "description": "Fetch a URL.", "input_schema": schema, "defer_loading": True}
    search = {"name": "ToolSearch", "description": "Load deferred tools.",
              "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}}}
    call = '<tool_call>\n{"name": "ToolSearch", "arguments": {"query": "select:WebFetch"}}\n</tool_call><|im_end|>'
    fetch_call = '<tool_call>\n{"name": "WebFetch", "arguments": {"url": "x"}}\n</tool_call><|im_end|>'

    async def claude(_, llm):
        client = anthropic_client(llm)
        msgs = [{"role": "user", "content": "Fetch x."}]
        first = await client.messages.create(model=llm.model, max_tokens=64, messages=msgs, tools=[search, fetch])
        msgs += [{"role": "assistant", "content": first.content}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": first.content[0].id,
             "content": [{"type": "tool_reference", "tool_name": "WebFetch"}]}]}]
        second = await client.messages.create(model=llm.model, max_tokens=64, messages=msgs, tools=[search, fetch])
        return second
    llm, second = chat_episode(ScriptEngine(tok, [call, fetch_call]), tok, claude)
    assert second.content[0].type == "tool_use" and second.content[0].input == {"url": "x"}
    [(ep, calls)] = endpoint.segments(llm, 1.0)
    check_tokens(ep, calls)
    first_prompt, second_prompt = [tok.decode(prompt) for prompt, _, _ in llm.calls]
    assert "Fetch a URL." not in first_prompt and "Load deferred tools." in first_prompt
    assert second_prompt.count("Fetch a URL.") == 1 and len(calls) == 2


def test_tool_call_ids_are_unique_in_a_conversation(tok):
    """Every reply's first call was call_0: Claude Code took the repeated id of its second Bash call for an
    interrupted one, replaced that turn by "[Tool use interrupted]" and so started a new segment."""
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "1"}}\n</tool_call><|im_end|>'
    tool = {"name": "python", "description": "Run Python code",
            "input_schema": {"type": "object", "properties": {"code": {"type": "string"}}}}

    async def claude(_, llm):
        client = anthropic_client(llm)
        msgs, ids = [{"role": "user", "content": "Run 1 twice."}], []
        for _ in range(2):
            reply = await client.messages.create(model=llm.model, max_tokens=64, messages=msgs, tools=[tool])
            ids.append(reply.content[0].id)
            msgs += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": ids[-1], "content": "1"}]}]
        return ids
    _, ids = chat_episode(ScriptEngine(tok, [call, call]), tok, claude)
    assert len(set(ids)) == 2, ids
