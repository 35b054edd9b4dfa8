"""The embedded torch engine: what it samples, what it records, and how it batches and swaps weights."""
import asyncio
import json
import math
import os
import sys
import threading
import time
import types

import pytest
import torch

import engine
import rollout
from engine import TorchEngine
from model_moe import ModelConfig, Transformer

V = 64


def tiny(seed=0, experts=4):
    c = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, num_experts=experts, num_experts_per_tok=2,
                    moe_intermediate_size=16, tie_word_embeddings=False)
    return Transformer(c).init_weights(seed, std=0.3)


def run(engine, prompts, delays=None, **kw):
    """Submit prompts (optionally after delays, in engine steps) and drive the engine until all finish."""
    async def main():
        loop_task = asyncio.create_task(engine.run())
        async def one(p, d):
            for _ in range(d):
                await asyncio.sleep(0)
            return await engine.generate(p, **kw)
        outs = await asyncio.gather(*(one(p, d) for p, d in zip(prompts, delays or [0] * len(prompts))))
        loop_task.cancel()
        return outs
    return asyncio.run(main())


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def full_logits(model, seq):
    with torch.no_grad():
        return model(torch.tensor([seq]))[0]  # (T, V)


def reference_filter(logits, temperature, top_k, top_p):
    """Independent re-statement of the sampling distribution: sort, cut, renormalise (plain loops)."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = sorted(range(len(p)), key=lambda i: -p[i].item())
    keep = order[:top_k] if top_k else order
    total = sum(p[i].item() for i in keep)  # top-p is taken of the distribution renormalised over the top-k
    kept, mass = [], 0.0
    for i in keep:
        if mass >= top_p:
            break
        kept.append(i)
        mass += p[i].item() / total
    q = torch.zeros_like(p)
    q[kept] = p[kept] / p[kept].sum()
    return q


def test_greedy_equals_argmax_of_full_forward():
    m = tiny()
    outs = run(TorchEngine(m, slots=4, max_len=64, temperature=0, max_new_tokens=10), prompts(6))
    for p, c in zip(prompts(6), outs):
        seq = p + c.ids
        logits = full_logits(m, seq)
        assert c.ids == logits[len(p) - 1:-1].argmax(-1).tolist()
        assert len(c.ids) == 10 and c.versions == [0] * 10


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.9, 10, 0.6)])
def test_sampled_logprobs_match_full_forward(temperature, top_k, top_p):
    m = tiny(1)
    e = TorchEngine(m, slots=8, max_len=64, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=12,
                    seed=3)
    for p, c in zip(prompts(5, 1), run(e, prompts(5, 1))):
        logits = full_logits(m, p + c.ids)
        for j, (t, lp) in enumerate(zip(c.ids, c.logprobs)):
            q = reference_filter(logits[len(p) - 1 + j], temperature, top_k, top_p)
            assert q[t] > 0, "sampled a token outside the top-k / top-p set"
            assert abs(math.log(q[t].item()) - lp) <= 1e-5


def test_sampler_frequencies_follow_the_filtered_distribution():
    """engine.sample draws from exactly the distribution whose logprobs it reports: empirical frequencies
    of 20k draws per row match reference_filter within 5 standard errors; filtered-out tokens never appear."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0)) * 2
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 10, 1.0), (1.3, 0, 0.8)]:
        n, g = 20_000, torch.Generator().manual_seed(1)
        ids, logps = engine.sample(logits.repeat_interleave(n, 0), torch.rand(3 * n, generator=g),
                                    temperature=temperature, top_k=top_k, top_p=top_p)
        for row in range(3):
            q = reference_filter(logits[row], temperature, top_k, top_p)
            got = torch.bincount(ids[row * n:(row + 1) * n], minlength=V).double() / n
            assert (got[q == 0] == 0).all(), "sampled a token of probability 0"
            assert ((got - q).abs() <= 5 * (q * (1 - q) / n).sqrt() + 1e-9).all()
            assert torch.allclose(logps[row * n:(row + 1) * n].double(), q[ids[row * n:(row + 1) * n]].log(), atol=1e-5)


def test_routing_matches_full_forward():
    m = tiny(2)
    engine = TorchEngine(m, slots=2, max_len=64, temperature=1.0, max_new_tokens=6)
    for p, c in zip(prompts(4, 2), run(engine, prompts(4, 2))):
        seq = p + c.ids
        with torch.no_grad():
            _, routing = m(torch.tensor([seq]), return_routing=True)  # (L, 1, T, k)
        assert c.routing.shape == (len(seq), 2, 2)
        assert torch.equal(c.routing[:-1].long(), routing[:, 0, :-1].transpose(0, 1))
        assert (c.routing[-1] == -1).all()  # the last sampled token was never fed to the model


def test_continuous_batching_matches_one_at_a_time():
    m = tiny(4)
    ps = prompts(9, 4)
    alone = [run(TorchEngine(m, slots=1, max_len=64, temperature=0, max_new_tokens=7), [p])[0].ids for p in ps]
    # 3 slots for 9 requests arriving at different times: slots are refilled as rows finish
    e = TorchEngine(m, slots=3, max_len=64, temperature=0, max_new_tokens=7, stop_ids=[5, 9])
    together = run(e, ps, delays=[0, 0, 1, 2, 3, 5, 8, 13, 21])
    stopped = [next((i + 1 for i, t in enumerate(a) if t in (5, 9)), len(a)) for a in alone]
    assert [c.ids for c in together] == [a[:n] for a, n in zip(alone, stopped)]


def test_equal_prompts_share_one_prefill_and_sample_as_alone():
    """A GRPO group's equal prompts are prefilled once (the first row's keys, values and experts copied to the others'
    slots): each row still samples, scores and routes what it does alone, keyed by its episode."""
    m = tiny(7)
    p, other = prompts(2, 7)
    reqs = [(p, (e, 0)) for e in range(5)] + [(other, (9, 0))]

    def go(engine, reqs):
        async def main():
            loop = asyncio.create_task(engine.run())
            outs = await asyncio.gather(*(engine.generate(ids, key=k) for ids, k in reqs))
            loop.cancel()
            return outs
        return asyncio.run(main())
    e, rows = TorchEngine(m, slots=6, max_len=64, temperature=1.0, max_new_tokens=6, seed=3), []
    forward = e._forward
    e._forward = lambda batch, *a, **kw: rows.append(len(batch)) or forward(batch, *a, **kw)  # counts, then runs
    together = go(e, reqs)
    assert rows[0] == 2  # the first step's prefill: one row per distinct prompt
    for (ids, k), c in zip(reqs, together):
        alone = go(TorchEngine(m, slots=1, max_len=64, temperature=1.0, max_new_tokens=6, seed=3), [(ids, k)])[0]
        assert c.ids == alone.ids and torch.equal(c.routing, alone.routing)
        assert max(abs(a - b) for a, b in zip(c.logprobs, alone.logprobs)) < 1e-5
    assert len({tuple(c.ids) for c in together[:5]}) > 1  # the rows that shared a prefill sample apart


def test_weight_swap_mid_generation():
    m, new = tiny(5), tiny(6)
    e = TorchEngine(m, slots=4, max_len=64, temperature=1.0, max_new_tokens=12, seed=1)
    ps = prompts(3, 5)

    async def main():
        loop_task = asyncio.create_task(swap_after(4))
        outs = await asyncio.gather(*(e.generate(p) for p in ps))
        loop_task.cancel()
        return outs

    async def swap_after(n):
        for _ in range(n):
            await asyncio.sleep(0)
            e.step()
        e.set_weights(new.state_dict(), 1)
        await e.run()

    old = tiny(5)
    for p, c in zip(ps, asyncio.run(main())):
        k = c.versions.index(1)
        assert 0 < k < len(c.ids) and c.versions == [0] * k + [1] * (len(c.ids) - k)
        for model, lo, hi in ((old, 0, k), (new, k, len(c.ids))):
            logp = torch.log_softmax(full_logits(model, p + c.ids), -1)
            for j in range(lo, hi):
                assert abs(logp[len(p) - 1 + j, c.ids[j]].item() - c.logprobs[j]) <= 1e-5


# ---- agents against the real engine: token identity and failures ----

import queue

import agent
from tools import agentkit
import config
from rollout import Policy, check_tokens, produce


class Counter:  # stands in for the shared mp.Value the trainer bumps
    def __init__(self, value=0):
        self.value = value


def engine_for(tok, seed=0):
    c = ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=16)
    return TorchEngine(Transformer(c).init_weights(seed, std=0.3), slots=16, max_len=256, temperature=1.0,
                       max_new_tokens=6, stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")], seed=seed)


def drive(engine, coro_fn):
    """Run engine.run() beside coro_fn() in one event loop; an engine error surfaces as it would in the rollout."""
    async def main():
        loop_task, work = asyncio.create_task(engine.run()), asyncio.create_task(coro_fn())
        done, _ = await asyncio.wait([loop_task, work], return_when=asyncio.FIRST_COMPLETED)
        if loop_task in done:
            work.cancel()
            loop_task.result()
        await stop_the_rest()
        return work.result()
    return asyncio.run(main())


async def stop_the_rest(timeout=30):
    """Cancel every task but this one and wait until they have ended, before asyncio.run's cleanup would: that
    cleanup also cancels CPython 3.11's own task that connects a new subprocess's pipes (an agent starting its
    program), and that process's wait() then never returns. Those pipe tasks are left to finish."""
    me = asyncio.current_task()
    while rest := [t for t in asyncio.all_tasks() if t is not me and getattr(t.get_coro(), "__name__", "") != "_connect_pipes"]:
        for t in rest:
            t.cancel()
        assert not (await asyncio.wait(rest, timeout=timeout))[1], "tasks still running after being cancelled"


def collect(cfg, engine, tok, n):
    """The rollout's producer (agents of cfg.task) on engine until n episodes have arrived, in whole groups."""
    out = queue.Queue()

    async def episodes():
        prod = asyncio.create_task(produce(cfg, engine, tok, out, Counter(), 0, len(tok)))
        msgs, deadline = [], time.monotonic() + 60
        while len(msgs) < n:
            assert time.monotonic() < deadline, f"{len(msgs)} of {n} episodes after 60 s"
            await asyncio.sleep(0.01)
            while not out.empty():
                msgs.extend(rollout.unpack(out.get()))  # a whole group
        prod.cancel()
        return msgs
    return drive(engine, episodes)


def test_drive_returns_while_agents_start_their_programs():
    """drive() (and so collect) returns when the work does, although agents it left running are starting programs
    at that moment: asyncio.run's cleanup cancelled CPython 3.11's own task that connects a new subprocess's pipes,
    and that process's wait() then never returned (a test hung 900 s in CI when an agent started its program late)."""
    class Idle:  # an engine with nothing to do
        async def run(self):
            await asyncio.Event().wait()

    async def agent():
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(60)",
                                                    stdout=asyncio.subprocess.PIPE)
        try:
            await proc.communicate()
        finally:  # as tests/agents/process_agent.py does
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    async def work():
        for _ in range(8):
            asyncio.ensure_future(agent())
        return "done"
    out = []
    thread = threading.Thread(target=lambda: out.append(drive(Idle(), work)), daemon=True)
    thread.start()
    thread.join(60)
    assert out == ["done"], "drive() hung stopping the agents it left running"


def test_episode_holds_exactly_the_sampled_ids(tok):
    """Multi-turn guess episodes from the real engine: the trained ids are the engine's ids, although
    decoding and re-encoding the sampled text would give other ids (the BPE merges them differently)."""
    cfg = config.load(["--group_size=2", "--prompts_per_step=4", "--max_turns=3", "--max_staleness=0"])
    engine = engine_for(tok)
    msgs = collect(cfg, engine, tok, 8)
    changed = 0
    for m in msgs:
        ids, mask = m["ids"], m["loss_mask"].bool()
        assert torch.equal(ids[mask], m["engine_ids"])
        sampled_runs = [ids[s:e].tolist() for s, e in runs(mask)]
        for r in sampled_runs:
            text = tok.decode(r)
            changed += tok.encode(text, add_special_tokens=False) != r
    assert changed > 0, "no sampled run re-tokenizes differently: the test would not catch re-tokenization"


def runs(mask):
    out, start = [], None
    for i, m in enumerate(mask.tolist() + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_check_tokens_rejects_an_episode_that_differs_from_the_engine(tok):
    engine = engine_for(tok, 1)

    async def main():
        loop_task = asyncio.create_task(engine.run())
        llm = Policy(engine, tok)
        ep = agent.Episode()
        ep.append(agentkit.prompt_ids(tok, "hi"))
        await agentkit.model_turn(llm, ep)
        loop_task.cancel()
        return ep, llm.calls
    ep, calls = asyncio.run(main())
    check_tokens(ep, calls)  # as produced: fine
    i = ep.loss_mask.index(1)
    ep.ids[i] = (ep.ids[i] + 1) % len(tok)  # one sampled id changed (e.g. by re-tokenization)
    with pytest.raises(ValueError, match="token mismatch"):
        check_tokens(ep, calls)


RAISING_AGENT = """
from agent import load_agent

arith = load_agent("arith")

async def run(task, llm):
    if task["index"] % 3 == 1:
        raise RuntimeError("agent bug")
    return await arith(task, llm)
"""


def test_agent_that_raises_is_counted_and_dropped(tok, tmp_path):
    (tmp_path / "bad.py").write_text(RAISING_AGENT)
    cfg = config.load([f"--task={tmp_path / 'bad.py'}", "--group_size=2", "--prompts_per_step=4", "--max_staleness=0"])
    msgs = collect(cfg, engine_for(tok, 2), tok, 5)
    assert all(m["index"] % 3 != 1 for m in msgs)
    assert msgs[-1]["stats"]["agent_errors"] >= 2  # episodes 1 and 4 failed before 5 good ones arrived


STUBBORN_AGENT = """
import asyncio
from agent import load_agent

arith = load_agent("arith")

async def run(task, llm):
    swallowed = False
    while task["index"] % 4 == 1:  # swallows the first cancellation (the timeout), then asks for more tokens
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            if swallowed:  # the second one (the test's shutdown) ends it
                raise
            swallowed = True
            try:
                await llm.generate([1, 2, 3])
                print("served", file=open(LOG, "a"))
            except RuntimeError as e:
                print(e, file=open(LOG, "a"))
    return await arith(task, llm)
"""


def test_an_agent_that_ignores_its_timeout_is_dropped_and_its_group_goes_on(tok, tmp_path):
    """episode_timeout drops the episode at once, although the agent swallows its cancellation: its group
    is sent without it (else the group would hold a place in the staleness window for good and, at
    max_staleness=0, the rollout would stop), and the agent gets no more tokens from the engine."""
    log = tmp_path / "after_timeout.txt"
    (tmp_path / "stubborn.py").write_text(f"LOG = {str(log)!r}\n" + STUBBORN_AGENT)
    cfg = config.load([f"--task={tmp_path / 'stubborn.py'}", "--group_size=2", "--prompts_per_step=6",
                       "--max_staleness=0", "--episode_timeout=3"])  # a busy machine's episode fits in 3 s
    engine = engine_for(tok, 2)
    msgs = collect(cfg, engine, tok, 9)  # the 6 groups max_staleness=0 lets start, less episodes 1, 5 and 9
    assert sorted(m["index"] for m in msgs) == [0, 2, 3, 4, 6, 7, 8, 10, 11]
    after = log.read_text().splitlines()
    assert len(after) == 3 and all("timed out" in line for line in after)  # no tokens for a closed policy


GROUP_AGENT = """
import agent
async def run(task, llm):
    if task["group"] == 1 or task["index"] % 3 == 1:  # all of group 1 and the middle episode of every group fail
        raise RuntimeError("injected")
    return await agent.load_agent("arith")(task, llm)
"""


def test_batches_get_whole_groups_and_a_failed_group_is_replaced(tok, tmp_path):
    """Each queue item is one group: its surviving episodes, sent once all of them have ended. A group whose
    episodes all failed frees its place, else at max_staleness=0 the rollout would wait for it forever."""
    (tmp_path / "groups.py").write_text(GROUP_AGENT)
    cfg = config.load([f"--task={tmp_path / 'groups.py'}", "--group_size=3", "--prompts_per_step=2",
                       "--max_staleness=0"])
    engine, out = engine_for(tok, 3), queue.Queue()

    async def main():
        loop_task = asyncio.create_task(engine.run())
        prod = asyncio.create_task(produce(cfg, engine, tok, out, Counter(), 0, len(tok)))
        items = []
        for _ in range(3000):  # 30 s at most
            await asyncio.sleep(0.01)
            while not out.empty():
                items.append(rollout.unpack(out.get()))
            if len(items) == 2:
                break
        prod.cancel()
        loop_task.cancel()
        return items
    items = asyncio.run(main())
    # group 1 failed whole, group 2 took its place
    assert sorted([m["index"] for m in g] for g in items) == [[0, 2], [6, 8]]
    assert all(m["group"] == m["index"] // 3 for g in items for m in g)


def _die_holding(lock):
    lock.acquire()  # as if killed inside a forward, between taking the weights lock and releasing it
    os._exit(3)


def test_publish_does_not_hang_on_the_lock_of_a_dead_rollout_process():
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    lock = ctx.Lock()
    proc = ctx.Process(target=_die_holding, args=(lock,))
    proc.start()
    proc.join()
    ro = rollout.Rollout(proc, types.SimpleNamespace(weights={"w": torch.zeros(2).share_memory_()},
                                                version=ctx.Value("l", 0), lock=lock, out_q=ctx.Queue()))
    ro.publish({"w": torch.ones(2)}, 1)  # returns: the trainer goes on to log the step, then stops, checkpointed
    assert ro.died == "rollout process died (exit code 3); its traceback is above" and ro.link.version.value == 0
    t0 = time.monotonic()
    assert ro.get(timeout=30) is None and ro.eval_result() == {}  # every later wait returns at once
    assert time.monotonic() - t0 < 1


def test_pack_unpack_round_trip_with_missing_fields():
    """A group crosses the queue as one item (its tensors as arrays, images too: no tensor, whose storage would pass a
    file descriptor each); episodes without routing keep None."""
    def msg(n, fill, routing, images):
        return {"engine_ids": torch.tensor([1, 2][:n % 3]), "ids": torch.full((n,), fill), "loss_mask": torch.ones(n),
                "versions": torch.zeros(n, dtype=torch.long), "logprobs": -torch.rand(n), "routing": routing,
                "reward": 1.0, "index": fill, "images": images}
    group = [msg(5, 0, None, []), msg(7, 1, torch.rand(7, 2, 1), [torch.rand(3, 8, 16), torch.rand(3, 16, 8)])]
    item = rollout.pack([dict(m) for m in group])
    assert item[0]["ids"].shape == (5,) and item[1]["routing"].shape == (7, 2, 1) and item[0]["routing"] is None
    tensors = []  # every leaf that json cannot write: arrays (by value), or tensors
    json.dumps(item, default=lambda o: tensors.append(o) if torch.is_tensor(o) else o.tolist())
    assert not tensors
    for a, b in zip(group, rollout.unpack(item)):
        assert a.keys() == b.keys()
        for k in a:
            assert (b[k] is None) if a[k] is None else torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else \
                all(map(torch.equal, a[k], b[k])) and len(a[k]) == len(b[k]) if k == "images" else a[k] == b[k]


COUNTING_AGENT = """
import agent
async def run(task, llm):
    print(task["index"], file=open(LOG, "a"), flush=True)  # started
    return await agent.load_agent("arith")(task, llm)
"""


def test_the_rollout_admits_exactly_the_groups_the_staleness_window_allows(tok, tmp_path):
    """A group starts only while the groups started (less those that failed whole) are fewer than (version + 1 +
    max_staleness) * prompts_per_step + dropped: the trainer's staleness bound then holds without dropping anything.
    Counted at the source: which episodes the rollout started, as the window moves (a drop, a new version)."""
    log = tmp_path / "started.txt"
    (tmp_path / "counting.py").write_text(f"LOG = {str(log)!r}\n" + COUNTING_AGENT)
    cfg = config.load([f"--task={tmp_path / 'counting.py'}", "--group_size=2", "--prompts_per_step=2",
                       "--max_staleness=1"])
    engine, out, dropped = engine_for(tok, 4), queue.Queue(), Counter()

    def started():
        return sorted(int(x) for x in log.read_text().split()) if log.exists() else []

    async def settle(n):  # until n episodes started and ended (their groups queued), then a little longer
        for _ in range(3000):
            await asyncio.sleep(0.01)
            if len(started()) >= n and out.qsize() >= n // 2:
                break
        await asyncio.sleep(0.5)
        return started()

    async def main():
        loop_task = asyncio.create_task(engine.run())
        prod = asyncio.create_task(produce(cfg, engine, tok, out, dropped, 0, len(tok)))
        seen = [await settle(8)]  # version 0: (0 + 1 + 1) * 2 groups of 2
        dropped.value += 1  # the trainer dropped a group: one more may start
        seen.append(await settle(10))
        engine.version = 1  # a new version: the window moves by prompts_per_step groups
        seen.append(await settle(14))
        prod.cancel()
        loop_task.cancel()
        return seen
    seen = asyncio.run(main())
    assert seen == [list(range(8)), list(range(10)), list(range(14))]
