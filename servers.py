"""servers.py: vLLM and SGLang server processes behind `await generate(ids)`, and their weight sync."""
import asyncio
import base64
import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import io
import itertools
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image

from agent import Completion, save_tokenizer
from engine import check_prompt, uniform
from model_moe import save_pretrained, to_hf_state

# ---- server engines: vLLM and SGLang over HTTP ----
# Servers run as their own processes (own Python, or other machines); ServerEngine.run moves them to new weights.
# weight_sync "gloo" (CPU servers) / "nccl" (GPU): SGLang in memory, the rollout process broadcasting the shared
# tensors `publish` fills (rank 0; server k: rank k + 1, tp 1). "disk" (vLLM; others): a directory per version.


class ServerError(RuntimeError):
    """A server died, is unreachable or refused a call: the rollout stops (a dead server is never a hang)."""


def _http(url, body=None, timeout=600.0):
    """POST `body` as JSON (GET when None) -> the decoded JSON answer, or its text."""
    req = urllib.request.Request(url, None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as response:
        text = response.read().decode()
    with contextlib.suppress(ValueError):
        return json.loads(text)
    return text


def vllm_command(model_dir, port, cfg, moe):
    """-> (arguments after the interpreter, environment) that start vLLM's OpenAI-compatible server."""
    argv = ["-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", cfg.dtype, "--max-model-len", str(cfg.engine_max_len),
            "--seed", str(cfg.seed), "--logprobs-mode", "processed_logprobs",  # of the distribution sampled from
            "--generation-config", "vllm"]  # no sampling defaults from the checkpoint: ours are explicit
    # dev mode serves /pause, /resume, /collective_rpc, /reset_prefix_cache; the CPU build needs a KV size (GiB)
    return argv, {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}


def _routed_experts(answer, decode):  # its base64 field's bytes, decoded; None where the answer has none
    if not answer.get("routed_experts"):
        return None
    return decode(base64.b64decode(answer["routed_experts"]))


def vllm_generate(url, prompts, params, timeout):
    """/v1/completions, one token-id prompt a call (a list shares one seed: a group's equal prompts, equal samples)."""
    (ids,), (p,) = prompts, params
    choice = _http(url + "/v1/completions", {
        "prompt": ids, "max_tokens": p["max_new_tokens"], "temperature": p["temperature"], "top_p": p["top_p"],
        "top_k": p["top_k"] or -1, "stop_token_ids": p["stop_ids"], "seed": p["seed"], "logprobs": 0,  # sampled only
        "return_token_ids": True, "skip_special_tokens": False}, timeout)["choices"][0]
    experts = _routed_experts(choice, lambda data: np.load(io.BytesIO(data)))  # .npy bytes
    return [(choice["token_ids"], choice["logprobs"]["token_logprobs"], experts, 0)]  # cached tokens: not reported


def vllm_load_weights(url, path, timeout):
    """Reload weights in place from `path`, between a pause (running requests finish) and a resume."""
    _http(url + "/pause?mode=wait", {}, timeout)
    _http(url + "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}}, timeout)
    if not _http(url + "/reset_prefix_cache", {}, timeout)["success"]:
        raise ServerError(f"{url}: /reset_prefix_cache failed after loading {path}")
    _http(url + "/resume", {}, timeout)


def sglang_command(model_dir, port, cfg, moe):
    argv = ["-m", "sglang.launch_server", "--model-path", model_dir, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", cfg.dtype, "--context-length", str(cfg.engine_max_len), "--random-seed", str(cfg.seed),
            "--sampling-defaults", "openai"]  # no sampling defaults from the checkpoint: ours are explicit
    if moe:
        argv.append("--enable-return-routed-experts")
    return argv, {}


def sglang_generate(url, prompts, params, timeout):
    """The native /generate with many prompts' input_ids (and each one's images, PNG data: URLs) -> per prompt (ids,
    logprobs, experts (T-1, layers, k), the prompt tokens its radix cache held)."""
    images = {"image_data": [p.get("images", []) for p in params]} if any("images" in p for p in params) else {}
    sampling = [{"max_new_tokens": p["max_new_tokens"], "temperature": p["temperature"], "top_p": p["top_p"],
                 "top_k": p["top_k"] or -1, "stop_token_ids": p["stop_ids"], "sampling_seed": p["seed"],
                 "skip_special_tokens": False, "no_stop_trim": True} for p in params]
    answers = _http(url + "/generate", images | {"input_ids": prompts, "return_logprob": True,
                    "return_routed_experts": params[0]["experts"], "sampling_params": sampling}, timeout)
    # meta_info.output_token_logprobs holds (logprob, id, _) per token; routed_experts is base64 of int32
    return [([t[1] for t in m["output_token_logprobs"]], [t[0] for t in m["output_token_logprobs"]],
             _routed_experts(m, lambda data: np.frombuffer(data, np.int32)), m.get("cached_tokens", 0))
            for m in (a["meta_info"] for a in answers)]


def sglang_load_weights(url, path, timeout):  # also flushes the radix cache: no prefix of the old weights is reused
    _http(url + "/update_weights_from_disk", {"model_path": path, "flush_cache": True}, timeout)


def sglang_join(url, join, timeout):  # the rollout's process group for in-memory weight updates
    _http(url + "/init_weights_update_group", join, timeout)


def sglang_receive(url, meta, timeout):
    """Take one version by broadcast (meta: names, dtypes, shapes in broadcast order); 0.5.23 needs begin/end."""
    for path in ("begin_weight_update", "update_weights_from_distributed", "end_weight_update"):
        _http(f"{url}/{path}", meta if path.startswith("update") else {}, timeout)


SERVERS = {"vllm": dict(command=vllm_command, generate=vllm_generate, load_weights=vllm_load_weights, batched=False),
           "sglang": dict(command=sglang_command, generate=sglang_generate, load_weights=sglang_load_weights,
                          batched=True)}  # /generate takes many prompts: a loop tick's requests in one call


class ServerEngine:
    """Episodes spread over the servers (data parallel), HTTP calls in threads; run() swaps weights."""
    def __init__(self, kind, urls, *, model_config, weights_dir, logs=None, temperature=1.0, top_p=1.0, top_k=0,
                 max_new_tokens=16, max_len=512, stop_ids=(), seed=0, version=None, timeout=600.0, concurrency=64,
                 weights=None, lock=None, sync="disk"):
        self.api = SERVERS[kind]
        self.urls, self.logs = list(urls), list(logs or [None] * len(urls))  # the servers, their logs (or None)
        self.c = model_config if kind == "sglang" else None  # SGLang takes images (Policy.generate checks them)
        self.top_k, self.vocab_size = model_config.num_experts_per_tok, model_config.vocab_size  # experts per token
        self.moe_layers = [i for i in range(model_config.num_hidden_layers) if model_config.is_moe_layer(i)]
        self.params = dict(temperature=temperature, top_p=top_p, top_k=top_k, stop_ids=list(stop_ids),
                           experts=bool(self.moe_layers))
        self.max_new, self.max_len = max_new_tokens, max_len
        self.seed = seed
        self.timeout = timeout
        self.stop_ids = set(stop_ids)  # the endpoint's too: a reply that ends with one is "stop"
        self.weights_dir, self.sync = weights_dir, sync  # where and how new weights come
        self.shared_version, self.lock = version, lock  # the trainer's latest published version, its weights' lock
        self.hf = None  # in-memory sync (sglang): the shared tensors under the servers' names (views), as written
        if weights is not None and sync != "disk":  # by write_weights: lm_head its own tensor
            lm_head = {"lm_head.weight": weights.get("lm_head.weight", weights["model.embed_tokens.weight"])}
            self.hf = to_hf_state(weights | lm_head, dataclasses.replace(model_config, tie_word_embeddings=False))
        self.group = self.meta = None  # in-memory sync: the broadcast's process group, what each server is told
        self.version = version.value if version is not None else 0  # tokens are tagged with it
        self.loaded = None  # the servers' version (None: unknown)
        self.failed = None  # a server call's exception: run() raises it
        self.open = asyncio.Event()  # admitting requests
        self.pool = concurrent.futures.ThreadPoolExecutor(concurrency + len(self.urls))  # one thread per call
        self.calls = itertools.count()
        self.tokens_generated, self.prompt_tokens = 0, np.zeros(2, int)  # sampled; prompt tokens sent, of them cached
        self.in_flight, self.home = {}, {}  # an answer's future -> its server; an episode -> its server
        self.queued = {server: [] for server in range(len(self.urls))}  # per server: the batch being formed

    async def generate(self, ids, max_new_tokens=None, key=None, sampling=None, images=None) -> Completion:
        max_new = check_prompt(ids, self.vocab_size, self.max_len, max_new_tokens or self.max_new)
        sent, at = [*ids], -1  # at: the last image placeholder
        for h, w in (self.c.grid(im) for im in images or []):  # SGLang expands each image's one placeholder itself
            at = sent.index(self.c.image_token_id, at + 1)  # its run of h * w becomes one
            del sent[at + 1:at + h * w]
        while self.shared_version is not None and self.shared_version.value != self.version:  # none on weights
            await asyncio.sleep(0.01)  # older than the published ones (an evaluation's are exactly its version's)
        await self.open.wait()  # closed while the servers change weights
        version = self.version
        call = next(self.calls)
        seed = int(uniform([[self.seed, *(key or (-1, call))]])[0] * 2**31)  # per request, as the torch engine's
        params = dict(self.params, max_new_tokens=max_new, seed=seed) | (sampling or {})  # draws (sampling_seed, seed)
        if images:
            params["images"] = [png_url(im) for im in images]
        # an episode's calls all go to one server (its radix cache keeps their shared prefix): the one with the fewest
        # requests in flight at its first call, ties by the episode's index modulo n; unkeyed calls: round-robin
        n = len(self.urls)
        if key and key[0] not in self.home:
            busy = [*self.in_flight.values()]
            self.home[key[0]] = min(range(n), key=lambda server: (busy.count(server), (server - key[0]) % n))
        out, logprobs, experts, cached = await self._submit(self.home[key[0]] if key else call % n, sent, params)
        self.tokens_generated += len(out)
        self.prompt_tokens += (len(ids), cached)  # what SGLang's radix cache saved (sticky routing: tests/test_servers)
        routing = None
        if experts is not None and self.moe_layers:  # every fed position: (T-1, layers, k)
            routing = torch.from_numpy(experts.astype(np.int16)).reshape(len(ids) + len(out) - 1, -1, self.top_k)
            if routing.shape[1] != len(self.moe_layers):  # a row per layer of the model: keep the MoE ones
                routing = routing[:, self.moe_layers]
            # (T, n_moe_layers, k) as Completion has it: -1 for the last sampled token, never fed
            routing = torch.cat([routing, routing.new_full((1, *routing.shape[1:]), -1)])
        return Completion(out, logprobs, [version] * len(out), routing)

    def _submit(self, server, ids, params):
        """-> a future of the server's answer, in in_flight till done; a loop tick's requests share a batched call."""
        if not self.queued[server] or not self.api["batched"]:
            self.queued[server] = []
            asyncio.ensure_future(self._send(server, self.queued[server]))  # held by the loop, then by its HTTP call
        fut = asyncio.get_running_loop().create_future()
        fut.add_done_callback(self.in_flight.pop)
        self.in_flight[fut] = server
        self.queued[server].append((ids, params, fut))
        return fut

    async def _send(self, server, batch):
        if self.queued[server] is batch:  # closed: later requests start the next
            self.queued[server] = []
        try:
            prompts, params, _ = map(list, zip(*batch))  # (ids, params, future) per request
            outs = await self._call(server, self.api["generate"], prompts, params, self.timeout)
        except Exception as e:  # every caller sees the failure, and run() raises it: prompts are checked, so a
            self.failed = e  # failed call is the server's (the rollout stops, chat agents too)
            outs = [e] * len(batch)
        for (*_, fut), out in zip(batch, outs):  # a future is done already where its agent was cancelled meanwhile
            if not fut.done() and isinstance(out, Exception):
                fut.set_exception(out)
            elif not fut.done():
                fut.set_result(out)

    async def _call(self, server, fn, *args):
        """fn(the server's url, *args) in a thread; any failure is a ServerError naming the server, with its log."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, self.urls[server], *args)
        except urllib.error.HTTPError as e:
            raise ServerError(f"{self.urls[server]} answered {e.code}: {e.read().decode(errors='replace')[-2000:]}"
                              f"{log_tail(self.logs[server])}") from e
        except OSError as e:  # refused, reset, timed out
            raise ServerError(f"server {self.urls[server]} is unreachable ({e}){log_tail(self.logs[server])}") from e

    async def run(self):
        """Each new shared version: every server moves to it with admission closed; later tokens are tagged with it."""
        while True:
            if self.failed is not None:
                raise self.failed
            target = self.shared_version.value if self.shared_version is not None else self.version
            if target != self.loaded:
                self.open.clear()
                if self.in_flight:
                    await asyncio.wait(self.in_flight)
                if self.hf is not None:
                    target = await self._sync_in_memory()  # the trainer may have published again meanwhile
                else:
                    path = os.path.join(self.weights_dir, f"v{target}")
                    await asyncio.gather(*(self._call(server, self.api["load_weights"], path, self.timeout)
                                           for server in range(len(self.urls))))
                self.version = self.loaded = target
                for name in os.listdir(self.weights_dir):  # older versions: no server will read them again
                    if name[:1] == "v" and name[1:].isdigit() and int(name[1:]) < target:
                        shutil.rmtree(os.path.join(self.weights_dir, name), ignore_errors=True)
            self.open.set()
            await asyncio.sleep(0.01)

    async def _sync_in_memory(self):
        """Broadcast the shared tensors to every server -> their version. The first call forms the group."""
        loop = asyncio.get_running_loop()
        n = len(self.urls)
        gloo = self.sync == "gloo"
        if self.group is None:
            with socket.create_connection(urllib.parse.urlsplit(self.urls[0]).netloc.rsplit(":", 1)) as sock:
                address = sock.getsockname()[0]  # ours, on the route to the servers: where they find the store
            td = datetime.timedelta(0, self.timeout)
            store = dist.TCPStore(address, 0, n + 1, True, td, wait_for_workers=False)
            name = f"nanomolt{store.port}"  # a server refuses a second group of one name
            join = {"master_address": address, "master_port": store.port, "world_size": n + 1, "backend": self.sync,
                    "group_name": name}
            # SGLang (init_custom_process_group) nests the store in these prefixes; a group made this way is not
            # registered with torch.distributed: its collectives are called on it directly
            for prefix in (name, name + "/", "cpu/" if gloo else "cuda/"):
                store = dist.PrefixStore(prefix, store)
            make = functools.partial(dist.ProcessGroupGloo, timeout=td) if gloo else dist.ProcessGroupNCCL
            joins = [self._call(server, sglang_join, dict(join, rank_offset=server + 1), self.timeout)
                     for server in range(n)]  # each answers once all ranks joined
            self.group, *_ = await asyncio.gather(loop.run_in_executor(self.pool, make, store, 0, n + 1), *joins)
            self.meta = {"names": list(self.hf), "dtypes": [str(t.dtype)[6:] for t in self.hf.values()],  # "torch.x"
                         "shapes": [list(t.shape) for t in self.hf.values()], "group_name": name, "flush_cache": True}

        def broadcast():  # in a thread, under the weights lock (the trainer never writes mid-broadcast)
            with self.lock:
                for tensor in self.hf.values():
                    self.group.broadcast(tensor.contiguous() if gloo else tensor.cuda(), 0).wait()
                return self.shared_version.value
        receives = [self._call(server, sglang_receive, self.meta, self.timeout) for server in range(n)]
        return (await asyncio.gather(loop.run_in_executor(self.pool, broadcast), *receives))[0]  # broadcast's version


def png_url(im):
    """(3, H, W) in [0, 1] -> a PNG data: URL; a ValueError for values a PNG cannot carry exactly (not k / 255)."""
    pixels = (im * 255).round()
    if not torch.equal(pixels / 255, im):
        raise ValueError("a server takes 8-bit images (values k / 255, as a PNG or JPEG decodes): quantize it first")
    buf = io.BytesIO()
    Image.fromarray(pixels.byte().permute(1, 2, 0).numpy()).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def write_weights(weights_dir, model_cfg, tokenizer_dir, version, state):
    """The trainer's full state dict as a Hugging Face directory `<weights_dir>/v<version>` -> its path; written under
    a temporary name, renamed (no server reads half of one); lm_head untied: vLLM's in-place reload skips a tied one."""
    final = os.path.join(weights_dir, f"v{version}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    state = dict(state, **{"lm_head.weight": state.get("lm_head.weight", state["model.embed_tokens.weight"]).clone()})
    save_pretrained(tmp, dataclasses.replace(model_cfg, tie_word_embeddings=False), state)
    save_tokenizer(tokenizer_dir, tmp)
    if vision := model_cfg.vision:  # SGLang's Qwen3-VL image processor, with bounds that resize none of our images
        f = vision["patch_size"] * vision["spatial_merge_size"]  # (their sides are multiples of f; the endpoint
        with open(os.path.join(tmp, "preprocessor_config.json"), "w") as fh:  # resized chat images already)
            json.dump(dict(image_processor_type="Qwen2VLImageProcessor", image_mean=[0.5] * 3, image_std=[0.5] * 3,
                           merge_size=vision["spatial_merge_size"], size={"shortest_edge": f**2, "longest_edge": 2**24},
                           **{k: vision[k] for k in ("patch_size", "temporal_patch_size")}), fh)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def start_server(kind, model_dir, cfg, log, moe=False):
    """Start a server (its own process group: see stop_server), output to `log`; wait until healthy -> (process, url)"""
    for port in np.random.default_rng().choice(range(20000, 32768), 64, replace=False).tolist():  # a free port
        with socket.socket() as sock, contextlib.suppress(OSError):  # below Linux's ephemeral range (32768-60999):
            sock.bind(("127.0.0.1", port))  # one from there, once released, can go to another process's connection
            break
    argv, env = SERVERS[kind]["command"](model_dir, port, cfg, moe)
    print(f"starting the {kind} server (log: {log}; server_timeout={cfg.server_timeout:.0f}s)", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
    with open(log, "ab") as fh:
        proc = subprocess.Popen([cfg.server_python or sys.executable, *argv, *shlex.split(cfg.server_args)],
                                stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, env=os.environ | env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, cfg.server_timeout, proc, log)
    except BaseException:
        stop_server(proc)
        raise
    return proc, url


def wait_healthy(url, timeout, proc=None, log=None):
    deadline = time.monotonic() + timeout
    while proc is None or proc.poll() is None:
        with contextlib.suppress(OSError):  # not listening yet, or 503 while loading
            return _http(url + "/health", timeout=5)
        if time.monotonic() > deadline:
            raise ServerError(f"server {url} not healthy after {timeout:.0f}s (server_timeout){log_tail(log)}")
        time.sleep(1)
    raise ServerError(f"server {url} exited with code {proc.returncode} while starting{log_tail(log)}")


def stop_server(proc):
    """Stop a server started by start_server and every process of its group (vLLM has engine workers)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=15)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def log_tail(path, n_bytes=3000):
    """'; last lines of <path>: ...' for error messages ('' when there is no log)."""
    if not path or not os.path.isfile(path):
        return ""
    with open(path, "rb") as log:  # a server's log grows all run: read its tail only
        log.seek(max(0, os.path.getsize(path) - n_bytes))
        return f"; last lines of {path}:\n" + log.read().decode(errors="replace")

