"""The loop end to end: FSDP equivalence, consistency checks every step, resume, faults."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


# vision: rank 0 has images, rank 1 none (its encoder idles); kl: a reference model, and rank 1 has an empty
# micro-batch (it hung there: the reference's all-gathers waited for it); mini: two updates per batch
# reshard_after_forward: on CPU the default keeps gathered weights; "true" runs the GPU's pattern (gathered again
# in backward), here with a reference and an empty micro-batch, and with two updates; activation_checkpointing:
# blocks recomputed in backward under FSDP (their weights gathered again there), with images too
@pytest.mark.parametrize("mode", ["", "vision", "kl", "mini", "kl --reshard_after_forward=true",
                                  "mini --reshard_after_forward=true", "kl --activation_checkpointing=true",
                                  "vision --activation_checkpointing=true --reshard_after_forward=true"])
def test_fsdp_two_ranks_equal_one_process(tmp_path, mode):
    one, two = one_and_two_ranks(tmp_path, *mode.split(), timeouts=(300, 120))
    same_tensors(one, two, ("grads", "weights", "published"))
    assert any(g.abs().max() > 0 for g in one["grads"].values())
    # the publish's one flat gather to rank 0 (train.full_state) rebuilds every tensor as DTensor.full_tensor does,
    # the 51-row embedding (split 26 / 25) and the lm_head tied to it too
    assert set(two["published"]) == set(two["weights"]) | {"lm_head.weight"}
    assert all(torch.equal(two["published"][k], w) for k, w in two["weights"].items())
    assert torch.equal(two["published"]["lm_head.weight"], two["weights"]["model.embed_tokens.weight"])


def test_split_batch_gives_every_rank_as_many_micro_batches_within_the_budget():
    """FSDP pairs the ranks' collectives forward by forward: unequal micro-batch counts would hang. A group's
    episodes stay together (train.packed_rows shares their prompt), longest first."""
    import train
    lengths = [5, 40, 7, 33, 12, 90, 8, 8, 21]
    msgs = [{"ids": torch.zeros(n), "index": i, "group": i // 3} for i, n in enumerate(lengths)]
    ranks = train.split_batch(msgs, list(range(len(msgs))), 2, budget=64)
    assert len(ranks[0]) == len(ranks[1]) == 3
    few = train.split_batch(msgs[:3], [0, 1, 2], 2, budget=8)  # 2 micro-batches on rank 0, 1 on rank 1
    assert len(few[0]) == len(few[1]) == 2 and sum(not mb for mbs in few for mb in mbs) == 1  # filled up: an empty one
    assert sorted(a for mbs in ranks for mb in mbs for _, a in mb) == list(range(len(msgs)))  # each once
    for mbs in ranks:
        for mb in mbs:
            assert all(m["index"] == a for m, a in mb)  # with its own advantage
            assert len(mb) <= 1 or len(mb) * max(len(m["ids"]) for m, _ in mb) <= 64
    dealt = [[m["group"] for mb in mbs for m, _ in mb] for mbs in ranks]  # each rank's, in order
    assert dealt == [[1, 1, 0, 2, 2], [1, 0, 0, 2]]  # groups by their longest: 1 (90), 0 (40), 2 (21)


PROBE = """
import builtins, os, sys
seen, imp = [], builtins.__import__
def hook(name, *a, **k):  # the environment as torch is first imported (when libgomp loads and reads it)
    if name == "torch" and "torch" not in sys.modules and not seen:
        seen.append(os.environ.get("OMP_WAIT_POLICY"))
    return imp(name, *a, **k)
builtins.__import__ = hook
import train
print(seen)
"""


def test_train_py_has_openmp_threads_sleep_when_they_wait_unless_told_otherwise():
    """The rollout process shares the cores: the trainer's OpenMP threads spinning as they wait (libgomp's default)
    took its cycles (SmolLM2's bf16 step: 6.8 s, 5.1 s passive). train.py sets OMP_WAIT_POLICY=PASSIVE before torch
    loads, where the user set none."""
    for given, expected in ((None, "PASSIVE"), ("ACTIVE", "ACTIVE")):
        env = {k: v for k, v in ENV.items() if k != "OMP_WAIT_POLICY"} | ({"OMP_WAIT_POLICY": given} if given else {})
        p = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert p.stdout.strip() == repr([expected]), (p.stdout, p.stderr[-2000:])


def run_train(out, *args, timeout=600):
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "guess.py"),
           f"--out_dir={out}", "--prompts_per_step=4", "--ckpt_every=0", "--dump_every=2", *args]
    return subprocess.run(cmd, env=ENV, cwd=ROOT, timeout=timeout, capture_output=True, text=True)


def run_and_resume(out, *args, half, steps):
    """train.py for `half` steps, then --resume to `steps` in the same out_dir; each part must succeed."""
    for extra in ([f"--max_steps={half}"], [f"--max_steps={steps}", "--resume"]):
        r = run_train(out, *args, *extra)
        assert r.returncode == 0, r.stderr[-3000:]


def one_and_two_ranks(tmp_path, *args, timeouts=(300, 300)):
    """tests/fsdp_worker.py in one process, then on 2 ranks under torchrun -> (what each saved)."""
    worker = os.path.join(ROOT, "tests", "fsdp_worker.py")
    subprocess.run([sys.executable, worker, str(tmp_path / "one.pt"), *args], check=True, env=ENV, cwd=ROOT,
                   timeout=timeouts[0])
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", worker,
                    str(tmp_path / "two.pt"), *args], check=True, env=ENV, cwd=ROOT, timeout=timeouts[1])
    return torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")


def same_tensors(one, two, kinds):
    """one[kind] and two[kind] (name -> tensor) have the same names and agree within 1e-5, for each kind."""
    for kind in kinds:
        assert one[kind].keys() == two[kind].keys(), kind
        for k in one[kind]:
            assert (one[kind][k] - two[kind][k]).abs().max() <= 1e-5, (kind, k)


def metrics(out):
    return [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]


def same_checkpoints(a, b):
    """Two checkpoints hold bitwise the same weights, optimizer state (and LoRA adapters): the untrained policy's
    rewards are mostly 0, so the metrics alone would not show a resume that restored neither."""
    from safetensors.torch import load_file
    wa, wb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = (torch.load(os.path.join(d, "trainer.pt"), weights_only=False) for d in (a, b))
    oa, ob = sa["optimizer"]["state"], sb["optimizer"]["state"]
    assert oa.keys() == ob.keys() and len(oa) > 0
    assert all(torch.equal(oa[k][n], ob[k][n]) for k in oa for n in oa[k]), "optimizer state"
    assert sa["adapters"].keys() == sb["adapters"].keys()
    assert all(torch.equal(sa["adapters"][k], sb["adapters"][k]) for k in sa["adapters"]), "adapters"


def test_on_policy_run_is_consistent_and_resumes_exactly(tmp_path):
    full = run_train(tmp_path / "a", "--max_staleness=0", "--max_steps=6")
    assert full.returncode == 0, full.stderr[-3000:]
    ma = metrics(tmp_path / "a")
    assert [m["step"] for m in ma] == list(range(1, 7))
    for m in ma:  # strictly on-policy: every token sampled by the weights it trains, mismatch ~0
        assert m["staleness/max"] == 0 and m["mismatch/tokens"] == m["tokens/trained"] > 0
        assert m["rollout/dropped_stale"] == 0
        assert m["mismatch/logprob_abs_diff"] < 1e-5 and abs(m["mismatch/kl"]) < 1e-5
        assert m["routing/flip_frac"] < 0.01  # the replayed experts are the ones the trainer's router picks too
        for key in ("policy_version", "reward/mean", "time/step", "time/wait_rollout", "time/weight_sync",
                    "throughput/rollout_tokens_per_s", "throughput/train_tokens_per_s", "staleness/mean"):
            assert key in m
    # stop after 3 steps, resume to 6: the same metrics as the uninterrupted run
    run_and_resume(tmp_path / "b", "--max_staleness=0", half=3, steps=6)
    mb = metrics(tmp_path / "b")
    assert [m["step"] for m in mb] == list(range(1, 7))
    for x, y in zip(ma, mb):
        assert x["reward/mean"] == y["reward/mean"] and x["tokens/trained"] == y["tokens/trained"]
        assert x["loss/policy"] == y["loss/policy"] and x["grad/norm"] == y["grad/norm"], x["step"]
    same_checkpoints(tmp_path / "a" / "ckpt", tmp_path / "b" / "ckpt")  # weights, optimizer state: bitwise
    # the checkpoint is a Hugging Face directory transformers loads
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "b" / "ckpt"))
    assert hf.config.num_experts == 8
    ep = json.loads(open(tmp_path / "a" / "episodes.jsonl").readline())
    assert "Guess my number" in ep["text"] and any(ep["mask"]) and len(ep["pieces"]) == len(ep["ids"])
    assert all(v >= 0 and lp < 0 for k, v, lp in zip(ep["mask"], ep["versions"], ep["logprobs"]) if k)


def test_async_run_bounds_staleness_and_matches_current_tokens(tmp_path):
    r = run_train(tmp_path, "--max_staleness=1", "--max_steps=8", "--kl_coef=0.05")
    assert r.returncode == 0, r.stderr[-3000:]
    ms = metrics(tmp_path)
    assert ms[0]["loss/kl_ref"] < 1e-6 < ms[-1]["loss/kl_ref"]  # the reference is the initial policy
    assert all(m["staleness/max"] <= 1 for m in ms)  # (by construction: take_batch drops what is past the bound)
    assert ms[-1]["rollout/dropped_stale"] == 0  # the admission bound kept every episode within it
    assert any(m["staleness/max"] == 1 for m in ms)  # it did run ahead of the trainer
    fresh = [m for m in ms if m["mismatch/tokens"]]
    assert fresh and all(m["mismatch/logprob_abs_diff"] < 1e-5 for m in fresh)


@pytest.mark.slow
def test_compile_gives_the_eager_loss_and_gradients(tmp_path):
    """compile=True: the policy's forward is torch.compile'd (graphs are compiled; the MoE layers run eager inside
    them), and its loss and gradients on a batch with replayed experts equal the eager model's (float32)."""
    import config
    import train
    from torch._dynamo.utils import counters
    cfg = config.load([f"--out_dir={tmp_path}", "--compile=true"])
    path, g = train.tiny_init(cfg, 0, False), torch.Generator().manual_seed(0)
    ids, mask = torch.randint(0, 384, (8, 12), generator=g), (torch.arange(12) >= 8).long().expand(8, 12)
    b = train.collate([{"ids": ids[i], "loss_mask": mask[i], "versions": torch.zeros(12, dtype=torch.long),
                        "logprobs": -torch.rand(12, generator=g), "routing": torch.randint(0, 8, (12, 4, 2), generator=g),
                        "engine_ids": ids[i][8:], "index": i} for i in range(8)], torch.device("cpu"))
    grads, losses, graphs = [], [], counters["stats"]["unique_graphs"]
    for compiled in (False, True):
        model = train.build_model(cfg if compiled else config.load([f"--out_dir={tmp_path}"]), 0, torch.device("cpu"),
                                  False, path)
        loss, _, _ = train.micro_loss(model, dict(b), cfg, (32.0, 8.0), torch.randn(8, generator=g.manual_seed(1)), 1)
        loss.backward()
        losses.append(loss.item())
        grads.append({k: p.grad for k, p in model.named_parameters()})
    assert counters["stats"]["unique_graphs"] > graphs  # it did compile
    assert abs(losses[0] - losses[1]) <= 1e-6 and losses[0] != 0
    assert all((grads[0][k] - grads[1][k]).abs().max() <= 1e-5 for k in grads[0])
    assert grads[1]["model.layers.0.mlp.gate.weight"].abs().sum() > 0  # the eager MoE's router got its gradient


def test_short_run_reward_rises(tmp_path):
    r = run_train(tmp_path, "--max_staleness=0", "--prompts_per_step=8", "--max_steps=60")
    assert r.returncode == 0, r.stderr[-3000:]
    rewards = [m["reward/mean"] for m in metrics(tmp_path)]
    # 10 steps are 640 episodes: at these rewards (~0.02 -> ~0.1) the standard error of a 10-step mean is ~0.01,
    # so +0.05 is a real rise (seeds 0 and 1 rose by ~0.09, by 0.12 under the previous sampler's stream)
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.05, rewards


LATE_AGENT = """
import asyncio
from agent import load_agent

guess = load_agent("guess")

async def run(task, llm):
    ep = await guess(task, llm)  # group 0 plays under version 0 ...
    while task["group"] == 0 and llm.engine.shared_version.value < 2:  # ... and hands its episodes in at version 2
        await asyncio.sleep(0.05)
    return ep
"""


def test_a_group_handed_in_past_the_staleness_bound_is_dropped_counted_and_the_run_goes_on(tmp_path):
    """The admission bound cannot stop an agent that returns late: its tokens (version 0) are 2 versions old when
    it arrives at the trainer of version 2, past max_staleness=1. Its episodes are dropped, counted, never trained,
    and the steps still get whole batches."""
    (tmp_path / "late.py").write_text(LATE_AGENT)
    r = run_train(tmp_path / "run", f"--task={tmp_path / 'late.py'}", "--max_staleness=1", "--prompts_per_step=2",
                  "--max_steps=4", "--rollout_dump", "--dump_every=0")
    assert r.returncode == 0, r.stderr[-3000:]
    ms = metrics(tmp_path / "run")
    assert ms[-1]["rollout/dropped_stale"] == 8 and ms[1]["rollout/dropped_stale"] == 0  # the whole group, once
    assert all(m["staleness/max"] <= 1 for m in ms)
    for step in range(1, 5):
        msgs = torch.load(tmp_path / "run" / "rollouts" / f"step_{step}.pt", weights_only=False)
        assert len(msgs) == 16 and all(m["group"] != 0 for m in msgs), step  # two whole groups, never group 0


DIE_AGENT = """
import os
from agent import load_agent

guess = load_agent("guess")

async def run(task, llm):
    if task["index"] == {n}:  # the whole rollout process dies mid-run
        os._exit(3)
    return await guess(task, llm)
"""


def test_dead_rollout_process_is_a_clear_error_with_a_checkpoint(tmp_path):
    (tmp_path / "die.py").write_text(DIE_AGENT.replace("{n}", "80"))
    r = run_train(tmp_path / "run", f"--task={tmp_path / 'die.py'}", "--max_steps=50", "--max_staleness=0")
    assert r.returncode != 0 and "rollout process died (exit code 3)" in r.stderr
    state = torch.load(tmp_path / "run" / "ckpt" / "trainer.pt", weights_only=False)
    assert state["step"] == 2  # 32 episodes a step; episode 80 is in step 3's batch


def test_failing_checkpoint_write_keeps_the_last_one(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "ckpt.tmp-4").write_text("in the way")  # the step-4 write cannot create its directory
    r = run_train(out, "--max_steps=6", "--ckpt_every=2")
    assert r.returncode != 0 and "checkpoint write failed at step 4" in r.stderr
    state = torch.load(out / "ckpt" / "trainer.pt", weights_only=False)
    assert state["step"] == 2
    from model_moe import Transformer
    Transformer.from_pretrained(str(out / "ckpt"))  # complete and loadable


def test_non_finite_steps_are_skipped_then_stop(tmp_path, monkeypatch):
    import estimators
    import train
    monkeypatch.setitem(estimators.ADVANTAGES, "grpo", lambda *, rewards, group_ids: rewards * float("nan"))
    with pytest.raises(RuntimeError, match="2 non-finite gradient norms in a row"):
        train.main(["--config", os.path.join(ROOT, "configs", "guess.py"), f"--out_dir={tmp_path}",
                    "--prompts_per_step=2", "--max_steps=5", "--max_bad_steps=2", "--max_staleness=0"])
    ms = metrics(tmp_path)
    assert len(ms) == 1 and ms[0]["train/skipped_steps"] == 1


@pytest.mark.parametrize("to", ["trainer", "group"])
def test_sigterm_or_ctrl_c_writes_a_checkpoint_and_exits_cleanly(tmp_path, to):
    """SIGTERM to the trainer; or SIGINT to the whole process group, as Ctrl-C in a terminal (or `timeout`)
    sends it: the rollout process gets it too and must leave the stop to the trainer."""
    import signal
    import time
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "guess.py"),
           f"--out_dir={tmp_path}", "--prompts_per_step=2", "--max_steps=100000", "--ckpt_every=0"]
    p = subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=to == "group")
    deadline = time.monotonic() + 120
    while not (tmp_path / "metrics.jsonl").exists() or len(metrics(tmp_path)) < 2:  # a run that dies fails here
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-2000:] if p.poll() else "slow"
        time.sleep(0.5)
    name = "SIGTERM" if to == "trainer" else "SIGINT"
    if to == "trainer":
        p.send_signal(signal.SIGTERM)
    else:
        os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    assert f"{name}: checkpoint of step" in out
    state = torch.load(tmp_path / "ckpt" / "trainer.pt", weights_only=False)
    assert state["step"] == len(metrics(tmp_path)) >= 2


def test_resume_survives_a_kill_between_the_renames_and_refuses_another_architecture(tmp_path):
    r = run_train(tmp_path, "--max_steps=2", "--max_staleness=0")
    assert r.returncode == 0, r.stderr[-3000:]
    os.replace(tmp_path / "ckpt", tmp_path / "ckpt.old")  # kill -9 after `ckpt -> ckpt.old`, before `tmp -> ckpt`
    r = run_train(tmp_path, "--max_steps=3", "--max_staleness=0", "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2, 3]
    r = run_train(tmp_path, "--max_steps=4", "--resume", "--tiny_experts=4")
    assert r.returncode != 0 and "num_experts: 8 vs 4" in r.stderr


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    r = run_train(tmp_path, "--model=/nonexistent/qwen3", "--max_steps=1")
    assert r.returncode != 0 and "/nonexistent/qwen3/config.json: missing" in r.stderr


@pytest.mark.slow
def test_kill_9_during_a_checkpoint_write_keeps_the_previous_one_and_resumes(tmp_path):
    """SIGKILL to the whole run (trainer and rollout process) while it writes the step-4 checkpoint: the step-2
    checkpoint is intact and loads, and --resume continues from step 2."""
    import signal
    import time
    import types
    from model_moe import Transformer
    args = ["--prompts_per_step=2", "--ckpt_every=2", "--max_staleness=0"]
    for attempt in range(3):  # a missed write window (the kill came after the rename) is retried, never passed
        out = tmp_path / f"run{attempt}"
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "guess.py"),
               f"--out_dir={out}", "--max_steps=100000", "--dump_every=0", *args]
        with open(tmp_path / f"log{attempt}", "w") as log:  # own session: one killpg reaches the rollout process
            p = subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=log, stderr=log, start_new_session=True)
        tmp, deadline = out / "ckpt.tmp-4", time.time() + 120
        try:  # kill once the weights file of step 4 exists: mid-write, before trainer.pt and the renames
            while not (tmp / "model.safetensors").exists() and p.poll() is None and time.time() < deadline:
                time.sleep(0.0005)  # the write lasts tens of ms; a poll every 0.5 ms lands in it
        finally:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        assert p.returncode == -signal.SIGKILL, open(tmp_path / f"log{attempt}").read()[-3000:]
        if tmp.exists():  # killed mid-write: ckpt.tmp-4 is there, not renamed
            break
    else:
        pytest.fail("never caught a checkpoint write in 3 runs")
    import train
    ckpt = train.latest_checkpoint(types.SimpleNamespace(out_dir=str(out)))  # ckpt, or ckpt.old between the renames
    state = torch.load(os.path.join(ckpt, "trainer.pt"), weights_only=False)
    assert state["step"] == 2 and state["data_position"] == 2 * 16
    Transformer.from_pretrained(ckpt)  # complete and loadable
    r = run_train(out, "--max_steps=6", "--resume", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in metrics(out)] == list(range(1, 7))  # steps 3.. of the killed run are logged anew
    state = torch.load(out / "ckpt" / "trainer.pt", weights_only=False)
    assert state["step"] == 6 and state["data_position"] == 6 * 16
    assert sorted(f.name for f in out.iterdir() if f.name.startswith("ckpt")) == ["ckpt"]  # the partial write is gone
