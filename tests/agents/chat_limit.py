"""A chat agent written only against the openai client that sets max_tokens, as most clients do."""
from tools import agentkit


async def run(task, llm):
    async with agentkit.openai_client(llm) as client:
        reply = await client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": f"{task['a']}+{task['b']}="}], max_tokens=2)
    return {"reward": float(str(task["a"] + task["b"]) in (reply.choices[0].message.content or "")),
            "info": {"completion_tokens": reply.usage.completion_tokens}}
