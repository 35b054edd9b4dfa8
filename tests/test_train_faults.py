"""The trainer's defects of issue 28 (items 6, 7, 8, 11, 12, 13, 18): each test failed before its fix."""
import os
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

import config
import estimators
import rollout
import train
from model_moe import ModelConfig, Transformer
from test_real_use import tiny_setup
from test_train import ENV, ROOT, metrics, run_train


# ---- 6. mini-batches: split evenly, never an empty update ----

def test_mini_batches_are_split_evenly_and_never_empty():
    cfg = config.load(["--mini_batches=4", "--prompts_per_step=3", "--group_size=3"])
    msgs = [{"ids": torch.zeros(5), "loss_mask": torch.ones(5), "index": i, "group": i // 3} for i in range(9)]
    counts = train.make_shares(msgs, [0.0] * 9, 1, cfg)[0]["counts"]
    assert sorted(n for _, n in counts) == [2, 2, 2, 3]  # ceiling division gave 3, 3, 3, 0
    counts = train.make_shares(msgs[:3], [0.0] * 3, 1, cfg)[0]["counts"]
    assert [n for _, n in counts] == [1, 1, 1]  # fewer episodes than mini_batches: fewer updates


def test_an_update_without_sampled_tokens_does_not_step():
    """AdamW moves weights on its momentum even at gradient 0: an update with nothing to train must not step."""
    def weights_after(keep):
        model, msgs = tiny_setup()
        msgs = [dict(m) for m in msgs[:2]]
        msgs[1]["loss_mask"] = torch.zeros_like(msgs[1]["loss_mask"])  # nothing sampled in the second update
        msgs[1]["engine_ids"] = msgs[1]["ids"][:0]
        cfg = config.load(["--max_staleness=0", "--lr=0.01", f"--mini_batches={len(msgs[:keep])}"])
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        share = train.make_shares(msgs[:keep], [1.0] * keep, 1, cfg)[0]
        norms = train.train_step(model, opt, share, cfg, 0, 1)[1]
        return torch.cat([p.detach().flatten() for p in model.parameters()]), norms
    one, _ = weights_after(1)
    two, norms = weights_after(2)
    assert len(norms) == 2 and norms[1] == 0
    assert torch.equal(one, two)


# ---- 7. the OPD teacher and the KL reference route by themselves ----

def own_logp(model, msgs, cfg):
    """Each sampled token's logprob under the model's own routing (temperature only), summed over the batch's mask."""
    b = train.collate(msgs, "cpu")
    return train.token_logp(model, b | {"routing": None}, cfg, filtered=False)[1], b["loss_mask"][:, 1:]


def test_a_teacher_of_another_depth_and_a_kl_reference_route_by_themselves():
    model, msgs = tiny_setup()
    c = model.config
    deeper = Transformer(ModelConfig(**{**c.__dict__, "num_hidden_layers": 3})).init_weights(5, std=0.2)
    other = Transformer(c).init_weights(6, std=0.2)  # same shape: the student's routing would fit it
    for frozen, args in ((deeper, ["--advantage=opd", "--teacher=t"]), (other, ["--advantage=opd", "--teacher=t"]),
                         (other, ["--kl_coef=0.1", "--kl_estimator=k1"])):
        model, msgs = tiny_setup()
        cfg = config.load(["--max_staleness=0", "--micro_batch_tokens=100000", *args])
        with torch.no_grad():
            old = train.token_logp(model, train.collate(msgs, "cpu"), cfg)[1]  # the student replays its routing
            theirs, mask = own_logp(frozen, msgs, cfg)
            replayed = train.token_logp(frozen, train.collate(msgs, "cpu"), cfg, filtered=False)[1] \
                if frozen is other else None
        share = train.make_shares(msgs, [0.0] * len(msgs), 1, cfg)[0]
        opd = cfg.advantage == "opd"
        vec = train.train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), share, cfg, 0, 1,
                               ref=None if opd else frozen, teacher=frozen if opd else None)[0]
        sums = train.reduce_metrics(vec, 1)[0]
        got = sums["distill_gap"] if opd else -sums["kl"]  # k1 = logp - ref_logp: -kl sums ref - old
        want = ((old - theirs) * mask).sum().item() if opd else ((theirs - old) * mask).sum().item()
        assert abs(got - want) < 1e-3, (args, got, want)
        if replayed is not None:  # the test can tell: replaying the student's experts changes the frozen model's logp
            assert ((replayed - theirs).abs() * mask).max() > 1e-2


# ---- 8. a chat episode's segments count once in its group's baseline ----

@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_an_episode_in_three_segments_weighs_once_in_its_group(name):
    # a group of 4 episodes, rewards 1, 1, 0, 0; episode 0 re-rendered into 3 segments (messages with its index)
    episodes = [(0, 1.0), (0, 1.0), (0, 1.0), (1, 1.0), (2, 0.0), (3, 0.0)]
    msgs = [{"index": i, "reward": r, "group": 0} for i, r in episodes]
    cfg = config.load([f"--advantage={name}"])
    adv = train.advantages(cfg, msgs).tolist()
    alone = estimators.ADVANTAGES[name](rewards=torch.tensor([1.0, 1.0, 0.0, 0.0]), group_ids=torch.zeros(4))
    expected = [alone[i].item() for i, _ in episodes]  # each segment gets its episode's advantage
    assert adv == pytest.approx(expected, abs=1e-6)
    if name == "grpo":
        assert adv[0] == pytest.approx(0.866, abs=1e-3)  # counting segments as episodes gave 0.65 / -1.29


def test_an_episode_in_three_segments_counts_once_in_the_logged_means():
    """reward/mean and episode/* are means over episodes: the 3 segments of episode 0 (each a message that carries
    the episode's reward and info) count once, as in the baseline above."""
    episodes = [(0, 1.0), (0, 1.0), (0, 1.0), (1, 1.0), (2, 0.0), (3, 0.0)]
    msgs = [{"index": i, "reward": r, "group": 0, "info": {"turns": 3.0 if i == 0 else 1.0}, "versions": torch.tensor([-1, 0]),
             "loss_mask": torch.tensor([0, 1])} for i, r in episodes]
    sums = dict.fromkeys(train.LOSS_KEYS + train.CONSISTENCY_KEYS, 1.0)
    stats = dict.fromkeys(rollout.COUNTS, 0)
    m = train.step_metrics(1, msgs, sums, [], [1.0], {"train": 1.0}, dict.fromkeys(
        ("skipped_steps", "dropped_stale", "filtered_groups"), 0), stats, 0.0)
    assert m["reward/mean"] == 0.5  # per segment: 4/6
    assert m["episode/turns"] == 1.5  # per segment: 12/6
    assert m["reward/std"] == pytest.approx(torch.tensor([1.0, 1.0, 0.0, 0.0]).std().item())


# ---- 11. --overwrite removes the rollout dumps too ----

def test_overwrite_removes_an_earlier_runs_rollout_dumps(tmp_path):
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / "step_9.pt").write_text("an earlier run's batch")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    train.check_out_dir(config.load([f"--out_dir={tmp_path}", "--overwrite"]))
    assert sorted(os.listdir(tmp_path)) == []  # a later --replay of rollouts/ would have mixed in step_9.pt


# ---- 12. a complete checkpoint is findable at every instant of a save; --resume without one is an error ----

class Killed(BaseException):
    """A kill -9 between two filesystem operations (BaseException: no `except OSError` in the save catches it)."""


@pytest.mark.parametrize("layout", ["ckpt", "ckpt.old"])  # ckpt.old alone: a run resumed after a kill mid-swap
def test_a_kill_at_any_operation_of_a_save_leaves_a_complete_checkpoint(tmp_path, tok, monkeypatch, layout):
    model, _ = tiny_setup()
    opt = torch.optim.AdamW(model.parameters())
    out, cfg = tmp_path / "out", types.SimpleNamespace(out_dir=str(tmp_path / "out"))
    train.save_checkpoint(cfg, model, opt, {"step": 1}, tok.name_or_path, 0, False)
    os.replace(out / "ckpt", out / layout)
    shutil.copytree(out, tmp_path / "before")
    real = {"replace": os.replace, "rmtree": shutil.rmtree}
    for n in range(100):  # kill at the n-th rename or removal; a removal killed midway has deleted the weights
        shutil.rmtree(out)
        shutil.copytree(tmp_path / "before", out)
        calls = []

        def op(name):
            def run(path, *args, **kw):
                calls.append(name)
                if len(calls) > n:
                    if name == "rmtree" and os.path.isfile(os.path.join(path, "model.safetensors")):
                        os.remove(os.path.join(path, "model.safetensors"))
                    raise Killed
                return real[name](path, *args, **kw)
            return run
        monkeypatch.setattr(os, "replace", op("replace"))
        monkeypatch.setattr(shutil, "rmtree", op("rmtree"))
        try:
            train.save_checkpoint(cfg, model, opt, {"step": 2}, tok.name_or_path, 0, False)
            killed = False
        except Killed:
            killed = True
        monkeypatch.undo()
        found = train.latest_checkpoint(cfg)
        assert found is not None, (n, calls, os.listdir(out))
        state = torch.load(os.path.join(found, "trainer.pt"), weights_only=False)
        Transformer.from_pretrained(found)  # complete: the weights load
        assert state["step"] in (1, 2)
        if not killed:  # n passed the save's last operation
            assert state["step"] == 2 and n > 2
            break


def test_resume_without_a_checkpoint_is_an_error_that_keeps_the_metrics(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    r = run_train(tmp_path, "--max_steps=1", "--resume", timeout=120)
    assert r.returncode != 0 and "no checkpoint" in r.stderr, r.stderr[-2000:]
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU cpu_offload runs: tests/test_gpu.py")
def test_cpu_offload_without_a_gpu_is_a_clear_error(tmp_path):
    r = run_train(tmp_path, "--max_steps=1", "--cpu_offload", timeout=120)
    assert r.returncode != 0 and "cpu_offload=True" in r.stderr and "GPU" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "metrics.jsonl").exists()


# ---- 13. SIGTERM is honoured in every wait; groups filtered without end are an error ----

SOLVED_AGENT = """
from agent import load_agent

guess = load_agent("guess")
async def run(task, llm):
    ep = await guess(task, llm)
    ep.reward = 1.0  # every group all-equal: filter_groups drops each one
    return ep
"""

SLOW_AGENT = """
import asyncio
from agent import load_agent

guess = load_agent("guess")
async def run(task, llm):
    await asyncio.sleep(1000)
"""


def start(tmp_path, agent, *args):
    (tmp_path / "agent.py").write_text(agent)
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "guess.py"),
           f"--out_dir={tmp_path / 'run'}", f"--task={tmp_path / 'agent.py'}", *args]
    return subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# many small groups in flight: the next filtered one always comes within a second
@pytest.mark.parametrize("agent,args", [
    (SOLVED_AGENT, ["--filter_groups", "--max_filtered_groups=100000000", "--group_size=2", "--max_staleness=3"]),
    (SLOW_AGENT, ["--deterministic", "--episode_timeout=1000", "--prompts_per_step=2"])], ids=["filter", "settle"])
def test_sigterm_ends_a_wait_on_groups_all_filtered_or_a_deterministic_settle(tmp_path, agent, args):
    p = start(tmp_path, agent, *args)
    try:
        time.sleep(15)  # started, filtering group after group (or settling on episodes that take 1000 s)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()  # (the rollout process dies with it)
    assert p.returncode == 0 and "SIGTERM: checkpoint of step 0" in out, err[-2000:]


def test_groups_filtered_for_long_end_the_run_with_a_clear_error(tmp_path):
    p = start(tmp_path, SOLVED_AGENT, "--filter_groups", "--max_filtered_groups=5", "--prompts_per_step=2")
    try:
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode != 0 and "5 groups in a row filtered out" in err, err[-2000:]


# ---- 11. a SIGTERM mid-step: the checkpoint's counters are those of the state it resumes from ----

KILL_AGENT = """
import asyncio, os, signal
from agent import load_agent

guess = load_agent("guess")
async def run(task, llm):
    ep = await guess(task, llm)
    group = task["index"] // 2
    ep.reward = 0.0 if group in (4, 5) else float(task["index"] % 2)  # step 3 drops groups 4, 5, then trains 6, 7
    if task["index"] == 12 and not os.path.exists({marker!r}):  # SIGTERM while step 3 waits for group 6
        open({marker!r}, "w").close()
        await asyncio.sleep(0.5)
        os.kill(os.getppid(), signal.SIGTERM)  # the rollout process's parent: the trainer
        await asyncio.sleep(2)
    return ep
"""


def test_a_sigterm_after_filtered_groups_does_not_count_them_twice_on_resume(tmp_path):
    (tmp_path / "agent.py").write_text(KILL_AGENT.format(marker=str(tmp_path / "killed")))
    args = [f"--task={tmp_path / 'agent.py'}", "--group_size=2", "--prompts_per_step=2", "--max_staleness=0",
            "--deterministic", "--filter_groups", "--max_steps=4"]
    first = run_train(tmp_path / "run", *args, timeout=300)
    assert first.returncode == 0 and "SIGTERM: checkpoint of step 2" in first.stdout, first.stderr[-3000:]
    second = run_train(tmp_path / "run", *args, "--resume", timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    ms = metrics(tmp_path / "run")
    assert [m["step"] for m in ms] == [1, 2, 3, 4]
    assert [m["rollout/filtered_groups"] for m in ms] == [0, 0, 2, 2]  # groups 4 and 5, once each


# ---- a rollout process that dies in any wait of the trainer's: a checkpoint, then the error ----

DIE_AGENT = """
import os, signal
from agent import load_agent

guess = load_agent("guess")
async def run(task, llm):
    if task["index"] {when}:
        os.kill(os.getpid(), signal.SIGKILL)  # the rollout process: the agent runs in it
    return await guess(task, llm)
"""


@pytest.mark.parametrize("when,args,step", [
    ("< 0", ["--eval_every=1", "--eval_prompts=2", "--eval_samples=2"], 1),  # in the evaluation of step 1
    ("== 40", ["--deterministic"], 2)], ids=["evaluation", "deterministic-settle"])  # in a settle, after step 2
def test_a_rollout_process_that_dies_in_any_wait_leaves_a_checkpoint(tmp_path, when, args, step):
    p = start(tmp_path, DIE_AGENT.format(when=when), "--prompts_per_step=2", "--max_steps=5", "--ckpt_every=0", *args)
    try:
        _, err = p.communicate(timeout=300)
    finally:
        p.kill()
    assert p.returncode != 0 and "rollout process died" in err, err[-3000:]
    saved = torch.load(tmp_path / "run" / "ckpt" / "trainer.pt", weights_only=False)
    lines = metrics(tmp_path / "run")
    # the steps trained before the death was seen (groups already queued may train one more), each logged
    assert saved["step"] == len(lines) >= step and [m["step"] for m in lines] == list(range(1, len(lines) + 1))


def test_cpu_threads_divide_the_node_among_its_own_ranks(monkeypatch):
    """Two nodes of 8 ranks on 64 cores: each rank's share is of its node (8 ranks and the rollout process), not of
    the 16 ranks of the whole run."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert train.cpu_threads(config.load([])) == 64 // 9
    assert train.cpu_threads(config.load(["--cpu_threads=3"])) == 3
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # python train.py: one rank and the rollout process
    assert train.cpu_threads(config.load([])) == 32
