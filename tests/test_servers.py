"""Server engines (rollout.py, last section).
(a) the SGLang client against a stand-in server speaking SGLang's documented /generate,
    /update_weights_from_disk and /flush_cache shapes; process start-up failures;
(b) vLLM for real on CPU (slow; needs tests/install_vllm.sh, which creates .venv-vllm);
(c) SGLang for real, on CPU (slow; needs tests/install_sglang.sh, which creates .venv-sglang) and, the same
    tests with GPU flags, on a GPU (skipped without one)."""
import asyncio
import base64
import gc
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from test_rollout import (  # the producer and engine loop, as the rollout runs them
    Counter,
    collect,
    drive,
)

import agent
from tools import agentkit
import config
import rollout
import servers
from engine import TorchEngine
from model_moe import ModelConfig, Transformer
from servers import ServerEngine, ServerError, start_server, stop_server, write_weights

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok"))
    agent.make_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tok_dir)


def tiny_config(vocab, experts=0, layers=2, mlp_only=()):
    return ModelConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=experts,
                       num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=list(mlp_only),
                       max_position_embeddings=512)


# ---- (a) the SGLang client against SGLang's documented request/response shapes ----

class FakeSGLang:
    """A stand-in SGLang server (stdlib http.server in a thread). Its "model" is a deterministic function of
    the prompt and of the weights directory last loaded; it answers in the documented shapes:
    /generate -> {"text", "output_ids", "meta_info": {"output_token_logprobs": [[logprob, id, None], ...],
    "routed_experts": base64 int32 (prompt+output-1, num_hidden_layers, top_k) when asked, ...}}."""

    def __init__(self, vocab, layers=2, top_k=2):
        self.vocab, self.layers, self.top_k = vocab, layers, top_k
        self.requests, self.loaded, self.fail_update, self.crashed = [], None, None, False
        self.gate = threading.Event()
        self.gate.set()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                fake.requests.append((self.path, None))
                self.reply(200, "") if self.path == "/health" else self.reply(404, "not found")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                fake.requests.append((self.path, body))
                if self.path == "/generate" and not all(0 <= t < fake.vocab for ids in body["input_ids"] for t in ids):
                    fake.crashed = True  # as SGLang 0.5.23 does: its scheduler dies on the embedding lookup
                if fake.crashed:  # and the server with it: the connection closes without a response
                    self.close_connection = True
                    return
                if self.path == "/generate":
                    fake.gate.wait(30)
                    self.reply(200, fake.generate(body))
                elif self.path == "/update_weights_from_disk":
                    if fake.fail_update or not os.path.isdir(body["model_path"]):
                        msg = fake.fail_update or f"{body['model_path']} not found"
                        return self.reply(400, {"success": False, "message": msg, "num_paused_requests": 0})
                    fake.loaded = body["model_path"]
                    self.reply(200, {"success": True, "message": "Succeeded to update model weights.",
                                     "num_paused_requests": 0})
                elif self.path == "/init_weights_update_group":  # as a server on a host that cannot reach us
                    self.reply(400, {"success": False, "message": "Failed to initialize custom process group: "
                                     "The client socket has timed out after 3000ms while trying to connect"})
                elif self.path == "/flush_cache":
                    self.reply(200, "Cache flushed.\nPlease check backend logs for more details.\n")
                else:
                    self.reply(404, {"detail": "Not Found"})

            def reply(self, code, obj):
                data = (obj if isinstance(obj, str) else json.dumps(obj)).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def outputs(self, ids, sp):
        salt = sum(map(ord, os.path.basename(self.loaded or "")))  # other weights, other tokens
        out = []
        for j in range(sp["max_new_tokens"]):
            out.append((sum(ids) * 31 + j * 7 + salt) % self.vocab)
            if out[-1] in sp["stop_token_ids"]:
                break
        return out

    def generate(self, body):  # many prompts at once, as the real server takes them
        return [self.answer(body, ids, sp) for ids, sp in zip(body["input_ids"], body["sampling_params"], strict=True)]

    def answer(self, body, ids, sp):
        out = self.outputs(ids, sp)
        meta = {"id": "0", "finish_reason": {"type": "length", "length": len(out)}, "prompt_tokens": len(ids),
                "completion_tokens": len(out), "cached_tokens": 0, "e2e_latency": 0.01,
                "output_token_logprobs": [[-0.1 * (j + 1), t, None] for j, t in enumerate(out)]}
        if body.get("return_routed_experts"):
            T = len(ids) + len(out)
            experts = np.array([[[(p + 3 * l + k) % 4 for k in range(self.top_k)] for l in range(self.layers)]
                                for p in range(T - 1)], dtype=np.int32)  # (T-1, num_hidden_layers, top_k)
            meta["routed_experts"] = base64.b64encode(experts.tobytes()).decode()
        return {"text": "...", "output_ids": out, "meta_info": meta}

    def calls(self, path):
        return [b for p, b in self.requests if p == path]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def sglang_engine(fakes, tmp_path, c, version=None, **kw):
    wdir = tmp_path / "engine_weights"
    (wdir / "v0").mkdir(parents=True, exist_ok=True)
    kw = dict(dict(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=5, stop_ids=[2], seed=3), **kw)
    return ServerEngine("sglang", [f.url for f in fakes], model_config=c, weights_dir=str(wdir),
                        version=version or Counter(0), **kw)


def test_sglang_request_and_response_shapes(tmp_path):
    # 3 layers, the middle one dense: the server reports every layer, the engine keeps the MoE ones
    c = tiny_config(384, experts=4, layers=3, mlp_only=[1])
    fake = FakeSGLang(384, layers=3)
    e = sglang_engine([fake], tmp_path, c)
    prompt = [1, 40, 41, 42]
    comp = drive(e, lambda: e.generate(prompt))
    # first the servers load the current version, then the request
    assert fake.calls("/update_weights_from_disk")[0]["model_path"] == str(tmp_path / "engine_weights" / "v0")
    assert fake.requests[0][0] == "/update_weights_from_disk" and fake.requests[0][1]["flush_cache"] is True
    body = fake.calls("/generate")[0]
    assert body["input_ids"] == [prompt] and body["return_logprob"] is True and body["return_routed_experts"] is True
    sp = body["sampling_params"][0]
    assert sp["max_new_tokens"] == 5 and sp["temperature"] == 0.7 and sp["top_p"] == 0.9 and sp["top_k"] == -1
    assert sp["stop_token_ids"] == [2] and isinstance(sp["sampling_seed"], int)
    assert sp["skip_special_tokens"] is False  # ids, never text, but keep the stop token visible
    out = fake.outputs(prompt, sp)
    assert comp.ids == out and comp.versions == [0] * len(out)
    assert comp.logprobs == pytest.approx([-0.1 * (j + 1) for j in range(len(out))])
    T = len(prompt) + len(out)
    assert comp.routing.shape == (T, 2, 2) and comp.routing.dtype == torch.int16
    for p in range(T - 1):  # layers 0 and 2 of what the server returned
        assert comp.routing[p].tolist() == [[(p + 3 * l + k) % 4 for k in range(2)] for l in (0, 2)]
    assert (comp.routing[-1] == -1).all()  # the last sampled token was never fed to the model
    fake.close()


def test_dense_model_asks_for_no_routing_and_servers_take_turns(tmp_path):
    fakes = [FakeSGLang(384), FakeSGLang(384)]
    e = sglang_engine(fakes, tmp_path, tiny_config(384))

    async def four():
        return [await e.generate([1, 50 + i]) for i in range(4)]
    comps = drive(e, four)
    assert all(c.routing is None for c in comps)
    assert [len(f.calls("/generate")) for f in fakes] == [2, 2]  # round-robin (data parallel)
    assert all(b["return_routed_experts"] is False for f in fakes for b in f.calls("/generate"))
    assert all(f.loaded == str(tmp_path / "engine_weights" / "v0") for f in fakes)
    for f in fakes:
        f.close()


def test_every_call_of_an_episode_goes_to_one_server(tmp_path):
    """A multi-turn episode's turns share their prefix: one server keeps it in its radix cache only if all of them go
    there. Episodes 0..2, 3 calls each, interleaved (3: round-robin by call would move each episode every turn): each
    episode's calls on one server, the episodes over both."""
    fakes = [FakeSGLang(384), FakeSGLang(384)]
    e = sglang_engine(fakes, tmp_path, tiny_config(384))

    async def turns():
        return [await e.generate([1, 60 + ep, 70 + call], key=(ep, call)) for call in range(3) for ep in range(3)]
    drive(e, turns)
    where = {}
    for k, f in enumerate(fakes):
        for body in f.calls("/generate"):
            where.setdefault(body["input_ids"][0][1] - 60, set()).add(k)
    assert sorted(where) == [0, 1, 2] and all(len(s) == 1 for s in where.values()), where
    assert {k for s in where.values() for k in s} == {0, 1}
    for f in fakes:
        f.close()


def test_a_new_episode_goes_to_the_server_with_the_fewest_requests_in_flight(tmp_path):
    """Episode 0's call holds server 0 (its answer waits): episode 2 starts on server 1, where by index modulo 2 it
    would join the busy one; each later call of either stays on its episode's server."""
    fakes = [FakeSGLang(384), FakeSGLang(384)]
    e = sglang_engine(fakes, tmp_path, tiny_config(384))
    fakes[0].gate.clear()

    async def two():
        first = asyncio.ensure_future(e.generate([1, 60], key=(0, 0)))
        while not fakes[0].calls("/generate"):
            await asyncio.sleep(0.01)
        await e.generate([1, 62], key=(2, 0))
        fakes[0].gate.set()
        await first
        for ep in (0, 2):
            await e.generate([1, 60 + ep, 70], key=(ep, 1))
    drive(e, two)
    where = {k: [b["input_ids"][0][1] - 60 for b in f.calls("/generate")] for k, f in enumerate(fakes)}
    assert where == {0: [0, 0], 1: [2, 2]}, where
    for f in fakes:
        f.close()


def test_requests_made_together_share_one_generate_call(tmp_path):
    """SGLang's /generate takes many prompts: the requests of one moment go in one call, each gets its answer."""
    fake = FakeSGLang(384)
    e = sglang_engine([fake], tmp_path, tiny_config(384, experts=4))
    prompts = [[1, 50 + i % 3] for i in range(8)]  # equal prompts too, as in a group

    async def together():
        return await asyncio.gather(*(e.generate(p) for p in prompts))
    comps = drive(e, together)
    (body,) = fake.calls("/generate")
    assert body["input_ids"] == prompts and len({sp["sampling_seed"] for sp in body["sampling_params"]}) == 8
    assert [c.ids for c in comps] == [fake.outputs(p, sp) for p, sp in zip(prompts, body["sampling_params"])]
    assert [c.routing.shape[0] for c in comps] == [len(p) + len(c.ids) for p, c in zip(prompts, comps)]
    fake.close()


def test_agents_train_exactly_the_server_tokens(tmp_path, tok):
    fake = FakeSGLang(len(tok))
    cfg = config.load(["--group_size=2", "--prompts_per_step=2", "--max_turns=3", "--max_staleness=0"])
    e = sglang_engine([fake], tmp_path, tiny_config(len(tok)), stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")],
                      max_new_tokens=4)
    msgs = collect(cfg, e, tok, 4)
    returned = [fake.outputs(i, sp) for b in fake.calls("/generate") for i, sp in zip(b["input_ids"], b["sampling_params"])]
    for m in msgs:
        ids, mask = m["ids"], m["loss_mask"].bool()
        assert torch.equal(ids[mask], m["engine_ids"])
        runs, start = [], None  # each run of sampled tokens is exactly one answer of the server
        for i, k in enumerate(mask.tolist() + [False]):
            if k and start is None:
                start = i
            elif not k and start is not None:
                runs.append(ids[start:i].tolist())
                start = None
        assert runs and all(r in returned for r in runs)
        assert (m["versions"][mask] == 0).all()  # versions tagged
    fake.close()


def test_weight_update_waits_for_running_requests_and_tags_versions(tmp_path):
    fakes = [FakeSGLang(384), FakeSGLang(384)]
    version = Counter(0)
    e = sglang_engine(fakes, tmp_path, tiny_config(384), version=version)
    wdir = tmp_path / "engine_weights"

    async def scenario():
        first = await e.generate([1, 2, 3])  # the servers now hold v0
        for f in fakes:
            f.gate.clear()  # the next request hangs in the server
        running = asyncio.create_task(e.generate([1, 2, 3]))
        await asyncio.sleep(0.2)
        (wdir / "v1").mkdir()
        version.value = 1  # the trainer published v1
        await asyncio.sleep(0.2)
        waiting = asyncio.create_task(e.generate([1, 2, 3]))  # admitted only once v1 is loaded
        await asyncio.sleep(0.2)
        loads = sum(len(f.calls("/update_weights_from_disk")) for f in fakes)
        assert loads == 2 and not waiting.done()  # v0 once per server; no v1 while a request runs
        for f in fakes:
            f.gate.set()
        return first, await running, await waiting
    first, during, after = drive(e, scenario)
    assert first.versions == during.versions == [0] * len(first.ids) and during.ids == first.ids
    assert after.versions == [1] * len(after.ids) and after.ids != first.ids  # sampled by the new weights
    for f in fakes:
        assert f.loaded == str(wdir / "v1")
        assert all(b["flush_cache"] for b in f.calls("/update_weights_from_disk"))  # no prefix of old weights reused
    assert not (wdir / "v0").exists()  # older versions are deleted once every server holds a newer one
    for f in fakes:
        f.close()


def test_failed_weight_update_is_a_server_error(tmp_path):
    fake = FakeSGLang(384)
    fake.fail_update = "Failed to load weights: shape mismatch"
    e = sglang_engine([fake], tmp_path, tiny_config(384))
    with pytest.raises(ServerError, match="answered 400.*shape mismatch"):
        drive(e, lambda: asyncio.sleep(5))
    fake.close()


def test_server_that_cannot_join_the_weights_group_is_a_server_error(tmp_path):
    c = tiny_config(384)
    fake = FakeSGLang(384)
    weights = Transformer(c).state_dict()
    e = sglang_engine([fake], tmp_path, c, weights=weights, lock=threading.Lock(), sync="gloo", timeout=3)
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="answered 400.*Failed to initialize custom process group"):
        drive(e, lambda: e.generate([1, 2]))
    assert time.monotonic() - t0 < 3  # the error comes at once, not after the group's timeout
    assert fake.calls("/init_weights_update_group")[0]["rank_offset"] == 1 and not fake.calls("/generate")
    fake.close()


def test_dead_server_is_an_error_with_its_log(tmp_path):
    fake = FakeSGLang(384)
    log = tmp_path / "server.log"
    log.write_text("loading weights...\nRuntimeError: CUDA error: an illegal memory access was encountered\n")
    e = sglang_engine([fake], tmp_path, tiny_config(384), logs=[str(log)])

    async def die():
        await e.generate([1, 2])
        fake.close()
        return await e.generate([1, 2])
    with pytest.raises(ServerError, match=r"(?s)unreachable.*illegal memory access"):
        drive(e, die)


BAD_ID_AGENT = """
from agent import load_agent

arith = load_agent("arith")

async def run(task, llm):
    if task["index"] == 1:  # beside the other agents' first calls: one /generate would carry them all
        await llm.generate([1, 2, 10 ** 6])
    return await arith(task, llm)
"""


def test_a_bad_token_id_fails_only_its_own_agent(tmp_path, tok, capsys):
    """SGLang takes a tick's requests in one /generate, and one id past the vocabulary kills it (its scheduler dies,
    tests (c) below): the engine checks ids before sending, with the torch engine's check, so that agent fails alone."""
    fake = FakeSGLang(len(tok))
    (tmp_path / "bad.py").write_text(BAD_ID_AGENT)
    cfg = config.load([f"--task={tmp_path / 'bad.py'}", "--group_size=2", "--prompts_per_step=2", "--max_staleness=0"])
    e = sglang_engine([fake], tmp_path, tiny_config(len(tok)), stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")])
    msgs = collect(cfg, e, tok, 3)
    assert sorted(m["index"] for m in msgs) == [0, 2, 3] and not fake.crashed
    err = capsys.readouterr().err
    assert "episode 1 dropped (agent_errors): ValueError('prompt ids must be ints in [0, 384)')" in err
    torch_engine = TorchEngine(Transformer(tiny_config(len(tok))), max_len=64)

    async def refusal(engine, ids):
        try:
            await engine.generate(ids)
        except ValueError as err:
            return type(err), str(err)
    for ids in ([], [1, -1], [1, 2.0], [True], [1, len(tok)]):  # both refuse the same prompts the same way, at once
        server, torch_ = (asyncio.run(refusal(x, ids)) for x in (e, torch_engine))  # (no engine loop running)
        assert server == torch_ == (ValueError, "prompt ids must be ints in [0, 384)"), ids
    assert not fake.crashed
    fake.close()


CHAT_AGENT = """
import aiohttp

async def run(task, llm):
    async with aiohttp.ClientSession() as s:
        async with s.post(llm.base_url + "/chat/completions", json={"model": llm.model, "messages": [
                {"role": "user", "content": "hi"}]}, headers={"Authorization": "Bearer " + llm.api_key}) as r:
            print(r.status, (await r.json())["error"]["type"], file=open(LOG, "a"))
            r.raise_for_status()
    return 1.0
"""


def test_a_dead_server_reaches_chat_agents_as_5xx_and_ends_the_run(tmp_path, tok):
    """A chat agent's call to a dead server: the endpoint answers 503 (not the agent's fault, not a 400), and the
    rollout stops with the server's log, as for a token-level agent; not agent errors until max_failed_groups."""
    fake, log, statuses = FakeSGLang(len(tok)), tmp_path / "server.log", tmp_path / "statuses.txt"
    log.write_text("Scheduler hit an exception: RuntimeError: CUDA error: an illegal memory access\n")
    (tmp_path / "chat.py").write_text(f"LOG = {str(statuses)!r}\n" + CHAT_AGENT)
    cfg = config.load([f"--task={tmp_path / 'chat.py'}", "--group_size=2", "--prompts_per_step=2",
                       "--max_failed_groups=2"])
    e = sglang_engine([fake], tmp_path, tiny_config(len(tok)), logs=[str(log)])

    async def chat_agents():
        await e.generate([1, 2, 3])  # the server holds v0 and answers
        fake.crashed = True  # then it dies
        await rollout.produce(cfg, e, tok, queue.Queue(), Counter(), 0, len(tok))
    with pytest.raises(ServerError, match=r"(?s)unreachable.*illegal memory access"):
        drive(e, chat_agents)
    assert set(statuses.read_text().splitlines()) == {"503 server_error"}
    fake.close()
    # the agents' tasks that produce left (done, their errors never retrieved) log them when collected: now, not in
    # the middle of a later ast.parse, where CPython 3.11.7 then fails with "AST constructor recursion depth mismatch"
    gc.collect()


def fake_interpreter(tmp_path, script):
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return str(path)


def test_server_that_dies_at_start_or_never_gets_healthy(tmp_path):
    crash = fake_interpreter(tmp_path, "echo 'torch.OutOfMemoryError: CUDA out of memory' >&2\nexit 3\n")
    cfg = config.load([f"--out_dir={tmp_path}", "--engine=sglang", f"--server_python={crash}"])
    with pytest.raises(ServerError, match=r"(?s)exited with code 3 while starting.*CUDA out of memory"):
        start_server("sglang", str(tmp_path), cfg, str(tmp_path / "a.log"))
    (tmp_path / "python").unlink()
    slow = fake_interpreter(tmp_path, "echo 'loading shards 1/80'\nexec sleep 60\n")
    cfg = config.load([f"--out_dir={tmp_path}", "--engine=sglang", f"--server_python={slow}", "--server_timeout=2"])
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=r"(?s)not healthy after 2s \(server_timeout\).*loading shards"):
        start_server("sglang", str(tmp_path), cfg, str(tmp_path / "b.log"))
    assert time.monotonic() - t0 < 20  # and the stuck process was killed, not waited for


def test_a_server_port_is_never_one_the_os_hands_to_outgoing_connections(tmp_path):
    """Two SGLang servers starting at once: a port picked from the OS's ephemeral range and released can be taken by
    one of the other server's outgoing connections before this one binds it ('address already in use', seen here)."""
    record = fake_interpreter(tmp_path, f"echo \"$@\" >> {tmp_path}/argv\nexit 3\n")
    cfg = config.load([f"--out_dir={tmp_path}", "--engine=sglang", f"--server_python={record}"])
    for k in range(3):
        with pytest.raises(ServerError, match="exited with code 3"):
            start_server("sglang", str(tmp_path), cfg, str(tmp_path / f"{k}.log"))
    low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    ports = [int(line.split("--port ")[1].split()[0]) for line in (tmp_path / "argv").read_text().splitlines()]
    assert len(ports) == 3 and not any(low <= p <= high for p in ports), (ports, low, high)


# ---- (b) vLLM for real, on CPU ----

VLLM_PYTHON = os.environ.get("NANOMOLT_VLLM_PYTHON", os.path.join(ROOT, ".venv-vllm", "bin", "python"))
needs_vllm = pytest.mark.usefixtures("vllm_installed")


@pytest.fixture(scope="session")
def vllm_installed(servers_installed):  # checked when the test runs: --install-servers may be installing it meanwhile
    if not os.path.exists(VLLM_PYTHON):
        pytest.skip(f"vLLM not installed at {VLLM_PYTHON}: run tests/install_vllm.sh (or pytest --install-servers)")


# vLLM 0.32 on CPU serves the tiny MoE correctly, but its in-place weight reload corrupts the CPU-prepacked
# expert weights (outputs match neither the old nor the new weights); these tests use a dense tiny Qwen3.


@pytest.fixture(scope="module")
def vllm_server(vllm_installed, tmp_path_factory, tok_dir, tok):
    out = tmp_path_factory.mktemp("vllm")
    cfg = config.load([f"--out_dir={out}", "--engine=vllm", f"--server_python={VLLM_PYTHON}",
                       "--server_args=--enforce-eager", "--engine_max_len=256", "--server_timeout=300"])
    c = tiny_config(len(tok))
    model = Transformer(c).init_weights(0, std=0.3)
    wdir = str(out / "engine_weights")
    t0 = time.monotonic()
    proc, url = start_server("vllm", write_weights(wdir, c, tok_dir, 0, model.state_dict()), cfg, str(out / "vllm.log"))
    print(f"vLLM server healthy after {time.monotonic() - t0:.0f}s")
    yield dict(proc=proc, url=url, log=str(out / "vllm.log"), cfg=c, model=model, wdir=wdir, out=out)
    stop_server(proc)


def vllm_engine(s, tok, version, **kw):
    kw = dict(dict(temperature=1.0, max_new_tokens=6, max_len=256, seed=0), **kw)
    return ServerEngine("vllm", [s["url"]], logs=[s["log"]], model_config=s["cfg"], weights_dir=s["wdir"],
                        stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")], version=version, **kw)


@pytest.mark.slow
@needs_vllm
def test_vllm_episodes_are_the_server_tokens_with_versions_and_logprobs(vllm_server, tok):
    e = vllm_engine(vllm_server, tok, Counter(0))
    returned, generate = [], e.api["generate"]

    def recording(*args):  # what the server answered, before any of our code touches it
        r = generate(*args)
        returned.append(list(r[0][0]))  # [(ids, logprobs, experts, cached)]: one prompt a call
        return r
    e.api = dict(e.api, generate=recording)
    cfg = config.load(["--group_size=2", "--prompts_per_step=2", "--max_turns=2", "--max_staleness=0"])
    msgs = collect(cfg, e, tok, 4)
    diffs = []
    for m in msgs:
        ids, mask = m["ids"], m["loss_mask"].bool()
        assert torch.equal(ids[mask], m["engine_ids"]) and (m["versions"][mask] == 0).all()
        sampled = m["engine_ids"].tolist()
        assert any(sampled[:len(r)] == r for r in returned)  # the first turn is one answer of the server
        with torch.no_grad():  # trainer-side recompute with model_moe on the same ids
            logp = torch.log_softmax(vllm_server["model"](ids[None])[0, :-1].double(), -1)
        lp = logp.gather(-1, ids[1:, None])[:, 0]
        diffs.append((lp[mask[1:]] - m["logprobs"][mask].double()).abs())
    d = torch.cat(diffs)
    print(f"trainer vs vLLM logprob |diff| over {d.numel()} tokens: mean {d.mean():.2e}, max {d.max():.2e}")
    assert d.numel() > 0 and d.mean() < 1e-4 and d.max() < 1e-3  # float32 on both sides


def topk_then_topp(logits, temperature, top_k, top_p):
    """vLLM's order: top-k, renormalise, then the smallest set whose (renormalised) mass reaches top_p."""
    p = torch.softmax(logits.double() / temperature, -1)
    kept = p.topk(top_k).indices.tolist()
    q = p[kept] / p[kept].sum()
    mass, keep = 0.0, []
    for i, qi in sorted(zip(kept, q.tolist()), key=lambda x: -x[1]):
        if mass >= top_p:
            break
        keep.append(i)
        mass += qi
    out = torch.zeros_like(p)
    out[keep] = p[keep] / p[keep].sum()
    return out


@pytest.mark.slow
@needs_vllm
def test_vllm_logprobs_are_of_the_filtered_distribution(vllm_server, tok):
    """With temperature, top-k and top-p the server's logprob is that of the distribution it sampled from
    (--logprobs-mode processed_logprobs). vLLM applies top-p to the distribution renormalised after top-k;
    the torch engine to the one before: the same knobs keep different sets (recorded either way)."""
    e = vllm_engine(vllm_server, tok, Counter(0), temperature=0.8, top_k=20, top_p=0.7, max_new_tokens=8)
    prompts = [[1, 40 + i, 60, 70 + i] for i in range(4)]

    async def sample():
        return [await e.generate(p) for p in prompts]
    for p, c in zip(prompts, drive(e, sample)):
        with torch.no_grad():
            logits = vllm_server["model"](torch.tensor([p + c.ids]))[0]
        for j, (t, lp) in enumerate(zip(c.ids, c.logprobs)):
            q = topk_then_topp(logits[len(p) - 1 + j], 0.8, 20, 0.7)
            assert q[t] > 0, "sampled a token outside the top-k / top-p set"
            assert abs(q[t].log().item() - lp) < 1e-4


def greedy_torch(model, prompts, stop_id, n=6):
    e = TorchEngine(model, slots=4, max_len=256, temperature=0, max_new_tokens=n, stop_ids=[stop_id])

    async def main():
        loop_task = asyncio.create_task(e.run())
        outs = await asyncio.gather(*(e.generate(p) for p in prompts))
        loop_task.cancel()
        return [c.ids for c in outs]
    return asyncio.run(main())


@pytest.mark.slow
@needs_vllm
def test_vllm_greedy_matches_torch_and_a_weight_update_takes_effect(vllm_server, tok, tok_dir):
    s, stop = vllm_server, tok.convert_tokens_to_ids("<|im_end|>")
    prompts = [agentkit.prompt_ids(tok, t) for t in ("Guess my number from 1 to 7.", "What is 3*4+5?", "2+2=")]
    version = Counter(0)
    e = vllm_engine(s, tok, version, temperature=0)
    new = Transformer(s["cfg"]).init_weights(7, std=0.3)

    async def scenario():
        before = [await e.generate(p) for p in prompts]
        write_weights(s["wdir"], s["cfg"], tok_dir, 1, new.state_dict())
        version.value = 1  # as Rollout.publish does
        t0 = time.monotonic()
        while e.version != 1:
            await asyncio.sleep(0.05)
        print(f"vLLM weight update (tiny model, disk path): {time.monotonic() - t0:.2f}s")
        return before, [await e.generate(p) for p in prompts]
    before, after = drive(e, scenario)
    old_greedy, new_greedy = greedy_torch(s["model"], prompts, stop), greedy_torch(new, prompts, stop)
    assert [c.ids for c in before] == old_greedy and all(c.versions == [0] * len(c.ids) for c in before)
    assert [c.ids for c in after] == new_greedy and all(c.versions == [1] * len(c.ids) for c in after)
    assert new_greedy != old_greedy
    assert not os.path.exists(os.path.join(s["wdir"], "v0"))


def train_loop_on_policy(tmp_path, engine, flags, env=()):
    """train.py on the default recipe with a server engine, 3 on-policy steps (each publishes new weights to the
    server), evaluating greedily at the start and after every step -> its metrics, after the checks every engine
    passes: versions 1..3, no staleness, every trained token the server's under the current weights; each
    evaluation's metrics on its step's line, its episodes dumped, none of them trained on."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "guess.py"),
           *flags, "--prompts_per_step=2", "--group_size=4", "--max_steps=3", "--max_staleness=0", "--ckpt_every=0",
           "--dump_every=0", "--rollout_dump", "--eval_at_start", "--eval_every=1", "--eval_prompts=2",
           "--eval_samples=2", "--eval_temperature=0"]
    env = {**os.environ, **dict(env), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), ROOT]))
    r = subprocess.run(cmd, env=env, cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:] + servers.log_tail(str(tmp_path / f"{engine}_server.log"))
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [m["step"] for m in lines] == [0, 1, 2, 3] and "reward/mean" not in lines[0]  # step 0: its evaluation
    # every token of the evaluation of step v was sampled by weights v: the rollout checks the versions the server's
    # answers were tagged with (test_eval: it refuses others), and a refusal would have ended the run
    for m in lines:
        assert m["eval/episodes"] == 4 and m["eval/failed"] == 0 and m["eval/response_tokens"] >= 1, m
        rows = [json.loads(line) for line in open(tmp_path / "eval" / f"step_{m['step']}.jsonl")]
        assert [(r["step"], r["prompt"]) for r in rows] == [(m["step"], p) for p in (0, 0, 1, 1)]
        assert rows[0]["text"] == rows[1]["text"] and rows[2]["text"] == rows[3]["text"]  # greedy reached the server
    trained = [[x["index"] for x in torch.load(tmp_path / "rollouts" / f"step_{s}.pt", weights_only=False)]
               for s in (1, 2, 3)]
    assert sorted(i for b in trained for i in b) == list(range(24))  # training's episodes only, each once
    ms = lines[1:]
    assert [m["policy_version"] for m in ms] == [1, 2, 3]
    for m in ms:
        assert m["staleness/max"] == 0 and m["mismatch/tokens"] == m["tokens/trained"] > 0
        assert m["rollout/dropped_stale"] == 0  # the admission bound kept every episode (staleness/max: by construction)
    print(f"{engine}: mismatch/logprob_abs_diff", [f"{m['mismatch/logprob_abs_diff']:.1e}" for m in ms],
          "time/weight_sync:", [round(m["time/weight_sync"], 3) for m in ms])
    return ms


@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("lora", [[], ["--lora_rank=4"]], ids=["full", "lora"])
def test_train_loop_against_vllm(tmp_path, lora):
    """The whole async loop with engine=vllm: on-policy, so every step loads new weights into the server;
    every trained token was sampled by the server under the weights that train it; it evaluates each version.
    LoRA with the default weight_sync: vLLM loads whole directories, so it gets the whole merged state."""
    ms = train_loop_on_policy(tmp_path, "vllm", [f"--out_dir={tmp_path}", "--engine=vllm", *lora,
                              f"--server_python={VLLM_PYTHON}", "--server_args=--enforce-eager", "--tiny_experts=0"])
    assert all(m["mismatch/logprob_abs_diff"] < 1e-4 for m in ms), ms
    assert not {"v0", "v1"} & set(os.listdir(tmp_path / "engine_weights"))  # older versions are deleted


@pytest.mark.slow
@needs_vllm
def test_killed_vllm_server_is_a_clear_error(vllm_server, tok):  # last: it kills the module's server
    e = vllm_engine(vllm_server, tok, Counter(1))

    async def kill_then_generate():
        await e.generate([1, 2, 3])
        os.killpg(vllm_server["proc"].pid, 9)  # the server and its engine workers crash
        vllm_server["proc"].wait()
        return await e.generate([1, 2, 3])
    with pytest.raises(ServerError, match=r"(?s)unreachable.*last lines of .*vllm.log"):
        drive(e, kill_then_generate)


# ---- (c) SGLang for real: on CPU here (tests/install_sglang.sh), the same tests with GPU flags on a GPU box ----

SGLANG_PYTHON = os.environ.get("NANOMOLT_SGLANG_PYTHON", os.path.join(ROOT, ".venv-sglang", "bin", "python"))
# per device: the server's flags (config, never guessed by the code), its environment, the weight sync.
# float32 on CPU: --dtype auto picks float16 there and the logprob gap grows to ~2e-3.
SGLANG = {"cpu": dict(args="--device cpu --attention-backend torch_native --disable-cuda-graph --skip-server-warmup "
                           "--max-total-tokens 4096", sync="gloo",
                      env={"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": os.path.join(ROOT, "tests", "sglang_cpu")}),
          "cuda": dict(args="--attention-backend triton --mem-fraction-static 0.2", sync="nccl", env={})}


def sglang_skip(device):
    if not os.path.exists(SGLANG_PYTHON):
        return f"sglang not installed at {SGLANG_PYTHON}: run tests/install_sglang.sh (or pytest --install-servers)"
    if device == "cpu" and not os.path.exists(os.path.join(os.path.dirname(SGLANG_PYTHON), "..", ".nanomolt-patched")):
        return "the CPU variant needs the venv of tests/install_sglang.sh (its routed-experts patch for CPU)"
    if device == "cuda" and not torch.cuda.is_available():
        return "the GPU variant of the SGLang tests needs a GPU (and the Dockerfile's image)"
    return None


@pytest.fixture
def sglang_device(device, servers_installed):  # the parameter "device", skipped with the reason if it cannot run here
    if reason := sglang_skip(device):
        pytest.skip(reason)


def sglang_flags(device, out, extra=()):
    d = SGLANG[device]
    return [f"--out_dir={out}", "--engine=sglang", f"--server_python={SGLANG_PYTHON}", f"--server_args={d['args']}",
            f"--weight_sync={d['sync']}", "--engine_max_len=256", "--server_timeout=300", *extra]


@pytest.fixture(scope="module", params=[(e, d) for d in ("cpu", "cuda") for e in (0, 4)],
                ids=lambda p: f"{p[1]}-{'moe' if p[0] else 'dense'}")
def sglang_server(request, servers_installed, tmp_path_factory, tok_dir, tok):
    experts, device = request.param
    if sglang_skip(device):
        pytest.skip(sglang_skip(device))
    out = tmp_path_factory.mktemp(f"sglang_{device}_{experts}")
    cfg = config.load(sglang_flags(device, out))
    c = tiny_config(len(tok), experts=experts)
    model = Transformer(c).init_weights(0, std=0.3)
    wdir, log = str(out / "engine_weights"), str(out / "sglang.log")
    t0 = time.monotonic()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in SGLANG[device]["env"].items():
            mp.setenv(k, v)
        first = write_weights(wdir, c, tok_dir, 0, model.state_dict())
        proc, url = start_server("sglang", first, cfg, log, moe=experts > 0)
    print(f"SGLang server ({device}, experts={experts}) healthy after {time.monotonic() - t0:.0f}s")
    yield dict(proc=proc, url=url, log=log, cfg=c, model=model, wdir=wdir, sync=SGLANG[device]["sync"])
    stop_server(proc)


def sglang_real_engine(s, tok, version, weights=None, lock=None, **kw):
    kw = dict(dict(temperature=1.0, max_new_tokens=6, max_len=256, seed=0), **kw)
    return ServerEngine("sglang", [s["url"]], logs=[s["log"]], model_config=s["cfg"], weights_dir=s["wdir"],
                        stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")], version=version, weights=weights,
                        lock=lock, sync=s["sync"] if weights is not None else "disk", **kw)


@pytest.mark.slow
def test_sglang_episodes_are_the_server_tokens_with_versions_logprobs_and_experts(sglang_server, tok):
    s = sglang_server
    e = sglang_real_engine(s, tok, Counter(0))
    cfg = config.load(["--group_size=2", "--prompts_per_step=2", "--max_turns=2", "--max_staleness=0"])
    msgs = collect(cfg, e, tok, 4)
    diffs, same, fed = [], 0, 0
    for m in msgs:
        ids, mask = m["ids"], m["loss_mask"].bool()
        assert torch.equal(ids[mask], m["engine_ids"]) and (m["versions"][mask] == 0).all()
        with torch.no_grad():  # trainer-side recompute with model_moe on the same ids
            logits, routing = s["model"](ids[None], return_routing=True)  # routing (L, 1, T, k) or None
        lp = torch.log_softmax(logits[0, :-1].double(), -1).gather(-1, ids[1:, None])[:, 0]
        diffs.append((lp[mask[1:]] - m["logprobs"][mask].double()).abs())
        if s["cfg"].num_experts:  # the experts SGLang routed each fed position to are model_moe's
            got = m["routing"].long()  # (T, n_moe_layers, k); -1 where the server returned none
            want = routing[:, 0].transpose(0, 1)  # (T, L, k)
            rows = (got >= 0).all(-1)  # (T, L)
            same += (got.sort(-1).values == want.sort(-1).values).all(-1)[rows].sum().item()
            fed += rows.sum().item()
        else:
            assert m["routing"] is None
    d = torch.cat(diffs)
    print(f"trainer vs SGLang logprob |diff| over {d.numel()} tokens: mean {d.mean():.2e}, max {d.max():.2e}; "
          f"experts equal at {same} of {fed} (position, layer)s")
    assert d.numel() > 0 and d.mean() < 1e-5 and d.max() < 1e-4  # float32 on both sides
    if s["cfg"].num_experts:
        assert fed > 0 and same / fed > 0.99  # near-ties may flip a choice; none seen so far


@pytest.mark.slow
def test_sglang_weight_update_takes_effect_after_running_requests(sglang_server, tok, tok_dir):
    """A new version reaches the server (broadcast from the shared tensors to the MoE server, a directory to the
    dense one: each way once, which halves the test's minutes); a request running when it is published finishes
    under the old weights and is tagged with the old version (no pause and resume); the next requests are greedy
    under the new weights."""
    s, stop = sglang_server, tok.convert_tokens_to_ids("<|im_end|>")
    sync = "memory" if s["cfg"].num_experts else "disk"
    prompts = [agentkit.prompt_ids(tok, t) for t in ("Guess my number from 1 to 7.", "What is 3*4+5?")]
    old = Transformer(s["cfg"]).init_weights(0, std=0.3)
    new = Transformer(s["cfg"]).init_weights(11 if sync == "memory" else 13, std=0.3)
    shared = {k: v.clone().share_memory_() for k, v in old.state_dict().items()}  # what start_rollout makes
    version, lock = Counter(0), threading.Lock()
    link = types.SimpleNamespace(weights=shared, version=version, lock=lock)
    ro = rollout.Rollout(None, link)  # the trainer's publish into shared tensors
    memory = sync == "memory"
    write_weights(s["wdir"], s["cfg"], tok_dir, 0, old.state_dict())  # v0 again: an earlier update deleted it
    e = sglang_real_engine(s, tok, version, weights=shared if memory else None, lock=lock, temperature=0)
    long_prompt = prompts[0][:-2]  # no assistant header: the model rambles on rather than stop

    async def scenario():
        before = [await e.generate(p) for p in prompts]  # (the server may hold another test's weights: v0 first)
        running = asyncio.create_task(e.generate(long_prompt, max_new_tokens=200))
        while not e.in_flight:  # publish as soon as it runs: 200 tokens take the CPU server well over 0.1 s
            await asyncio.sleep(0.001)
        assert not running.done()
        t0 = time.monotonic()
        if memory:
            ro.publish(new.state_dict(), 1)
        else:
            write_weights(s["wdir"], s["cfg"], tok_dir, 1, new.state_dict())
            version.value = 1
        while e.version != 1:
            await asyncio.sleep(0.01)
        print(f"SGLang weight update ({sync}): {time.monotonic() - t0:.2f}s after publish")
        return before, await running, [await e.generate(p) for p in prompts]
    before, during, after = drive(e, scenario)
    assert [c.ids for c in before] == greedy_torch(old, prompts, stop)
    assert during.ids == greedy_torch(old, [long_prompt], stop, n=200)[0] and during.versions == [0] * len(during.ids)
    assert [c.ids for c in after] == greedy_torch(new, prompts, stop) != [c.ids for c in before]
    assert all(c.versions == [1] * len(c.ids) for c in after)
    assert os.path.exists(os.path.join(s["wdir"], "v1")) != memory  # in memory: no directory written
    shutil.rmtree(os.path.join(s["wdir"], "v1"), ignore_errors=True)


@pytest.mark.slow
def test_sglang_bad_token_id_fails_only_its_own_request(sglang_server, tok):
    """SGLang fails a whole /generate for one bad prompt: the engine checks ids first (as the torch engine does),
    so the request with an id past the vocabulary fails alone and the one sent beside it gets its tokens."""
    s = sglang_server  # in memory: the disk test above deleted v0
    e = sglang_real_engine(s, tok, Counter(0), weights=s["model"].state_dict(), lock=threading.Lock())

    async def together():  # one tick: one /generate would carry both
        return await asyncio.gather(e.generate([1, 2, 3]), e.generate([1, 2, s["cfg"].vocab_size + 5]),
                                    return_exceptions=True)
    good, bad = drive(e, together)
    print("beside the bad request:", repr(good)[:300], "| the bad one:", repr(bad)[:1000])
    assert isinstance(bad, ValueError) and "prompt ids must be ints" in str(bad)
    assert isinstance(good, agent.Completion) and good.ids and good.versions == [0] * len(good.ids)


@pytest.mark.slow
def test_killed_sglang_server_is_a_clear_error(sglang_server, tok):  # last: it kills the module's server
    s = sglang_server  # in memory: the disk test above deleted v0, as the engine does once v1 is loaded
    e = sglang_real_engine(s, tok, Counter(0), weights=s["model"].state_dict(), lock=threading.Lock())

    async def kill_then_generate():
        await e.generate([1, 2, 3])
        os.killpg(sglang_server["proc"].pid, 9)  # the server and its scheduler / detokenizer processes
        sglang_server["proc"].wait()
        return await e.generate([1, 2, 3])
    with pytest.raises(ServerError, match=r"(?s)unreachable.*last lines of .*sglang.log"):
        drive(e, kill_then_generate)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.usefixtures("sglang_device")
def test_sticky_routing_keeps_each_episodes_prefix_in_its_servers_radix_cache(tmp_path, tok, tok_dir, device):
    """Two real SGLang servers, 16 three-turn episodes at once, by the servers' own counts (meta_info.cached_tokens):
    with every call of an episode on one server, its later turns find the conversation so far in that server's radix
    cache; with the calls spread over both (no episode key: round-robin by call, the routing before sticky) they miss
    it about half the time. Each run starts on flushed caches (the engine loads its weights with flush_cache)."""
    cfg, c = config.load(sglang_flags(device, tmp_path)), tiny_config(len(tok))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    wdir, servers = str(tmp_path / "engine_weights"), []
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in SGLANG[device]["env"].items():
                mp.setenv(k, v)
            first = write_weights(wdir, c, tok_dir, 0, Transformer(c).init_weights(0, std=0.3).state_dict())
            servers = [start_server("sglang", first, cfg, str(tmp_path / f"sglang{k}.log")) for k in range(2)]

        async def episode(e, j, keyed):
            ids = agentkit.prompt_ids(tok, f"I guess {j}. {j + 1} is too high")  # distinct prompts
            for turn in range(3):
                out = (await e.generate(ids, key=(j, turn) if keyed else None)).ids
                ids = ids + out + [end] * (out[-1:] != [end]) + agentkit.turn_suffix(tok, "say a number")

        async def episodes(e, keyed):
            await asyncio.gather(*(episode(e, j, keyed) for j in range(16)))
        counts = {}
        for keyed in (True, False):
            e = ServerEngine("sglang", [u for _, u in servers], model_config=c, weights_dir=wdir, stop_ids=[end],
                             max_new_tokens=8, max_len=256, seed=0, sync="disk")
            drive(e, lambda: episodes(e, keyed))
            counts[keyed] = e.prompt_tokens.tolist()  # (prompt tokens sent, of them cached)
    finally:
        for p, _ in servers:
            stop_server(p)
    (sent, hit), (sent_rr, hit_rr) = counts[True], counts[False]
    print(f"sticky: {hit} of {sent} prompt tokens cached ({hit / sent:.0%}); round-robin: {hit_rr} of {sent_rr} "
          f"({hit_rr / sent_rr:.0%})")
    assert hit / sent > 0.5 and hit / sent > 1.3 * hit_rr / sent_rr


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.usefixtures("sglang_device")
def test_train_loop_against_sglang_moe(tmp_path, device):
    """The whole async loop with engine=sglang on the tiny MoE, on-policy: every step broadcasts new weights
    to the server; every trained token was sampled by it under the weights that train it, with the experts
    it routed to replayed in training; each version evaluated on the server, none of its episodes trained on."""
    ms = train_loop_on_policy(tmp_path, "sglang", sglang_flags(device, tmp_path), SGLANG[device]["env"])
    assert all(m["mismatch/logprob_abs_diff"] < 1e-5 and m["routing/flip_frac"] < 0.01 for m in ms), ms
    print("routing/flip_frac:", [m["routing/flip_frac"] for m in ms])
    assert os.listdir(tmp_path / "engine_weights") == []  # later versions went in memory; v0 deleted once v1 is in


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.usefixtures("sglang_device")
def test_sglang_serves_qwen3_vl_moe_with_images(tmp_path, tok, tok_dir, device):
    """A tiny Qwen3-VL-MoE on a real SGLang server: two turns, an 8-bit image of another size in each, sent as PNG
    data: URLs with one <|image_pad|> per image (SGLang expands it). The trainer's recompute on the same pixels gives
    the server's logprobs (float32) and experts; other pixels do not (the server saw the images)."""
    from test_vision import VISION

    from model_moe import ModelConfig
    from rollout import Policy, check_tokens, episode_to_msg
    pad = tok.convert_tokens_to_ids(agent.IMAGE_PAD)
    v = VISION | dict(depth=3, deepstack_visual_indexes=[0, 1, 2], hidden_size=16, intermediate_size=32, patch_size=4,
                      out_hidden_size=32, num_position_embeddings=4)
    c = ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=16, tie_word_embeddings=False, vision=v, mrope_section=[2, 1, 1], image_token_id=pad)
    model = Transformer(c).init_weights(0, std=0.3)
    cfg, wdir, log = config.load(sglang_flags(device, tmp_path)), str(tmp_path / "weights"), str(tmp_path / "s.log")
    with pytest.MonkeyPatch.context() as mp:
        for k, val in SGLANG[device]["env"].items():
            mp.setenv(k, val)
        proc, url = start_server("sglang", write_weights(wdir, c, tok_dir, 0, model.state_dict()), cfg, log, moe=True)
    e = ServerEngine("sglang", [url], logs=[log], model_config=c, weights_dir=wdir, max_new_tokens=4, max_len=256,
                     stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")], seed=0, sync="disk")

    async def episode(j):
        g, llm, ep = torch.Generator().manual_seed(j), Policy(e, tok, j), agent.Episode()
        for turn, (H, W) in enumerate([(16, 16), (8, 24)]):  # 2 x 2 and 1 x 3 image tokens
            text = agent.IMAGE_PAD * (H // 8 * W // 8) + agent.load_agent("count").__globals__["PROMPT"]
            ep.append_image(torch.randint(0, 256, (3, H, W), generator=g) / 255,
                            agentkit.turn_suffix(tok, text) if turn else agentkit.prompt_ids(tok, text))
            await agentkit.model_turn(llm, ep)
        return episode_to_msg(ep, j, j, check_tokens(ep, llm.calls))

    async def episodes():
        return await asyncio.gather(*(episode(j) for j in range(6)), return_exceptions=True)
    try:
        outs = drive(e, episodes)
        with pytest.raises(ValueError, match="8-bit images"):  # what a PNG cannot carry is refused, not rounded
            drive(e, lambda: Policy(e, tok).generate([1, pad, pad, pad, pad, 2], images=[torch.full((3, 16, 16), 0.3)]))
    finally:
        stop_server(proc)
    msgs = [m for m in outs if not isinstance(m, BaseException)]  # a sampled placeholder ends its episode (no image)
    assert len(msgs) >= 4 and all("image placeholders" in str(m) for m in outs if isinstance(m, BaseException))
    diff, other, same, fed = [], [], 0, 0
    for m in msgs:
        ids, mask = m["ids"], m["loss_mask"][1:].bool()
        with torch.no_grad():
            logits, routing = model(ids[None], images=m["images"], return_routing=True)
            flipped = model(ids[None], images=[im.flip(-1) for im in m["images"]])
        for out, acc in ((logits, diff), (flipped, other)):
            lp = torch.log_softmax(out[0, :-1].double(), -1).gather(-1, ids[1:, None])[:, 0]
            acc.append((lp - m["logprobs"][1:].double())[mask].abs())
        got, want = m["routing"].long(), routing[:, 0].transpose(0, 1)  # (T, n_moe, k); -1 where none was returned
        rows = (got >= 0).all(-1)
        same += (got.sort(-1).values == want.sort(-1).values).all(-1)[rows].sum().item()
        fed += rows.sum().item()
    d, o = torch.cat(diff), torch.cat(other)
    print(f"trainer vs SGLang with images: |diff| mean {d.mean():.1e}, max {d.max():.1e} over {d.numel()} tokens "
          f"(other pixels: max {o.max():.1e}); experts equal at {same} of {fed}")
    assert d.mean() < 1e-5 and d.max() < 1e-4 and o.max() > 1e-3
    assert fed > 0 and same / fed > 0.99
