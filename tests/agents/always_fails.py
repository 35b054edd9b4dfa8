"""An agent whose every episode fails: it samples, then raises."""


async def run(task, llm):
    await llm.generate(llm.tokenizer.encode("1+1="))
    raise RuntimeError("this agent always fails")
