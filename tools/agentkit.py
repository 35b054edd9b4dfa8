"""tools/agentkit.py: helpers agent programs import (the framework uses none of them). Token level: prompt_ids,
turn_suffix and model_turn build an agent.Episode turn by turn; chat level: openai_client, an OpenAI client on the
episode's endpoint. Beside it, tools/sandbox.py runs the code a model writes for its tools."""


# conversations grow by appending token ids, never by re-rendering
def prompt_ids(tok, text: str) -> list[int]:
    """The opening user turn and the assistant header, as the chat template renders it."""
    s = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok.encode(s, add_special_tokens=False)


def turn_suffix(tok, text: str, role: str = "user") -> list[int]:
    """Ids that continue a chat after an assistant turn that ended with <|im_end|>: a new turn + assistant header."""
    # Special tokens split the text before BPE runs, so these ids equal what a full render would give here.
    return tok.encode(f"\n<|im_start|>{role}\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


async def model_turn(llm, ep) -> str:
    """One model turn appended to ep; returns its text, decoded only to show the environment."""
    completion = await (llm.generate(ep.ids, images=ep.images) if ep.images else llm.generate(ep.ids))
    ep.append_completion(completion)
    end = llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    if not completion.ids or completion.ids[-1] != end:  # cut off at max_new_tokens: we close the turn (mask 0)
        ep.append([end])
    return llm.tokenizer.decode(completion.ids, skip_special_tokens=True)


def openai_client(llm):
    """An `openai.AsyncOpenAI` on this episode's endpoint, for chat agents. verify=False: the endpoint is plain HTTP
    on loopback, and a default client loads the CA certificates (blocking the rollout's loop) each time one is made."""
    import openai  # here: only chat agents need it
    # no client timeout: the episode's is episode_timeout
    return openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0, timeout=None,
                              http_client=openai.DefaultAsyncHttpxClient(verify=False))
