"""A verifiers (0.4.0) environment trained unchanged (agents/verifiers_env.py): one worker program under
.venv-verifiers per rollout process runs verifiers' own rollouts (its `null` chat harness, its MCP tool server) and
rubric against each episode's endpoint. Nothing of verifiers is mocked: the rewards are checked against its rubric
called directly. Needs the venv: `bash tests/install_verifiers.sh`, which CI runs in its background install."""
import asyncio
import json
import os
import signal
import subprocess

import pytest
from test_endpoint import SAMPLING, ScriptEngine
from test_train import ROOT, metrics, run_train

import agent
import endpoint
from agent import Completion
from rollout import Policy, check_tokens

VENV_PYTHON = os.path.join(ROOT, ".venv-verifiers", "bin", "python")
STARTED = "[verifiers worker] pid"  # the line the worker writes to stderr once, when it is ready


@pytest.fixture(autouse=True)
def verifiers_venv(servers_installed):
    if not os.path.exists(VENV_PYTHON):
        pytest.skip(".venv-verifiers is absent: run `bash tests/install_verifiers.sh` (CI installs it in the "
                    "background install of --install-servers)")


# verifiers' own scoring of a reply: the taskset's task at that row, Task.score over a Trace whose last reply it is
RUBRIC = """
import asyncio, json, sys
import verifiers.v1 as vf
from verifiers.v1.trace import AgentInfo
from verifiers.v1.utils.loaders import load_taskset

async def main():
    scores = []
    for env, config, row, reply in json.load(sys.stdin):
        tasks = list(load_taskset(vf.SingleAgentEnvConfig(taskset={"id": env, **config}).taskset))
        task = tasks[row % len(tasks)]
        trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data),
                         agent=AgentInfo(config=vf.AgentConfig(model="m")), root_reply=reply)
        await task.score(trace)
        scores.append({"reward": trace.reward, "prompt": task.data.prompt_text})
    print(json.dumps(scores))

asyncio.run(main())
"""


def rubric(items):
    """[(env, config, row, reply)] -> [{"reward", "prompt"}], computed by verifiers in its venv."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "agents", "vf_envs"))
    r = subprocess.run([VENV_PYTHON, "-c", RUBRIC], input=json.dumps(items), env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def reply_of(row, tok):
    """The text the endpoint answered with: the sampled ids decoded, less the stop token it ended on."""
    ids = [i for i, m in zip(row["ids"], row["mask"]) if m]
    if ids and ids[-1] == tok.eos_token_id:
        ids = ids[:-1]
    return tok.decode(ids)


@pytest.mark.slow
def test_a_short_run_trains_on_the_rubrics_rewards_with_one_worker(tmp_path, tok):
    """train.py on vf_arith, with held-out evaluation on its test split: nothing fails, the one worker serves both,
    and every dumped episode's reward is what verifiers' rubric gives its reply, for the task of its group."""
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(json.dumps({"vf_env": "vf_arith", "vf_config": {"split": "test"}}) + "\n")
    out = tmp_path / "run"
    r = run_train(out, "--task=verifiers_env", "--max_steps=2", "--prompts_per_step=2", "--group_size=2",
                  "--max_new_tokens=8", "--engine_max_len=512", "--eval_every=1", "--eval_prompts=2",
                  "--eval_samples=2", f"--eval_file={held_out}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count(STARTED) == 1, r.stderr[-3000:]  # one worker for the rollout process, not one an episode
    lines = metrics(out)
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["rollout/agent_errors"] == m["rollout/malformed"] == m["rollout/agent_timeouts"] == 0, m
        assert m["tokens/trained"] > 0 and m["eval/failed"] == 0 and m["eval/episodes"] == 4, m
        assert m["episode/reward_correct"] == pytest.approx(m["reward/mean"]) and m["episode/turns"] == 1, m
    trained = [json.loads(line) for line in open(out / "episodes.jsonl")]
    evaluated = [json.loads(line) for step in (1, 2) for line in open(out / "eval" / f"step_{step}.jsonl")]
    assert len(trained) == 4 and len(evaluated) == 8
    asked = [("vf_arith", {}, row["group"], reply_of(row, tok)) for row in trained]
    asked += [("vf_arith", {"split": "test"}, row["prompt"], reply_of(row, tok)) for row in evaluated]
    for row, score in zip(trained + evaluated, rubric(asked)):
        assert row["reward"] == score["reward"] == row["info"]["reward_correct"], (row["text"], score)
        assert f"user\n{score['prompt']}<|im_end|>" in row["text"]  # the task of its group, from its split


def serve_episodes(tok, cases, check=None):
    """Each (task, engine) as an episode of the agent, all at once through one endpoint, in one event loop; then
    check(state), the agent's worker state, in the same loop -> ([(llm, the result or the error)], check's result)."""
    async def main():
        server = await endpoint.serve(tok, SAMPLING, [tok.eos_token_id])
        run = agent.load_agent("verifiers_env")
        llms = [endpoint.attach(server, Policy(engine, tok)) for _, engine in cases]
        results = await asyncio.gather(*(run(task, llm) for (task, _), llm in zip(cases, llms)),
                                       return_exceptions=True)
        checked = await check(run.__globals__["STATE"], server) if check else None
        await server["runner"].cleanup()
        return list(zip(llms, results)), checked
    return asyncio.run(main())


def tool_call(a, b):  # the model calls the taskset's tool, as the chat template writes a call
    return '<tool_call>\n{"name": "calc_multiply", "arguments": ' + json.dumps({"a": a, "b": b}) + '}\n</tool_call>'


def test_the_tool_env_is_multi_turn_and_both_envs_share_one_worker(tok, capfd):
    """Scripted replies, scored by the tasksets' rubrics: vf_calc's tool is called through verifiers' MCP server and
    its result read back in a second turn, token-exactly; vf_arith's rows by group, held-out rows by prompt."""
    end = "<|im_end|>"
    cases = [({"group": 0, "vf_env": "vf_calc"}, [tool_call(3, 4) + end, "3*4 is 12, so 17." + end], 1.0, 2),
             ({"group": 0, "vf_env": "vf_calc"}, [tool_call(3, 4) + end, "18" + end], 0.0, 2),
             ({"group": 1}, ["2+7 is 9" + end], 1.0, 1),  # vf_arith's train row 1: 2+7
             ({"group": 9}, ["2+7 is 10" + end], 0.0, 1),  # row 9 % 8: 2+7 again
             ({"group": -2, "vf_config": {"split": "test"}}, ["11" + end], 1.0, 1)]  # held-out prompt 1: 6+5
    episodes, _ = serve_episodes(tok, [(task, ScriptEngine(tok, replies)) for task, replies, _, _ in cases])
    for (task, _, reward, turns), (llm, result) in zip(cases, episodes):
        assert result == {"reward": reward, "info": {"turns": turns, "reward_correct": reward}}, (task, result)
        [(ep, calls)] = endpoint.segments(llm, result)
        check_tokens(ep, calls)
        if task.get("vf_env") == "vf_calc":
            assert ep.info["tool_calls"] == 1 and len(calls) == 2
            assert "<tool_response>\n12\n</tool_response>" in tok.decode(ep.ids)  # what verifiers' tool returned
    assert capfd.readouterr().err.count(STARTED) == 1  # five episodes, two environments, one worker


class Blocked:
    """An engine that answers only once released: its episode waits on the model until it is cancelled or its worker
    dies. (Released at the end: the endpoint's cleanup waits for the requests it still answers.)"""

    def __init__(self, tok, release):
        self.tok = tok
        self.release = release  # an asyncio.Event
        self.called = asyncio.Event()

    async def generate(self, ids, max_new_tokens=None, **kw):
        self.called.set()
        await self.release.wait()
        return Completion([self.tok.eos_token_id], [-1.0], [0], None)


def children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return f.read().split()


async def until(condition, timeout=30.0):
    for _ in range(int(timeout / 0.1)):
        if condition():
            return
        await asyncio.sleep(0.1)
    raise AssertionError("timed out")


def test_a_cancelled_episode_leaves_the_worker_serving_and_a_dead_worker_fails_its_episodes(tok):
    """An episode timed out while verifiers waits on the model; then the worker killed while it does."""
    release = asyncio.Event()

    async def blocked_episode(run, server):
        engine = Blocked(tok, release)
        llm = endpoint.attach(server, Policy(engine, tok))
        episode = asyncio.ensure_future(run({"group": 0}, llm))
        await asyncio.wait_for(engine.called.wait(), 60)  # the model's program asked for its reply
        return llm, episode

    async def check(state, server):
        run = agent.load_agent("verifiers_env")
        # the episode timed out: the rollout closes its policy and cancels the agent, which cancels the rollout in
        # the worker: its chat program is ended, and the worker serves the next episode
        llm, episode = await blocked_episode(run, server)
        pid = (await state["start"])["proc"].pid
        assert children(pid)  # the chat program
        llm.closed = True
        episode.cancel()
        await asyncio.gather(episode, return_exceptions=True)
        await until(lambda: not children(pid))
        again = endpoint.attach(server, Policy(ScriptEngine(tok, ["7<|im_end|>"]), tok))
        assert (await run({"group": 0}, again))["reward"] == 1.0
        assert (await state["start"])["proc"].pid == pid
        # the worker dies: its episode in flight fails (an agent error), the next episode starts a new worker
        _, episode = await blocked_episode(run, server)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="verifiers worker exited with code -9"):
            await episode
        again = endpoint.attach(server, Policy(ScriptEngine(tok, ["9<|im_end|>"]), tok))
        assert (await run({"group": 3}, again))["reward"] == 1.0
        release.set()
        return pid, (await state["start"])["proc"].pid

    _, (first, second) = serve_episodes(tok, [], check)
    assert second != first
