"""
bench.py: generation throughput of the embedded engine (rollout.TorchEngine) against transformers'
`generate`, on the same tiny MoE with the same weights, in the same process.

Both sides sample (temperature 1, no top-k / top-p, no stop token), so every row generates exactly
`new_tokens` tokens and tokens/s = rows * new_tokens / wall time. The engine additionally records a
logprob, a policy version and the routed experts for every token; `generate` records nothing.
Repeats are interleaved (engine, HF, engine, HF, ...) so a noisy neighbour hurts both sides alike,
and the median is reported.

Wall-clock tokens/s is what the table's first columns report; on a shared machine other processes
steal time from both sides, so the last column also gives the ratio in CPU time of this process.

    python bench.py            # the full run (about a minute on 2 CPU cores)
    python bench.py --quick    # a smoke run (< 60 s)
    python bench.py --threads 1

Sections (a positional argument; the default is the engine section above, `all` runs every one):
    python bench.py engine|overlap|parity|trainer|flops|moe|publish|scale|memory|all
overlap, parity, scale and memory launch train.py (configs/guess.py) as subprocesses with --key=value overrides
and read <tmp out_dir>/metrics.jsonl; the trainer is pinned to CPU 0 and the rollout process to CPU 1, both
with torch threads 1 (train.py's default on 2 cores). Run timing sections one at a time on a shared machine:
    flock /tmp/nanomolt-cpu.lock python bench.py overlap
"""
import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

# OpenMP workers that spin while waiting fight other processes for the cores: on a busy 2-core
# machine, 2 spinning threads made both generators ~10x slower. Must be set before torch starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from model_moe import ModelConfig, Transformer  # noqa: E402
from rollout import TorchEngine  # noqa: E402
import agent as agent_mod  # noqa: E402
import config  # noqa: E402
import estimators as est  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402

# ==== sections other than the engine's: functions here, chosen by the positional argument below ====
SECTIONS = ("engine", "overlap", "parity", "trainer", "flops", "moe", "publish", "scale", "memory")
GUESS = ["--config", "configs/guess.py", "--dump_every=0", "--ckpt_every=0"]  # the default recipe, nothing dumped mid-run
med = statistics.median


def table(title, header, rows):
    """A markdown table; rows hold formatted cells."""
    print(f"\n{title}\n\n| " + " | ".join(header) + " |\n| --- |" + " ---: |" * (len(header) - 1))
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |", flush=True)


# ---- train.py as a subprocess: pinned, watched (threads, memory), its metrics.jsonl read back ----

def descendants(pid):
    out = []
    for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}") else []:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:  # the thread or process just ended
            continue
        for k in kids:
            out += [k] + descendants(k)
    return out


def role(pid):
    """-> (role name, RSS MB, peak RSS MB) of a process of the run, or None (gone, or a helper we don't report)."""
    try:
        cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
        st = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
        env = open(f"/proc/{pid}/environ").read().split("\0")
    except OSError:
        return None
    if "resource_tracker" in cmd or "VmRSS" not in st:
        return None
    name = ("rollout" if "spawn_main" in cmd else "torchrun launcher" if "torch.distributed.run" in cmd else
            "trainer rank " + next((e[5:] for e in env if e.startswith("RANK=")), "0"))
    return name, int(st["VmRSS"].split()[0]) / 1024, int(st["VmHWM"].split()[0]) / 1024


def run_train(overrides, ranks=1, pin=True, seconds=0):
    """train.py on the default recipe (plus overrides) in a temporary out_dir. pin: the trainer on CPU 0 and the
    rollout process (with every thread it has) on CPU 1; else every process may use both cores. seconds > 0:
    SIGTERM to the trainer ranks after that long (train.py checkpoints and exits). -> (metrics, wall s, [(t, {role: (RSS, peak)})])"""
    launch = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc_per_node={ranks}"]
    with tempfile.TemporaryDirectory() as d, open(os.path.join(d, "log"), "w+") as log:
        t0, mem, last = time.perf_counter(), [], -1.0
        p = subprocess.Popen(launch + ["train.py", *GUESS, f"--out_dir={d}", *overrides], stdout=log, stderr=log,
                             preexec_fn=(lambda: os.sched_setaffinity(0, {0})) if pin else None)
        while p.poll() is None:
            now = time.perf_counter() - t0
            pids = [p.pid] + descendants(p.pid)
            if pin:  # the rollout process starts on CPU 0 (inherited): move it, and each thread, to CPU 1
                for pid in pids:
                    r = role(pid)
                    if r and r[0] == "rollout":
                        with contextlib.suppress(OSError):  # it may end between the two reads
                            for tid in os.listdir(f"/proc/{pid}/task"):
                                os.sched_setaffinity(int(tid), {1})
            if now - last >= 1.0:
                mem.append((now, {r[0]: r[1:] for r in map(role, pids) if r}))
                last = now
            if seconds and now > seconds:  # stop every trainer rank (not torchrun, which would exit with an error)
                for pid in pids:
                    if (role(pid) or ("",))[0].startswith("trainer"):
                        os.kill(pid, signal.SIGTERM)
                seconds = 0
            time.sleep(0.1)
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            log.seek(0)
            raise RuntimeError(f"train.py {' '.join(overrides)} failed ({p.returncode}):\n{log.read()[-3000:]}")
        with open(os.path.join(d, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f], wall, mem


# ---- async overlap: generation and training each on one core, sync vs async steps/s ----

def bench_overlap():
    steps, warm = (14, 4) if args.quick else (40, 10)
    runs = []
    for _ in range(args.repeats):  # interleaved: sync, async, sync, async, ...
        sync = run_train([f"--max_steps={steps}", "--max_staleness=0"])[0][warm:]
        asyn = run_train([f"--max_steps={steps}", "--max_staleness=1"])[0][warm:]
        # synchronous: the rollout starts batch v+1 only when weights v+1 are published, so the trainer's wait
        # is the generation time of a batch and the rest of the step is the train step (with publish and log)
        gen = med(m["time/wait_rollout"] for m in sync)
        trn = med(m["time/step"] - m["time/wait_rollout"] for m in sync)
        sps, aps = (len(ms) / sum(m["time/step"] for m in ms) for ms in (sync, asyn))
        runs.append(dict(gen=gen, train=trn, sync=sps, asyn=aps, ideal=(gen + trn) / max(gen, trn),
                         wait=med(m["time/wait_rollout"] for m in asyn), atrain=med(m["time/train"] for m in asyn)))
    r = {k: med(x[k] for x in runs) for k in runs[0]}
    achieved = med(x["asyn"] / x["sync"] for x in runs)
    table(f"async overlap: configs/guess.py, trainer on CPU 0 and rollout on CPU 1, steps {warm + 1}..{steps}, "
          f"median of {args.repeats} interleaved sync/async pairs",
          ["measure", "measured", "baseline", "ratio", "target"], [
              ("generation of a batch (sync loop) / train step", f"{r['gen']:.3f} s", f"{r['train']:.3f} s",
               f"{r['gen'] / r['train']:.2f}", ""),
              ("steps/s: async (max_staleness=1) / sync (0)", f"{r['asyn']:.3f}", f"{r['sync']:.3f}", f"{achieved:.2f}x", ""),
              ("async speed-up: achieved / ideal (gen+train)/max", f"{achieved:.2f}x", f"{r['ideal']:.2f}x",
               f"{achieved / r['ideal']:.0%}", ">= 90%"),
              ("async: trainer wait / train time per step", f"{r['wait']:.3f} s", f"{r['atrain']:.3f} s", "", "")])


# ---- learning parity: 5 seeds, async vs sync, final reward and wall time ----

def welch(a, b):
    """Welch's t-test -> (t, degrees of freedom, two-sided p); the Student-t tail by Simpson's rule on its density."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return 0.0, float("nan"), 1.0 if statistics.mean(a) == statistics.mean(b) else 0.0
    t = (statistics.mean(a) - statistics.mean(b)) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    n, h = 2000, abs(t) / 2000
    area = h / 3 * sum((1 if i in (0, n) else 4 if i % 2 else 2) * math.exp(c - (df + 1) / 2 * math.log1p((i * h) ** 2 / df))
                       for i in range(n + 1))  # P(0 < T < |t|)
    return t, df, max(0.0, 1 - 2 * area)


def bench_parity():
    steps, last = (20, 5) if args.quick else (args.parity_steps, 25)
    final, wall = {0: [], 1: []}, {0: [], 1: []}
    rows = []
    for seed in range(args.seeds):
        for s in (0, 1):
            ms, w, _ = run_train([f"--max_steps={steps}", f"--max_staleness={s}", f"--seed={seed}"])
            final[s].append(statistics.mean(m["reward/mean"] for m in ms[-last:]))
            wall[s].append(w)
        rows.append((f"seed {seed}", f"{final[1][-1]:.3f}", f"{final[0][-1]:.3f}", f"{final[1][-1] - final[0][-1]:+.3f}",
                     f"{wall[1][-1]:.0f} s", f"{wall[0][-1]:.0f} s", f"{wall[1][-1] / wall[0][-1]:.2f}"))
    t, df, p = welch(final[1], final[0])
    mean, sd = statistics.mean, statistics.stdev
    rows.append(("mean ± sd", *(f"{mean(final[s]):.3f} ± {sd(final[s]):.3f}" for s in (1, 0)),
                 f"{mean(final[1]) - mean(final[0]):+.3f} (target within ±0.05)", f"{mean(wall[1]):.0f} s",
                 f"{mean(wall[0]):.0f} s", f"{mean(wall[1]) / mean(wall[0]):.2f}"))
    rows.append(("Welch t-test", f"t = {t:+.2f}", f"df = {df:.1f}", f"p = {p:.2f} (target: not separated, p > 0.05)", "", "", ""))
    table(f"learning parity: configs/guess.py --max_steps={steps}, final reward = mean of the last {last} steps, "
          f"trainer on CPU 0 and rollout on CPU 1",
          ["seed", "async final reward (measured)", "sync (baseline)", "difference", "async wall", "sync wall",
           "wall ratio"], rows)


# ---- in-process sections: the trainer's core (CPU 0), torch threads 1, a real batch of the default recipe ----

def trainer_setup(d, overrides=()):
    """-> (cfg, model, optimizer, tokenizer dir) of the default recipe in out_dir d, built by train.py's code."""
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    cfg = config.load([*GUESS, f"--out_dir={d}", *overrides])
    model, tok_dir = train.build_model(cfg, 0, 1, torch.device("cpu"))
    return cfg, model, torch.optim.AdamW(model.parameters(), lr=cfg.lr), tok_dir


def guess_batch(cfg, model, tok_dir, replay=True):
    """One batch of real guess episodes sampled by the embedded engine, as the rollout process sends them.
    replay False: no recorded experts (route freely)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tok_dir)
    engine = TorchEngine(model, slots=cfg.engine_slots, max_len=cfg.engine_max_len, max_new_tokens=cfg.max_new_tokens,
                         stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")], seed=cfg.seed)
    run = agent_mod.load_agent(cfg.task)

    async def one(i):
        llm = rollout.Policy(engine, tok)
        ep = await run(agent_mod.make_task(cfg.task, i, seed=cfg.seed, group_size=cfg.group_size,
                                           guess_max=cfg.guess_max, max_turns=cfg.max_turns), llm)
        msg = rollout.episode_to_msg(ep, i, rollout.check_tokens(ep, llm.calls))
        return msg if replay else dict(msg, routing=None)

    async def main():
        loop = asyncio.create_task(engine.run())
        msgs = await asyncio.gather(*(one(i) for i in range(cfg.batch_size)))
        loop.cancel()
        return msgs
    msgs = asyncio.run(main())
    model.train()
    rewards = torch.tensor([m["reward"] for m in msgs])
    adv = est.ADVANTAGES[cfg.advantage](rewards=rewards, group_ids=torch.tensor([m["group"] for m in msgs]))
    if not adv.abs().sum():  # all rewards equal: give the loss a gradient anyway (the time is what we measure)
        adv = torch.randn(len(msgs))
    n_tok = sum(float(m["tokens"][1].sum()) for m in msgs)
    return {"msgs": msgs, "advantages": adv.tolist(), "micro_batches": train.split_batch(msgs, adv.tolist(), 1, cfg.micro_batch_tokens)[0],
            "num_tokens": n_tok, "num_seqs": float(len(msgs))}


def embedded_publisher(model):
    """A Rollout handle with shared-memory weights, as start_rollout makes for the torch engine (no process)."""
    shared = {k: v.detach().clone().share_memory_() for k, v in train.full_state(model, 1).items()}
    ctx = torch.multiprocessing.get_context("spawn")
    return rollout.Rollout(None, None, shared, ctx.Value("l", 0), ctx.Lock(), None)


def timed(fn, n, best=False):
    """-> (wall, CPU) seconds of a call, the median (best: the minimum) of n calls after one warm-up call.
    CPU time (of this process; one torch thread) is what other processes on a shared machine cannot steal."""
    fn()
    ts = []
    for _ in range(n):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        ts.append((time.perf_counter() - t0, time.process_time() - c0))
    return tuple(map(min if best else med, zip(*ts)))


def bench_trainer():
    n = 3 if args.quick else 10
    with tempfile.TemporaryDirectory() as d:
        cfg, model, opt, tok_dir = trainer_setup(d)
        share = guess_batch(cfg, model, tok_dir)
        ro = embedded_publisher(model)
        plain_model = Transformer(model.config)
        plain_model.load_state_dict(model.state_dict())
        plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=cfg.lr)
        b = train.collate(share["msgs"], "cpu")  # the plain loop gets its tensors ready-made
        ids, mask = b["ids"], b["loss_mask"][:, 1:]
        A = torch.tensor(share["advantages"])[:, None]
        tokens = sum(m["tokens"].shape[1] for m in share["msgs"])  # episode tokens (the plain loop also runs padding)

        def full():  # what train.py does per step on one rank
            train.train_step(model, opt, share, cfg, 0, 1)
            ro.publish(train.full_state(model, 1), 1)

        def plain():  # forward, a policy-gradient loss, backward, AdamW
            plain_opt.zero_grad(set_to_none=True)
            logp = torch.log_softmax(plain_model(ids)[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, T-1)
            (-(logp * A * mask).sum() / mask.sum()).backward()
            plain_opt.step()

        ts = {"full": [], "plain": [], "step": [], "publish": []}
        for _ in range(args.repeats):  # interleaved
            ts["full"].append(timed(full, n))
            ts["plain"].append(timed(plain, n))
            ts["step"].append(timed(lambda: train.train_step(model, opt, share, cfg, 0, 1), n))
            ts["publish"].append(timed(lambda: ro.publish(train.full_state(model, 1), 1), n))
        t = {k: med(w for w, _ in v) for k, v in ts.items()}  # wall seconds
        c = {k: med(cpu for _, cpu in v) for k, v in ts.items()}  # CPU seconds
        table(f"trainer overhead: one batch of the default recipe ({len(share['msgs'])} episodes, {tokens} tokens, the plain loop pads to {tuple(ids.shape)}, "
              f"{share['num_tokens']:.0f} trained), 1 thread on CPU 0, median of {args.repeats}x{n}",
              ["measure", "measured tok/s", "plain loop tok/s (baseline)", "ratio", "ratio, CPU time", "target"], [
                  ("full train step (train.train_step + publish)", f"{tokens / t['full']:,.0f}",
                   f"{tokens / t['plain']:,.0f}", f"{t['plain'] / t['full']:.2f}", f"{c['plain'] / c['full']:.2f}",
                   ">= 0.90"),
                  ("train.train_step alone", f"{tokens / t['step']:,.0f}", f"{tokens / t['plain']:,.0f}",
                   f"{t['plain'] / t['step']:.2f}", f"{c['plain'] / c['step']:.2f}", ""),
                  ("weight publish alone (ms)", f"{t['publish'] * 1e3:.1f} ms", f"{t['full'] * 1e3:.1f} ms step",
                   f"{t['publish'] / t['full']:.1%}", f"{c['publish'] / c['full']:.1%}", "")])


# ---- hardware use: the trainer's FLOP/s against a large matmul's ----

def step_flops(c, B, T, n_logits=None):
    """Matmul FLOPs of one training step (forward + backward = 3x forward) on (B, T) tokens; attention counted
    over the full T x T (as SDPA computes it here), MoE over the top-k experts a token runs; the vocabulary
    projection over n_logits positions (default all; train.py computes it only where a token is trained)."""
    N, H, hd = B * T, c.hidden_size, c.head_dim
    attn = 2 * N * H * hd * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) + 4 * B * c.num_attention_heads * T * T * hd
    mlp = [2 * N * 3 * H * c.moe_intermediate_size * c.num_experts_per_tok + 2 * N * H * c.num_experts if c.is_moe_layer(i)
           else 2 * N * 3 * H * c.intermediate_size for i in range(c.num_hidden_layers)]
    return 3 * (c.num_hidden_layers * attn + sum(mlp) + 2 * (N if n_logits is None else n_logits) * H * c.vocab_size)


def bench_flops():
    n = 2 if args.quick else 5
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    peak = [2 * 2048 ** 3 / s for s in timed(lambda: a @ b, 3 * n, best=True)]  # (wall, CPU) FLOP/s
    rows = []
    for width in ((128,) if args.quick else (128, 256, 512)):
        with tempfile.TemporaryDirectory() as d:
            cfg, model, opt, tok_dir = trainer_setup(d, [f"--tiny_hidden={width}"])
            # wider than 128: the same kind of batch, routed freely (a wide random model's experts)
            share = guess_batch(cfg, model, tok_dir, replay=width == 128)
            flops = sum(step_flops(model.config, len(mb), max(m["tokens"].shape[1] for m, _ in mb),  # logits: trained
                                   int(sum(m["tokens"][1].sum() for m, _ in mb))) for mb in share["micro_batches"])  # positions only
            B, T = len(share["msgs"]), sum(m["tokens"].shape[1] for m in share["msgs"]) / len(share["msgs"])
            fl = [flops / s for s in timed(lambda: train.train_step(model, opt, share, cfg, 0, 1), n)]
            rows.append((f"tiny_hidden={width} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
                         f"{B} episodes, {T:.0f} tokens each on average)", f"{fl[0] / 1e9:.1f}", f"{peak[0] / 1e9:.1f}", f"{fl[0] / peak[0]:.0%}",
                         f"{fl[1] / peak[1]:.0%}", ">= 50%" if width == 128 else ""))
    table(f"hardware use: train.train_step FLOP/s (median of {n}) vs a 2048x2048 fp32 matmul (best of {3 * n}), "
          "1 thread on CPU 0", ["model", "trainer GFLOP/s (measured)", "matmul GFLOP/s (baseline)", "ratio",
                                "ratio, CPU time", "target"], rows)


# ---- mixture of experts: grouped (model_moe.MoE) vs naive per-expert masks vs dense of equal active size ----

def moe_naive(m, x):
    """Every expert over every token, weighted by its combine weight (0 where the token is not routed to it)."""
    probs = F.softmax(m.gate(x), dim=-1, dtype=torch.float32)  # (N, E)
    w, e = probs.topk(m.top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True) if m.norm_topk_prob else w
    comb = torch.zeros_like(probs).scatter(-1, e, w).to(x.dtype)  # (N, E)
    y = 0
    for j in range(m.w_gate.shape[0]):
        y = y + comb[:, j:j + 1] * ((F.silu(x @ m.w_gate[j].T) * (x @ m.w_up[j].T)) @ m.w_down[j].T)
    return y


def bench_moe():
    from model_moe import MLP, MoE, ModelConfig
    n = 3 if args.quick else 10
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    rows = []
    for H in (128, 512):
        c = ModelConfig(hidden_size=H, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=H)
        moe = MoE(c)
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.02)
        dense = MLP(H, c.num_experts_per_tok * c.moe_intermediate_size)  # the same parameters per token
        x = torch.randn(64 * 64, H, requires_grad=True)  # a batch of 64 episodes of 64 tokens
        torch.testing.assert_close(moe(x)[0], moe_naive(moe, x), rtol=1e-4, atol=1e-5)
        fns = {"grouped": lambda: moe(x)[0].sum().backward(), "naive": lambda: moe_naive(moe, x).sum().backward(),
               "dense": lambda: dense(x).sum().backward()}
        t = {k: med(timed(f, n)[0] for _ in range(args.repeats)) for k, f in fns.items()}
        for k, what in (("naive", "naive per-expert masks (all experts, all tokens)"),
                        ("dense", f"dense MLP, {c.num_experts_per_tok * H} wide (same active parameters)")):
            rows.append((f"H={H}, 8 experts top-2", f"{t['grouped'] * 1e3:.1f} ms", f"{what}: {t[k] * 1e3:.1f} ms",
                         f"{t[k] / t['grouped']:.2f}x"))
    table(f"mixture of experts: one layer forward + backward on 4096 tokens, 1 thread on CPU 0, median of {n}",
          ["layer", "grouped (model_moe.MoE, measured)", "baseline", "speed-up of grouped"], rows)


# ---- weight publishing: shared memory (embedded engine) and disk (server engines) ----

def bench_publish():
    n = 3 if args.quick else 10
    rows = []
    for width in (128, 512):
        with tempfile.TemporaryDirectory() as d:
            cfg, model, opt, tok_dir = trainer_setup(d, [f"--tiny_hidden={width}"])
            share = guess_batch(cfg, model, tok_dir, replay=width == 128)
            ro = embedded_publisher(model)
            gb = sum(t.numel() * t.element_size() for t in train.full_state(model, 1).values()) / 1e9
            step = timed(lambda: train.train_step(model, opt, share, cfg, 0, 1), 3)[0]
            shm = timed(lambda: ro.publish(train.full_state(model, 1), 1), n)[0]
            disk = timed(lambda: rollout.write_weights(os.path.join(d, "w"), model.config, tok_dir, 1,
                                                       train.full_state(model, 1)), n)[0]
            for name, t in (("embedded: Rollout.publish to shared memory", shm),
                            ("servers: rollout.write_weights to disk", disk)):
                rows.append((f"tiny_hidden={width}, {gb * 1e3:.1f} MB", name, f"{t * 1e3:.1f} ms", f"{gb / t:.2f} GB/s",
                             f"{step * 1e3:.0f} ms", f"{t / (t + step):.1%}", "< 5%" if width == 128 else ""))
    table(f"weight publishing, 1 thread on CPU 0, median of {n} (the disk path's time excludes the servers' load)",
          ["model", "path", "seconds/step (measured)", "GB/s", "train step (baseline)", "fraction of step", "target"], rows)


# ---- scale: step time as batch, sequence length, concurrent agents and trainer ranks grow ----

def bench_scale():
    steps, warm = (8, 3) if args.quick else (25, 5)
    grid = [("batch (episodes)", "prompts_per_step", [4, 8, 16], lambda v: 8 * v),
            ("max_new_tokens per turn", "max_new_tokens", [1, 4, 8], lambda v: v),
            ("concurrent agents", "concurrent_agents", [16, 32, 64, 128], lambda v: v),
            ("trainer ranks (unpinned)", "ranks", [1, 2], lambda v: v)]
    rows, curves = [], {}
    for label, key, values, x in grid:
        for v in values:
            over = [f"--max_steps={steps}"] + ([] if key == "ranks" else [f"--{key}={v}"])
            ms = run_train(over, ranks=v if key == "ranks" else 1, pin=key != "ranks")[0][warm:]
            st, tr = med(m["time/step"] for m in ms), med(m["time/train"] for m in ms)
            tok = med(m["tokens/trained"] for m in ms) / (8 * v if key == "prompts_per_step" else 64)
            curves.setdefault(label, []).append((x(v), st, tr))
            rows.append((label, x(v), f"{st:.3f} s", f"{tr:.3f} s", f"{med(m['time/wait_rollout'] for m in ms):.3f} s",
                         f"{tok:.1f}", f"{med(m['throughput/rollout_tokens_per_s'] for m in ms):.0f}"))
    table(f"scale: configs/guess.py, async, one setting changed at a time, median of steps {warm + 1}..{steps}",
          ["axis", "value", "step time", "train time", "trainer wait", "sampled tokens/episode", "rollout tok/s"], rows)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(curves), figsize=(4 * len(curves), 3.4))
    for ax, (label, pts) in zip(axes, curves.items()):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="step")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], "s--", label="train part")
        ax.set(xlabel=label, ylabel="seconds", ylim=(0, None))
        ax.legend()
    fig.suptitle("nanomolt step time, configs/guess.py on 2 CPU cores")
    fig.tight_layout()
    os.makedirs("assets", exist_ok=True)
    fig.savefig("assets/bench_scale.png", dpi=100)
    print("\nwrote assets/bench_scale.png")


# ---- memory: resident memory of every process over a long run ----

def bench_memory():
    seconds = 60 if args.quick else args.minutes * 60
    ms, wall, mem = run_train(["--max_steps=1000000"], ranks=2, pin=False, seconds=seconds)
    mem = [(t, m) for t, m in mem if t <= seconds]  # until the SIGTERM (the final checkpoint is no growth)
    start = next(i for i, (t, _) in enumerate(mem) if t >= min(60, seconds / 5))  # after start-up and warm-up
    rows, names = [], sorted({k for _, m in mem for k in m})
    for name in names:
        pts = [(t, m[name]) for t, m in mem[start:] if name in m]
        (t0, (r0, _)), (t1, (r1, peak)) = pts[0], pts[-1]
        rows.append((name, f"{peak:.0f} MB", f"{r0:.0f} MB at {t0:.0f} s", f"{r1:.0f} MB at {t1:.0f} s",
                     f"{r1 - r0:+.1f} MB ({(r1 - r0) / r0:+.1%})", "flat"))
    table(f"memory: torchrun --nproc_per_node=2 train.py --config configs/guess.py for {wall / 60:.1f} minutes "
          f"({len(ms)} steps), RSS sampled every second",
          ["process", "peak RSS", "RSS after warm-up (baseline)", "RSS at the end (measured)", "growth", "target"], rows)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for name in names:
        ax.plot([t / 60 for t, m in mem if name in m], [m[name][0] for t, m in mem if name in m], label=name)
    ax.set(xlabel="minutes", ylabel="RSS (MB)", ylim=(0, None), title="resident memory, configs/guess.py, 2 ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig("assets/bench_memory.png", dpi=100)
    print("\nwrote assets/bench_memory.png")


BENCHES = {"overlap": bench_overlap, "parity": bench_parity, "trainer": bench_trainer, "flops": bench_flops,
           "moe": bench_moe, "publish": bench_publish, "scale": bench_scale, "memory": bench_memory}


# ---- options ----
ap = argparse.ArgumentParser(description="nanomolt benchmarks: engine vs transformers generate (default), overlap, parity, ...")
ap.add_argument("--quick", action="store_true", help="a smoke run: fewer new tokens and one repeat (other sections: fewer steps and calls)")
ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: all cores)")
ap.add_argument("--seed", type=int, default=0, help="weights, prompts and sampling seed")
ap.add_argument("section", nargs="?", default="engine", choices=[*SECTIONS, "all"], help="what to measure")
ap.add_argument("--repeats", type=int, default=3, help="sections other than engine: repeats, the median reported")
ap.add_argument("--seeds", type=int, default=5, help="parity: seeds of each loop")
ap.add_argument("--parity_steps", type=int, default=100, help="parity: optimizer steps of each run")
ap.add_argument("--minutes", type=float, default=10, help="memory: length of the run")
args = ap.parse_args()
new_tokens = 16 if args.quick else 128  # per row
repeats = 1 if args.quick else 3
batch = 64  # rows in the engine-vs-HF comparison (= engine slots)
torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
hf_logging.set_verbosity_error()  # generate() warns about generation flags it ignores on this model
hf_logging.disable_progress_bar()

# ---- the sections defined above; the engine comparison below runs for "engine" (the default) and "all" ----
if args.section != "engine":
    os.chdir(os.path.dirname(os.path.abspath(__file__)))  # they use repository paths: train.py, configs/, assets/
    for name in BENCHES if args.section == "all" else [args.section]:
        BENCHES[name]()
    if args.section != "all":
        sys.exit(0)
    os.sched_setaffinity(0, range(os.cpu_count()))  # the in-process sections ran on CPU 0, 1 thread
    torch.set_num_threads(args.threads or os.cpu_count())

# ---- the tiny MoE, once as ours and once as Hugging Face's ----
# the "tiny" preset of train.py (vocab of the made-up tokenizer, 128 wide, 4 layers, 8 experts top-2)
c = ModelConfig(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                max_position_embeddings=256)
ours = Transformer(c).init_weights(args.seed).eval()
with tempfile.TemporaryDirectory() as d:  # the HF copy is loaded from our own checkpoint: same weights
    ours.save_pretrained(d)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()

g = torch.Generator().manual_seed(args.seed)
prompts = [torch.randint(0, c.vocab_size, (int(torch.randint(16, 33, (1,), generator=g)),), generator=g).tolist()
           for _ in range(batch)]  # lengths 16..32
max_len = max(map(len, prompts)) + new_tokens  # the engine's per-slot KV length


# ---- the two generators: each returns (tokens/s of wall time, tokens/s of CPU time) ----

def run_engine(ps):
    """All requests submitted at once from concurrent coroutines, as agents do; the engine loop
    runs beside them (as in tests/test_rollout.py). Engine construction is outside the timer."""
    engine = TorchEngine(ours, slots=batch, max_len=max_len, temperature=1.0, max_new_tokens=new_tokens,
                         seed=args.seed)

    async def main():  # timed inside the event loop: asyncio.run's setup and teardown are not the engine's
        t0, c0 = time.perf_counter(), time.process_time()
        loop_task = asyncio.create_task(engine.run())
        outs = await asyncio.gather(*(engine.generate(p) for p in ps))
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        loop_task.cancel()
        return outs, dt, dc

    outs, dt, dc = asyncio.run(main())
    n = sum(len(o.ids) for o in outs)
    assert n == len(ps) * new_tokens and all(o.routing is not None and len(o.logprobs) == new_tokens for o in outs)
    return n / dt, n / dc


def run_hf(ps):
    """One left-padded batch through `generate`; min_new_tokens pins the length (there is no eos anyway)."""
    T = max(map(len, ps))
    ids = torch.zeros(len(ps), T, dtype=torch.long)
    mask = torch.zeros(len(ps), T, dtype=torch.long)
    for b, p in enumerate(ps):
        ids[b, T - len(p):], mask[b, T - len(p):] = torch.tensor(p), 1
    torch.manual_seed(args.seed)
    t0, c0 = time.perf_counter(), time.process_time()
    out = hf.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, top_k=0, top_p=1.0, pad_token_id=0)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    n = (out.shape[1] - T) * len(ps)
    assert n == len(ps) * new_tokens
    return n / dt, n / dc


def measure(ps):
    """-> engine (wall, CPU) tokens/s and HF (wall, CPU) tokens/s, each the median of interleaved repeats."""
    run_engine(ps[:4]), run_hf(ps[:4])  # first calls pay for lazy init (kernels, generation config)
    eng, ref = [], []
    for _ in range(repeats):
        eng.append(run_engine(ps))
        ref.append(run_hf(ps))
    return [statistics.median(x) for x in zip(*eng)], [statistics.median(x) for x in zip(*ref)]


# ---- engine vs HF generate: 64 prompts, all rows generating new_tokens ----
full = measure(prompts)
rows = [("engine vs HF generate", f"{batch} prompts", *full)]

# ---- concurrent agents: the engine with 1, 8 and 64 requests in flight ----
# the baseline is `generate` on the same prompts as one batch, so each ratio compares like with like;
# 64 in flight is the run above
for n in (1, 8):
    rows.append(("concurrent agents", f"{n} concurrent", *measure(prompts[:n])))
rows.append(("concurrent agents", f"{batch} concurrent (as above)", *full))

# ---- report ----
print(f"\ntiny MoE ({sum(p.numel() for p in ours.parameters()) / 1e6:.2f}M params, {c.num_experts} experts top-"
      f"{c.num_experts_per_tok}), prompts 16..32 tokens, {new_tokens} new tokens/row, sampled at temperature 1, "
      f"median of {repeats}, torch threads {torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}\n")
print("| section | setting | engine tok/s (measured) | HF generate tok/s (baseline) | ratio | ratio, CPU time |")
print("| --- | --- | ---: | ---: | ---: | ---: |")
for section, setting, (eng, eng_cpu), (ref, ref_cpu) in rows:
    print(f"| {section} | {setting} | {eng:,.0f} | {ref:,.0f} | {eng / ref:.2f}x | {eng_cpu / ref_cpu:.2f}x |")
