"""An agent file whose agent is a separate process: `--task=tests/agents/process_agent.py`. The program gets the
episode's endpoint in its environment (OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL) and prints its reward last;
the rollout builds the episode from the endpoint's record of its calls."""
import asyncio
import json
import os
import sys
from pathlib import Path

PROGRAM = [sys.executable, str(Path(__file__).with_name("sum_program.py"))]  # or any command: node, curl, ...


async def run(task, llm):
    env = dict(os.environ, OPENAI_BASE_URL=llm.base_url, OPENAI_API_KEY=llm.api_key, OPENAI_MODEL=llm.model)
    proc = await asyncio.create_subprocess_exec(*PROGRAM, json.dumps(task), env=env, stdout=asyncio.subprocess.PIPE)
    try:
        out, _ = await proc.communicate()
    finally:  # the episode timed out (cancelled): the program must not outlive it
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"{PROGRAM[-1]} exited with code {proc.returncode}")
    return float(out.decode().split()[-1])
