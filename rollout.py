"""rollout.py: generation. The embedded torch engine (continuous batching over a slot KV cache), the rollout process
that runs agents against it, the bounded shared-memory queue to the trainer, and the vLLM / SGLang server engines
(last section), all behind `await generate(ids)`. Every generated token comes back with its logprob under the
distribution it was sampled from, the version of the weights that sampled it and, for MoE, its experts. Weights live
in shared memory: the trainer copies new ones in under a lock, bumps the version; the engine sees them between steps."""
import asyncio
import base64
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import datetime
import functools
import io
import itertools
import json
import math
import os
import queue as queue_mod
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
import types
import urllib.error
import urllib.parse
import urllib.request
from collections import deque

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import agent as agent_mod
import endpoint
import estimators as est
from model_moe import KVCache, Transformer, save_pretrained, to_hf_state


@dataclasses.dataclass
class Completion:
    ids: list  # sampled token ids (the stop token included when it was sampled)
    logprobs: list  # logprob of each sampled id under the distribution it was drawn from
    versions: list  # policy version of the weights that sampled each id
    routing: torch.Tensor | None  # (len(prompt) + len(ids), n_moe_layers, top_k) int16, -1 where not computed


def filtered_logp(logits, *, temperature, top_k=0, top_p=1.0):
    """logits (B, V) -> logprobs (B, V) sampled from: temperature, top-k, then top-p over the renormalised top-k
    (vLLM's, SGLang's and transformers' order); -inf outside. Engine and trainer both use it: one distribution."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if 0 < top_k < logp.shape[-1]:
        kth = logp.topk(top_k, dim=-1).values[:, -1:]
        logp = torch.log_softmax(logp.masked_fill(logp < kth, -math.inf), dim=-1)
    if top_p < 1.0:  # keep the smallest prefix of the sorted distribution whose mass reaches top_p
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        p = sorted_logp.exp()
        drop_sorted = (p.cumsum(-1) - p) >= top_p
        logp = torch.log_softmax(logp.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), -math.inf), dim=-1)
    return logp


def uniform(keys):
    """keys (B, n) ints -> (B,) float64 in [0, 1): splitmix64 (Steele et al. 2014) folded over each row, counter-based:
    a draw depends on (seed, episode, call, position) only, not batch or timing: a resumed episode resamples alike."""
    h = np.zeros(len(keys), dtype=np.uint64)
    for col in np.asarray(keys, dtype=np.int64).astype(np.uint64).T:  # numpy: uint64 (wrapping), 3x torch's speed
        h = (h ^ col) + np.uint64(0x9E3779B97F4A7C15)
        for s, m in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, 1)):
            h = (h ^ (h >> np.uint64(s))) * np.uint64(m)
    return torch.from_numpy((h >> np.uint64(11)).astype(np.float64) / 2**53)  # the top 53 bits


def sample(logits, u, *, temperature, top_p=1.0, top_k=0):
    """logits (B, V), u (B,) the rows' uniforms in [0, 1) -> ids (B,), logprobs (B,) under the filtered, renormalised
    distribution. temperature 0 is greedy (its logprob is reported at temperature 1)."""
    if temperature == 0:
        logp = torch.log_softmax(logits.float(), dim=-1)
        ids = logp.argmax(-1)
    else:
        logp = filtered_logp(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        # inverse-CDF sampling: one uniform per row against the running sum of probabilities (multinomial draws one
        # exponential per entry); the sum is float64 and u stays below its total: a probability-0 token is never picked
        cdf = logp.exp().cumsum(-1, dtype=torch.float64)
        u = u.to(cdf)[:, None] * cdf[:, -1:]
        ids = torch.searchsorted(cdf, torch.minimum(u, cdf[:, -1:].nextafter(u.new_zeros(()))), right=True)[:, 0]
    return ids, logp.gather(-1, ids[:, None])[:, 0]


class ContextFull(ValueError):
    """The conversation has reached the engine's max_len: the rollout trains the episode so far as truncated."""


def check_prompt(ids, vocab_size, max_len, max_new):
    """-> the tokens a prompt may have sampled (at most max_new). Both engines check a prompt here, in its agent's call:
    a bad id fails that agent, not the torch engine's next step or the server (SGLang dies) and the batch it joins."""
    if not ids or not all(type(t) is int and 0 <= t < vocab_size for t in ids):
        raise ValueError(f"prompt ids must be ints in [0, {vocab_size})")
    if len(ids) >= max_len:
        raise ContextFull(f"prompt of {len(ids)} tokens leaves no room in the engine's max_len={max_len}")
    return min(max_new, max_len - len(ids))


@dataclasses.dataclass(eq=False)
class _Request:
    ids: list  # prompt, then sampled tokens as they come
    prompt_len: int
    max_new: int
    future: asyncio.Future
    logprobs: list
    versions: list
    slot: int = -1
    key: tuple = ()  # (episode, call): with the seed and a token's position, what its random draw is a function of
    images: list | None = None  # (C, H, W) each on the CPU, for the prompt's placeholders; used by prefills only
    shift: int = 0  # M-RoPE: a decoded position turns this much more than its index (a prefill has the images)
    sampling: tuple = ()  # an evaluation's (key, value) pairs over the engine's temperature, top_p


class TorchEngine:
    """Embedded engine: `await generate(ids)` from many agents, batched continuously over a slot KV cache (step)."""
    def __init__(self, model: Transformer, *, slots=64, max_len=512, temperature=1.0, top_p=1.0, top_k=0,
                 max_new_tokens=16, stop_ids=(), seed=0, version=None, lock=None, source=None, chunk_tokens=8192):
        self.model, self.c = model.eval(), model.config
        p = next(model.parameters())
        self.cache = KVCache(self.c, slots, max_len, dtype=p.dtype, device=p.device)
        # experts by slot and position (S, max_len, n_moe, k), -1: not computed; per slot as the KV cache: one write
        self.routing = torch.full((slots, max_len, self.c.n_moe_layers, self.c.num_experts_per_tok), -1,
                                  dtype=torch.int16) if self.c.n_moe_layers else None
        self.sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
        self.max_new, self.stop_ids, self.seed, self.max_len = max_new_tokens, set(stop_ids), seed, max_len
        self.chunk_tokens = chunk_tokens  # padded tokens per prefill forward: bounds its activations
        if self.c.vision:  # a sampled placeholder has no image: end the row there (the agent rejects
            self.stop_ids.add(self.c.image_token_id)  # the episode), else a re-prefill would splice a feature in
        self.shared_version, self.source, self.lock = version, source, lock or contextlib.nullcontext()  # shared
        self.version = version.value if version is not None else 0
        self.requests = itertools.count()
        self.waiting, self.active, self.free = deque(), {}, list(range(slots))[::-1]
        self.wake, self.tokens_generated = asyncio.Event(), 0

    async def generate(self, ids, max_new_tokens=None, images=None, key=None, sampling=None) -> Completion:
        """images: (C, H, W) each, one per run of placeholders in ids (checked by Policy.generate)."""
        max_new = check_prompt(ids, self.c.vocab_size, self.max_len, max_new_tokens or self.max_new)
        req = _Request(list(ids), len(ids), max_new, asyncio.get_running_loop().create_future(), [], [],
                       images=None if images is None else [im.cpu() for im in images],
                       shift=sum(max(h, w) - h * w for h, w in map(self.c.grid, images or [])),
                       key=key or (-1, next(self.requests)), sampling=tuple(sorted((sampling or {}).items())))
        self.waiting.append(req)
        self.wake.set()
        return await req.future

    def set_weights(self, state, version):
        """Load new weights (a state dict; {}: the shared tensors hold them) as `version`. Rows in flight go on with
        their keys recomputed: a token tagged `version` is exactly what those weights sample (the recompute matches)."""
        self.model.load_state_dict(state, strict=False)
        self.version = version
        rows = list(self.active.values())  # each holds the keys of all its tokens but the last sampled one
        if rows:  # no logits needed, only the keys
            self._forward(rows, [r.ids[:-1] for r in rows], start=[0] * len(rows), prefill=True, logits=False)

    @torch.inference_mode()  # not no_grad: it also skips autograd's view and version tracking
    def _forward(self, rows, chunks, start, prefill=False, logits=True):
        """-> logits (B, V) at each row's last chunk token. prefill: the chunks hold every placeholder, so images go
        in. Groups of at most `chunk_tokens` padded tokens, logits only at the last position ((B, T, V) would not
        fit), tensors built per group, not per row: small tensors cost more than the decode step's compute."""
        out, i, dev = [], 0, self.cache.k.device
        while i < len(rows):
            n, T = 1, len(chunks[i])
            while i + n < len(rows) and (n + 1) * max(T, len(chunks[i + n])) <= self.chunk_tokens:
                n, T = n + 1, max(T, len(chunks[i + n]))
            group, lens, starts = rows[i:i + n], torch.tensor([len(ch) for ch in chunks[i:i + n]]), start[i:i + n]
            ids = torch.tensor([ch + [0] * (T - len(ch)) for ch in chunks[i:i + n]], device=dev)  # (b, T), right-padded
            pos = torch.tensor(starts)[:, None] + torch.arange(T)  # (b, T); padding continues them: past the row
            slots = torch.tensor([r.slot for r in group])  # (b,)
            images = [im.to(dev) for r in group for im in r.images or ()] if prefill else []
            last = torch.arange(T) == (lens - 1)[:, None]  # (b, T): each row's last token
            logit, routing = self.model(ids, positions=pos.to(dev), cache=self.cache, slots=slots.to(dev),
                                        return_routing=True, images=images, logits_at=last.to(dev) & logits,
                                        rope_shift=torch.tensor([0 if prefill else r.shift for r in group], device=dev))
            out.append(logit)  # (b, V) in row order
            if routing is not None:  # routing (n_moe, b, T, k) -> the slots' records, at the rows' real positions
                real = torch.arange(T) < lens[:, None]  # (b, T): not padding
                self.routing[slots[:, None].expand(-1, T)[real], pos[real]] = \
                    routing.permute(1, 2, 0, 3).to("cpu", torch.int16)[real]  # (n_real, n_moe, k)
            i += n
        return torch.cat(out) if logits else None

    def step(self):
        """One engine iteration -> the number of rows that got a token. Continuous batching: requests that arrived
        since the last step take the free KV-cache slots and are prefilled (their whole prompt, one token sampled);
        then every other active row decodes one token. Weights change only here, between forwards, under the lock
        the trainer's publish takes, so each token's recorded version is the weights that sampled it."""
        with self.lock:  # the trainer cannot swap weights in the middle of a forward
            if self.shared_version is not None and self.shared_version.value != self.version:
                self.set_weights(self.source or {}, self.shared_version.value)
            new = [self.waiting.popleft() for _ in range(min(len(self.waiting), len(self.free)))]
            for r in new:
                r.slot = self.free.pop()
                self.active[r.slot] = r
                if self.routing is not None:
                    self.routing[r.slot] = -1  # forget the previous occupant's experts
            if new:  # prefill: the whole prompt of each new row; sample its first token. Equal prompts and images (a
                lead = {}  # GRPO group's) are computed once, its keys, values and experts copied to the others
                src = [lead.setdefault((*r.ids, *(im.numpy().tobytes() for im in r.images or ())), r) for r in new]
                logits = self._forward(uniq := [*lead.values()], [r.ids for r in uniq], [0] * len(uniq), prefill=True)
                if dup := [(r.slot, s.slot) for r, s in zip(new, src) if r is not s]:
                    (d, s), n = map(list, zip(*dup)), max(len(r.ids) for r in new)
                    for t in (self.cache.k, self.cache.v):  # (L, S, nkv, max_len, hd)
                        t[:, d, :, :n] = t[:, s, :, :n]
                    if self.routing is not None:
                        self.routing[d, :n] = self.routing[s, :n]
                self._sample(new, logits[[uniq.index(s) for s in src]])
            # in slot order: when the slots in use are consecutive (all busy), the cache reads them as a view
            rows = [self.active[s] for s in sorted(self.active) if self.active[s] not in new]
            if rows:  # decode: feed each row's last sampled token
                self._sample(rows, self._forward(rows, [r.ids[-1:] for r in rows], [len(r.ids) - 1 for r in rows]))
        return len(new) + len(rows)

    def _sample(self, rows, logits):
        u = uniform([[self.seed, *r.key, len(r.ids)] for r in rows])  # (B,); len(r.ids): the new token's position
        ids, logps = torch.zeros(len(rows), dtype=torch.long), torch.zeros(len(rows))
        for s in {r.sampling for r in rows}:  # an evaluation's rows sample with its own settings
            at = [i for i, r in enumerate(rows) if r.sampling == s]
            ids[at], logps[at] = (x.cpu() for x in sample(logits[at], u[at], **self.sampling | dict(s)))
        self.tokens_generated += len(rows)
        for r, t, lp in zip(rows, ids.tolist(), logps.tolist()):
            r.ids.append(t)
            r.logprobs.append(lp)
            r.versions.append(self.version)
            if t in self.stop_ids or len(r.ids) - r.prompt_len >= r.max_new or len(r.ids) >= self.max_len:
                del self.active[r.slot]
                self.free.append(r.slot)
                routing = self.routing[r.slot, :len(r.ids)].clone() if self.routing is not None else None
                if not r.future.done():  # an agent cancelled by its timeout no longer waits
                    r.future.set_result(Completion(r.ids[r.prompt_len:], r.logprobs, r.versions, routing))

    async def run(self):
        while True:
            if not self.waiting and not self.active:
                self.wake.clear()
                await self.wake.wait()
            self.step()
            await asyncio.sleep(0)  # let agents react to finished rows before the next step


class Policy:
    """What an agent sees as `llm`: a tokenizer and `await llm.generate(ids)`. One per episode: it keeps
    what the engine was given and returned, to check the episode against (token identity)."""
    def __init__(self, engine, tokenizer, episode=None, sampling=None):
        self.engine, self.tokenizer, self.calls, self.closed, self.full = engine, tokenizer, [], False, False
        self.sampling = sampling or {}  # an evaluation's temperature, top_p, max_new_tokens; {}: the run's
        self.keys = None if episode is None else zip(itertools.repeat(episode), itertools.count())  # (episode, call)

    async def generate(self, ids, max_new_tokens=None, images=None):
        """images: a list of (C, H, W) tensors in [0, 1], one per run of placeholders in ids, in order."""
        if self.closed:  # the episode timed out: an agent that swallowed its cancellation gets no more tokens
            raise RuntimeError("this episode has timed out; its policy is closed")
        images = check_images(ids, images, getattr(self.engine, "c", None))  # bad input fails here, in the agent
        sampling = dict(self.sampling)
        max_new_tokens = max_new_tokens or sampling.pop("max_new_tokens", None)
        try:
            c = await self.engine.generate(ids, max_new_tokens, images=images, key=self.keys and next(self.keys),
                                           sampling=sampling)
        except ContextFull:
            self.full = True  # an agent that gives up now (a chat agent's client raises the 400) is truncated
            raise
        self.calls.append((list(ids), c, images))
        return c


def check_images(ids, images, c):
    """-> the images as a list of float (C, H, W), or None. c: the engine's ModelConfig (None: it takes no images). A
    ValueError for images without a vision tower, of a wrong shape or range, or not matching the placeholders."""
    images = list(images if images is not None else [])
    if c is None or not c.vision:
        if images:
            raise ValueError("images given, but the engine takes none (a text model, or vLLM)")
        return None
    f = c.vision["patch_size"] * c.vision["spatial_merge_size"]
    for i, im in enumerate(images):
        if not (isinstance(im, torch.Tensor) and im.is_floating_point() and im.dim() == 3 and len(im) == 3
                and all(s >= f and s % f == 0 for s in im.shape[1:]) and bool(((im >= 0) & (im <= 1)).all())):
            got = tuple(im.shape) if isinstance(im, torch.Tensor) else type(im).__name__
            raise ValueError(f"image {i}: {got}, the model takes float (3, H, W) in [0, 1], H and W multiples of {f}")
    c.check_placeholders(sum(t == c.image_token_id for t in ids), images)
    return [im.float() for im in images] if images else None


class Malformed(Exception):
    """An episode that fails check_tokens, check_images or validate: dropped, nothing malformed is trained."""


COUNTS = ("agent_errors", "agent_timeouts", "malformed")  # episodes dropped, by cause


def stop_ids(tok, model_dir):
    """Every end-of-turn id: the tokenizer's eos, <|im_end|> if it has one, and generation_config.json's eos ids."""
    ids = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else None}
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        eos = json.load(open(path)).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos])
    return sorted(i for i in ids if i is not None)


@functools.lru_cache(maxsize=4)
def _tokenizer(path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def save_tokenizer(src, dst):
    """The tokenizer (its chat template too, in whatever file it came) and generation_config.json beside weights."""
    _tokenizer(src).save_pretrained(dst)
    if os.path.isfile(os.path.join(src, "generation_config.json")):
        shutil.copy(os.path.join(src, "generation_config.json"), dst)


def check_tokens(ep, calls):
    """The trainer must train exactly the tokens the engine saw and sampled (ValueError otherwise) -> the engine's
    record: logprobs, versions [T] (0.0, -1 where mask 0), routing (T, n_moe, k) int16 or None (-1: not run), ids."""
    T = len(ep.ids)
    logprobs, versions, sampled, routing = [0.0] * T, [-1] * T, 0, None
    for prompt, c, images in calls:
        p, n = len(prompt), len(c.ids)
        if not n == len(c.logprobs) == len(c.versions):
            raise ValueError(f"sampled lengths differ: ids {n}, logprobs {len(c.logprobs)}, versions {len(c.versions)}")
        if not all(math.isfinite(lp) and v >= 0 for lp, v in zip(c.logprobs, c.versions)):
            raise ValueError(f"a sampled token at position {p} has a non-finite logprob or no policy version")
        if ep.ids[:p] != prompt or ep.ids[p:p + n] != c.ids or not all(ep.loss_mask[p:p + n]):
            raise ValueError(f"token mismatch: the episode does not contain the engine's call at position {p}")
        if images is not None and not (len(ep.images) >= len(images) and all(
                torch.equal(a.float(), b) for a, b in zip(ep.images, images))):
            raise ValueError(f"image mismatch: the episode's images differ from the engine's call at position {p}")
        logprobs[p:p + n], versions[p:p + n] = c.logprobs, c.versions
        sampled += n
        if c.routing is not None:
            if c.routing.dim() != 3 or len(c.routing) != p + n:
                raise ValueError(f"completion routing shape {tuple(c.routing.shape)}, expected "
                                 f"(prompt + sampled = {p + n}, n_moe_layers, top_k)")
            if routing is None:
                routing = torch.full((T, *c.routing.shape[1:]), -1, dtype=torch.int16)
            known = c.routing >= 0  # the latest computation of a position wins; -1: not computed (a cache hit)
            routing[:p + n][known] = c.routing[known].to(torch.int16)
    if sum(ep.loss_mask) != sampled:
        raise ValueError(f"token mismatch: loss_mask marks {sum(ep.loss_mask)} tokens, the engine sampled {sampled}")
    return logprobs, versions, routing, torch.tensor([t for _, c, _ in calls for t in c.ids], dtype=torch.long)


def truncated_episode(calls):
    """ContextFull: the conversation to its last completion, trained as is (dropping biases to short ones), reward 0."""
    prompt, c, images = calls[-1]
    ep = agent_mod.Episode(ids=prompt + c.ids, loss_mask=[0] * (len(prompt) + len(c.ids)),
                           images=list(images) if images is not None else [], info={"truncated": 1})
    for prompt, c, _ in calls:
        ep.loss_mask[len(prompt):len(prompt) + len(c.ids)] = [1] * len(c.ids)
    return ep

# ---- the rollout process: agents -> episodes -> the shared-memory queue ----


def episode_to_msg(ep, index, group, record):
    """An episode as named tensors (the queue moves them to shared memory, a group at a time: `pack`). record:
    check_tokens' (logprobs, versions, routing, engine_ids); the group is the rollout's, never the agent's."""
    logprobs, versions, routing, engine_ids = record
    return {"ids": torch.tensor(ep.ids), "loss_mask": torch.tensor(ep.loss_mask), "versions": torch.tensor(versions),
            "logprobs": torch.tensor(logprobs, dtype=torch.float32), "routing": routing,  # (T, n_moe, k) or None
            "engine_ids": engine_ids, "images": [im.float().cpu() for im in ep.images],  # (C, H, W) each, on the CPU
            "reward": float(ep.reward), "group": group, "index": index,
            "info": {k: float(v) for k, v in ep.info.items()}}


PACKED = ("ids", "loss_mask", "versions", "logprobs", "routing", "engine_ids")  # tensors, length first


def pack(group):
    """A group's messages -> one queue item, tensor fields concatenated over the episodes as numpy arrays: pickled by
    value (a shared-memory tensor passes a file descriptor over a socket, ~0.5 ms each); images as arrays."""
    item = {"msgs": [{k: [im.numpy() for im in v] if k == "images" else v for k, v in m.items() if k not in PACKED}
                     for m in group]}
    for k in PACKED:
        kept = [m[k] for m in group if m[k] is not None]
        item[k] = torch.cat(kept).numpy() if kept else None, [-1 if m[k] is None else len(m[k]) for m in group]
    return item


def unpack(item):
    """pack's inverse: the group's messages (their tensors are views of the arrays)."""
    for k in PACKED:
        t, sizes = item[k]
        parts = iter(torch.from_numpy(t).split([s for s in sizes if s >= 0]) if t is not None else ())
        for m, s in zip(item["msgs"], sizes):
            m[k] = next(parts) if s >= 0 else None
    return [m | {"images": [torch.from_numpy(im) for im in m["images"]]} for m in item["msgs"]]


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
    tok = _tokenizer(tokenizer_dir)
    sampling = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.max_new_tokens,
                    max_len=cfg.engine_max_len, stop_ids=stop_ids(tok, tokenizer_dir), seed=cfg.seed,
                    version=link.version, lock=link.lock)
    if link.servers is not None:
        engine = ServerEngine(cfg.engine, [u for u, _ in link.servers], logs=[log for _, log in link.servers],
                              weights_dir=os.path.abspath(os.path.join(cfg.out_dir, "engine_weights")),
                              timeout=cfg.server_timeout, concurrency=cfg.concurrent_agents, weights=link.weights,
                              sync=cfg.weight_sync, model_config=model_cfg, **sampling)
    else:
        copy = torch.cuda.is_available() or cfg.dtype != "float32"  # on CPU in float32 the parameters ARE the
        with contextlib.nullcontext() if copy else torch.device("meta"):  # shared tensors: nothing to copy
            model = Transformer(model_cfg)
        if copy:  # a copy in the compute dtype (as in the trainer), refreshed from the shared tensors each version
            model = model.to("cuda" if torch.cuda.is_available() else "cpu", getattr(torch, cfg.dtype))
        model.load_state_dict(link.weights, assign=not copy)
        if model_cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        engine = TorchEngine(model, slots=cfg.engine_slots, source=link.weights if copy else None, **sampling)
    # neither returns: the first error, the engine's or the producer's, ends the rollout process (rollout_main)
    await asyncio.gather(engine.run(), produce(cfg, engine, tok, link.out_q, link.dropped, start_index,
                                               model_cfg.vocab_size, state, link.evals))


KNOBS = ("seed", "group_size", "guess_max", "max_turns", "tool_timeout", "tool_memory_mb", "sandbox_unsafe",
         "image_size", "patch_size", "task_file", "arith_prompt")  # the config fields make_task reads


def eval_tasks(cfg):
    """The held-out tasks, eval_samples per prompt, at indices -1, -2, ... (the trainer refuses any). make_task seeds
    group g with seed * 1_000_003 + g; prompt p is group 2**40 + p, which training (groups 0, 1, ...) never reaches
    (negative groups would: Random(-n) is Random(n)). A task of few prompts (guess: 5 secrets) repeats some anyway."""
    K, knobs = cfg.eval_samples, {k: getattr(cfg, k) for k in KNOBS} | dict(group_size=1, task_file=cfg.eval_file)
    return [agent_mod.make_task(cfg.eval_task or cfg.task, 2**40 + j // K, **knobs) | {"index": -1 - j,
            "group": -1 - j // K} for j in range(cfg.eval_prompts * K)]


async def evaluate(cfg, one, tokenizer, version, out):
    """Weights `version` on eval_tasks, beside training's agents but outside its window and queue: the episodes to
    <out_dir>/eval/step_<version>.jsonl, the eval/ metrics to `out`. A failed episode is counted and scores 0."""
    t0, tasks, P, K = time.perf_counter(), eval_tasks(cfg), cfg.eval_prompts, cfg.eval_samples
    sampling = dict(temperature=cfg.eval_temperature, top_p=cfg.eval_top_p,
                    max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens)
    run = agent_mod.load_agent(cfg.eval_task or cfg.task)
    done = await asyncio.gather(*(one(t, t["index"], run, sampling) for t in tasks), return_exceptions=True)
    if err := next((e for e in done if isinstance(e, ServerError)), None):
        raise err
    eps = {t["index"]: ms for t, ms in zip(tasks, done) if not isinstance(ms, BaseException)}  # segments of each
    if stale := [i for i, ms in eps.items() for m in ms if (m["versions"][m["loss_mask"] == 1] != version).any()]:
        raise AssertionError(f"evaluation of version {version}: episodes {stale} hold tokens other weights sampled")
    rewards = torch.tensor([eps[t["index"]][0]["reward"] if t["index"] in eps else 0.0 for t in tasks]).view(P, K)
    os.makedirs(os.path.join(cfg.out_dir, "eval"), exist_ok=True)
    with open(os.path.join(cfg.out_dir, "eval", f"step_{version}.jsonl"), "w") as f:
        for t, ms in zip(tasks, done):
            for row in [{"error": repr(ms)}] if isinstance(ms, BaseException) else [dict(
                    reward=m["reward"], info=m["info"], text=tokenizer.decode(m["ids"].tolist())) for m in ms]:
                f.write(json.dumps({"step": version, "index": t["index"], "prompt": -1 - t["group"]} | row) + "\n")
    passed, n = rewards >= cfg.eval_pass_reward, max(len(eps), 1)  # (P, K)
    out.put({"eval/reward_mean": sum(ms[0]["reward"] for ms in eps.values()) / n,  # over the episodes that ended
             "eval/pass@1": est.pass_at_k(passed=passed, k=1).mean().item(),
             f"eval/pass@{K}": est.pass_at_k(passed=passed, k=K).mean().item(),
             f"eval/mean@{K}": rewards.mean().item(),  # over all P * K, a failed episode's 0 too
             "eval/response_tokens": sum(int(m["loss_mask"].sum()) for ms in eps.values() for m in ms) / n,
             "eval/failed": len(tasks) - len(eps), "eval/episodes": len(tasks), "eval/time": time.perf_counter() - t0,
             "eval/truncated": sum(any(m["info"].get("truncated") for m in ms) for ms in eps.values())})


async def produce(cfg, engine, tokenizer, out_q, dropped, start_index, vocab_size, state=None, evals=None):
    """Run agents; queue each group whole once all its episodes ended (its advantages compare the whole group).
    Staleness bound: a group starts only while fewer groups are live (started, not all failed) than (version + 1 +
    max_staleness) * prompts_per_step + dropped; max_staleness=0 is synchronous RL. state: a checkpoint's COUNTS
    (deterministic: and index, base). deterministic: once all admitted have ended, {"idle": (version, dropped),
    "state"} follows the groups in the queue (Rollout.settle). evals: (the version to evaluate, its metrics' queue)."""
    run, G, P, S = agent_mod.load_agent(cfg.task), cfg.group_size, cfg.prompts_per_step, cfg.max_staleness
    first = -(-start_index // G)  # resume at the first group not yet started (whole groups only)
    # base: the window's origin in groups, one later for each group that failed whole
    counts = {"index": first * G, "base": first - engine.version * P} | dict.fromkeys(COUNTS, 0) | (state or {})
    index, base, in_a_row, running, groups, idle = counts.pop("index"), counts.pop("base"), 0, {}, {}, None
    asked, evaluation, pending = -1, None, deque()  # pending: finished groups waiting for queue room (back-pressure)
    knobs = {k: getattr(cfg, k) for k in KNOBS}
    server = await endpoint.serve(tokenizer, dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k),
                                  engine.stop_ids)

    async def one(task, index, run=run, sampling=None):
        llm = endpoint.attach(server, Policy(engine, tokenizer, index, sampling))  # base_url, api_key, model for chat
        agent_task = asyncio.ensure_future(run(task, llm))
        if not (await asyncio.wait([agent_task], timeout=cfg.episode_timeout))[0]:
            # not wait_for: it waits for the cancelled agent to finish, forever if the agent swallows the
            # cancellation, and its group would hold a place in the staleness window for good
            llm.closed = True
            agent_task.cancel()
            agent_task.add_done_callback(lambda t: t.cancelled() or t.exception())  # nothing to report later
            raise asyncio.TimeoutError(f"agent still running after episode_timeout={cfg.episode_timeout} s")
        truncated = llm.full and llm.calls and agent_task.exception() is not None  # chat agents too: not dropped
        result = (0.0 if llm.segs else truncated_episode(llm.calls)) if truncated else agent_task.result()
        try:  # a chat agent returned its reward: its episodes (one per segment) come from the endpoint's record
            pairs = [(result, llm.calls)] if isinstance(result, agent_mod.Episode) else endpoint.segments(llm, result)
            msgs = []
            for ep, calls in pairs:
                ep.info |= {"truncated": 1} if truncated else {}
                record = check_tokens(ep, calls)
                check_images(ep.ids, ep.images, getattr(engine, "c", None))  # e.g. a placeholder the policy sampled
                ep.validate(vocab_size)
                msgs.append(episode_to_msg(ep, index, index // G, record))
        except ValueError as e:  # nothing malformed reaches the trainer
            raise Malformed(str(e)) from e
        return msgs  # one per segment

    while True:
        published = engine.shared_version.value if engine.shared_version is not None else engine.version
        drops = dropped.value
        if evals is not None and evals[0].value > asked:  # the trainer asks for an evaluation of its latest version
            asked = evals[0].value
            evaluation = asyncio.ensure_future(evaluate(cfg, one, tokenizer, asked, evals[1]))
        if evaluation is not None and evaluation.done():
            evaluation = evaluation.result()  # None, or its error (a server's, a version's) ends the rollout
        while not cfg.eval_only and len(running) < cfg.concurrent_agents and \
                index // G < base + drops + (published + 1 + S) * P:
            running[asyncio.create_task(one(agent_mod.make_task(cfg.task, index, **knobs), index))] = index
            index += 1
        if cfg.deterministic and not running and idle != (published, drops):  # a state to resume from
            idle = (published, drops)
            pending.append({"idle": idle, "state": dict(counts, index=index, base=base)})
        done = (await asyncio.wait(running, timeout=0.01, return_when=asyncio.FIRST_COMPLETED))[0] if running \
            else await asyncio.sleep(0.01, ())  # asyncio.wait takes no empty set
        for t in done:
            i, err, msgs = running.pop(t), t.exception(), []
            failed = getattr(engine, "failed", None)  # a server failed (where a chat agent only saw a 503)
            if failed or isinstance(err, ServerError):  # not the agent's fault, and every later call would fail too
                raise failed or err
            if err is None:
                msgs = [m | {"stats": dict(counts, tokens_generated=engine.tokens_generated)} for m in t.result()]
            else:
                key = "agent_timeouts" if isinstance(err, asyncio.TimeoutError) else \
                    "malformed" if isinstance(err, Malformed) else "agent_errors"
                counts[key] += 1
                print(f"[rollout] episode {i} dropped ({key}): {err!r}", file=sys.stderr)
            groups.setdefault(i // G, []).append(msgs)
            if len(groups[i // G]) == G:  # the group has ended: send what is left of it, or let another group start
                kept = sorted((m for ms in groups.pop(i // G) for m in ms), key=lambda m: m["index"])
                pending.extend([pack(kept)] if kept else [])
                base, in_a_row = (base, 0) if kept else (base + 1, in_a_row + 1)  # a failed group frees its place
                if in_a_row >= cfg.max_failed_groups:  # an agent that always fails would have us spin for good
                    raise RuntimeError(f"{in_a_row} groups in a row failed (max_failed_groups); last error: {err!r}")
        with contextlib.suppress(queue_mod.Full):  # what does not fit waits for the trainer to take some
            while pending:
                out_q.put_nowait(pending[0])
                pending.popleft()


def start_rollout(cfg, model_cfg, weights, start_version, start_index, tokenizer_dir, state=None, dropped=0):
    """Rank 0: the rollout process, and the servers unless server_urls names them (state, dropped: a checkpoint's)."""
    ctx, procs, servers, write = mp.get_context("spawn"), [], None, None
    memory = cfg.engine == "sglang" and cfg.weight_sync != "disk"  # the rollout process broadcasts the shared tensors
    shared = {k: v.clone().share_memory_() for k, v in weights.items()} if cfg.engine == "torch" or memory else None
    if cfg.engine != "torch":  # the servers start from the first version's directory
        write = functools.partial(write_weights, os.path.join(cfg.out_dir, "engine_weights"), model_cfg, tokenizer_dir)
        first = write(start_version, weights)
        if cfg.server_urls:  # servers started elsewhere: wait for them
            servers = [(u.strip().rstrip("/"), None) for u in cfg.server_urls.split(",") if u.strip()]
            for url, _ in servers:
                wait_healthy(url, cfg.server_timeout)
        else:
            log = os.path.join(cfg.out_dir, f"{cfg.engine}_server.log")
            proc, url = start_server(cfg.engine, first, cfg, log, moe=model_cfg.num_experts > 0)
            procs, servers = [(proc, log)], [(url, log)]
    link = types.SimpleNamespace(weights=shared, version=ctx.Value("l", start_version), lock=ctx.Lock(),
                                 out_q=ctx.Queue(maxsize=cfg.queue_size), dropped=ctx.Value("l", dropped),
                                 servers=servers, evals=(ctx.Value("l", -1), ctx.Queue()))
    proc = ctx.Process(target=rollout_main, daemon=True, name="nanomolt-rollout",
                       args=(cfg, model_cfg, link, start_index, tokenizer_dir, state))
    proc.start()
    return Rollout(proc, link, procs, None if memory else write, cfg.deterministic)


class Rollout:
    """The trainer's handle on the rollout process (and on the inference servers it started); link: start_rollout's."""
    def __init__(self, proc, link, servers=(), write=None, deterministic=False):
        self.proc, self.link, self.servers, self.write = proc, link, servers, write  # servers: [(process, log path)]
        self.held, self.idle, self.deterministic = deque(), None, deterministic  # held: settled groups, untrained

    def get(self, timeout=1.0, stop=lambda: None):
        """Next group: a list of episode messages, or None after `timeout` seconds without one; raises if the
        rollout process or a server it uses died. deterministic: the settled groups, in data order (None: stop())."""
        if self.deterministic and not self.held:
            self.settle(stop)  # nothing held after a stop: None
        item = self.held.popleft() if self.held else None if self.deterministic else self._next(timeout)
        return None if item is None else unpack(item)

    def settle(self, stop=lambda: None):
        """deterministic: wait for the rollout to report that all the published version admitted has ended, every
        drop seen; hold the groups before the report, in data order -> its state then (resume: it and `held`); None
        once stop() is true (a signal: episodes may run up to episode_timeout, longer than a preemption's grace)."""
        while self.idle is None or self.idle["idle"] != (self.link.version.value, self.link.dropped.value):
            if stop():
                return None
            if (item := self._next(1.0)) is not None:  # a group (packed: the checkpoint saves it so) or the report
                self.held.extend([] if "idle" in item else [item])
                self.idle = item if "idle" in item else self.idle
        self.held = deque(sorted(self.held, key=lambda item: item["msgs"][0]["index"]))
        return self.idle["state"]

    def evaluate(self, version):
        """Ask the rollout process to evaluate weights `version`, the ones just published (see evaluate)."""
        self.link.evals[0].value = version

    def eval_result(self):
        """-> the eval/ metrics asked for last; waits (the next publish must not come before they are sampled)."""
        while (m := self._next(1.0, self.link.evals[1])) is None:
            pass
        return m

    def _next(self, timeout, q=None):
        try:
            return (self.link.out_q if q is None else q).get(timeout=timeout)
        except (OSError, EOFError) as e:  # the sender died while the item's tensors were being handed over
            raise RuntimeError(f"rollout process died while sending episodes ({e!r})") from e
        except queue_mod.Empty:
            for p, log in self.servers:
                if p.poll() is not None:
                    raise RuntimeError(f"inference server died (exit code {p.returncode}){log_tail(log)}")
            if not self.proc.is_alive():
                raise RuntimeError(f"rollout process died (exit code {self.proc.exitcode}); its traceback is above")
            return None

    def publish(self, state, version):
        """Hand new weights to the engine as `version`: copied into its shared tensors (torch; sglang in
        memory: the rollout process broadcasts them), or written as a directory the servers load (disk)."""
        if self.write is not None:
            self.write(version, state)
            self.link.version.value = version
            return
        while not self.link.lock.acquire(timeout=1.0):  # a process killed inside a forward never releases it
            if self.proc is not None and not self.proc.is_alive():
                raise RuntimeError(f"rollout process died (exit code {self.proc.exitcode}) holding the weights lock")
        try:
            for k, t in state.items():
                self.link.weights[k].copy_(t)
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
        for p, _ in self.servers:
            stop_server(p)

# ---- server engines: vLLM and SGLang over HTTP ----
# Servers (own processes, own Python, or other machines) behind `await generate(ids)`; new weights: ServerEngine.run.
# weight_sync "gloo" (CPU servers) / "nccl" (GPU): SGLang in memory, the rollout process broadcasting the shared
# tensors `publish` fills (rank 0; server k: rank k + 1, tp 1). "disk" (vLLM; others): a directory per version.


class ServerError(RuntimeError):
    """A server died, is unreachable or refused a call: the rollout stops (a dead server is never a hang)."""


def _http(url, body=None, timeout=600.0):
    """POST `body` as JSON (GET when None) -> the decoded JSON answer, or its text."""
    req = urllib.request.Request(url, None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read().decode()
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


def vllm_generate(url, ids, p, timeout):
    """/v1/completions, one token-id prompt a call (a list shares one seed: a group's equal prompts, equal samples)."""
    (ids,), (p,) = ids, p
    c = _http(url + "/v1/completions", {
        "prompt": ids, "max_tokens": p["max_new_tokens"], "temperature": p["temperature"], "top_p": p["top_p"],
        "top_k": p["top_k"] or -1, "stop_token_ids": p["stop_ids"], "seed": p["seed"], "logprobs": 0,  # sampled only
        "return_token_ids": True, "skip_special_tokens": False}, timeout)["choices"][0]
    experts = c.get("routed_experts") and np.load(io.BytesIO(base64.b64decode(c["routed_experts"])))  # .npy bytes
    return [(c["token_ids"], c["logprobs"]["token_logprobs"], experts, 0)]  # cached tokens: not reported


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
    return argv + ["--enable-return-routed-experts"] * moe, {}


def sglang_generate(url, ids, ps, timeout):
    """The native /generate with many prompts' input_ids (and each one's images, PNG data: URLs) -> per prompt (ids,
    logprobs, experts (T-1, layers, k), the prompt tokens its radix cache held)."""
    images = {"image_data": [p.get("images", []) for p in ps]} if any("images" in p for p in ps) else {}
    answers = _http(url + "/generate", images | {"input_ids": ids, "return_logprob": True, "return_routed_experts": ps[
        0]["experts"], "sampling_params": [{"max_new_tokens": p["max_new_tokens"], "temperature": p["temperature"],
        "top_p": p["top_p"], "top_k": p["top_k"] or -1, "stop_token_ids": p["stop_ids"], "sampling_seed": p["seed"],
        "skip_special_tokens": False, "no_stop_trim": True} for p in ps]}, timeout)
    # meta_info.output_token_logprobs holds (logprob, id, _) per token; routed_experts is base64 of int32
    return [([t[1] for t in m["output_token_logprobs"]], [t[0] for t in m["output_token_logprobs"]],
             m.get("routed_experts") and np.frombuffer(base64.b64decode(m["routed_experts"]), np.int32),
             m.get("cached_tokens", 0)) for m in (a["meta_info"] for a in answers)]


def sglang_load_weights(url, path, timeout):  # also flushes the radix cache: no prefix of the old weights is reused
    _http(url + "/update_weights_from_disk", {"model_path": path, "flush_cache": True}, timeout)


def sglang_receive(url, meta, timeout):
    """Take one version by broadcast (meta: names, dtypes, shapes in broadcast order); 0.5.23 needs begin/end."""
    for path in ("begin_weight_update", "update_weights_from_distributed", "end_weight_update"):
        _http(f"{url}/{path}", meta if path.startswith("update") else {}, timeout)


SERVERS = {"vllm": dict(command=vllm_command, generate=vllm_generate, load_weights=vllm_load_weights, batched=False),
           "sglang": dict(command=sglang_command, generate=sglang_generate, load_weights=sglang_load_weights,
                          batched=True)}  # /generate takes many prompts: a tick's requests in one call (+30% tok/s)


class ServerEngine:
    """Episodes spread over the servers (data parallel), HTTP calls in threads; run() swaps weights."""
    def __init__(self, kind, urls, *, model_config, weights_dir, logs=None, temperature=1.0, top_p=1.0, top_k=0,
                 max_new_tokens=16, max_len=512, stop_ids=(), seed=0, version=None, timeout=600.0, concurrency=64,
                 weights=None, lock=None, sync="disk"):
        c, self.api, self.urls, self.logs = model_config, SERVERS[kind], list(urls), list(logs or [None] * len(urls))
        self.c = c if kind == "sglang" else None  # SGLang takes images (Policy.generate checks them against it)
        self.top_k, self.vocab_size = c.num_experts_per_tok, c.vocab_size
        self.moe_layers = [i for i in range(c.num_hidden_layers) if c.is_moe_layer(i)]
        self.params = dict(temperature=temperature, top_p=top_p, top_k=top_k, stop_ids=list(stop_ids),
                           experts=bool(self.moe_layers))
        self.max_new, self.max_len, self.seed, self.timeout = max_new_tokens, max_len, seed, timeout
        self.stop_ids = set(stop_ids)  # the endpoint's too: a reply that ends with one is "stop"
        self.weights_dir, self.shared_version, self.lock, self.sync = weights_dir, version, lock, sync
        self.hf = None  # in-memory sync (sglang): the shared tensors under the servers' names (views), as written
        if weights is not None and sync != "disk":  # by write_weights: lm_head its own tensor
            lm_head = {"lm_head.weight": weights.get("lm_head.weight", weights["model.embed_tokens.weight"])}
            self.hf = to_hf_state(weights | lm_head, dataclasses.replace(c, tie_word_embeddings=False))
        self.version = version.value if version is not None else 0  # tokens are tagged with it
        self.group = self.meta = self.loaded = self.failed = None  # loaded: the servers' version (None: unknown)
        self.open = asyncio.Event()  # admitting requests
        self.pool = concurrent.futures.ThreadPoolExecutor(concurrency + len(self.urls))  # one thread per call
        self.calls, self.tokens_generated, self.prompt_tokens = itertools.count(), 0, np.zeros(2, int)  # sent, cached
        self.in_flight, self.home = {}, {}  # an answer's future -> its server; an episode -> its server
        self.queued = {k: [] for k in range(len(self.urls))}  # per server: the batch being formed

    async def generate(self, ids, max_new_tokens=None, key=None, sampling=None, images=None) -> Completion:
        max_new = check_prompt(ids, self.vocab_size, self.max_len, max_new_tokens or self.max_new)
        sent, at = [*ids], -1
        for h, w in (self.c.grid(im) for im in images or []):  # SGLang expands each image's one placeholder itself
            at = sent.index(self.c.image_token_id, at + 1)  # its run of h * w becomes one
            del sent[at + 1:at + h * w]
        while self.shared_version is not None and self.shared_version.value != self.version:  # none on weights
            await asyncio.sleep(0.01)  # older than the published ones (an evaluation's are exactly its version's)
        await self.open.wait()  # closed while the servers change weights
        version, i = self.version, next(self.calls)
        seed = int(uniform([[self.seed, *(key or (-1, i))]])[0] * 2**31)  # per request, as the torch engine's
        p = dict(self.params, max_new_tokens=max_new, seed=seed) | (sampling or {})  # draws (sampling_seed, seed)
        p |= {"images": [png_url(im) for im in images]} if images else {}
        # an episode's calls all go to one server (its radix cache keeps their shared prefix): the one with the fewest
        # requests in flight at its first call, ties by the episode's index modulo n; unkeyed calls: round-robin
        n = len(self.urls)
        if key and key[0] not in self.home:
            busy = [*self.in_flight.values()]
            self.home[key[0]] = min(range(n), key=lambda k: (busy.count(k), (k - key[0]) % n))
        out, logprobs, experts, cached = await self._submit(self.home[key[0]] if key else i % n, sent, p)
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

    def _submit(self, k, ids, p):
        """-> a future of server k's answer, in in_flight till done; a loop tick's requests share a batched call."""
        if not self.queued[k] or not self.api["batched"]:
            self.queued[k] = []
            asyncio.ensure_future(self._send(k, self.queued[k]))  # held by the loop, then by its HTTP call
        fut = asyncio.get_running_loop().create_future()
        fut.add_done_callback(self.in_flight.pop)
        self.in_flight[fut] = k
        self.queued[k].append((ids, p, fut))
        return fut

    async def _send(self, k, batch):
        self.queued[k] = [] if self.queued[k] is batch else self.queued[k]  # closed: later requests start the next
        try:
            outs = await self._call(k, self.api["generate"], [b[0] for b in batch], [b[1] for b in batch], self.timeout)
        except Exception as e:  # every caller sees the failure, and run() raises it: prompts are checked, so a
            outs, self.failed = [e] * len(batch), e  # failed call is the server's (the rollout stops, chat agents too)
        for (*_, fut), out in zip(batch, outs):
            if not fut.done():  # its agent was cancelled meanwhile
                fut.set_exception(out) if isinstance(out, Exception) else fut.set_result(out)

    async def _call(self, k, fn, *args):
        """fn(url of server k, *args) in a thread; any failure is a ServerError naming the server, with its log."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, self.urls[k], *args)
        except urllib.error.HTTPError as e:
            raise ServerError(f"{self.urls[k]} answered {e.code}: {e.read().decode(errors='replace')[-2000:]}"
                              f"{log_tail(self.logs[k])}") from e
        except OSError as e:  # refused, reset, timed out
            raise ServerError(f"server {self.urls[k]} is unreachable ({e}){log_tail(self.logs[k])}") from e

    async def run(self):
        """On a new shared version: close admission, wait for the requests in flight, move every server to
        it (in memory or from its directory), reopen. Tokens sampled after that are tagged with it."""
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
                    await asyncio.gather(*(self._call(k, self.api["load_weights"], path, self.timeout)
                                           for k in range(len(self.urls))))
                self.version = self.loaded = target
                for name in os.listdir(self.weights_dir):  # older versions: no server will read them again
                    if name[:1] == "v" and name[1:].isdigit() and int(name[1:]) < target:
                        shutil.rmtree(os.path.join(self.weights_dir, name), ignore_errors=True)
            self.open.set()
            await asyncio.sleep(0.01)

    async def _sync_in_memory(self):
        """Broadcast the shared tensors to every server -> their version. The first call forms the group."""
        loop, n, gloo = asyncio.get_running_loop(), len(self.urls), self.sync == "gloo"
        if self.group is None:
            with socket.create_connection(urllib.parse.urlsplit(self.urls[0]).netloc.rsplit(":", 1)) as s:
                address = s.getsockname()[0]  # ours, on the route to the servers: where they find the store
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
            self.group, *_ = await asyncio.gather(loop.run_in_executor(self.pool, make, store, 0, n + 1), *(self._call(
                k, lambda url, body: _http(url + "/init_weights_update_group", body, self.timeout),
                dict(join, rank_offset=k + 1)) for k in range(n)))  # each join answers once all ranks joined
            self.meta = {"names": list(self.hf), "dtypes": [str(t.dtype)[6:] for t in self.hf.values()],  # "torch.x"
                         "shapes": [list(t.shape) for t in self.hf.values()], "group_name": name, "flush_cache": True}

        def broadcast():  # in a thread, under the weights lock (the trainer never writes mid-broadcast)
            with self.lock:
                for t in self.hf.values():
                    self.group.broadcast(t.contiguous() if gloo else t.cuda(), 0).wait()
                return self.shared_version.value
        return (await asyncio.gather(loop.run_in_executor(self.pool, broadcast), *(
            self._call(k, sglang_receive, self.meta, self.timeout) for k in range(n))))[0]  # broadcast's version


def png_url(im):
    """(3, H, W) in [0, 1] -> a PNG data: URL; a ValueError for values a PNG cannot carry exactly (not k / 255)."""
    pixels = (im * 255).round()
    if not torch.equal(pixels / 255, im):
        raise ValueError("a server takes 8-bit images (values k / 255, as a PNG or JPEG decodes): quantize it first")
    buf = io.BytesIO()
    endpoint.Image.fromarray(pixels.byte().permute(1, 2, 0).numpy()).save(buf, "PNG")
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
    if v := model_cfg.vision:  # SGLang's Qwen3-VL image processor, with bounds that resize none of our images (sides
        f = v["patch_size"] * v["spatial_merge_size"]  # multiples of f; the endpoint resized chat images already)
        with open(os.path.join(tmp, "preprocessor_config.json"), "w") as fh:
            json.dump(dict(image_processor_type="Qwen2VLImageProcessor", image_mean=[0.5] * 3, image_std=[0.5] * 3,
                           merge_size=v["spatial_merge_size"], size={"shortest_edge": f * f, "longest_edge": 2**24},
                           **{k: v[k] for k in ("patch_size", "temporal_patch_size")}), fh)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def start_server(kind, model_dir, cfg, log, moe=False):
    """Start a server (its own process group: see stop_server), output to `log`; wait until healthy -> (process, url)"""
    for port in np.random.default_rng().choice(range(20000, 32768), 64, replace=False).tolist():  # a free port
        with socket.socket() as s, contextlib.suppress(OSError):  # below Linux's ephemeral range (32768-60999): one
            s.bind(("127.0.0.1", port))  # from there, once released, can go to another process's outgoing connection
            break
    argv, env = SERVERS[kind]["command"](model_dir, port, cfg, moe)
    print(f"starting the {kind} server (log: {log}; server_timeout={cfg.server_timeout:.0f}s)", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
    with open(log, "ab") as f:
        proc = subprocess.Popen([cfg.server_python or sys.executable, *argv, *shlex.split(cfg.server_args)],
                                stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=os.environ | env,
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
    with open(path, "rb") as f:  # a server's log grows all run: read its tail only
        f.seek(max(0, os.path.getsize(path) - n_bytes))
        return f"; last lines of {path}:\n" + f.read().decode(errors="replace")
