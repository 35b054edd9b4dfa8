"""One step of configs/smollm2_cpu.py broken down (issue #32): the embedded engine samples one batch (8 arith prompts x
8 samples, 12 new tokens, the recipe's agent and sampling) with prefill and decode timed apart, then the trainer trains
on exactly that batch: collate (with the shared-prompt packing), forward with the loss, backward, optimizer (norm clip
+ AdamW) and publish (the full state copied into the engine's shared tensors, as Rollout.publish does). Each side as
train.py runs it: the engine in the rollout process's one thread, the trainer with cpu_threads (2), one after the
other here (in a run they overlap). In float32 and bfloat16, `--steps` steps each (the first a warm-up, not counted).
Run alone on the machine:
    python tests/step_breakdown.py [--dtype float32 bfloat16] [--steps 3]"""
import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections import defaultdict
from statistics import median

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import agent  # noqa: E402
import config  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
from engine import TorchEngine  # noqa: E402
from model_moe import Transformer, convert_gguf  # noqa: E402


def sample(cfg, engine, tok, first, times):
    """prompts_per_step groups from data index `first` -> their messages; times["engine ..."] += seconds."""
    forward = engine._forward

    def timed(rows, chunks, start, prefill=False, logits=True):
        t = time.perf_counter()
        out = forward(rows, chunks, start, prefill=prefill, logits=logits)
        times["engine prefill" if prefill else "engine decode"] += time.perf_counter() - t
        return out
    engine._forward = timed
    knobs = {k: getattr(cfg, k) for k in rollout.KNOBS}

    async def one(i):
        llm = rollout.Policy(engine, tok, i)
        ep = await agent.load_agent("arith")(agent.make_task("arith", i, **knobs), llm)
        return rollout.episode_to_msg(ep, i, i // cfg.group_size, rollout.check_tokens(ep, llm.calls))

    async def batch():
        engine.wake = asyncio.Event()  # this loop's (asyncio.run makes a loop per batch)
        run = asyncio.ensure_future(engine.run())
        msgs = await asyncio.gather(*(one(i) for i in range(first, first + cfg.batch_size)))
        run.cancel()
        return msgs
    msgs = asyncio.run(batch())
    engine._forward = forward
    return msgs


def train_on(cfg, model, opt, msgs, shared, times):
    """train_step's work for one update (mini_batches=1: no separate recompute), each part timed; then publish."""
    share = train.make_shares(msgs, train.advantages(cfg, msgs).tolist(), 1, cfg)[0]
    (mini,), (counts,) = share["mini_batches"], share["counts"]
    opt.zero_grad(set_to_none=True)
    for mb in mini:
        t = time.perf_counter()
        b = train.collate([m for m, _ in mb], "cpu", model.config.image_token_id)
        adv = torch.tensor([a for _, a in mb])
        t1 = time.perf_counter()
        loss = train.micro_loss(model, b, cfg, counts, adv, 1)[0]
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        times["trainer collate"] += t1 - t
        times["trainer forward + loss"] += t2 - t1
        times["trainer backward"] += t3 - t2
    t = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    t1 = time.perf_counter()
    state = train.full_state(model, train.dist.is_initialized())
    for k, v in state.items():
        shared[k].copy_(v)
    times["trainer optimizer"] += t1 - t
    times["publish"] += time.perf_counter() - t1


def measure(dtype, steps):
    cfg = config.load(["--config", os.path.join(ROOT, "configs", "smollm2_cpu.py"), f"--dtype={dtype}",
                       f"--out_dir={tempfile.mkdtemp()}"])
    rank, world, device, fsdp = train.compute_init(cfg)
    path = convert_gguf(cfg.model)
    tok = agent.load_tokenizer(path)
    model = train.build_model(cfg, rank, device, fsdp, path)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, eps=cfg.adam_eps,
                            weight_decay=cfg.weight_decay, fused=True)
    # as rollout.start_rollout: the engine's parameters are the shared tensors, in the compute dtype
    state = train.full_state(model, fsdp)
    shared = {k: v.to(getattr(torch, dtype), copy=True).share_memory_() for k, v in state.items()}
    with torch.device("meta"):
        m = Transformer(model.config)
    m.load_state_dict(shared, assign=True)
    engine = TorchEngine(m, slots=cfg.engine_slots, max_len=cfg.engine_max_len, temperature=cfg.temperature,
                                 max_new_tokens=cfg.max_new_tokens, stop_ids=agent.stop_ids(tok, path), seed=0)
    rows, tokens = [], 0
    for step in range(steps):
        times = defaultdict(float)
        torch.set_num_threads(1)  # the rollout process's
        msgs = sample(cfg, engine, tok, step * cfg.batch_size, times)
        torch.set_num_threads(cfg.cpu_threads)
        train_on(cfg, model, opt, msgs, shared, times)
        tokens = sum(int(m["loss_mask"].sum()) for m in msgs)
        print(f"{dtype} step {step}: " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()), flush=True)
        rows.append(times)
    if train.dist.is_initialized():
        train.dist.destroy_process_group()
    return {k: median(r[k] for r in rows[1:]) for k in rows[-1]}, tokens


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    res = {d: measure(d, args.steps) for d in args.dtype}
    keys = list(next(iter(res.values()))[0])
    print(f"\n| seconds (median of steps 2-{args.steps}) | " + " | ".join(args.dtype) + " |")
    print("| --- |" + " ---: |" * len(args.dtype))
    for k in keys + ["engine", "trainer + publish"]:
        part = (lambda r: sum(v for n, v in r.items() if n.startswith("engine"))) if k == "engine" else \
            (lambda r: sum(v for n, v in r.items() if not n.startswith("engine"))) if k.startswith("trainer +") else \
            (lambda r: r[k])
        print(f"| {k} | " + " | ".join(f"{part(res[d][0]):.2f}" for d in args.dtype) + " |")
    print("| sampled tokens in the batch | " + " | ".join(str(res[d][1]) for d in args.dtype) + " |")
