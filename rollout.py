"""rollout.py: the rollout process. Agents run against an engine (engine.py, servers.py's), each episode is checked
(check_tokens), finished groups go to the trainer over a bounded queue; held-out evaluation runs here too."""
import asyncio
import contextlib
import ctypes
import functools
import itertools
import json
import math
import os
import queue as queue_mod
import signal
import sys
import time
import traceback
import types
from collections import deque

import numpy as np
import torch
import torch.multiprocessing as mp

import agent as agent_mod
import endpoint
import estimators as est
from engine import TorchEngine
from model_moe import Transformer
from servers import ServerEngine, ServerError, log_tail, start_server, stop_server, wait_healthy, write_weights


class Policy:
    """What an agent sees as `llm`: a tokenizer and `await llm.generate(ids)`; one per episode, its calls recorded."""
    def __init__(self, engine, tokenizer, episode=None, sampling=None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.calls = []  # (prompt ids, Completion, images) of each call the engine answered
        self.closed = False  # the episode timed out
        self.full = False  # the engine had no room for a call (ContextFull)
        self.sampling = sampling or {}  # an evaluation's temperature, top_p, max_new_tokens; {}: the run's
        self.keys = itertools.repeat(None) if episode is None else zip(itertools.repeat(episode), itertools.count())
        # endpoint.attach sets the chat endpoint's address and key; the episode's record there follows
        self.api_key = None
        self.model = None
        self.base_url = None
        self.segs = []  # {"ep", "ids", "calls", "text"} for each segment of the conversation
        self.lock = asyncio.Lock()  # one call of the episode at a time
        # tool calls, good and malformed; requests whose own sampling the run's replaced; hosted tools left out
        self.counts = dict.fromkeys(["tool_calls", "malformed_tool_calls", "sampling_overridden",
                                     "hosted_tools_dropped"], 0)

    async def generate(self, ids, max_new_tokens=None, images=None):
        """images: a list of (C, H, W) tensors in [0, 1], one per run of placeholders in ids, in order."""
        if self.closed:  # the episode timed out: an agent that swallowed its cancellation gets no more tokens
            raise RuntimeError("this episode has timed out; its policy is closed")
        images = check_images(ids, images, getattr(self.engine, "c", None))  # bad input fails here, in the agent
        sampling = {k: v for k, v in self.sampling.items() if k != "max_new_tokens"}
        if max_new_tokens is None:  # an evaluation's limit; the agent's own wins
            max_new_tokens = self.sampling.get("max_new_tokens")
        try:
            completion = await self.engine.generate(ids, max_new_tokens, images=images, key=next(self.keys),
                                                    sampling=sampling)
        except agent_mod.ContextFull:
            self.full = True  # an agent that gives up now (a chat agent's client raises the 400) is truncated
            raise
        self.calls.append((list(ids), completion, images))
        return completion


def check_images(ids, images, mc):
    """-> the images as float (C, H, W), or None; ValueError if bad. mc: the engine's ModelConfig (None: text)"""
    images = list(images if images is not None else [])
    if mc is None or not mc.vision:
        if images:
            raise ValueError("images given, but the engine takes none (a text model, or vLLM)")
        return None
    f = mc.vision["patch_size"] * mc.vision["spatial_merge_size"]
    for i, im in enumerate(images):
        if not (isinstance(im, torch.Tensor) and im.is_floating_point() and im.dim() == 3 and len(im) == 3
                and all(s >= f and s % f == 0 for s in im.shape[1:]) and bool(((im >= 0) & (im <= 1)).all())):
            got = tuple(im.shape) if isinstance(im, torch.Tensor) else type(im).__name__
            raise ValueError(f"image {i}: {got}, the model takes float (3, H, W) in [0, 1], H and W multiples of {f}")
    mc.check_placeholders(sum(t == mc.image_token_id for t in ids), images)
    return [im.float() for im in images] if images else None


class Malformed(Exception):
    """An episode that fails check_tokens, check_images or validate: dropped, nothing malformed is trained."""


COUNTS = ("agent_errors", "agent_timeouts", "malformed")  # episodes dropped, by cause
CAUSES = ((asyncio.TimeoutError, "agent_timeouts"), (Malformed, "malformed"))  # by the error's class; else agent_errors


def check_tokens(ep, calls):
    """The trainer must train exactly the tokens the engine saw and sampled (ValueError otherwise) -> the engine's
    record: logprobs, versions [T] (0.0, -1 where mask 0), routing (T, n_moe, k) int16 or None (-1: not run), ids."""
    T = len(ep.ids)
    logprobs = [0.0] * T
    versions = [-1] * T
    routing = None
    for prompt, out, images in calls:  # out: the engine's Completion
        p, n = len(prompt), len(out.ids)  # the call's tokens are ep.ids[p:p + n]
        if not n == len(out.logprobs) == len(out.versions):
            raise ValueError(f"sampled lengths differ: ids {n}, logprobs {len(out.logprobs)}, "
                             f"versions {len(out.versions)}")
        if not all(math.isfinite(lp) and v >= 0 for lp, v in zip(out.logprobs, out.versions)):
            raise ValueError(f"a sampled token at position {p} has a non-finite logprob or no policy version")
        if ep.ids[:p] != prompt or ep.ids[p:p + n] != out.ids or not all(ep.loss_mask[p:p + n]):
            raise ValueError(f"token mismatch: the episode does not contain the engine's call at position {p}")
        if images is not None and not (len(ep.images) >= len(images) and all(
                torch.equal(a.float(), b) for a, b in zip(ep.images, images))):
            raise ValueError(f"image mismatch: the episode's images differ from the engine's call at position {p}")
        logprobs[p:p + n], versions[p:p + n] = out.logprobs, out.versions
        if out.routing is not None:
            if out.routing.dim() != 3 or len(out.routing) != p + n:
                raise ValueError(f"completion routing shape {tuple(out.routing.shape)}, expected "
                                 f"(prompt + sampled = {p + n}, n_moe_layers, top_k)")
            if routing is None:
                routing = torch.full((T, *out.routing.shape[1:]), -1, dtype=torch.int16)
            known = out.routing >= 0  # the latest computation of a position wins; -1: not computed (a cache hit)
            routing[:p + n][known] = out.routing[known].to(torch.int16)
    engine_ids = torch.tensor([t for _, out, _ in calls for t in out.ids], dtype=torch.long)  # all it sampled
    if sum(ep.loss_mask) != len(engine_ids):
        raise ValueError(f"token mismatch: loss_mask marks {sum(ep.loss_mask)} tokens, "
                         f"the engine sampled {len(engine_ids)}")
    return logprobs, versions, routing, engine_ids


def truncated_episode(calls):
    """ContextFull: the conversation to its last completion, trained as is (dropping biases to short ones), reward 0."""
    prompt, out, images = calls[-1]  # out: the engine's Completion
    ep = agent_mod.Episode(ids=prompt + out.ids, loss_mask=[0] * (len(prompt) + len(out.ids)),
                           images=list(images) if images is not None else [], info={"truncated": 1})
    for prompt, out, _ in calls:
        ep.loss_mask[len(prompt):len(prompt) + len(out.ids)] = [1] * len(out.ids)
    return ep

# ---- the rollout process: agents -> episodes -> the shared-memory queue ----


def episode_to_msg(ep, index, group, record):
    """An episode as named tensors; record: check_tokens'; the group is the rollout's, never the agent's."""
    logprobs, versions, routing, engine_ids = record
    return {"ids": torch.tensor(ep.ids), "loss_mask": torch.tensor(ep.loss_mask), "versions": torch.tensor(versions),
            "logprobs": torch.tensor(logprobs, dtype=torch.float32), "routing": routing,  # (T, n_moe, k) or None
            "engine_ids": engine_ids, "images": [im.float().cpu() for im in ep.images],  # (C, H, W) each, on the CPU
            "reward": float(ep.reward), "group": group, "index": index,
            "info": {k: float(v) for k, v in ep.info.items()}}


def dump_row(msg, tokenizer):
    """An episode message as a row of a dump (what tools/view.py shows): its text, and each token's own fields."""
    ids = msg["ids"].tolist()
    return {"group": msg["group"], "reward": msg["reward"], "info": msg["info"], "text": tokenizer.decode(ids),
            "ids": ids, "pieces": tokenizer.batch_decode([[t] for t in ids]), "mask": msg["loss_mask"].tolist(),
            "logprobs": msg["logprobs"].tolist(), "versions": msg["versions"].tolist()}


def pack(group):
    """A group's messages -> one queue item, their tensors as numpy arrays: pickled by value (a tensor passes a file
    descriptor each)."""
    return [{k: _each(v, torch.Tensor, torch.Tensor.numpy) for k, v in m.items()} for m in group]


def unpack(item):
    """pack's inverse: the group's messages (their tensors are views of the arrays)."""
    return [{k: _each(v, np.ndarray, torch.from_numpy) for k, v in m.items()} for m in item]


def _each(value, kind, fn):
    """fn(value) if value is a `kind`, or on each of a list (images); anything else as it is"""
    if isinstance(value, list):
        return [_each(v, kind, fn) for v in value]
    return fn(value) if isinstance(value, kind) else value


def rollout_main(cfg, model_cfg, link, start_index, tokenizer_dir, state):
    """The rollout process's entry; link: start_rollout's (servers: [(url, log path or None)], None: torch engine)."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: a trainer killed with -9 takes this process along
    if os.getppid() != mp.parent_process().pid:  # ... also if it died before the line above ran
        os._exit(1)
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C reaches the whole process group: the trainer alone
        signal.signal(sig, signal.SIG_IGN)  # decides, checkpoints, then stops this process (Rollout.close)
    torch.set_num_threads(1)
    try:
        # not asyncio.run: on an error its cleanup cancels every task at once, and a tool subprocess cancelled
        # that way (CPython 3.11) never finishes, so the process would hang instead of exiting below
        asyncio.new_event_loop().run_until_complete(_rollout(cfg, model_cfg, link, start_index, tokenizer_dir, state))
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # now: sys.exit would first wait for threads still blocked in HTTP calls to servers


async def _rollout(cfg, model_cfg, link, start_index, tokenizer_dir, state):
    tok = agent_mod.load_tokenizer(tokenizer_dir)
    sampling = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.max_new_tokens,
                    max_len=cfg.engine_max_len, stop_ids=agent_mod.stop_ids(tok, tokenizer_dir), seed=cfg.seed,
                    version=link.version, lock=link.lock)
    if link.servers is not None:
        engine = ServerEngine(cfg.engine, [u for u, _ in link.servers], logs=[log for _, log in link.servers],
                              weights_dir=os.path.abspath(os.path.join(cfg.out_dir, "engine_weights")),
                              timeout=cfg.server_timeout, concurrency=cfg.concurrent_agents, weights=link.weights,
                              sync=cfg.weight_sync, model_config=model_cfg, **sampling)
    else:  # the model's parameters are the shared tensors, which each publish overwrites
        with torch.device("meta"):
            model = Transformer(model_cfg)
        model.load_state_dict(link.weights, assign=True)  # (tied: lm_head.weight is published too)
        engine = TorchEngine(model, slots=cfg.engine_slots, **sampling)
    # neither returns: the first error, the engine's or the producer's, ends the rollout process (rollout_main)
    await asyncio.gather(engine.run(), produce(cfg, engine, tok, link.out_q, link.dropped, start_index,
                                               model_cfg.vocab_size, state, link.evals))


KNOBS = ("seed", "group_size", "guess_max", "max_turns", "tool_timeout", "tool_memory_mb", "sandbox_unsafe",
         "image_size", "patch_size", "task_file", "arith_prompt")  # the config fields make_task reads


def eval_tasks(cfg):
    """The held-out tasks, eval_samples per prompt, at indices -1, -2, ... (the trainer refuses any). Prompt p is group
    2**40 + p, never reached by training (negative groups would be: Random(-n) is Random(n))."""
    K = cfg.eval_samples
    knobs = {k: getattr(cfg, k) for k in KNOBS} | dict(group_size=1, task_file=cfg.eval_file)
    return [agent_mod.make_task(cfg.eval_task or cfg.task, 2**40 + j // K, **knobs) | {"index": -1 - j,
            "group": -1 - j // K} for j in range(cfg.eval_prompts * K)]


async def evaluate(cfg, episode, tokenizer, version, out):
    """Weights `version` on eval_tasks, outside training's window and queue -> eval/step_<version>.jsonl and `out`."""
    t0 = time.perf_counter()
    tasks = eval_tasks(cfg)
    K = cfg.eval_samples
    sampling = dict(temperature=cfg.eval_temperature, top_p=cfg.eval_top_p,
                    max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens)
    run = agent_mod.load_agent(cfg.eval_task or cfg.task)
    done = await asyncio.gather(*(episode(t, t["index"], run, sampling) for t in tasks), return_exceptions=True)
    if err := next((e for e in done if isinstance(e, ServerError)), None):
        raise err
    eps = {t["index"]: ms for t, ms in zip(tasks, done) if not isinstance(ms, BaseException)}  # segments of each
    if stale := [i for i, ms in eps.items() for m in ms if (m["versions"][m["loss_mask"] == 1] != version).any()]:
        raise AssertionError(f"evaluation of version {version}: episodes {stale} hold tokens other weights sampled")
    rewards = torch.tensor([eps[t["index"]][0]["reward"] if t["index"] in eps else 0.0 for t in tasks]).view(-1, K)
    os.makedirs(os.path.join(cfg.out_dir, "eval"), exist_ok=True)
    with open(os.path.join(cfg.out_dir, "eval", f"step_{version}.jsonl"), "w") as f:
        for t, ms in zip(tasks, done):
            for row in [{"error": repr(ms)}] if isinstance(ms, BaseException) else [dump_row(m, tokenizer) for m in ms]:
                f.write(json.dumps({"step": version, "index": t["index"], "prompt": -1 - t["group"]} | row) + "\n")
    ended = torch.tensor([t["index"] in eps for t in tasks]).view(-1, K)
    passed = ended & (rewards >= cfg.eval_pass_reward)  # (P, K), P: eval_prompts; a failed episode never passes
    n = max(len(eps), 1)  # the episodes that ended
    out.put({"eval/reward_mean": sum(ms[0]["reward"] for ms in eps.values()) / n,
             "eval/pass@1": est.pass_at_k(passed=passed, k=1).mean().item(),
             f"eval/pass@{K}": est.pass_at_k(passed=passed, k=K).mean().item(),
             f"eval/mean@{K}": rewards.mean().item(),  # over all P * K, a failed episode's 0 too
             "eval/response_tokens": sum(int(m["loss_mask"].sum()) for ms in eps.values() for m in ms) / n,
             "eval/failed": len(tasks) - len(eps), "eval/episodes": len(tasks), "eval/time": time.perf_counter() - t0,
             "eval/truncated": sum(any(m["info"].get("truncated") for m in ms) for ms in eps.values())})


async def run_episode(cfg, engine, tokenizer, server, vocab_size, task, index, run, sampling=None):
    """One agent on one task -> its messages, one per segment; raises TimeoutError, Malformed or the agent's error."""
    llm = endpoint.attach(server, Policy(engine, tokenizer, index, sampling))  # base_url, api_key, model for chat
    agent_task = asyncio.ensure_future(run(task, llm))
    if not (await asyncio.wait([agent_task], timeout=cfg.episode_timeout))[0]:  # (done, pending)
        # not wait_for: it waits for the cancelled agent to finish, forever if the agent swallows the
        # cancellation, and its group would hold a place in the staleness window for good
        llm.closed = True
        agent_task.cancel()
        agent_task.add_done_callback(lambda t: t.cancelled() or t.exception())  # nothing to report later
        raise asyncio.TimeoutError(f"agent still running after episode_timeout={cfg.episode_timeout} s")
    # an agent that gave up when the engine had no room (ContextFull) is not dropped: its episode is truncated
    truncated = bool(llm.full and llm.calls and agent_task.exception() is not None)
    if not truncated:
        result = agent_task.result()  # an Episode, or a chat agent's reward
    else:  # reward 0: a chat agent's segments as the endpoint recorded them, else the calls to the last one
        result = 0.0 if llm.segs else truncated_episode(llm.calls)
    try:  # a chat agent returned its reward: its episodes (one per segment) come from the endpoint's record
        pairs = [(result, llm.calls)] if isinstance(result, agent_mod.Episode) else endpoint.segments(llm, result)
        msgs = []
        for ep, calls in pairs:
            ep.info |= {"truncated": 1} if truncated else {}
            record = check_tokens(ep, calls)
            check_images(ep.ids, ep.images, getattr(engine, "c", None))  # e.g. a placeholder the policy sampled
            ep.validate(vocab_size)
            msgs.append(episode_to_msg(ep, index, index // cfg.group_size, record))
    except ValueError as e:  # nothing malformed reaches the trainer
        raise Malformed(str(e)) from e
    return msgs


async def produce(cfg, engine, tokenizer, out_q, dropped, start_index, vocab_size, state=None, evals=None):
    """Run agents; queue each group whole once all its episodes ended, admitting groups within the staleness window.
    state: a checkpoint's COUNTS (deterministic: and index, base); evals: (version, metrics' queue)."""
    G = cfg.group_size
    P = cfg.prompts_per_step
    run = agent_mod.load_agent(cfg.task)
    knobs = {k: getattr(cfg, k) for k in KNOBS}
    server = await endpoint.serve(tokenizer, dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k),
                                  engine.stop_ids)
    episode = functools.partial(run_episode, cfg, engine, tokenizer, server, vocab_size)  # (task, index, run, ...)
    first = math.ceil(start_index / G)  # resume at the first group not yet started (whole groups only)
    # base: the window's origin in groups, one later for each group that failed whole
    counts = {"index": first * G, "base": first - engine.version * P} | dict.fromkeys(COUNTS, 0) | (state or {})
    index = counts.pop("index")  # the next episode to start
    base = counts.pop("base")
    in_a_row = 0  # groups that failed whole in a row
    running = {}  # asyncio task -> its episode's index
    groups = {}  # group -> the messages of each of its episodes that ended
    idle = None  # deterministic: the (version, dropped) last reported idle
    asked = -1  # the version the trainer last asked to evaluate
    evaluation = None  # its asyncio task, while it runs
    pending = deque()  # finished groups waiting for queue room (back-pressure)

    while True:
        published = engine.shared_version.value if engine.shared_version is not None else engine.version
        drops = dropped.value
        if evals is not None and evals[0].value > asked:  # the trainer asks for an evaluation of its latest version
            asked = evals[0].value
            evaluation = asyncio.ensure_future(evaluate(cfg, episode, tokenizer, asked, evals[1]))
        if evaluation is not None and evaluation.done():
            evaluation.result()  # its error (a server's, a version's) ends the rollout
            evaluation = None

        window_end = base + drops + (published + 1 + cfg.max_staleness) * P  # the first group the window excludes
        while not cfg.eval_only and len(running) < cfg.concurrent_agents and index // G < window_end:
            agent = episode(agent_mod.make_task(cfg.task, index, **knobs), index, run)
            running[asyncio.create_task(agent)] = index
            index += 1
        if cfg.deterministic and not running and idle != (published, drops):  # a state to resume from
            idle = (published, drops)
            pending.append({"idle": idle, "state": dict(counts, index=index, base=base)})

        if running:
            done, _ = await asyncio.wait(running, timeout=0.01, return_when=asyncio.FIRST_COMPLETED)
        else:  # asyncio.wait takes no empty set
            done = await asyncio.sleep(0.01, result=())
        for ended in done:
            ep_index = running.pop(ended)
            err = ended.exception()
            failed = getattr(engine, "failed", None)  # a server failed (where a chat agent only saw a 503)
            if failed or isinstance(err, ServerError):  # not the agent's fault, and every later call would fail too
                raise failed or err
            msgs = []  # a dropped episode's
            if err is None:
                msgs = [m | {"stats": dict(counts, tokens_generated=engine.tokens_generated)} for m in ended.result()]
            else:
                key = next((name for cls, name in CAUSES if isinstance(err, cls)), "agent_errors")
                counts[key] += 1
                print(f"[rollout] episode {ep_index} dropped ({key}): {err!r}", file=sys.stderr)
            groups.setdefault(ep_index // G, []).append(msgs)
            if len(groups[ep_index // G]) == G:  # the group has ended: send what is left of it, or free its place
                kept = sorted((m for ms in groups.pop(ep_index // G) for m in ms), key=lambda m: m["index"])
                if kept:
                    pending.append(pack(kept))
                    in_a_row = 0
                else:  # a failed group lets another group start in its place
                    base += 1
                    in_a_row += 1
                if in_a_row >= cfg.max_failed_groups:  # an agent that always fails would have us spin for good
                    raise RuntimeError(f"{in_a_row} groups in a row failed (max_failed_groups); last error: {err!r}")

        with contextlib.suppress(queue_mod.Full):  # what does not fit waits for the trainer to take some
            while pending:
                out_q.put_nowait(pending[0])
                pending.popleft()


def start_rollout(cfg, model_cfg, weights, start_version, start_index, tokenizer_dir, state=None, dropped=0):
    """Rank 0: the rollout process, and the servers unless server_urls names them (state, dropped: a checkpoint's)."""
    ctx = mp.get_context("spawn")
    # in the compute dtype: the torch engine's parameters (a GPU's reach it by CUDA IPC), or SGLang's broadcast
    device = "cuda" if cfg.engine == "torch" and torch.cuda.is_available() else "cpu"
    shared = {k: v.to(device, getattr(torch, cfg.dtype), copy=True).share_memory_()
              for k, v in weights.items()} if cfg.weights_in_memory else None
    write = functools.partial(write_weights, os.path.join(cfg.out_dir, "engine_weights"), model_cfg, tokenizer_dir)
    procs = []  # the servers started here: [(process, log path)]
    servers = None  # [(url, log path or None)]; None: the torch engine
    if cfg.engine != "torch":  # the servers start from the first version's directory
        first = write(start_version, weights)
        if cfg.server_urls:  # servers started elsewhere: wait for them
            servers = [(u.strip().rstrip("/"), None) for u in cfg.server_urls.split(",") if u.strip()]
            for url, _ in servers:
                wait_healthy(url, cfg.server_timeout)
        else:
            log = os.path.join(cfg.out_dir, f"{cfg.engine}_server.log")
            server_proc, url = start_server(cfg.engine, first, cfg, log, moe=model_cfg.num_experts > 0)
            procs, servers = [(server_proc, log)], [(url, log)]
    link = types.SimpleNamespace(weights=shared, version=ctx.Value("l", start_version), lock=ctx.Lock(),
                                 out_q=ctx.Queue(maxsize=cfg.queue_size), dropped=ctx.Value("l", dropped),
                                 servers=servers, evals=(ctx.Value("l", -1), ctx.Queue()))
    proc = ctx.Process(target=rollout_main, daemon=True, name="nanomolt-rollout",
                       args=(cfg, model_cfg, link, start_index, tokenizer_dir, state))
    proc.start()
    return Rollout(proc, link, procs, None if cfg.weights_in_memory else write, cfg.deterministic)


class Rollout:
    """The trainer's handle on the rollout process (and on the inference servers it started); link: start_rollout's."""
    def __init__(self, proc, link, servers=(), write=None, deterministic=False):
        self.proc = proc
        self.link = link
        self.servers = servers  # [(process, log path)]
        self.write = write  # (version, weights) -> a directory the servers load; None: into the shared tensors
        self.deterministic = deterministic
        self.held = deque()  # settled groups, untrained
        self.idle = None  # the rollout's last report that all it admitted has ended (settle)
        self.died = None  # why the rollout process (or a server) died: every wait then returns, the trainer stops

    def get(self, timeout=1.0, stop=lambda: None):
        """Next group (its messages), or None after `timeout` s or once `died`; deterministic: settled groups."""
        if self.deterministic and not self.held:
            self.settle(stop)  # nothing held after a stop: None
        if self.held or self.deterministic:  # deterministic: the settled groups only
            return unpack(self.held.popleft()) if self.held else None
        item = self._next(timeout)
        return None if item is None else unpack(item)

    def settle(self, stop=lambda: None):
        """deterministic: wait for the rollout to report that all the published version admitted has ended, every
        drop seen; hold the groups before the report, in data order -> its state then; None once stop() is true."""
        while self.idle is None or self.idle["idle"] != (self.link.version.value, self.link.dropped.value):
            if stop() or self.died:
                return None
            item = self._next(1.0)
            if isinstance(item, dict):  # the report
                self.idle = item
            elif item is not None:  # a group (packed: the checkpoint saves it so)
                self.held.append(item)
        self.held = deque(sorted(self.held, key=lambda item: item[0]["index"]))
        return self.idle["state"]

    def evaluate(self, version):
        """Ask the rollout process to evaluate weights `version`, the ones just published (see evaluate)."""
        self.link.evals[0].value = version

    def eval_result(self, stop=lambda: None):
        """-> the eval/ metrics asked for last, waited for (the next publish must not come first); {} once stop()."""
        metrics = None
        while metrics is None and not (stop() or self.died):
            metrics = self._next(1.0, self.link.evals[1])
        return metrics or {}

    def _next(self, timeout, q=None):
        """An item of the episodes' queue (or q), or None after `timeout`, or at once after the rollout died."""
        if self.died:
            return None
        try:
            return (self.link.out_q if q is None else q).get(timeout=timeout)
        except (OSError, EOFError) as e:  # the sender died while the item's tensors were being handed over
            self.died = f"rollout process died while sending episodes ({e!r})"
        except queue_mod.Empty:
            self.check_alive()
        return None

    def check_alive(self):
        """Set `died` if the rollout process or a server it started has died (the trainer stops, checkpointed)."""
        for proc, log in self.servers:
            if proc.poll() is not None:
                self.died = f"inference server died (exit code {proc.returncode}){log_tail(log)}"
        if not self.proc.is_alive():
            self.died = f"rollout process died (exit code {self.proc.exitcode}); its traceback is above"

    def publish(self, state, version):
        """Hand new weights to the engine as `version`: into its shared tensors, or as a directory the servers load."""
        if self.write is not None:
            self.write(version, state)
            self.link.version.value = version
            return
        while not self.link.lock.acquire(timeout=1.0):  # a process killed inside a forward never releases it
            self.check_alive()
            if self.died:
                return
        try:
            for k, t in state.items():
                self.link.weights[k].copy_(t)
            if torch.cuda.is_available():  # the engine reads them once the lock is free: the copies must have ended
                torch.cuda.synchronize()
            self.link.version.value = version
        finally:
            self.link.lock.release()

    def drop(self, n):
        """The trainer dropped n groups (all their episodes too stale): let the rollout start n more."""
        with self.link.dropped.get_lock():
            self.link.dropped.value += n

    def close(self):
        self.proc.kill()  # (a no-op on one that has ended)
        self.proc.join(timeout=10)
        for proc, _ in self.servers:
            stop_server(proc)

