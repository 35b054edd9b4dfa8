"""bench.py: the numbers README's "Performance" section quotes, each as measured, baseline and ratio.
    python bench.py [engine|overlap|parity|trainer|moe|publish|all] [--quick] [--threads N]
engine, overlap, parity on all cores; the others on CPU 0, one thread. (scale, memory, flops: commit 8482101.)
On a shared machine run one section at a time: flock /tmp/nanomolt-cpu.lock python bench.py overlap"""
import argparse
import asyncio
import collections
import copy
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from statistics import mean, median as med, stdev, variance

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: spinning waiters fight for cores (~10x slower)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # generate() warns about flags it ignores on this model
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import agent  # noqa: E402
import config  # noqa: E402
import endpoint  # noqa: E402
import estimators as est  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
from model_moe import MLP, ModelConfig, MoE, Transformer  # noqa: E402

GUESS = ["--config", "configs/guess.py", "--dump_every=0", "--ckpt_every=0"]  # the default recipe, no mid-run dumps

def table(title, header, rows):
    lines = [header, ["---"] + ["---:"] * (len(header) - 1), *rows]
    print(f"\n{title}\n\n" + "\n".join("| " + " | ".join(map(str, r)) + " |" for r in lines), flush=True)

def timed(fns, n, best=False):
    """{name: call} -> {name: wall s}, the median (best: minimum) of n interleaved rounds."""
    ts = {k: [] for k in fns}
    for _ in range(n + 1):  # the first round warms up (lazy init) and is dropped
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            ts[k].append(time.perf_counter() - t0)
    return {k: (min if best else med)(v[1:]) for k, v in ts.items()}

def run_train(overrides):
    """train.py + overrides in a temporary out_dir (one thread each for trainer and rollout) -> (metrics, wall s)."""
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "train.py", *GUESS, f"--out_dir={d}", *overrides], capture_output=True)
        if p.returncode != 0:
            raise RuntimeError(f"train.py {overrides} failed ({p.returncode}):\n{p.stderr[-3000:].decode()}")
        with open(os.path.join(d, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f], time.perf_counter() - t0

def bench_overlap():
    """The baseline of async is the same run at max_staleness=0 (synchronous RL), interleaved with it."""
    steps, warm, repeats = (14, 4, 1) if args.quick else (40, 10, 3)
    runs = [run_train([f"--max_steps={steps}", f"--max_staleness={s}"])[0][warm:] for _ in range(repeats) for s in "01"]
    sync, asyn = sum(runs[0::2], []), sum(runs[1::2], [])  # interleaved, then pooled: steps after warm-up
    # sync: batch v+1 starts once weights v+1 are out, so the trainer's wait is a batch's generation time
    gen, trn = med(m["time/wait_rollout"] for m in sync), med(m["time/step"] - m["time/wait_rollout"] for m in sync)
    sps, aps = (len(ms) / sum(m["time/step"] for m in ms) for ms in (sync, asyn))
    rows = [("generation of a batch (sync) / train step, s", gen, trn, ""),
            ("steps/s: async (max_staleness=1) / sync (0)", aps, sps, ""),
            ("async speed-up: achieved / ideal (gen+train)/max", aps / sps, (gen + trn) / max(gen, trn), ">= 0.90"),
            ("async: trainer wait / train time per step, s", med(m["time/wait_rollout"] for m in asyn),
             med(m["time/train"] for m in asyn), "")]
    table(f"async overlap: steps {warm + 1}..{steps} of {repeats} interleaved sync/async pairs, medians",
          ["measure", "measured", "baseline", "ratio", "target"],
          [(what, f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}", target) for what, a, b, target in rows])

def bench_parity():
    """The baseline of async learning is sync learning: final rewards over seeds, compared by Welch's t-test."""
    steps, last, seeds = (20, 5, 2) if args.quick else (100, 25, 5)
    runs = []  # per seed: (async final reward, sync final reward, async wall, sync wall)
    for seed in range(seeds):
        out = [run_train([f"--max_steps={steps}", f"--max_staleness={s}", f"--seed={seed}"]) for s in (1, 0)]
        runs.append([mean(m["reward/mean"] for m in ms[-last:]) for ms, _ in out] + [w for _, w in out])
    fa, fs = list(zip(*runs))[:2]
    va, vb = variance(fa) / seeds + 1e-12, variance(fs) / seeds + 1e-12  # squared standard errors, never 0
    t = (mean(fa) - mean(fs)) / (va + vb) ** 0.5
    df = (va + vb) ** 2 / (va ** 2 + vb ** 2) * (seeds - 1)  # Welch-Satterthwaite, two samples of `seeds`
    x = torch.linspace(0, abs(t), 2001, dtype=torch.float64)
    p = 1 - 2 * torch.trapezoid(torch.distributions.StudentT(df).log_prob(x).exp(), x).item()  # two-sided
    rows = [(name, f"{a:.3f}", f"{s:.3f}", f"{a - s:+.3f}", f"{wa:.0f} s", f"{ws:.0f} s", f"{wa / ws:.2f}")
            for name, (a, s, wa, ws) in [*zip(range(seeds), runs), ("mean", list(map(mean, zip(*runs))))]]
    rows += [("sd", f"{stdev(fa):.3f}", f"{stdev(fs):.3f}", "target: mean within ±0.05"),
             ("Welch t-test", f"t = {t:+.2f}", f"df = {df:.1f}", f"p = {max(0.0, p):.2f} (target > 0.05)")]
    table(f"learning parity: --max_steps={steps}, final reward = mean of the last {last} steps", ["seed",
          "async final reward (measured)", "sync (baseline)", "difference", "async wall", "sync wall", "ratio"], rows)

@functools.cache
def setup(width=128):
    """The default recipe at tiny_hidden=width, a batch its rollout sampled -> {cfg, model, msgs, adv, share, calls}."""
    d = tempfile.mkdtemp()  # lives as long as this process: the cached setup uses it
    cfg = config.load([*GUESS, f"--out_dir={d}", f"--tiny_hidden={width}"])
    init = train.tiny_init(cfg, 0, False)
    model = train.build_model(cfg, 0, torch.device("cpu"), False, init)
    ro = rollout.start_rollout(cfg, model.config, train.full_state(model, False), 0, 0, init)
    msgs = train.take_batch(cfg, ro, 0, collections.Counter())[0]
    ro.close()  # else it samples on, on our core; a lock it held when killed stays held: a new one
    ro = rollout.Rollout(None, None, ro.shared, ro.version, torch.multiprocessing.Lock(), None)
    msgs = msgs if width == 128 else [dict(m, routing=None) for m in msgs]  # wider: random experts, routed freely
    adv = est.ADVANTAGES[cfg.advantage](rewards=torch.tensor([m["reward"] for m in msgs]),
                                        group_ids=torch.tensor([m["group"] for m in msgs]))
    adv = adv if adv.abs().sum() else torch.randn(len(msgs))  # equal rewards: a gradient anyway (time is measured)
    share = train.make_shares(msgs, adv.tolist(), 1, cfg)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, eps=cfg.adam_eps)
    return dict(cfg=cfg, model=model, msgs=msgs, adv=adv, share=share,
                step=lambda: train.train_step(model, opt, share, cfg, 0, 1),
                publish=lambda: ro.publish(train.full_state(model, False), 1),
                disk=lambda: rollout.write_weights(d, model.config, init, 1, train.full_state(model, False)))

def bench_trainer():
    """The baseline is the loop one writes first: on ready-made padded tensors, a policy-gradient step, no publish."""
    s = setup()
    plain_model = copy.deepcopy(s["model"])
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=s["cfg"].lr)
    b = train.collate(s["msgs"], "cpu")
    ids, mask, A = b["ids"], b["loss_mask"][:, 1:], s["adv"][:, None]
    tokens = sum(len(m["ids"]) for m in s["msgs"])  # episode tokens (the plain loop also runs padding)

    def plain():
        plain_opt.zero_grad(set_to_none=True)
        logp = torch.log_softmax(plain_model(ids)[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, T-1)
        (-(logp * A * mask).sum() / mask.sum()).backward()
        plain_opt.step()
    t = timed({"full": lambda: (s["step"](), s["publish"]()), "plain": plain}, 3 if args.quick else 10)
    table(f"trainer overhead: {len(ids)} episodes, {tokens} tokens, the plain loop pads to {tuple(ids.shape)}",
          ["measure", "measured", "plain loop (baseline)", "ratio", "target"], [("train_step + publish, tok/s",
           f"{tokens / t['full']:,.0f}", f"{tokens / t['plain']:,.0f}", f"{t['plain'] / t['full']:.2f}", ">= 0.90")])

def bench_moe():
    """Two baselines: the MoE as first written (naive), and a dense MLP as wide as its active parameters per token."""
    n, rows = 3 if args.quick else 10, []

    def naive(m, x):  # every expert over every token, times its combine weight (0 where not routed)
        probs = F.softmax(m.gate(x), dim=-1, dtype=torch.float32)  # (N, E)
        w, e = probs.topk(m.top_k, dim=-1)
        comb = torch.zeros_like(probs).scatter(-1, e, w / w.sum(-1, keepdim=True) if m.norm_topk_prob else w)
        return sum(comb[:, j:j + 1] * ((F.silu(x @ m.w_gate[j].T) * (x @ m.w_up[j].T)) @ m.w_down[j].T)
                   for j in range(m.w_gate.shape[0]))
    for H in (128, 512):
        moe, dense = MoE(ModelConfig(hidden_size=H, num_experts=8, moe_intermediate_size=H)), MLP(H, 2 * H)
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.02)
        x = torch.randn(64 * 64, H, requires_grad=True)  # 64 episodes of 64 tokens
        t = timed({"grouped": lambda: moe(x)[0].sum().backward(), "naive": lambda: naive(moe, x).sum().backward(),
                   "dense": lambda: dense(x).sum().backward()}, n)
        rows.append((f"H={H}, 8 experts top-2", *(f"{t[k] * 1e3:.1f} ms" for k in t),
                     f"{t['naive'] / t['grouped']:.2f}x", f"{t['dense'] / t['grouped']:.2f}x"))
    table(f"mixture of experts: one layer forward + backward on 4096 tokens, median of {n}", ["layer",
          "model_moe.MoE (measured)", "naive (baseline)", "dense MLP (baseline)", "ratio to naive", "to dense"], rows)

def bench_publish():
    """The baseline is the train step a publish follows: what matters is its share of a step."""
    n, rows = 3 if args.quick else 10, []
    for width in (128, 512):
        s = setup(width)
        mb = sum(t.numel() * t.element_size() for t in s["model"].state_dict().values()) / 1e6
        t = timed({k: s[k] for k in ("step", "publish", "disk")}, n)
        rows += [(f"tiny_hidden={width}, {mb:.1f} MB", k, f"{t[k] * 1e3:.1f} ms", f"{mb / 1e3 / t[k]:.2f} GB/s",
                  f"{t['step'] * 1e3:.0f} ms", f"{t[k] / (t[k] + t['step']):.1%}", "< 5%" * (width == 128))
                 for k in ("publish", "disk")]
    table(f"weight publishing, median of {n}: publish = Rollout.publish to shared memory, disk = write_weights",
          ["model", "path", "per step (measured)", "GB/s", "train step (baseline)", "share of a step", "target"], rows)

def bench_engine():
    """The baseline: HF `generate` on the same weights (from our checkpoint), one left-padded batch per call."""
    new, repeats = (16, 1) if args.quick else (128, 3)  # new tokens per row
    c = ModelConfig(vocab_size=384, num_experts=8, max_position_embeddings=256)  # else the defaults: the tiny preset
    ours = Transformer(c).init_weights(0).eval()
    with tempfile.TemporaryDirectory() as d:
        ours.save_pretrained(d)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(c.vocab_size, (int(n),), generator=g) for n in torch.randint(16, 33, (64,), generator=g)]

    async def serve(ps):  # every request at once, as concurrent agents send them, while the engine's loop runs
        e = rollout.TorchEngine(ours, slots=64, max_len=32 + new, max_new_tokens=new, seed=0)
        loop = asyncio.create_task(e.run())
        outs = await asyncio.gather(*(e.generate(p.tolist()) for p in ps))
        loop.cancel()
        assert all(len(o.ids) == new and o.routing is not None for o in outs)

    def generate(ps):  # -1 marks padding; min_new_tokens pins the length (there is no eos anyway)
        ids = torch.nn.utils.rnn.pad_sequence(ps, batch_first=True, padding_value=-1, padding_side="left")
        torch.manual_seed(0)
        out = hf.generate(ids.clamp(min=0), attention_mask=(ids >= 0).long(), do_sample=True, max_new_tokens=new,
                          min_new_tokens=new, top_k=0, top_p=1.0, pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + new
    rows = []
    for n in (64, 1, 8):  # as many as the engine has slots, then one and a few concurrent agents
        t = timed({"engine": lambda: asyncio.run(serve(prompts[:n])), "hf": lambda: generate(prompts[:n])}, repeats)
        rows.append((n, f"{n * new / t['engine']:,.0f}", f"{n * new / t['hf']:,.0f}", f"{t['hf'] / t['engine']:.2f}x"))
    table(f"tiny MoE, {sum(p.numel() for p in ours.parameters()) / 1e6:.2f}M params, 8 experts top-2, prompts 16..32 "
          f"tokens, {new} new tokens/row at temperature 1, median of {repeats}, {torch.get_num_threads()} threads",
          ["requests at once", "engine tok/s (measured)", "HF generate tok/s (baseline)", "ratio"], rows)

def bench_endpoint():
    """The baseline: the same 3-turn chats by a token-level agent on llm.generate, on the same engine and weights."""
    n, repeats, d = (16, 1, tempfile.mkdtemp()) if args.quick else (64, 5, tempfile.mkdtemp())
    agent.make_tokenizer(d)
    tok, ask, turn = rollout._tokenizer(d), agent.GUESS_PROMPT.format(7), {"role": "user", "content": "4 is too low"}
    model = Transformer(ModelConfig(vocab_size=len(tok), num_experts=8, max_position_embeddings=256)).init_weights(0)

    async def chat(llm):  # as calc does: the process's client, this episode's URL; the episode is the record
        msgs, client = [{"role": "user", "content": ask}], agent.openai_client(llm)
        for _ in range(3):
            m = (await client.chat.completions.create(model=llm.model, messages=msgs)).choices[0].message
            msgs += [m.model_dump(exclude_none=True), turn]
        return [rollout.check_tokens(*s) for s in endpoint.segments(llm, 0.0)]

    async def tokens(llm):  # the same turns as token ids
        ep = agent.Episode(ids=(p := agent.prompt_ids(tok, ask)), loss_mask=[0] * len(p))
        for _ in range(3):
            await agent.model_turn(llm, ep)
            ep.append(agent.turn_suffix(tok, turn["content"]))
        return rollout.check_tokens(ep, llm.calls)

    async def episodes(fn, new):  # n at once; no stop token: every turn samples `new` tokens
        engine = rollout.TorchEngine(model, slots=n, max_len=256, max_new_tokens=new)
        server, loop = await endpoint.serve(tok, {}), asyncio.create_task(engine.run())  # {}: no sampling is sent
        await asyncio.gather(*(fn(endpoint.attach(server, rollout.Policy(engine, tok))) for _ in range(n)))
        loop.cancel()
        await server["runner"].cleanup()
    t = {new: timed({"chat": lambda: asyncio.run(episodes(chat, new)),
                     "generate": lambda: asyncio.run(episodes(tokens, new))}, repeats) for new in (16, 64)}
    table(f"endpoint: {n} 3-turn chats at once, tiny MoE, episodes/s, median of {repeats}", ["tokens a turn",
          "endpoint + openai client (measured)", "llm.generate (baseline)", "ratio", "target"],
          [(k, f"{n / v['chat']:.1f}", f"{n / v['generate']:.1f}", f"{v['generate'] / v['chat']:.2f}", ">= 0.8")
           for k, v in t.items()])

BENCHES = {"engine": bench_engine, "overlap": bench_overlap, "parity": bench_parity, "trainer": bench_trainer,
           "moe": bench_moe, "publish": bench_publish, "endpoint": bench_endpoint}
if __name__ == "__main__":  # not in the rollout process that setup() spawns
    ap = argparse.ArgumentParser(description="nanomolt benchmarks: measured, baseline and ratio of each README number")
    ap.add_argument("section", nargs="?", default="engine", choices=[*BENCHES, "all"], help="what to measure")
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer tokens, steps, seeds and repeats")
    ap.add_argument("--threads", type=int, default=0, help="engine: torch.set_num_threads (0: all cores)")
    args = ap.parse_args()
    os.chdir(os.path.dirname(os.path.abspath(__file__)))  # train.py and configs/ are repository paths
    for name in [*list(BENCHES)[1:], "engine"] if args.section == "all" else [args.section]:
        one_core = name in ("trainer", "moe", "publish")  # the trainer's share of a 2-core machine
        os.sched_setaffinity(0, {0} if one_core else range(os.cpu_count()))
        torch.set_num_threads(1 if one_core else args.threads or os.cpu_count())
        BENCHES[name]()
