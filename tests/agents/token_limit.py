"""A token-level agent that sets its own limit on each call (max_new_tokens=1): one turn of a+b=, one token."""
from agent import Episode
from tools.agentkit import model_turn, prompt_ids


class OneToken:
    """The episode's llm, asking for one token a call: what an agent that sets a limit passes through."""
    def __init__(self, llm):
        self.llm = llm
        self.tokenizer = llm.tokenizer

    async def generate(self, ids, **kw):
        return await self.llm.generate(ids, max_new_tokens=1, **kw)


async def run(task, llm):
    ep = Episode()
    ep.append(prompt_ids(llm.tokenizer, f"{task['a']}+{task['b']}="))
    answer = await model_turn(OneToken(llm), ep)
    ep.reward = float(answer.strip() == str(task["a"] + task["b"]))
    ep.info = {"sampled": sum(ep.loss_mask)}
    return ep
