"""Evaluation on held-out prompts: its task stream, exact versions, metrics and dump, a training stream it leaves
unchanged, eval_only; the Logger's W&B stream, read back from an offline run."""
import asyncio
import glob
import json
import os
import queue
import subprocess
import sys
import time

import pytest
import torch
from test_rollout import Counter, drive, engine_for
from test_train import ENV, ROOT, metrics, run_train

import agent
import config
import engine
import rollout
import train


def test_held_out_prompts_come_from_random_streams_training_never_draws(tmp_path):
    """make_task seeds a group's draws with seed * 1_000_003 + group; evaluation's groups are -1, -2, ...: its
    prompts' streams (the 32-bit `seed` each task draws last tells them apart) are none of training's."""
    cfg = config.load(["--task=calc", "--eval_prompts=50", "--eval_samples=3", "--group_size=4"])
    held_out = rollout.eval_tasks(cfg)
    assert [t["group"] for t in held_out] == [-1 - j // 3 for j in range(150)]  # eval_samples episodes a prompt
    knobs = {k: getattr(cfg, k) for k in rollout.KNOBS}
    trained = {agent.make_task("calc", g * cfg.group_size, **knobs)["seed"] for g in range(20_000)}
    streams = {t["seed"] for t in held_out}
    assert len(streams) == 50 and not streams & trained
    # a data set: the eval_file's rows are the held-out prompts; task_file's alone would be trained on
    (tmp_path / "train.jsonl").write_text('{"a": 1, "b": 1, "c": 1}\n')
    (tmp_path / "eval.jsonl").write_text("".join(f'{{"a": {a}, "b": 2, "c": 3}}\n' for a in (5, 6, 7)))
    with pytest.raises(ValueError, match="eval_file"):
        config.load([f"--task_file={tmp_path / 'train.jsonl'}", "--eval_every=5"])
    cfg = config.load([f"--task_file={tmp_path / 'train.jsonl'}", f"--eval_file={tmp_path / 'eval.jsonl'}",
                       "--eval_every=5", "--eval_prompts=3", "--eval_samples=2"])
    assert sorted({t["a"] for t in rollout.eval_tasks(cfg)}) == [5, 6, 7]


def evaluate(cfg, engine, tok, version=0, out=None):
    """The rollout's producer (training agents running too) asked for an evaluation of `version` -> its metrics;
    `out`: the trainer's queue, which the groups of training go to."""
    out = queue.Queue() if out is None else out
    evals = (Counter(version), queue.Queue())

    async def main():
        prod = asyncio.create_task(rollout.produce(cfg, engine, tok, out, Counter(), 0, len(tok), evals=evals))
        deadline = time.monotonic() + 120
        while evals[1].empty():
            assert time.monotonic() < deadline, "no evaluation after 120 s"
            if prod.done():
                prod.result()  # the producer's error
            await asyncio.sleep(0.01)
        prod.cancel()
        return evals[1].get()
    return drive(engine, main)


def dump(out_dir, step):
    return [json.loads(line) for line in open(os.path.join(out_dir, "eval", f"step_{step}.jsonl"))]


def test_greedy_evaluation_of_a_token_agent_dumps_and_scores_every_episode(tok, tmp_path):
    cfg = config.load(["--task=guess", f"--out_dir={tmp_path}", "--max_turns=2", "--group_size=2", "--eval_prompts=6",
                       "--eval_samples=3", "--eval_temperature=0", "--eval_max_new_tokens=2"])
    m = evaluate(cfg, engine_for(tok), tok)
    rows = dump(tmp_path, 0)
    assert len(rows) == m["eval/episodes"] == 18 and m["eval/failed"] == 0
    assert [r["prompt"] for r in rows] == [j // 3 for j in range(18)]
    for p in range(6):  # greedy: a prompt's episodes are one and the same (the run's temperature 1 would vary them)
        assert len({r["text"] for r in rows if r["prompt"] == p}) == 1
    rewards = torch.tensor([r["reward"] for r in rows])
    assert m["eval/pass@1"] == pytest.approx(rewards.mean().item()) == m["eval/mean@3"] == m["eval/pass@3"]
    assert 2 <= m["eval/response_tokens"] <= 2 * 2  # eval_max_new_tokens per turn, not the engine's 6
    assert all(r["text"].startswith("<|im_start|>user\nGuess my number") for r in rows)


def test_an_evaluation_of_a_version_the_engine_does_not_hold_is_refused(tok, tmp_path):
    """Every evaluation token must come from the weights evaluated: asked for version 1, the engine samples with 0."""
    cfg = config.load(["--task=arith", f"--out_dir={tmp_path}", "--eval_prompts=2", "--eval_samples=2"])
    with pytest.raises(AssertionError, match="other weights sampled"):
        evaluate(cfg, engine_for(tok), tok, version=1)


def test_a_chat_agent_evaluates_through_the_endpoint(tok, tmp_path):
    cfg = config.load(["--task=calc", f"--out_dir={tmp_path}", "--max_turns=2", "--group_size=2", "--eval_prompts=2",
                       "--eval_samples=2", "--eval_temperature=0.7"])
    small = engine_for(tok)  # its max_len (256) is less than the prompt with its tool (274 tokens)
    m = evaluate(cfg, engine.TorchEngine(small.model, slots=16, max_len=512, max_new_tokens=6, seed=0,
                                          stop_ids=sorted(small.stop_ids)), tok)
    rows = dump(tmp_path, 0)
    assert m["eval/episodes"] == 4 and {r["index"] for r in rows} == {-1, -2, -3, -4}  # each episode dumped
    assert m["eval/failed"] == sum("error" in r for r in rows) < 4
    assert all("What is" in r["text"] for r in rows if "text" in r)  # the chat template's rendering of the prompt


AGENTS = os.path.join(ROOT, "tests", "agents")


@pytest.mark.parametrize("limit", [2, 8])
def test_an_evaluation_keeps_the_limit_a_chat_agent_sets(tok, tmp_path, limit):
    """A chat agent passes max_tokens (2, below the evaluation's eval_max_new_tokens=4; 8, above it): the evaluation
    runs, and the agent's own limit wins over the evaluation's default, as over max_new_tokens in training."""
    source = open(os.path.join(AGENTS, "chat_limit.py")).read()
    (tmp_path / "chat_limit.py").write_text(source.replace("max_tokens=2", f"max_tokens={limit}"))
    cfg = config.load([f"--task={tmp_path}/chat_limit.py", f"--out_dir={tmp_path}", "--group_size=2",
                       "--eval_prompts=3", "--eval_samples=2", "--eval_max_new_tokens=4"])
    m = evaluate(cfg, engine_for(tok), tok)
    rows = dump(tmp_path, 0)
    assert m["eval/episodes"] == 6 and m["eval/failed"] == 0, rows
    assert max(r["info"]["completion_tokens"] for r in rows) == limit  # (a random policy rarely stops earlier)
    assert 1 <= m["eval/response_tokens"] <= limit
    assert m["eval/pass@1"] == pytest.approx(sum(r["reward"] for r in rows) / 6)


def test_an_evaluation_keeps_the_limit_a_token_agent_sets(tok, tmp_path):
    cfg = config.load([f"--task={AGENTS}/token_limit.py", f"--out_dir={tmp_path}", "--group_size=2",
                       "--eval_prompts=3", "--eval_samples=2", "--eval_max_new_tokens=4"])
    m = evaluate(cfg, engine_for(tok), tok)
    rows = dump(tmp_path, 0)
    assert m["eval/episodes"] == 6 and m["eval/failed"] == 0, rows
    assert [r["info"]["sampled"] for r in rows] == [1.0] * 6 and m["eval/response_tokens"] == 1


def test_a_failed_evaluation_episode_never_passes(tok, tmp_path):
    """eval_pass_reward <= 0 would let a failed episode's 0 pass: a failed episode never passes."""
    cfg = config.load([f"--task={AGENTS}/always_fails.py", f"--out_dir={tmp_path}", "--group_size=2",
                       "--eval_prompts=2", "--eval_samples=2", "--eval_pass_reward=0", "--max_failed_groups=1000"])
    m = evaluate(cfg, engine_for(tok), tok)
    assert m["eval/failed"] == m["eval/episodes"] == 4
    assert m["eval/pass@1"] == m["eval/pass@2"] == 0.0


def test_an_evaluation_episode_never_reaches_the_trainers_queue(tok, tmp_path):
    """Evaluation runs in the rollout beside training's agents: its episodes go to its dump and metrics, never to the
    queue the trainer takes batches from (where training's groups do go meanwhile)."""
    cfg = config.load(["--task=arith", f"--out_dir={tmp_path}", "--group_size=2", "--eval_prompts=4",
                       "--eval_samples=2"])
    out = queue.Queue()
    m = evaluate(cfg, engine_for(tok), tok, out=out)
    assert m["eval/episodes"] == 8 and m["eval/failed"] == 0
    items = [out.get() for _ in range(out.qsize())]
    indices = [msg["index"] for item in items for msg in rollout.unpack(item)]
    assert indices and min(indices) >= 0, indices  # training's episodes only


def test_the_trainer_refuses_an_evaluation_episode():
    class Ro:  # a rollout whose queue (wrongly) holds an evaluation episode
        died = None

        def get(self, stop=None):
            return [{"index": -3, "reward": 0.0}]
    cfg = config.load(["--prompts_per_step=1"])
    with pytest.raises(AssertionError, match="evaluation episode -3 reached the trainer"):
        train.take_batch(cfg, Ro(), 0, {"dropped_stale": 0, "filtered_groups": 0})


EVAL = ["--eval_every=2", "--eval_at_start", "--eval_prompts=4", "--eval_samples=2"]


@pytest.mark.slow
def test_evaluation_leaves_the_training_stream_unchanged_and_eval_only_repeats_it(tmp_path):
    """deterministic: a run with evaluations trains on exactly the episodes of one without; its eval/ metrics are on
    the lines of the steps they evaluate; eval_only on its checkpoint evaluates the same weights to the same result."""
    args = ["--max_staleness=1", "--deterministic", "--rollout_dump", "--dump_every=0", "--max_steps=4"]
    for name, extra in (("plain", []), ("eval", EVAL)):
        r = run_train(tmp_path / name, *args, *extra)
        assert r.returncode == 0, r.stderr[-3000:]
    for step in range(1, 5):
        a, b = (torch.load(tmp_path / name / "rollouts" / f"step_{step}.pt", weights_only=False)
                for name in ("plain", "eval"))
        assert [m["index"] for m in a] == [m["index"] for m in b] and min(m["index"] for m in b) >= 0
        assert all(torch.equal(x["ids"], y["ids"]) and x["reward"] == y["reward"] for x, y in zip(a, b))
    plain, ev = metrics(tmp_path / "plain"), metrics(tmp_path / "eval")
    assert [m["step"] for m in ev] == [0, 1, 2, 3, 4] and [m["step"] for m in plain] == [1, 2, 3, 4]
    assert [m["step"] for m in ev if "eval/pass@1" in m] == [0, 2, 4]
    assert [m["reward/mean"] for m in ev[1:]] == [m["reward/mean"] for m in plain]
    for step in (0, 2, 4):
        rows = dump(tmp_path / "eval", step)
        assert len(rows) == 8 and all(r["step"] == step and "text" in r for r in rows)
    r = run_train(tmp_path / "eval", "--eval_only", "--eval_prompts=4", "--eval_samples=2")
    assert r.returncode == 0, r.stderr[-3000:]
    again = [json.loads(line) for line in open(tmp_path / "eval" / "eval" / "metrics.jsonl")]
    assert [m["step"] for m in again] == [4] and metrics(tmp_path / "eval") == ev  # the run's record untouched
    assert again[0]["eval/pass@1"] == ev[-1]["eval/pass@1"] and again[0]["eval/mean@2"] == ev[-1]["eval/mean@2"]


def wandb_records(path):
    """The records of a .wandb file: W&B's LevelDB-style log (a 7-byte file header, then 32 KiB blocks of chunks,
    each a 7-byte header: crc, length, type; FULL = 1 and LAST = 4 end a record), each a protobuf Record."""
    from wandb.proto import wandb_internal_pb2 as pb
    data, pos, buf, out = open(path, "rb").read(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        n, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        buf, pos = buf + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            out.append(pb.Record.FromString(buf))
            buf = b""
    return out


@pytest.mark.slow
def test_wandb_offline_run_holds_the_metrics_lines_and_a_resumed_run_continues_it(tmp_path):
    pytest.importorskip("wandb", reason="wandb is in requirements.txt")
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "guess.py"),
           f"--out_dir={out}", "--prompts_per_step=2", "--ckpt_every=1", "--wandb_project=nanomolt-test",
           "--wandb_run=offline-test", "--eval_every=2", "--eval_prompts=2", "--eval_samples=2"]
    env = ENV | {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    for extra in (["--max_steps=2"], ["--max_steps=3", "--resume"]):
        r = subprocess.run(cmd + extra, env=env, cwd=ROOT, timeout=600, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
    files = sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2 and len({os.path.basename(f) for f in files}) == 1  # two processes, one run id
    history, runs = {}, []
    for f in files:
        for rec in wandb_records(f):
            if rec.WhichOneof("record_type") == "history":
                item = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                history[item["_step"]] = item
            elif rec.WhichOneof("record_type") == "run":
                runs.append(rec.run)
    assert [r.display_name for r in runs] == ["offline-test"] * 2
    assert all(json.loads({u.key: u.value_json for u in r.config.update}["lr"]) == 5e-4 for r in runs)
    lines = metrics(out)
    assert [m["step"] for m in lines] == sorted(history) == [1, 2, 3] and "eval/pass@1" in history[2]
    for m in lines:  # the same dict as each metrics line
        for k, v in m.items():
            assert history[m["step"]][k] == pytest.approx(v), k


def test_a_wandb_run_resumed_after_a_crash_rewinds_to_the_checkpoint_and_logs_the_steps_again(tmp_path):
    """A crash after step 3 with the checkpoint at 2: the resumed run trains 3 and 4 again. W&B drops steps below a
    run's latest, so the resumed process rewinds the run to the checkpoint's step (resume_from) and logs 3, 4 anew."""
    pytest.importorskip("wandb", reason="wandb is in requirements.txt")
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "guess.py"),
           f"--out_dir={out}", "--prompts_per_step=2", "--ckpt_every=2", "--wandb_project=nanomolt-test",
           "--eval_every=2", "--eval_prompts=2", "--eval_samples=2"]
    env = ENV | {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    p = subprocess.Popen(cmd + ["--max_steps=100"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").exists() or len(metrics(out)) < 3:
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.05)
    finally:
        os.killpg(p.pid, 9)  # the trainer, its rollout process and W&B's service: a crash
        p.wait()
    r = subprocess.run(cmd + ["--max_steps=4", "--resume"], env=env, cwd=ROOT, timeout=600, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    files = sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb")), key=os.path.getmtime)
    assert len({os.path.basename(f) for f in files}) == 1  # one run id
    records = wandb_records(files[-1])  # the resumed process's
    run = next(rec.run for rec in records if rec.WhichOneof("record_type") == "run")
    assert (run.branch_point.run, run.branch_point.metric, run.branch_point.value) == (run.run_id, "_step", 2)
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
               for rec in records if rec.WhichOneof("record_type") == "history"]
    steps = [h["step"] for h in history]
    assert all(h["_step"] == h["step"] for h in history if "_step" in h)
    assert steps == [m["step"] for m in metrics(out)][2:] == [3, 4]  # eval/ of step 4 on its line


@pytest.mark.parametrize("k", [1, 4])
def test_the_console_line_names_each_pass_at_k_once(tmp_path, capsys, k):
    """An evaluation's console line: pass@1, and pass@k beside it only when k > 1 (eval_samples=1: pass@1 once)."""
    cfg = config.load([f"--out_dir={tmp_path}", f"--eval_samples={k}"])
    log = train.Logger(cfg, 0, {}).log
    log({"step": 1, "reward/mean": 0.5, "loss/policy": 0.1, "staleness/mean": 0.0, "staleness/max": 0, "time/step": 1.0,
         "time/wait_rollout": 0.0})
    assert "reward 0.500" in capsys.readouterr().out
    log({"step": 1, "eval/pass@1": 0.25, f"eval/pass@{k}": 0.5 if k > 1 else 0.25})
    line = capsys.readouterr().out
    assert line.count("pass@1 0.250") == 1 and ("pass@4 0.500" in line) == (k == 4), line


AGENT_FILES = ["guess", "calc", "arith", "count", *(os.path.join("tests", "agents", f) for f in (
    "count_chat.py", "process_agent.py", "token_limit.py", "chat_limit.py"))]


@pytest.mark.slow
@pytest.mark.parametrize("task", AGENT_FILES)
def test_every_built_in_task_and_test_agent_trains_and_evaluates_under_the_default_recipe(tmp_path, task):
    """Each agent (token level, chat level, a process, images; with or without its own limits) through a training step
    and the held-out evaluation that the default recipe runs every eval_every steps."""
    vision = ["--tiny_vision"] if "count" in task else []
    r = run_train(tmp_path, f"--task={task}", "--max_steps=2", "--eval_every=1", "--eval_prompts=2",
                  "--eval_samples=2", "--prompts_per_step=2", "--group_size=2", "--engine_max_len=512", *vision)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = metrics(tmp_path)
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["eval/episodes"] == 4 and m["eval/failed"] == 0 and m["eval/response_tokens"] >= 1, m
        assert m["tokens/trained"] > 0 and m["rollout/agent_errors"] == m["rollout/malformed"] == 0
