"""verifiers_env: a verifiers (https://github.com/PrimeIntellect-ai/verifiers, 0.4.0) environment, trained unchanged.
verifiers pins openai<3 and this project openai 3, so it runs in its own venv (`bash tests/install_verifiers.sh` makes
.venv-verifiers), in one long-lived worker program per rollout process (agents/verifiers_worker.py), started on the
first episode and reused: its start-up (importing verifiers) is paid once, not once an episode.

Which environment: the task file row's `vf_env`, a verifiers taskset id (default `vf_arith`, single turn; `vf_calc`
has a tool; both in agents/vf_envs/, which the worker has on its path; any taskset installed in the venv works too),
and `vf_config`, its TasksetConfig knobs. Which task: row `group % len` of the taskset's load(), so a group's
episodes share a task and a resumed run draws the same ones. Held-out evaluation prompt p (group -1 - p) takes row p
of the taskset that --eval_file's row names: `{"vf_config": {"split": "test"}}` holds out vf_arith's test questions.

The worker runs the rollout against the episode's endpoint (base_url, api_key, model) with verifiers' own `null`
chat harness, and the taskset's @vf.reward functions score it: their sum is the reward, each is in the info. A worker
that dies fails its episodes (agent errors); the next episode starts a new one. A cancelled episode (episode_timeout)
cancels its rollout in the worker, which goes on serving the others."""
import asyncio
import itertools
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-verifiers"
WORKER = [str(VENV / "bin" / "python"), str(Path(__file__).with_name("verifiers_worker.py"))]
ENVS_DIR = Path(__file__).with_name("vf_envs")  # the worker's PYTHONPATH: the example tasksets
IDS = itertools.count()
STATE = {}  # the event loop, and the task that started the worker there: its process, reader, requests


async def read_replies(proc, pending):
    """Resolve each reply's future by id; once the worker's stdout closes, fail whatever is still waiting."""
    while line := await proc.stdout.readline():
        reply = json.loads(line)
        fut = pending.pop(reply["id"], None)
        if fut is not None and not fut.done():
            fut.set_result(reply)
    code = await proc.wait()
    for fut in pending.values():
        if not fut.done():
            fut.set_exception(RuntimeError(f"the verifiers worker exited with code {code} (its stderr is above)"))
    pending.clear()


async def start_worker() -> dict:
    if not VENV.is_dir():
        raise RuntimeError(f"{VENV} is missing: run `bash tests/install_verifiers.sh`")
    # the venv's bin first: verifiers' harness setup finds `uv` there (installed with it)
    env = dict(os.environ, PYTHONPATH=str(ENVS_DIR), PATH=f"{VENV / 'bin'}{os.pathsep}{os.environ['PATH']}")
    proc = await asyncio.create_subprocess_exec(*WORKER, env=env, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE, limit=2**24)
    pending = {}  # request id -> the future its reply resolves
    return {"proc": proc, "pending": pending, "reader": asyncio.ensure_future(read_replies(proc, pending))}


def dead(start) -> bool:
    if not start.done():
        return False
    return start.exception() is not None or start.result()["proc"].returncode is not None


async def worker() -> dict:
    """The rollout process's worker: started on first use, again if it died or the event loop is a new one. The
    first episodes all come at once: they share one start (a task, created before the first await)."""
    loop = asyncio.get_running_loop()
    if "start" not in STATE or STATE["loop"] is not loop or dead(STATE["start"]):
        STATE.update(loop=loop, start=asyncio.ensure_future(start_worker()))
    return await asyncio.shield(STATE["start"])  # a cancelled episode does not cancel the start


def row_of(task: dict) -> int:
    """Training group g takes row g (mod the taskset's size); held-out prompt p (group -1 - p) takes row p."""
    if task["group"] < 0:
        return -1 - task["group"]
    return task["group"]


async def run(task: dict, llm) -> dict:
    """One rollout in the worker -> the rubric's reward; the info: verifiers' turns and each reward function's value."""
    w = await worker()
    request_id = next(IDS)
    request = {"id": request_id, "env": task.get("vf_env", "vf_arith"), "config": task.get("vf_config", {}),
               "row": row_of(task), "base_url": llm.base_url, "api_key": llm.api_key, "model": llm.model}
    if w["reader"].done():  # the worker has just died: nothing would ever answer
        raise RuntimeError("the verifiers worker exited (its stderr is above)")
    fut = asyncio.get_running_loop().create_future()
    w["pending"][request_id] = fut
    try:
        w["proc"].stdin.write(json.dumps(request).encode() + b"\n")
        await w["proc"].stdin.drain()
        reply = await fut
    except asyncio.CancelledError:  # the episode timed out: its rollout must not go on sampling
        w["pending"].pop(request_id, None)
        if w["proc"].returncode is None:
            w["proc"].stdin.write(json.dumps({"id": request_id, "cancel": True}).encode() + b"\n")
        raise
    except (BrokenPipeError, ConnectionResetError) as e:
        raise RuntimeError(f"the verifiers worker is gone: {e!r}") from e
    if "error" in reply:
        raise RuntimeError(f"verifiers rollout failed: {reply['error']}")
    info = {"turns": reply["turns"]}  # the endpoint counts tool calls itself
    info |= {f"reward_{name}": value for name, value in reply["rewards"].items()}
    return {"reward": float(reply["reward"]), "info": info}

