"""The verifiers worker: a long-lived program under .venv-verifiers/bin/python (verifiers 0.4.0 pins openai<3, this
project openai 3), started by agents/verifiers_env.py once per rollout process. It runs verifiers rollouts, several at
once, against the episode endpoints it is handed, and speaks JSON lines:

  stdin   {"id": 7, "env": "vf_arith", "config": {}, "row": 3, "base_url": ..., "api_key": ..., "model": ...}
          {"id": 7, "cancel": true}                      (the episode timed out: its rollout is cancelled)
  stdout  {"id": 7, "reward": 1.0, "rewards": {"correct": 1.0}, "turns": 1}
          {"id": 7, "error": "..."}                      (the rollout failed: the agent raises it)

`env` is a verifiers taskset id (a module exporting its Taskset: agents/vf_envs/ is on the path, or any taskset
installed in the venv), `config` its TasksetConfig knobs, `row` the task's position in its load(). Each (env, config)
is served once for the worker's life (SingleAgentEnv.serving: shared tool servers, the interception server), the
model's program is verifiers' `null` chat harness in a local subprocess. Ends when stdin closes."""
import asyncio
import contextlib
import json
import os
import sys
import time

T0 = time.perf_counter()
OUT = os.fdopen(os.dup(1), "w")  # the protocol's own stdout: whatever else prints (fd 1) goes to stderr
os.dup2(2, 1)

import verifiers.v1 as vf  # noqa: E402 (after T0 and the redirect: its import is most of the start-up)

ENVS = {}  # (env, config as JSON) -> asyncio task: (the served env, its tasks)
AGENT = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}  # the chat program, on this machine


async def serve_env(stack, name, config):
    env = vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset={"id": name, **config}, agent=AGENT))
    if not env.taskset.bounded:
        raise ValueError(f"taskset {name!r} is infinite: the worker takes a task by its row in load()")
    await stack.enter_async_context(env.serving())
    return env, list(env.taskset)


async def rollout(stack, req):
    """One episode -> its reply. The endpoint's key reaches verifiers' client through an environment variable named
    by the config (api_key_var), one per request: each episode has its own endpoint and key. (Its name holds API_KEY:
    verifiers' subprocess runtime keeps such variables from the programs it starts.)"""
    key = (req["env"], json.dumps(req.get("config", {}), sort_keys=True))
    if key not in ENVS:  # concurrent first requests share one start
        ENVS[key] = asyncio.ensure_future(serve_env(stack, req["env"], req.get("config", {})))
    env, tasks = await asyncio.shield(ENVS[key])
    key_var = f"NANOMOLT_API_KEY_{req['id']}"
    os.environ[key_var] = req["api_key"]
    client = vf.EvalClientConfig(base_url=req["base_url"], api_key_var=key_var)
    try:
        episode = await env.run_episode(tasks[req["row"] % len(tasks)], vf.ModelContext(req["model"], client))
    finally:
        os.environ.pop(key_var)
    if not episode.ok:  # the model's endpoint refused, the harness failed, a reward function raised, ...
        errors = episode.errors + [e for trace in episode.traces for e in trace.errors]
        return {"error": "; ".join(f"{e.type}: {e.message}" for e in errors) or "the episode failed"}
    [trace] = episode.traces  # one agent (SingleAgentEnv), one trace
    rewards = {name: r.value for name, r in trace.rewards.items() if r is not None}
    return {"reward": trace.reward, "rewards": rewards, "turns": trace.num_turns}


async def main():
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader(limit=2**24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    running = {}  # request id -> its asyncio task

    def reply(req, task):
        running.pop(req["id"], None)
        if task.cancelled():
            return  # the agent asked for it and waits for nothing
        err = task.exception()
        msg = {"error": f"{type(err).__name__}: {err}"} if err is not None else task.result()
        OUT.write(json.dumps({"id": req["id"], **msg}) + "\n")
        OUT.flush()

    print(f"[verifiers worker] pid {os.getpid()} ready in {time.perf_counter() - T0:.2f} s", file=sys.stderr)
    async with contextlib.AsyncExitStack() as stack:
        while line := await stdin.readline():
            req = json.loads(line)
            if req.get("cancel"):
                if req["id"] in running:
                    running[req["id"]].cancel()
                continue
            task = asyncio.ensure_future(rollout(stack, req))
            running[req["id"]] = task
            task.add_done_callback(lambda t, req=req: reply(req, t))
        for task in list(running.values()):
            task.cancel()
        await asyncio.gather(*running.values(), return_exceptions=True)


if __name__ == "__main__":
    asyncio.run(main())
