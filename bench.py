"""
bench.py: the numbers README's "Performance" section quotes, each as measured, baseline and ratio.
    python bench.py [engine|overlap|parity|trainer|flops|moe|publish|scale|memory|all] [--quick] [--threads N]
engine (default): rollout.TorchEngine vs transformers' `generate`, same tiny MoE and weights, 1/8/64 requests.
overlap, parity, scale, memory: train.py subprocesses (`run_train`), trainer on CPU 0 and rollout on CPU 1.
trainer, flops, moe, publish: in this process on CPU 0, one thread, on a real batch of guess episodes (`setup`).
On a shared machine run one section at a time: flock /tmp/nanomolt-cpu.lock python bench.py overlap
"""
import argparse
import asyncio
import contextlib
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

# OpenMP workers that spin while they wait fight other processes for the cores (2 spinning threads made
# both generators ~10x slower on a busy 2-core machine); it must be set before torch starts
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import agent  # noqa: E402
import config  # noqa: E402
import estimators as est  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
from model_moe import MLP, ModelConfig, MoE, Transformer  # noqa: E402

GUESS = ["--config", "configs/guess.py", "--dump_every=0", "--ckpt_every=0"]  # the default recipe, no mid-run dumps
med, mean = statistics.median, statistics.mean


def table(title, header, rows):
    print(f"\n{title}\n\n| " + " | ".join(header) + " |\n| --- |" + " ---: |" * (len(header) - 1))
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |", flush=True)


def timed(fns, n, best=False):
    """{name: call} -> {name: (wall s, CPU s)}: a warm-up call each (lazy init), then n interleaved rounds;
    the median (best: the minimum) of each."""
    for f in fns.values():
        f()
    ts = {k: [] for k in fns}
    for _ in range(n):
        for k, f in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            f()
            ts[k].append((time.perf_counter() - t0, time.process_time() - c0))
    return {k: tuple(map(min if best else med, zip(*v))) for k, v in ts.items()}


def plot(name, panels, title):
    """panels [(xlabel, ylabel, {label: (xs, ys)})], side by side -> assets/<name>.png."""
    import matplotlib.pyplot as plt  # (its default backend needs no display when there is none)
    fig, axes = plt.subplots(1, len(panels), figsize=(max(7, 4 * len(panels)), 3.4), squeeze=False)
    for ax, (xlabel, ylabel, lines) in zip(axes[0], panels):
        for label, (xs, ys) in lines.items():
            ax.plot(xs, ys, "o-" if len(xs) < 10 else "-", label=label)
        ax.set(xlabel=xlabel, ylabel=ylabel, ylim=(0, None), title=title * (ax is axes[0][0]))
        ax.legend()
    fig.tight_layout()
    fig.savefig(f"assets/{name}.png", dpi=100)


def serve(engine, coros):
    """Await coroutines that call engine.generate while its step loop runs -> their results."""
    async def main():
        loop = asyncio.create_task(engine.run())
        out = await asyncio.gather(*coros)
        loop.cancel()
        return out
    return asyncio.run(main())


# ---- the runner of the training sections: train.py as a subprocess, pinned, its memory watched ----

def processes(pid):
    """-> {pid: (role, RSS MB, peak RSS MB)} of a process and its descendants, helpers left out."""
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError, ValueError):  # a process may end between two reads
            todo += [int(k) for t in os.listdir(f"/proc/{p}/task")
                     for k in open(f"/proc/{p}/task/{t}/children").read().split()]
            cmd, env = open(f"/proc/{p}/cmdline").read(), open(f"/proc/{p}/environ").read().split("\0")
            st = dict(line.split(":", 1) for line in open(f"/proc/{p}/status") if ":" in line)
            rank = next((e[5:] for e in env if e.startswith("RANK=")), "0")
            role = "rollout" if "spawn_main" in cmd else \
                "torchrun" if "distributed.run" in cmd else f"trainer rank {rank}"
            if "resource_tracker" not in cmd and "VmRSS" in st:
                out[p] = role, int(st["VmRSS"].split()[0]) / 1024, int(st["VmHWM"].split()[0]) / 1024
    return out


def run_train(overrides, ranks=1, seconds=0):
    """train.py on the default recipe plus overrides in a temporary out_dir. One rank: pinned to CPU 0, the rollout
    process (each of its threads) to CPU 1; more: unpinned. seconds > 0: SIGTERM to the trainer ranks after that
    long (they checkpoint and exit). -> (metrics, wall s, [(t, {role: (RSS, peak)})] once a second)"""
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] if ranks > 1 else []
    with tempfile.TemporaryDirectory() as d, open(os.path.join(d, "log"), "w+") as log:
        t0, mem = time.perf_counter(), []
        p = subprocess.Popen([sys.executable, *launch, "train.py", *GUESS, f"--out_dir={d}", *overrides], stdout=log,
                             stderr=log, preexec_fn=(lambda: os.sched_setaffinity(0, {0})) if ranks == 1 else None)
        while p.poll() is None:
            now, procs = time.perf_counter() - t0, processes(p.pid)
            for pid, (role, *_) in procs.items():
                with contextlib.suppress(OSError):  # the rollout starts on CPU 0 (inherited): move it to CPU 1
                    for tid in os.listdir(f"/proc/{pid}/task") if ranks == 1 and role == "rollout" else ():
                        os.sched_setaffinity(int(tid), {1})
                    if 0 < seconds < now and role.startswith("trainer"):  # not torchrun: it would exit with an error
                        os.kill(pid, signal.SIGTERM)
            seconds = 0 if 0 < seconds < now else seconds
            if not mem or now - mem[-1][0] >= 1.0:
                mem.append((now, {role: r for role, *r in procs.values()}))
            time.sleep(0.1)
        if p.returncode != 0:
            log.seek(0)
            raise RuntimeError(f"train.py {' '.join(overrides)} failed ({p.returncode}):\n{log.read()[-3000:]}")
        with open(os.path.join(d, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f], time.perf_counter() - t0, mem


def bench_overlap():
    steps, warm = (14, 4) if args.quick else (40, 10)
    runs = []
    for _ in range(args.repeats):  # interleaved sync, async, sync, ...
        sync, asyn = (run_train([f"--max_steps={steps}", f"--max_staleness={s}"])[0][warm:] for s in (0, 1))
        # sync: batch v+1 starts once weights v+1 are out, so the trainer's wait is a batch's generation time
        gen, trn = med(m["time/wait_rollout"] for m in sync), med(m["time/step"] - m["time/wait_rollout"] for m in sync)
        sps, aps = (len(ms) / sum(m["time/step"] for m in ms) for ms in (sync, asyn))
        runs.append(dict(gen=gen, trn=trn, sync=sps, asyn=aps, x=aps / sps, ideal=(gen + trn) / max(gen, trn),
                         wait=med(m["time/wait_rollout"] for m in asyn), atrn=med(m["time/train"] for m in asyn)))
    r = {k: med(x[k] for x in runs) for k in runs[0]}
    table(f"async overlap: steps {warm + 1}..{steps}, median of {args.repeats} interleaved sync/async pairs",
          ["measure", "measured", "baseline", "ratio", "target"], [
              ("generation of a batch (sync) / train step", f"{r['gen']:.3f} s", f"{r['trn']:.3f} s",
               f"{r['gen'] / r['trn']:.2f}", ""),
              ("steps/s: async (max_staleness=1) / sync (0)", f"{r['asyn']:.3f}", f"{r['sync']:.3f}",
               f"{r['x']:.2f}x", ""),
              ("async speed-up: achieved / ideal (gen+train)/max", f"{r['x']:.2f}x", f"{r['ideal']:.2f}x",
               f"{r['x'] / r['ideal']:.0%}", ">= 90%"),
              ("async: trainer wait / train time per step", f"{r['wait']:.3f} s", f"{r['atrn']:.3f} s", "", "")])


def welch(a, b):
    """Welch's t-test -> (t, degrees of freedom, two-sided p), the Student-t density integrated by torch."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return 0.0, float("nan"), float(mean(a) == mean(b))
    t = (mean(a) - mean(b)) / (va + vb) ** 0.5
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    x = torch.linspace(0, abs(t), 2001, dtype=torch.float64)
    area = torch.trapezoid(torch.distributions.StudentT(df).log_prob(x).exp(), x).item()  # P(0 < T < |t|)
    return t, df, max(0.0, 1 - 2 * area)


def bench_parity():
    steps, last = (20, 5) if args.quick else (args.parity_steps, 25)
    runs = []  # per seed: (async final reward, sync final reward, async wall, sync wall)
    for seed in range(args.seeds):
        out = [run_train([f"--max_steps={steps}", f"--max_staleness={s}", f"--seed={seed}"])[:2] for s in (1, 0)]
        runs.append([mean(m["reward/mean"] for m in ms[-last:]) for ms, _ in out] + [w for _, w in out])
    fa, fs = list(zip(*runs))[:2]
    t, df, p = welch(fa, fs)
    named = [*((f"seed {i}", r) for i, r in enumerate(runs)), ("mean", list(map(mean, zip(*runs))))]
    rows = [(name, f"{a:.3f}", f"{s:.3f}", f"{a - s:+.3f}", f"{wa:.0f} s", f"{ws:.0f} s", f"{wa / ws:.2f}")
            for name, (a, s, wa, ws) in named]
    rows += [("sd", f"{statistics.stdev(fa):.3f}", f"{statistics.stdev(fs):.3f}", "target: mean within ±0.05"),
             ("Welch t-test", f"t = {t:+.2f}", f"df = {df:.1f}", f"p = {p:.2f} (target > 0.05)")]
    table(f"learning parity: --max_steps={steps}, final reward = mean of the last {last} steps",
          ["seed", "async final reward (measured)", "sync (baseline)", "difference", "async wall", "sync wall",
           "wall ratio"], rows)


# ---- in-process sections: one real batch of the default recipe, on the trainer's core, one thread ----

@functools.cache
def setup(width=128):
    """The default recipe at tiny_hidden=width, built by train.py's code, one step's batch of guess episodes that
    its engine sampled, shared out as train.py does -> {cfg, model, msgs, adv, share, and timed calls: step,
    publish (to shared memory, as for the embedded engine), disk (write_weights, as for servers)}."""
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    d = tempfile.mkdtemp()  # lives as long as this process: the cached setup uses it
    cfg = config.load([*GUESS, f"--out_dir={d}", f"--tiny_hidden={width}"])
    init = train.tiny_init(cfg, 0, False)
    model = train.build_model(cfg, 0, torch.device("cpu"), False, init)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(init)
    engine = rollout.TorchEngine(model, slots=cfg.engine_slots, max_len=cfg.engine_max_len, seed=cfg.seed,
                                 max_new_tokens=cfg.max_new_tokens, stop_ids=rollout.stop_ids(tok, init))
    run = agent.load_agent(cfg.task)

    async def one(i):
        llm = rollout.Policy(engine, tok)
        ep = await run(agent.make_task(cfg.task, i, seed=cfg.seed, group_size=cfg.group_size,
                                       guess_max=cfg.guess_max, max_turns=cfg.max_turns), llm)
        msg = rollout.episode_to_msg(ep, i, i // cfg.group_size, rollout.check_tokens(ep, llm.calls))
        return msg if width == 128 else dict(msg, routing=None)  # wider: a random model's experts, routed freely
    msgs = serve(engine, [one(i) for i in range(cfg.batch_size)])
    model.train()
    adv = est.ADVANTAGES[cfg.advantage](rewards=torch.tensor([m["reward"] for m in msgs]),
                                        group_ids=torch.tensor([m["group"] for m in msgs]))
    adv = adv if adv.abs().sum() else torch.randn(len(msgs))  # equal rewards: a gradient anyway (time is measured)
    share = train.make_shares(msgs, adv.tolist(), 1, cfg)[0]
    ctx = torch.multiprocessing.get_context("spawn")
    shared = {k: v.detach().clone().share_memory_() for k, v in train.full_state(model, False).items()}
    ro = rollout.Rollout(None, None, shared, ctx.Value("l", 0), ctx.Lock(), None)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, eps=cfg.adam_eps)
    return dict(cfg=cfg, model=model, msgs=msgs, adv=adv, share=share,
                step=lambda: train.train_step(model, opt, share, cfg, 0, 1),
                publish=lambda: ro.publish(train.full_state(model, False), 1),
                disk=lambda: rollout.write_weights(d, model.config, init, 1, train.full_state(model, False)))


def bench_trainer():
    s = setup()
    plain_model = Transformer(s["model"].config)
    plain_model.load_state_dict(s["model"].state_dict())
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=s["cfg"].lr)
    b = train.collate(s["msgs"], "cpu")  # the plain loop gets its tensors ready-made
    ids, mask, A = b["ids"], b["loss_mask"][:, 1:], s["adv"][:, None]
    tokens = sum(len(m["ids"]) for m in s["msgs"])  # episode tokens (the plain loop also runs padding)

    def plain():  # forward, a policy-gradient loss, backward, AdamW
        plain_opt.zero_grad(set_to_none=True)
        logp = torch.log_softmax(plain_model(ids)[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, T-1)
        (-(logp * A * mask).sum() / mask.sum()).backward()
        plain_opt.step()
    t = timed({"full": lambda: (s["step"](), s["publish"]()), "plain": plain, "publish": s["publish"]},
              3 if args.quick else 10)
    full, base, pub = t["full"][0], t["plain"][0], t["publish"][0]
    table(f"trainer overhead: {len(ids)} episodes, {tokens} tokens, the plain loop pads to {tuple(ids.shape)}",
          ["measure", "measured", "plain loop (baseline)", "ratio", "target"],
          [("train.train_step + publish, tok/s", f"{tokens / full:,.0f}", f"{tokens / base:,.0f}",
            f"{base / full:.2f}", ">= 0.90"),
           ("weight publish alone", f"{pub * 1e3:.1f} ms", f"{full * 1e3:.1f} ms step", f"{pub / full:.1%}")])


def step_flops(c, mb):
    """Matmul FLOPs of a train step (forward + backward = 3x forward) on a micro-batch [(msg, adv)] padded to
    (B, T): attention over the full T x T (as SDPA computes it), MoE over the top-k experts a token runs, the
    vocabulary only at the positions whose next token is trained (the sampled ones)."""
    B, T, n_logits = len(mb), max(len(m["ids"]) for m, _ in mb), sum(len(m["engine_ids"]) for m, _ in mb)
    N, H, hd = B * T, c.hidden_size, c.head_dim
    attn = 4 * N * H * hd * (c.num_attention_heads + c.num_key_value_heads) + 4 * B * c.num_attention_heads * T * T * hd
    mlp = sum(2 * N * H * (3 * c.moe_intermediate_size * c.num_experts_per_tok + c.num_experts) if c.is_moe_layer(i)
              else 6 * N * H * c.intermediate_size for i in range(c.num_hidden_layers))
    return 3 * (c.num_hidden_layers * attn + mlp + 2 * n_logits * H * c.vocab_size)


def bench_flops():
    n, rows, a = 2 if args.quick else 5, [], torch.randn(2048, 2048)
    for width in (128,) if args.quick else (128, 256, 512):
        s = setup(width)
        peak = 2 * 2048 ** 3 / timed({"mm": lambda: a @ a}, 3 * n, best=True)["mm"][0]  # FLOP/s
        flops = sum(step_flops(s["model"].config, mb) for mini in s["share"]["mini_batches"] for mb in mini)
        fl = flops / timed({"step": s["step"]}, n)["step"][0]
        rows.append((f"tiny_hidden={width} ({sum(p.numel() for p in s['model'].parameters()) / 1e6:.1f}M params)",
                     f"{fl / 1e9:.1f}", f"{peak / 1e9:.1f}", f"{fl / peak:.0%}", ">= 50%" if width == 128 else ""))
    table(f"hardware use: train_step FLOP/s (median of {n}) vs a 2048x2048 fp32 matmul (best of {3 * n})",
          ["model", "trainer GFLOP/s (measured)", "matmul GFLOP/s (baseline)", "ratio", "target"], rows)


def moe_naive(m, x):
    """Every expert over every token, weighted by its combine weight (0 where the token is not routed to it)."""
    probs = F.softmax(m.gate(x), dim=-1, dtype=torch.float32)  # (N, E)
    w, e = probs.topk(m.top_k, dim=-1)
    comb = torch.zeros_like(probs).scatter(-1, e, w / w.sum(-1, keepdim=True) if m.norm_topk_prob else w)  # (N, E)
    return sum(comb[:, j:j + 1] * ((F.silu(x @ m.w_gate[j].T) * (x @ m.w_up[j].T)) @ m.w_down[j].T)
               for j in range(m.w_gate.shape[0]))


def bench_moe():
    n, rows = 3 if args.quick else 10, []
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    for H in (128, 512):
        moe = MoE(ModelConfig(hidden_size=H, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=H))
        dense = MLP(H, 2 * H)  # the MoE's active parameters per token
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.02)
        x = torch.randn(64 * 64, H, requires_grad=True)  # 64 episodes of 64 tokens
        t = timed({"grouped": lambda: moe(x)[0].sum().backward(), "naive": lambda: moe_naive(moe, x).sum().backward(),
                   "dense": lambda: dense(x).sum().backward()}, n)
        rows += [(f"H={H}, 8 experts top-2", f"{t['grouped'][0] * 1e3:.1f} ms", f"{what}: {t[k][0] * 1e3:.1f} ms",
                  f"{t[k][0] / t['grouped'][0]:.2f}x")
                 for k, what in (("naive", "per-expert masks over all tokens"), ("dense", f"dense MLP {2 * H} wide"))]
    table(f"mixture of experts: one layer forward + backward on 4096 tokens, median of {n}",
          ["layer", "grouped (model_moe.MoE, measured)", "baseline", "speed-up of grouped"], rows)


def bench_publish():
    n, rows = 3 if args.quick else 10, []
    for width in (128, 512):
        s = setup(width)
        mb = sum(t.numel() * t.element_size() for t in s["model"].state_dict().values()) / 1e6
        t = {k: wall for k, (wall, _) in timed({k: s[k] for k in ("step", "publish", "disk")}, n).items()}
        rows += [(f"tiny_hidden={width}, {mb:.1f} MB", name, f"{t[k] * 1e3:.1f} ms", f"{mb / 1e3 / t[k]:.2f} GB/s",
                  f"{t['step'] * 1e3:.0f} ms", f"{t[k] / (t[k] + t['step']):.1%}", "< 5%" * (width == 128))
                 for k, name in (("publish", "embedded: Rollout.publish to shared memory"),
                                 ("disk", "servers: rollout.write_weights"))]
    table(f"weight publishing, median of {n} (the disk path leaves out the servers' own load)",
          ["model", "path", "per step (measured)", "GB/s", "train step (baseline)", "share of a step", "target"], rows)


def bench_scale():
    steps, warm = (8, 3) if args.quick else (25, 5)
    rows, panels = [], []
    for label, key, values in (("episodes per batch", "prompts_per_step", [4, 8, 16]),
                               ("max_new_tokens per turn", "max_new_tokens", [1, 4, 8]),
                               ("concurrent agents", "concurrent_agents", [16, 32, 64, 128]),
                               ("trainer ranks (unpinned)", "ranks", [1, 2])):
        pts = []
        for v in values:
            over = [f"--max_steps={steps}"] + [f"--{key}={v}"] * (key != "ranks")
            ms = run_train(over, ranks=v if key == "ranks" else 1)[0][warm:]
            x = 8 * v if key == "prompts_per_step" else v  # episodes: 8 per prompt
            pts.append((x, med(m["time/step"] for m in ms), med(m["time/train"] for m in ms)))
            rows.append((label, x, f"{pts[-1][1]:.3f} s", f"{pts[-1][2]:.3f} s",
                         f"{med(m['tokens/trained'] for m in ms) / (x if key == 'prompts_per_step' else 64):.1f}",
                         f"{med(m['time/wait_rollout'] for m in ms):.3f} s",
                         f"{med(m['throughput/rollout_tokens_per_s'] for m in ms):.0f}"))
        xs, step_s, train_s = zip(*pts)
        panels.append((label, "seconds", {"step": (xs, step_s), "train part": (xs, train_s)}))
    table(f"scale: async, one setting changed at a time, median of steps {warm + 1}..{steps}",
          ["axis", "value", "step time", "train time", "sampled tokens/episode", "trainer wait", "rollout tok/s"], rows)
    plot("bench_scale", panels, "nanomolt step time, configs/guess.py on 2 CPU cores")


def bench_memory():
    seconds = 60 if args.quick else args.minutes * 60
    ms, wall, mem = run_train(["--max_steps=1000000"], ranks=2, seconds=seconds)
    mem = [(t, m) for t, m in mem if t <= seconds]  # until the SIGTERM (the final checkpoint is no growth)
    rows, lines = [], {}
    for name in sorted({k for _, m in mem for k in m}):
        pts = [(t, m[name]) for t, m in mem if name in m and t >= min(60, seconds / 5)]  # after start-up and warm-up
        (t0, (r0, _)), (t1, (r1, peak)) = pts[0], pts[-1]
        rows.append((name, f"{peak:.0f} MB", f"{r0:.0f} MB at {t0:.0f} s", f"{r1:.0f} MB at {t1:.0f} s",
                     f"{r1 - r0:+.1f} MB ({(r1 - r0) / r0:+.1%})", "flat"))
        lines[name] = [t / 60 for t, m in mem if name in m], [m[name][0] for t, m in mem if name in m]
    table(f"memory: torchrun --nproc_per_node=2 train.py, {wall / 60:.1f} minutes ({len(ms)} steps), RSS each second",
          ["process", "peak RSS", "RSS after warm-up (baseline)", "RSS at the end (measured)", "growth", "target"],
          rows)
    plot("bench_memory", [("minutes", "RSS (MB)", lines)], "resident memory, configs/guess.py, 2 ranks")


def bench_engine():
    """The tiny preset of train.py, as ours and as Hugging Face's (loaded from our checkpoint: same weights)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()  # generate() warns about generation flags it ignores on this model
    hf_logging.disable_progress_bar()
    os.sched_setaffinity(0, range(os.cpu_count()))  # other sections of `all` ran on CPU 0, one thread
    torch.set_num_threads(args.threads or os.cpu_count())
    new, rows_max, repeats = (16, 64, 1) if args.quick else (128, 64, 3)  # new tokens per row; rows = engine slots
    c = ModelConfig(vocab_size=384, num_experts=8, max_position_embeddings=256)  # else the defaults: the tiny preset
    ours = Transformer(c).init_weights(args.seed).eval()
    with tempfile.TemporaryDirectory() as d:
        ours.save_pretrained(d)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, c.vocab_size, (int(torch.randint(16, 33, (1,), generator=g)),), generator=g)
               for _ in range(rows_max)]  # 16..32 tokens
    pad = functools.partial(torch.nn.utils.rnn.pad_sequence, batch_first=True, padding_side="left")

    def engine(ps):  # every request at once from concurrent coroutines, as agents send them
        e = rollout.TorchEngine(ours, slots=rows_max, max_len=32 + new, max_new_tokens=new, seed=args.seed)
        outs = serve(e, [e.generate(p.tolist()) for p in ps])
        assert all(len(o.ids) == len(o.logprobs) == new and o.routing is not None for o in outs)

    def generate(ps):  # one left-padded batch; min_new_tokens pins the length (there is no eos anyway)
        ids, mask = pad(ps), pad([torch.ones_like(p) for p in ps])
        torch.manual_seed(args.seed)
        out = hf.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=new, min_new_tokens=new, top_k=0,
                          top_p=1.0, pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + new
    rows = []
    for setting, n in (("engine vs HF generate", rows_max), ("concurrent agents", 1), ("concurrent agents", 8)):
        t = timed({"engine": lambda: engine(prompts[:n]), "hf": lambda: generate(prompts[:n])}, repeats)
        rows.append((setting, f"{n} {'prompts' if n == rows_max else 'concurrent'}", f"{n * new / t['engine'][0]:,.0f}",
                     f"{n * new / t['hf'][0]:,.0f}", f"{t['hf'][0] / t['engine'][0]:.2f}x",
                     f"{t['hf'][1] / t['engine'][1]:.2f}x"))
    table(f"tiny MoE ({sum(p.numel() for p in ours.parameters()) / 1e6:.2f}M params, 8 experts top-2), prompts "
          f"16..32 tokens, {new} new tokens/row at temperature 1, median of {repeats}, torch threads "
          f"{torch.get_num_threads()}",
          ["section", "setting", "engine tok/s (measured)", "HF generate tok/s (baseline)", "ratio", "ratio, CPU time"],
          rows)


BENCHES = {"engine": bench_engine, "overlap": bench_overlap, "parity": bench_parity, "trainer": bench_trainer,
           "flops": bench_flops, "moe": bench_moe, "publish": bench_publish, "scale": bench_scale,
           "memory": bench_memory}
ap = argparse.ArgumentParser(description="nanomolt benchmarks: measured, baseline and ratio for each README number")
ap.add_argument("section", nargs="?", default="engine", choices=[*BENCHES, "all"], help="what to measure")
ap.add_argument("--quick", action="store_true", help="a smoke run: fewer tokens, steps, calls and repeats")
ap.add_argument("--threads", type=int, default=0, help="engine: torch.set_num_threads (0: all cores)")
ap.add_argument("--seed", type=int, default=0, help="engine: weights, prompts and sampling seed")
ap.add_argument("--repeats", type=int, default=3, help="overlap: sync/async pairs")
ap.add_argument("--seeds", type=int, default=5, help="parity: seeds of each loop")
ap.add_argument("--parity_steps", type=int, default=100, help="parity: optimizer steps of each run")
ap.add_argument("--minutes", type=float, default=10, help="memory: length of the run")
args = ap.parse_args()
os.chdir(os.path.dirname(os.path.abspath(__file__)))  # train.py, configs/ and assets/ are repository paths
for name in [*list(BENCHES)[1:], "engine"] if args.section == "all" else [args.section]:  # engine last: all cores
    BENCHES[name]()
