"""The CUDA paths: the embedded engine on a GPU, the trainer's step in bf16 compute with fp32 master weights
(FSDP2's MixedPrecisionPolicy, as train.build_model sets it), mismatch/* of a bf16 run (eager, activation
checkpointing, compile), cpu_offload, Qwen3-VL(-MoE) against transformers and the image recipe on a GPU.
tests/gpu_check.sh runs these on a lent GPU; without CUDA they skip."""
import asyncio
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from test_rollout import prompts, run, tiny

import agent
import config
import estimators as est
import rollout
import train
from engine import TorchEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu_check.sh)")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-4  # fp32 on the GPU: batched decode and a full forward take different kernels (1e-5 on CPU)


def full_logp(model, seq):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([seq], device="cuda"))[0].float(), -1).cpu()  # (T, V)


def test_engine_logprobs_match_a_full_forward_on_cuda():
    m = tiny(1).cuda()
    e = TorchEngine(m, slots=8, max_len=64, temperature=1.0, max_new_tokens=12, seed=3)
    for p, c in zip(prompts(6, 1), run(e, prompts(6, 1))):
        logp = full_logp(m, p + c.ids)
        assert len(c.ids) == 12 and c.routing is not None
        assert max(abs(logp[len(p) - 1 + j, t].item() - lp) for j, (t, lp) in enumerate(zip(c.ids, c.logprobs))) < TOL


def test_weight_swap_mid_generation_on_cuda():
    old, new = tiny(5).cuda(), tiny(6).cuda()
    e = TorchEngine(tiny(5).cuda(), slots=4, max_len=64, temperature=1.0, max_new_tokens=12, seed=1)
    ps = prompts(3, 5)

    async def main():
        async def swap_after(n):
            for _ in range(n):
                await asyncio.sleep(0)
                e.step()
            e.set_weights(new.state_dict(), 1)
            await e.run()
        loop_task = asyncio.create_task(swap_after(4))
        outs = await asyncio.gather(*(e.generate(p) for p in ps))
        loop_task.cancel()
        return outs
    for p, c in zip(ps, asyncio.run(main())):
        k = c.versions.index(1)
        assert 0 < k < len(c.ids) and c.versions == [0] * k + [1] * (len(c.ids) - k)
        for model, lo, hi in ((old, 0, k), (new, k, len(c.ids))):
            logp = full_logp(model, p + c.ids)
            assert all(abs(logp[len(p) - 1 + j, c.ids[j]].item() - c.logprobs[j]) < TOL for j in range(lo, hi))


def test_continuous_batching_matches_one_at_a_time_on_cuda():
    m, ps = tiny(4).cuda(), prompts(9, 4)
    alone = [run(TorchEngine(m, slots=1, max_len=64, temperature=0, max_new_tokens=7), [p])[0].ids for p in ps]
    e = TorchEngine(m, slots=3, max_len=64, temperature=0, max_new_tokens=7)  # 3 slots, 9 staggered requests
    assert [c.ids for c in run(e, ps, delays=[0, 0, 1, 2, 3, 5, 8, 13, 21])] == alone


def guess_batch(cfg, model, tok_dir):
    """One step's guess episodes, sampled on the GPU by the embedded engine (fp32, as the rollout runs it)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tok_dir)
    engine = TorchEngine(model, slots=cfg.engine_slots, max_len=cfg.engine_max_len, max_new_tokens=cfg.max_new_tokens,
                         stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")], seed=cfg.seed)
    run_agent = agent.load_agent(cfg.task)

    async def one(i):
        llm = rollout.Policy(engine, tok)
        ep = await run_agent(agent.make_task(cfg.task, i, seed=cfg.seed, group_size=cfg.group_size,
                                             guess_max=cfg.guess_max, max_turns=cfg.max_turns), llm)
        return rollout.episode_to_msg(ep, i, i // cfg.group_size, rollout.check_tokens(ep, llm.calls))

    async def main():
        loop = asyncio.create_task(engine.run())
        msgs = await asyncio.gather(*(one(i) for i in range(cfg.batch_size)))
        loop.cancel()
        return msgs
    return asyncio.run(main())


def test_train_step_in_bf16_with_fp32_master_weights(tmp_path):
    import torch.distributed as dist

    from model_moe import Transformer
    cfg = config.load(["--config", os.path.join(ROOT, "configs", "guess.py"), f"--out_dir={tmp_path}",
                       "--prompts_per_step=4", "--dtype=bfloat16"])
    rank, world, device, fsdp = train.compute_init(cfg)  # one process, bf16: a group of one (cpu:gloo,cuda:nccl)
    try:
        assert fsdp and device.type == "cuda"
        path = train.tiny_init(cfg, rank, fsdp)
        model = train.build_model(cfg, rank, device, fsdp, path)  # meta, sharded, MixedPrecisionPolicy(bf16)
        msgs = guess_batch(cfg, Transformer.from_pretrained(path, device=device), path)  # an fp32 engine
        before = {k: v.clone() for k, v in train.full_state(model, fsdp).items()}
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, eps=cfg.adam_eps)
        rewards = torch.tensor([m["reward"] for m in msgs])
        adv = est.ADVANTAGES[cfg.advantage](rewards=rewards, group_ids=torch.tensor([m["group"] for m in msgs]))
        adv = adv if adv.abs().sum() else torch.randn(len(msgs))  # equal rewards: still a gradient to check
        vec, norms = train.train_step(model, opt, train.make_shares(msgs, adv.tolist(), 1, cfg)[0], cfg, 0, 1)
        sums, hist = train.reduce_metrics(vec, 1)  # a collective on a CUDA tensor
        state = train.full_state(model, fsdp)
        assert all(v.dtype == torch.float32 for v in state.values())  # the master weights stay fp32
        assert all(math.isfinite(g) and g > 0 for g in norms) and hist[1:] == [0] * cfg.max_staleness
        assert any(not torch.equal(state[k], before[k]) for k in before)  # the optimizer stepped
        mm = sums["mm_abs"] / sums["mm_tokens"]  # bf16 trainer vs the fp32 engine on the same weights
        assert sums["mm_tokens"] == sums["tokens"] > 0 and 1e-6 < mm < 0.05, mm  # > 0: the forward ran in bf16
    finally:
        dist.destroy_process_group()


# FSDP2 on CUDA reshards after the forward: activation checkpointing re-gathers; compile: CUDA graphs of the forward
@pytest.mark.parametrize("extra", [[], ["--activation_checkpointing=true"], ["--compile=true"]])
def test_a_bf16_run_logs_mismatch(tmp_path, extra):
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "guess.py"),
           f"--out_dir={tmp_path}", "--dtype=bfloat16", "--max_steps=4", "--max_staleness=0", "--ckpt_every=0", *extra]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ms = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(ms) == 4 and all(m["staleness/max"] == 0 and m["mismatch/tokens"] == m["tokens/trained"] for m in ms)
    assert all(m["memory/peak_mb"] > 0 and math.isfinite(m["grad/norm"]) for m in ms)  # CUDA's allocated peak
    for m in ms:  # the engine samples in bf16 too: eager kernels can agree bit for bit (0.0 on an H200), compile's
        assert 0 <= m["mismatch/logprob_abs_diff"] < 0.1 and math.isfinite(m["mismatch/kl"])  # fused ones differ


def test_the_engine_samples_from_the_tensors_published_in_place(tmp_path):
    """On a GPU the engine's parameters are the trainer's published bf16 tensors (CUDA IPC), copied into on the GPU
    each step: on-policy and eager, its logprobs are the trainer's recompute; an engine on older weights is ~0.2 off.
    (tests/test_real_use.py checks the same on the CPU.)"""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "guess.py"),
           f"--out_dir={tmp_path}", "--dtype=bfloat16", "--max_steps=6", "--max_staleness=0", "--ckpt_every=0",
           "--lr=1e-3"]  # 6 steps of 64 episodes: some group has a reward, so a gradient, before the last
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ms = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert any(m["grad/norm"] > 0 for m in ms[:-1])  # the weights changed before a later step sampled
    assert all(m["mismatch/logprob_abs_diff"] < 1e-2 for m in ms), [m["mismatch/logprob_abs_diff"] for m in ms]


def test_cpu_offload_trains_as_without_it(tmp_path):
    """cpu_offload: FSDP2 keeps parameters, gradients and AdamW state (policy and KL reference) in CPU memory. Step 1
    samples the same tokens from the same weights, so its loss and gradient norm are the GPU-resident run's."""
    runs = {}
    for on in (False, True):
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "guess.py"),
               f"--out_dir={tmp_path / str(on)}", "--max_steps=3", "--max_staleness=0", "--ckpt_every=0",
               "--kl_coef=0.1", f"--cpu_offload={on}"]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[on] = [json.loads(line) for line in open(tmp_path / str(on) / "metrics.jsonl")]
    off, on = runs[False], runs[True]
    assert len(on) == 3 and all(math.isfinite(m["grad/norm"]) and m["mismatch/logprob_abs_diff"] < 1e-3 for m in on)
    assert on[0]["loss/policy"] == pytest.approx(off[0]["loss/policy"], rel=1e-4, abs=1e-6)
    assert on[0]["grad/norm"] == pytest.approx(off[0]["grad/norm"], rel=1e-4)
    assert on[0]["loss/kl_ref"] == pytest.approx(off[0]["loss/kl_ref"], rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("moe", [False, True])
def test_qwen3_vl_matches_transformers_on_cuda(tmp_path, monkeypatch, moe):
    """tests/test_vision.py's parity on the GPU, float32 (TF32 off: transformers' patch embedding is a convolution):
    three images of different sizes over two rows, one of them right-padded."""
    from test_vision import chat_ids, hf_vlm, images_and_pixels

    from model_moe import Transformer
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    hf = hf_vlm(moe)
    hf.save_pretrained(tmp_path)
    hf, ours = hf.cuda(), Transformer.from_pretrained(str(tmp_path), device="cuda").eval()
    images, pixels, grids = images_and_pixels()
    g = torch.Generator().manual_seed(0)
    rows = [chat_ids(grids[:2], g, [1, 1]), chat_ids(grids[2:], g, [1])]
    T = max(map(len, rows))
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows], device="cuda")
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows], device="cuda")
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, pixel_values=pixels.cuda(), image_grid_thw=grids.cuda(),
                 mm_token_type_ids=(ids == hf.config.image_token_id).int()).logits
        out = ours(ids, segments=mask.long() - 1, images=[im.cuda() for im in images])
    diff = (ref - out)[mask.bool()].abs().max().item()
    assert diff <= 1e-4 * max(1.0, ref.abs().max().item()), diff


def test_image_recipe_trains_on_cuda_in_bf16(tmp_path):
    """configs/image_count.py (a tiny Qwen3-VL-MoE, images in every prompt) for 3 steps on the GPU in bf16: the
    engine samples with images on CUDA, the trainer's forward takes the same pixels, mismatch/* is logged."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "image_count.py"),
           f"--out_dir={tmp_path}", "--dtype=bfloat16", "--max_steps=3", "--ckpt_every=0", "--filter_groups=false",
           "--eval_every=0"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ms = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(ms) == 3 and all(m["mismatch/tokens"] == m["tokens/trained"] > 0 for m in ms)
    assert all(0 < m["mismatch/logprob_abs_diff"] < 0.1 and math.isfinite(m["grad/norm"]) for m in ms)
