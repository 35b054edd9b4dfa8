"""reasoning_gym: one question from a reasoning-gym generator (https://github.com/open-thought/reasoning-gym), asked
through the chat endpoint and scored by the generator's own `score_answer` (a float in [0, 1]).

The task dict says which generator: `rg_task` (a name from `reasoning_gym.factory.DATASETS`, default chain_sum) and
`rg_config` (its config's knobs, e.g. {"min_terms": 2}); both come from a row of --task_file, so a one-line JSONL
`{"rg_task": "leg_counting"}` trains on that generator. Give the same file as --eval_file: the held-out groups draw
other `seed`s, so other problems. Each group's problem is entry 0 of the generator seeded with the task's `seed`.

The reply's answer is the text of its last <answer>...</answer> tag, which the prompt asks for; a reply without one
answers with its last number, or its last non-empty line (a small model rarely writes the tags before it is trained)."""
import functools
import json
import re

import reasoning_gym
from reasoning_gym.utils import extract_answer

from tools.agentkit import openai_client

DEFAULT_TASK = "chain_sum"  # short prompts, integer answers: "... 4 - 5 + 3 - 4 + 9 ="
INSTRUCTION = "\nGive your final answer inside <answer></answer> tags."


@functools.lru_cache(maxsize=1024)
def dataset(name: str, config: str, seed: int):
    """The generator `name` with its config (a JSON object, hashable as text), seeded: one problem, drawn once for a
    group's episodes (creating one takes 0.1-40 ms)."""
    return reasoning_gym.create_dataset(name, seed=seed, size=1, **json.loads(config))


def answer_of(reply: str) -> str:
    """The last <answer> tag's text; without one, the last number in the reply ("... the answer is 12."), else its
    last non-empty line."""
    tagged = extract_answer(reply)
    if tagged is not None:
        return tagged
    numbers = re.findall(r"-?\d+(?:\.\d+)?", reply)
    if numbers:
        return numbers[-1]
    lines = [line.strip() for line in reply.splitlines() if line.strip()]
    if not lines:
        return ""
    return lines[-1]


async def run(task: dict, llm) -> dict:
    config = json.dumps(task.get("rg_config", {}), sort_keys=True)
    data = dataset(task.get("rg_task", DEFAULT_TASK), config, task["seed"])
    entry = data[0]  # {"question", "answer", "metadata"}
    msgs = [{"role": "user", "content": entry["question"] + INSTRUCTION}]
    async with openai_client(llm) as client:
        reply = await client.chat.completions.create(model=llm.model, messages=msgs)
    text = reply.choices[0].message.content or ""
    score = data.score_answer(answer_of(text), entry)
    tagged = extract_answer(text) is not None
    return {"reward": float(score), "info": {"tagged": float(tagged), "exact": float(score == 1.0)}}
