"""engine.py: the embedded torch engine and sampling. Every generated token comes back with its logprob under the
distribution it was sampled from, the version of the weights that sampled it and, for MoE, its experts."""
import asyncio
import contextlib
import dataclasses
import itertools
import math
from collections import deque

import numpy as np
import torch

from agent import Completion, ContextFull
from model_moe import KVCache, Transformer


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
    """keys (B, n) ints -> (B,) float64 in [0, 1): splitmix64 (Steele et al. 2014) over each row, a pure function of
    (seed, episode, call, position), not of batch or timing: a resumed episode resamples alike."""
    h = np.zeros(len(keys), dtype=np.uint64)
    for col in np.asarray(keys, dtype=np.int64).astype(np.uint64).T:  # numpy: uint64 arithmetic wraps, and is fast
        h = (h ^ col) + np.uint64(0x9E3779B97F4A7C15)
        for s, m in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, 1)):
            h = (h ^ (h >> np.uint64(s))) * np.uint64(m)
    return torch.from_numpy((h >> np.uint64(11)).astype(np.float64) / 2**53)  # the top 53 bits


def sample(logits, u, *, temperature, top_p=1.0, top_k=0):
    """logits (B, V), u (B,) uniforms in [0, 1) -> ids, logprobs (B,); temperature 0: greedy, its logprob at T=1"""
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
                 max_new_tokens=16, stop_ids=(), seed=0, version=None, lock=None, chunk_tokens=8192):
        self.model = model.eval()
        self.c = model.config  # (Policy and the chat endpoint read its vision settings)
        param = next(model.parameters())
        self.cache = KVCache(self.c, slots, max_len, dtype=param.dtype, device=param.device)
        # experts by slot and position (S, max_len, n_moe, k), -1: not computed; per slot as the KV cache: one write
        self.routing = torch.full((slots, max_len, self.c.n_moe_layers, self.c.num_experts_per_tok), -1,
                                  dtype=torch.int16) if self.c.n_moe_layers else None
        self.sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
        self.max_new = max_new_tokens
        self.stop_ids = set(stop_ids)
        self.seed = seed
        self.max_len = max_len
        self.chunk_tokens = chunk_tokens  # padded tokens per prefill forward: bounds its activations
        if self.c.vision:  # a sampled placeholder has no image: end the row there (the agent rejects
            self.stop_ids.add(self.c.image_token_id)  # the episode), else a re-prefill would splice a feature in
        self.shared_version = version  # the version the trainer published (shared); its tensors are the model's
        self.lock = lock or contextlib.nullcontext()  # held by the trainer while it publishes
        self.version = version.value if version is not None else 0  # the version of the model's weights
        self.requests = itertools.count()  # numbers the calls that come without a key
        self.waiting = deque()  # requests not yet in a slot
        self.active = {}  # slot -> its request
        self.free = list(range(slots))[::-1]  # the free slots, the lowest last (popped first)
        self.wake = asyncio.Event()  # set when a request arrives
        self.tokens_generated = 0

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
        self._forward(rows, [r.ids[:-1] for r in rows], start=[0] * len(rows), prefill=True, logits=False)

    @torch.inference_mode()  # not no_grad: it also skips autograd's view and version tracking
    def _forward(self, rows, chunks, start, prefill=False, logits=True):
        """-> logits (B, V) at each row's last chunk token (prefill: images go in). Forwards of at most `chunk_tokens`
        padded tokens, logits only where needed, tensors built per group, not per row (small tensors cost more)."""
        out = []  # (b, V) of each group
        dev = self.cache.k.device
        i = 0  # the group's first row
        while i < len(rows):
            n, T = 1, len(chunks[i])  # the group's rows and padded length
            while i + n < len(rows) and (n + 1) * max(T, len(chunks[i + n])) <= self.chunk_tokens:
                n, T = n + 1, max(T, len(chunks[i + n]))
            group = rows[i:i + n]
            lens = torch.tensor([len(ch) for ch in chunks[i:i + n]])  # (b,)
            ids = torch.tensor([ch + [0] * (T - len(ch)) for ch in chunks[i:i + n]], device=dev)  # (b, T), right-padded
            pos = torch.tensor(start[i:i + n])[:, None] + torch.arange(T)  # (b, T); padding's run on past the row
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
        """One iteration -> the rows that got a token; weights change only here, under the publish lock (versions)."""
        with self.lock:  # no publish mid-forward (on a GPU, sampling's copy to the CPU waits for every kernel)
            if self.shared_version is not None and self.shared_version.value != self.version:
                self.set_weights({}, self.shared_version.value)
            new = [self.waiting.popleft() for _ in range(min(len(self.waiting), len(self.free)))]
            for req in new:
                req.slot = self.free.pop()
                self.active[req.slot] = req
                if self.routing is not None:
                    self.routing[req.slot] = -1  # forget the previous occupant's experts
            if new:  # prefill: the whole prompt of each new row; sample its first token. Equal prompts and images (a
                first = {}  # GRPO group's) are computed once, its keys, values and experts copied to the others
                images = [[(im.shape, im.numpy().tobytes()) for im in r.images or ()] for r in new]  # shape: H != W
                leads = [first.setdefault((*r.ids, *ims), r) for r, ims in zip(new, images)]
                uniq = list(first.values())
                logits = self._forward(uniq, [r.ids for r in uniq], [0] * len(uniq), prefill=True)
                copies = [(r.slot, lead.slot) for r, lead in zip(new, leads) if r is not lead]  # (to, from)
                if copies:
                    dst, src = map(list, zip(*copies))
                    longest = max(len(r.ids) for r in new)
                    for kv in (self.cache.k, self.cache.v):  # (L, S, nkv, max_len, hd)
                        kv[:, dst, :, :longest] = kv[:, src, :, :longest]
                    if self.routing is not None:
                        self.routing[dst, :longest] = self.routing[src, :longest]
                self._sample(new, logits[[uniq.index(lead) for lead in leads]])
            # in slot order: when the slots in use are consecutive (all busy), the cache reads them as a view
            rows = [self.active[s] for s in sorted(self.active) if self.active[s] not in new]
            if rows:  # decode: feed each row's last sampled token
                self._sample(rows, self._forward(rows, [r.ids[-1:] for r in rows], [len(r.ids) - 1 for r in rows]))
        return len(new) + len(rows)

    def _sample(self, rows, logits):
        u = uniform([[self.seed, *r.key, len(r.ids)] for r in rows])  # (B,); len(r.ids): the new token's position
        ids, logps = torch.zeros(len(rows), dtype=torch.long), torch.zeros(len(rows))
        for setting in {r.sampling for r in rows}:  # an evaluation's rows sample with its own settings
            at = [i for i, r in enumerate(rows) if r.sampling == setting]
            ids[at], logps[at] = (x.cpu() for x in sample(logits[at], u[at], **self.sampling | dict(setting)))
        self.tokens_generated += len(rows)
        for req, token, lp in zip(rows, ids.tolist(), logps.tolist()):
            req.ids.append(token)
            req.logprobs.append(lp)
            req.versions.append(self.version)
            if token in self.stop_ids or len(req.ids) - req.prompt_len >= req.max_new or len(req.ids) >= self.max_len:
                del self.active[req.slot]
                self.free.append(req.slot)
                routing = self.routing[req.slot, :len(req.ids)].clone() if self.routing is not None else None
                if not req.future.done():  # an agent cancelled by its timeout no longer waits
                    req.future.set_result(Completion(req.ids[req.prompt_len:], req.logprobs, req.versions, routing))

    async def run(self):
        while True:
            if not self.waiting and not self.active:
                self.wake.clear()
                await self.wake.wait()
            self.step()
            await asyncio.sleep(0)  # let agents react to finished rows before the next step

