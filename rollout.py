"""
rollout.py: generation. The embedded torch engine (continuous batching over a slot KV cache), the
rollout process that runs agents against it, and the bounded shared-memory queue to the trainer.

Every generated token comes back with the id that was sampled, its logprob under the distribution it
was actually sampled from (temperature, top-k, top-p applied), the version of the weights that sampled
it and, for MoE, the experts each position was routed to. Weights live in shared memory: the trainer
copies new ones in under a lock and bumps the version; the engine sees them between decode steps.
"""
import asyncio
import math
import os
import queue as queue_mod
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

import agent as agent_mod
from model_moe import KVCache, ModelConfig, Transformer


@dataclass
class Completion:
    ids: list  # sampled token ids (the stop token included when it was sampled)
    logprobs: list  # logprob of each sampled id under the distribution it was drawn from
    versions: list  # policy version of the weights that sampled each id
    routing: torch.Tensor | None  # (len(prompt) + len(ids), n_moe_layers, top_k) int16, -1 where not computed


def sample(logits, *, temperature, top_p=1.0, top_k=0, generator=None):
    """logits (B, V) -> ids (B,), logprobs (B,) under the filtered, renormalised distribution.
    temperature 0 is greedy (its logprob is reported at temperature 1)."""
    logp = torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)
    if temperature == 0:
        ids = logp.argmax(-1)
        return ids, logp.gather(-1, ids[:, None])[:, 0]
    if 0 < top_k < logp.shape[-1]:
        kth = logp.topk(top_k, dim=-1).values[:, -1:]
        logp = logp.masked_fill(logp < kth, -math.inf)
    if top_p < 1.0:  # keep the smallest prefix of the sorted distribution whose mass reaches top_p
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        p = sorted_logp.exp()
        drop_sorted = (p.cumsum(-1) - p) >= top_p
        logp = logp.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), -math.inf)
    logp = torch.log_softmax(logp, dim=-1)  # renormalise over what was kept
    ids = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
    return ids, logp.gather(-1, ids[:, None])[:, 0]


@dataclass(eq=False)
class _Request:
    ids: list  # prompt, then sampled tokens as they come
    prompt_len: int
    max_new: int
    future: asyncio.Future
    logprobs: list
    versions: list
    slot: int = -1
    fed: int = 0  # tokens whose keys are in the cache


class TorchEngine:
    """Embedded engine: `await generate(ids)` from many agents; one `step()` runs one prefill (new
    rows) and one decode (all rows). A finished row's slot is refilled at the next step."""

    def __init__(self, model: Transformer, *, slots=64, max_len=512, temperature=1.0, top_p=1.0, top_k=0,
                 max_new_tokens=16, stop_ids=(), seed=0, version=None, lock=None):
        self.model, self.c = model.eval(), model.config
        p = next(model.parameters())
        self.cache = KVCache(self.c, slots, max_len, dtype=p.dtype, device=p.device)
        # experts of each slot's positions (S, max_len, n_moe, top_k), -1 where not computed: kept per
        # slot like the KV cache, so a step records all its rows with one indexed write
        self.routing = torch.full((slots, max_len, self.c.n_moe_layers, self.c.num_experts_per_tok), -1,
                                  dtype=torch.int16) if self.c.n_moe_layers else None
        self.sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
        self.max_new, self.stop_ids, self.seed, self.max_len = max_new_tokens, set(stop_ids), seed, max_len
        self.shared_version, self.lock = version, lock  # set by the trainer when weights are shared
        self.version = version.value if version is not None else 0
        self.generator = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + self.version)
        self.waiting, self.active, self.free = deque(), {}, list(range(slots))[::-1]
        self.wake = asyncio.Event()
        self.tokens_generated, self.busy_s = 0, 0.0

    async def generate(self, ids, max_new_tokens=None) -> Completion:
        max_new = min(max_new_tokens or self.max_new, self.max_len - len(ids))
        if max_new <= 0:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room in the engine's max_len={self.max_len}")
        req = _Request(list(ids), len(ids), max_new, asyncio.get_running_loop().create_future(), [], [])
        self.waiting.append(req)
        self.wake.set()
        return await req.future

    def set_weights(self, state, version):
        """Load new weights (a state dict) as `version`; in-flight rows continue under them."""
        self.model.load_state_dict(state, strict=False)
        self._new_version(version)

    def _new_version(self, version):
        self.version = version
        # reseeding per version makes a batch's samples depend only on (seed, version): resumable runs
        self.generator.manual_seed(self.seed * 1_000_003 + version)
        # recompute in-flight rows' keys under the new weights, so every token tagged `version` is
        # exactly what those weights would sample (the trainer's recompute then matches it)
        rows = [r for r in self.active.values() if r.fed > 0]
        if rows:
            self._forward(rows, [r.ids[:r.fed] for r in rows], start=[0] * len(rows))

    @torch.no_grad()
    def _forward(self, rows, chunks, start):
        """Run each row's chunk of tokens at positions start.. in its slot; returns logits at each row's
        last chunk token (B, V) and records routing for those positions."""
        # Inputs are built as one tensor each and routing is recorded with one indexed write: building
        # and copying small tensors row by row cost ~1 ms per decode step at 64 rows (~10% of the step).
        lens, dev = [len(ch) for ch in chunks], self.cache.k.device
        T = max(lens)
        ids = torch.tensor([ch + [0] * (T - len(ch)) for ch in chunks], device=dev)  # (B, T), right-padded
        # positions (B, T); padding continues them: written past the row, masked
        pos = torch.tensor(start)[:, None] + torch.arange(T)
        slots = torch.tensor([r.slot for r in rows])  # (B,)
        logits, routing = self.model(ids, positions=pos.to(dev), cache=self.cache, slots=slots.to(dev),
                                     return_routing=True)
        for r, n, s in zip(rows, lens, start):
            r.fed = s + n
        if routing is not None:  # routing (n_moe, B, T, k) -> the slots' records, at the rows' real positions
            real = torch.arange(T) < torch.tensor(lens)[:, None]  # (B, T): not padding
            self.routing[slots[:, None].expand(-1, T)[real], pos[real]] = \
                routing.permute(1, 2, 0, 3).to("cpu", torch.int16)[real]  # (n_real, n_moe, k)
        return logits[torch.arange(len(rows), device=dev), torch.tensor(lens, device=dev) - 1]

    def step(self):
        """One engine iteration. Returns the number of rows that decoded."""
        t0 = time.perf_counter()
        lock = self.lock if self.lock is not None else _NoLock()
        with lock:  # the trainer cannot swap weights in the middle of a forward
            if self.shared_version is not None and self.shared_version.value != self.version:
                self._new_version(self.shared_version.value)  # the weights themselves are shared tensors
            new = []
            while self.waiting and self.free:
                r = self.waiting.popleft()
                r.slot = self.free.pop()
                if self.routing is not None:
                    self.routing[r.slot] = -1  # forget the previous occupant's experts
                self.active[r.slot] = r
                new.append(r)
            if new:  # prefill: the whole prompt of each new row; sample its first token
                self._sample(new, self._forward(new, [r.ids for r in new], [0] * len(new)))
            rows = [r for r in self.active.values() if r not in new]
            if rows:  # decode: feed each row's last sampled token
                self._sample(rows, self._forward(rows, [r.ids[-1:] for r in rows], [r.fed for r in rows]))
        self.busy_s += time.perf_counter() - t0
        return len(new) + len(rows)

    def _sample(self, rows, logits):
        ids, logps = sample(logits, generator=self.generator, **self.sampling)
        for r, t, lp in zip(rows, ids.tolist(), logps.tolist()):
            r.ids.append(t)
            r.logprobs.append(lp)
            r.versions.append(self.version)
            self.tokens_generated += 1
            n = len(r.ids) - r.prompt_len
            if t in self.stop_ids or n >= r.max_new or len(r.ids) >= self.max_len:
                del self.active[r.slot]
                self.free.append(r.slot)
                routing = self.routing[r.slot, :len(r.ids)].clone() if self.routing is not None else None
                if not r.future.done():  # an agent cancelled by its timeout no longer waits
                    r.future.set_result(Completion(r.ids[r.prompt_len:], r.logprobs, r.versions, routing))

    async def run(self):
        """The engine loop: step while there is work, sleep when there is none."""
        while True:
            if not self.waiting and not self.active:
                self.wake.clear()
                await self.wake.wait()
            self.step()
            await asyncio.sleep(0)  # let agents react to finished rows before the next step


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class Policy:
    """What an agent sees as `llm`: a tokenizer and `await llm.generate(ids)`. One per episode: it keeps
    what the engine was given and returned, to check the episode against (token identity)."""

    def __init__(self, engine, tokenizer):
        self.engine, self.tokenizer, self.calls = engine, tokenizer, []

    async def generate(self, ids, max_new_tokens=None):
        c = await self.engine.generate(ids, max_new_tokens)
        self.calls.append((list(ids), c))
        return c


class Malformed(Exception):
    pass


def check_tokens(ep, calls):
    """The trainer must train exactly the tokens the engine saw and sampled: every call's prompt is a
    prefix of the episode, its sampled ids follow it with loss_mask 1, and nothing else has mask 1.
    Logprobs, versions and routing are taken from the engine's record, not from the agent."""
    T = len(ep.ids)
    logprobs, versions, sampled = [0.0] * T, [-1] * T, 0
    routing = None
    for prompt, c in calls:
        p, n = len(prompt), len(c.ids)
        if ep.ids[:p] != prompt or ep.ids[p:p + n] != c.ids or not all(ep.loss_mask[p:p + n]):
            raise ValueError(f"token mismatch: the episode does not contain the engine's call at position {p}")
        logprobs[p:p + n], versions[p:p + n] = c.logprobs, c.versions
        sampled += n
        if c.routing is not None:
            if routing is None:
                routing = torch.full((T, *c.routing.shape[1:]), -1, dtype=torch.int16)
            known = c.routing >= 0  # the latest computation of a position wins
            routing[:p + n][known] = c.routing[known]
    if sum(ep.loss_mask) != sampled:
        raise ValueError(f"token mismatch: loss_mask marks {sum(ep.loss_mask)} tokens, the engine sampled {sampled}")
    ep.logprobs, ep.versions, ep.routing = logprobs, versions, routing
    return torch.tensor([t for prompt, c in calls for t in c.ids], dtype=torch.long)


# ---- the rollout process: agents -> episodes -> the shared-memory queue ----

def episode_to_msg(ep, index, engine_ids):
    """Pack an episode into a few tensors (moved to shared memory by the queue, not pickled)."""
    return {"engine_ids": engine_ids, "tokens": torch.tensor([ep.ids, ep.loss_mask, ep.versions], dtype=torch.long),  # (3, T)
            "logprobs": torch.tensor(ep.logprobs, dtype=torch.float32),  # (T,)
            "routing": ep.routing, "reward": float(ep.reward), "group": ep.group, "index": index,
            "info": {k: float(v) for k, v in ep.info.items()}}


def rollout_main(cfg, model_cfg, weights, version, lock, out_q, dropped, start_index, tokenizer_dir):
    """Entry of the rollout process. weights: the shared state dict the engine computes with."""
    torch.set_num_threads(1)
    try:
        asyncio.run(_rollout(cfg, model_cfg, weights, version, lock, out_q, dropped, start_index, tokenizer_dir))
    except Exception:
        traceback.print_exc()
        sys.exit(1)


async def _rollout(cfg, model_cfg, weights, version, lock, out_q, dropped, start_index, tokenizer_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    with torch.device("meta"):
        model = Transformer(model_cfg)
    model.load_state_dict(weights, assign=True, strict=True)  # parameters ARE the shared tensors
    if model_cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    engine = TorchEngine(model, slots=cfg.engine_slots, max_len=cfg.engine_max_len, temperature=cfg.temperature,
                         top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.max_new_tokens,
                         stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")], seed=cfg.seed, version=version, lock=lock)
    loop_task = asyncio.create_task(engine.run())
    await produce(cfg, engine, tok, out_q, dropped, start_index, model_cfg.vocab_size)
    loop_task.cancel()


async def produce(cfg, engine, tokenizer, out_q, dropped, start_index, vocab_size):
    """Run agents, `concurrent_agents` at a time, and put finished episodes on the queue.
    Admission bounds staleness: episode n may start only while the live episodes (started, not failed,
    not dropped by the trainer) number fewer than (version + 1 + max_staleness) * batch_size. With
    max_staleness=0 this is synchronous RL: batch v is sampled entirely by weights v."""
    run = agent_mod.load_agent(cfg.task)
    start_version = engine.version
    counts = {"agent_errors": 0, "agent_timeouts": 0, "malformed": 0}
    index, started, failed, running = start_index, 0, 0, {}
    pending = deque()  # finished messages waiting for room in the queue (back-pressure)
    knobs = dict(seed=cfg.seed, group_size=cfg.group_size, guess_max=cfg.guess_max, max_turns=cfg.max_turns,
                 tool_timeout=cfg.tool_timeout, tool_memory_mb=cfg.tool_memory_mb)

    async def one(task, index):
        llm = Policy(engine, tokenizer)
        ep = await asyncio.wait_for(run(task, llm), cfg.episode_timeout)
        try:
            engine_ids = check_tokens(ep, llm.calls)
            ep.validate(vocab_size)
        except ValueError as e:  # nothing malformed reaches the trainer
            raise Malformed(str(e)) from e
        return episode_to_msg(ep, index, engine_ids)

    while True:
        published = engine.shared_version.value if engine.shared_version is not None else engine.version
        limit = (published - start_version + 1 + cfg.max_staleness) * cfg.batch_size + dropped.value
        while len(running) < cfg.concurrent_agents and started - failed < limit:
            task = agent_mod.make_task(cfg.task, index, **knobs)
            running[asyncio.create_task(one(task, index))] = index
            index, started = index + 1, started + 1
        done = ()
        if running:
            done, _ = await asyncio.wait(running, timeout=0.01, return_when=asyncio.FIRST_COMPLETED)
        else:
            await asyncio.sleep(0.01)
        for t in done:
            i = running.pop(t)
            err = t.exception()
            if err is None:
                msg = t.result()
                msg["stats"] = dict(counts, tokens_generated=engine.tokens_generated, engine_busy_s=engine.busy_s)
                pending.append(msg)
                continue
            failed += 1
            key = "agent_timeouts" if isinstance(err, asyncio.TimeoutError) else \
                "malformed" if isinstance(err, Malformed) else "agent_errors"
            counts[key] += 1
            print(f"[rollout] episode {i} dropped ({key}): {err!r}", file=sys.stderr)
        while pending:
            try:
                out_q.put_nowait(pending[0])
                pending.popleft()
            except queue_mod.Full:
                break


def start_rollout(cfg, model_cfg, weights, start_version, start_index, tokenizer_dir):
    """Start the rollout process (trainer rank 0). weights: a state dict, copied to shared memory once;
    later versions are written into it by `publish`."""
    ctx = mp.get_context("spawn")
    shared = {k: v.detach().clone().share_memory_() for k, v in weights.items()}
    version, lock, dropped = ctx.Value("l", start_version), ctx.Lock(), ctx.Value("l", 0)
    out_q = ctx.Queue(maxsize=cfg.queue_size)
    proc = ctx.Process(target=rollout_main, daemon=True, name="nanomolt-rollout",
                       args=(cfg, model_cfg, shared, version, lock, out_q, dropped, start_index, tokenizer_dir))
    proc.start()
    return Rollout(proc, out_q, shared, version, lock, dropped)


class Rollout:
    """The trainer's handle on the rollout process."""

    def __init__(self, proc, out_q, shared, version, lock, dropped):
        self.proc, self.q, self.shared, self.version, self.lock, self.dropped = proc, out_q, shared, version, lock, dropped

    def get(self, timeout=1.0):
        """Next episode message; raises if the rollout process died."""
        while True:
            try:
                return self.q.get(timeout=timeout)
            except queue_mod.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"rollout process died (exit code {self.proc.exitcode}); its traceback is above")

    def publish(self, state, version):
        """Copy new weights into the engine's shared tensors, then tag them `version`."""
        with self.lock:
            for k, t in state.items():
                self.shared[k].copy_(t)
            self.version.value = version

    def drop(self, n):
        """The trainer dropped n episodes (too stale): let the rollout start n more."""
        with self.dropped.get_lock():
            self.dropped.value += n

    def close(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
