"""arith: one turn, the question `arith_prompt` (default `a+b=`); the answer's last integer is checked ("3 + 4 = 7")."""
import re

from agent import Episode
from tools.agentkit import model_turn, prompt_ids


async def run(task: dict, llm) -> Episode:
    ep = Episode()
    question = task.get("arith_prompt", "{a}+{b}=").format(**task)
    ep.append(prompt_ids(llm.tokenizer, question))
    answer = re.findall(r"-?\d+", await model_turn(llm, ep))
    ep.reward = float(bool(answer) and int(answer[-1]) == task["a"] + task["b"])
    return ep
