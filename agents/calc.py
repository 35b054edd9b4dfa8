"""calc: a*b+c. A chat agent: the openai client on the episode's endpoint, a sandboxed `python` tool; the last
reply's last integer is the answer. It returns the reward; the rollout builds the episode from the endpoint's record."""
import json
import re

from tools.agentkit import openai_client
from tools.sandbox import run_tool

PROMPT = "What is {}*{}+{}? You may run Python."
PYTHON_TOOL = {"type": "function", "function": {
    "name": "python",
    "description": "Run Python code, see its output",
    "parameters": {"type": "object", "required": ["code"], "properties": {"code": {"type": "string"}}}}}


async def call_tool(call, task):
    """One tool call the endpoint parsed (its arguments are a JSON object) -> (ok, the tool message)."""
    code = str(json.loads(call.function.arguments).get("code", ""))
    ok, out = await run_tool(code, timeout_s=task["tool_timeout"], memory_mb=task["tool_memory_mb"],
                             max_output=task.get("tool_max_output", 1024), unsafe=task.get("sandbox_unsafe", False))
    return ok, {"role": "tool", "tool_call_id": call.id, "content": out.strip() or "(no output)"}


async def run(task: dict, llm) -> dict:
    msgs = [{"role": "user", "content": PROMPT.format(task["a"], task["b"], task["c"])}]
    calls = 0
    errors = 0
    async with openai_client(llm) as client:
        for turn in range(1, task["max_turns"] + 1):
            reply = await client.chat.completions.create(model=llm.model, messages=msgs, tools=[PYTHON_TOOL])
            message = reply.choices[0].message
            msgs.append(message.model_dump(exclude_none=True))
            if not message.tool_calls or turn == task["max_turns"]:
                break  # an answer, or a call whose result no turn is left to read
            for call in message.tool_calls:
                ok, result = await call_tool(call, task)
                msgs.append(result)
                calls += 1
                if not ok:
                    errors += 1
    answer = re.findall(r"-?\d+", message.content or "")
    right = bool(answer) and int(answer[-1]) == task["a"] * task["b"] + task["c"]
    return {"reward": float(right), "info": {"turns": turn, "tool_calls": calls, "tool_errors": errors}}
