"""The image task `count` as a chat agent: `--task=tests/agents/count_chat.py`. The image goes as an OpenAI
`image_url` content part (a PNG data: URL) in the user message, through the official client; the answer is text."""
import base64
import io
import random
import re

from PIL import Image

import agent
from tools import agentkit


async def run(task, llm):
    rng = random.Random(task["seed"])
    k = rng.randint(1, 4)
    pixels = (agent.load_agent("count").__globals__["squares"](rng, task.get("image_size", 16), k) * 255).round().byte().permute(1, 2, 0).numpy()
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, "PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": agent.load_agent("count").__globals__["PROMPT"]}]
    async with agentkit.openai_client(llm) as client:
        reply = await client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": content}])
    digit = re.search(r"\d", reply.choices[0].message.content or "")
    return float(digit is not None and int(digit.group()) == k)
