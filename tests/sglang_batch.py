"""SGLang's /generate batched (the requests of one event-loop tick in one call) vs one call per request: the tiny MoE
on one CPU server (needs tests/install_sglang.sh), 2-turn agents, 64 new tokens a turn. README: "Batched /generate".
    python tests/sglang_batch.py"""
import asyncio
import os
import statistics
import sys
import tempfile
import time
from multiprocessing import Value

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)
import torch  # noqa: E402

import agent  # noqa: E402
import config  # noqa: E402
from model_moe import ModelConfig, Transformer  # noqa: E402
from servers import ServerEngine, start_server, stop_server, write_weights  # noqa: E402

SGL = os.path.join(ROOT, ".venv-sglang", "bin", "python")
env = {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": os.path.join(ROOT, "tests", "sglang_cpu")}
out = tempfile.mkdtemp()
tok_dir = tempfile.mkdtemp()
agent.make_tokenizer(tok_dir)
ARGS = ("--server_args=--device cpu --attention-backend torch_native --disable-cuda-graph --skip-server-warmup "
        "--max-total-tokens 16384")
cfg = config.load([f"--out_dir={out}", "--engine=sglang", f"--server_python={SGL}", ARGS, "--engine_max_len=256",
                   "--server_timeout=300"])
c = ModelConfig(vocab_size=384, num_experts=8, max_position_embeddings=256)
model = Transformer(c).init_weights(0)
os.environ.update(env)
first = write_weights(os.path.join(out, "w"), c, tok_dir, 0, model.state_dict())
proc, url = start_server("sglang", first, cfg, os.path.join(out, "s.log"), moe=True)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(384, (int(n),), generator=g).tolist() for n in torch.randint(16, 33, (64,), generator=g)]
NEW = 64
async def serve(batched, n):
    e = ServerEngine("sglang", [url], model_config=c, weights_dir=os.path.join(out, "w"), max_new_tokens=NEW,
                     max_len=256, temperature=1.0, stop_ids=[], version=Value("i", 0), concurrency=64)
    e.api = dict(e.api, batched=batched)
    loop = asyncio.create_task(e.run())
    await asyncio.sleep(0.5)
    t0 = time.perf_counter()
    async def agent(p):  # 2 turns each, as a multi-turn agent
        a = await e.generate(p); b = await e.generate(p + a.ids + [5, 6]); return len(a.ids) + len(b.ids)
    toks = sum(await asyncio.gather(*(agent(p) for p in prompts[:n])))
    dt = time.perf_counter() - t0
    loop.cancel()
    return toks / dt
try:
    res = {}
    for r in range(3):
        for n in (64, 8):
            for b in (True, False):
                v = asyncio.run(serve(b, n))
                if r: res.setdefault((n, b), []).append(v)
    for (n, b), v in sorted(res.items()):
        print(f"agents {n} batched {b}: median {statistics.median(v):,.0f} tok/s  {[round(x) for x in v]}")
finally:
    stop_server(proc)
