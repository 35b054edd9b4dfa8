"""The other wires harnesses speak, each driven by its own official client against the episode's endpoint: Anthropic
Messages (the anthropic SDK: Claude Code's wire), OpenAI Responses (the openai SDK and the OpenAI Agents SDK: Codex's
wire), and the engine's logprobs on chat and completions. Each records exactly what the chat wire records."""
import json

import anthropic
import openai
import pytest
import torch
from test_endpoint import PY_TOOL, ScriptEngine, chat_episode, dense_engine, qwen3_tokenizer, tool_call_text

import endpoint
from rollout import check_tokens

THINK_CALL = "<think>\nI should compute.\n</think>\n\n" + tool_call_text("print(3*4+5)") + "<|im_end|>"
THINK_ANSWER = "<think>\nThe tool says 17.\n</think>\n\nIt is 17.<|im_end|>"
ANTHROPIC_TOOL = {"name": "python", "description": "Run Python code",
                  "input_schema": {"type": "object", "properties": {"code": {"type": "string"}}}}
RESPONSES_TOOL = {"type": "function", "name": "python", "description": "Run Python code",
                  "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}


def anthropic_client(llm, **kw):
    """The SDK appends /v1/messages to its base URL, as Claude Code's ANTHROPIC_BASE_URL."""
    kw = {"api_key": llm.api_key} | kw
    return anthropic.AsyncAnthropic(base_url=llm.base_url.removesuffix("/v1"), max_retries=0, **kw)


async def chat_tool_turns(client, llm):
    """The reference: the same conversation on the chat wire."""
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3*4+5?"}]
    tool = {"type": "function", "function": {"name": "python", "description": "Run Python code",
                                             "parameters": PY_TOOL["function"]["parameters"]}}
    r = await client.chat.completions.create(model=llm.model, messages=msgs, tools=[tool])
    msgs += [r.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": r.choices[0].message.tool_calls[0].id, "content": "17"}]
    await client.chat.completions.create(model=llm.model, messages=msgs, tools=[tool])


def record(llm):
    """-> the one segment's ids and loss mask, after the token check passed"""
    [(ep, calls)] = endpoint.segments(llm, 1.0)
    check_tokens(ep, calls)
    return ep.ids, ep.loss_mask


# ---- Anthropic Messages ----


def test_anthropic_thinking_and_tool_use_record_exactly_what_chat_records():
    q = qwen3_tokenizer()

    async def claude(_, llm):
        client = anthropic_client(llm)
        msgs = [{"role": "user", "content": "What is 3*4+5?"}]
        first = await client.messages.create(model=llm.model, max_tokens=64, system="Be brief.", messages=msgs,
                                             tools=[ANTHROPIC_TOOL])
        [use] = [b for b in first.content if b.type == "tool_use"]
        msgs += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "17"}]}]
        second = await client.messages.create(model=llm.model, max_tokens=64, system=[{"type": "text",
                                              "text": "Be brief."}], messages=msgs, tools=[ANTHROPIC_TOOL])
        return first, second
    chat_llm, _ = chat_episode(ScriptEngine(q, [THINK_CALL, THINK_ANSWER]), q, chat_tool_turns)
    llm, (first, second) = chat_episode(ScriptEngine(q, [THINK_CALL, THINK_ANSWER]), q, claude)
    assert [b.type for b in first.content] == ["thinking", "tool_use"] and first.stop_reason == "tool_use"
    assert first.content[0].thinking == "I should compute." and first.content[1].input == {"code": "print(3*4+5)"}
    assert [b.type for b in second.content] == ["thinking", "text"] and second.stop_reason == "end_turn"
    assert second.content[1].text == "It is 17." and second.usage.output_tokens == len(q.encode(THINK_ANSWER))
    assert record(llm) == record(chat_llm)  # one segment, token for token the chat wire's


def test_anthropic_stream_stop_sequences_limits_count_tokens_and_keys(tok):
    engine = ScriptEngine(tok, ["I guess 4. Then 5<|im_end|>", "I guess 4. Then 5<|im_end|>", "4 5 6", "ok<|im_end|>"])
    msgs = [{"role": "user", "content": "Guess my number from 1 to 7."}]

    async def claude(_, llm):
        client = anthropic_client(llm)
        plain = await client.messages.create(model=llm.model, max_tokens=8, messages=msgs, stop_sequences=[". "])
        async with client.messages.stream(model=llm.model, max_tokens=8, messages=msgs,
                                          stop_sequences=[". "]) as stream:
            deltas = [text async for text in stream.text_stream]
            streamed = await stream.get_final_message()
        cut = await client.messages.create(model=llm.model, max_tokens=3, messages=msgs)
        count = await client.messages.count_tokens(model=llm.model, messages=msgs)
        bearer = anthropic.AsyncAnthropic(base_url=llm.base_url.removesuffix("/v1"), auth_token=llm.api_key)
        ok = await bearer.messages.create(model=llm.model, max_tokens=8, messages=msgs)
        with pytest.raises(anthropic.AuthenticationError):
            await anthropic_client(llm, api_key="wrong").messages.create(model=llm.model, max_tokens=8, messages=msgs)
        with pytest.raises(anthropic.BadRequestError) as bad:
            await client.messages.create(model=llm.model, max_tokens=8, messages=[{"role": "user", "content": [
                {"type": "document", "source": {}}]}])
        return plain, deltas, streamed, cut, count, ok, bad.value
    llm, (plain, deltas, streamed, cut, count, ok, bad) = chat_episode(engine, tok, claude)
    assert plain.content[0].text == "I guess 4" and plain.stop_reason == "stop_sequence"
    assert plain.stop_sequence == ". " and "".join(deltas) == "I guess 4"
    assert streamed.model_dump() | {"id": ""} == plain.model_dump() | {"id": ""}
    assert cut.stop_reason == "max_tokens" and ok.content[0].text == "ok" and ok.stop_reason == "end_turn"
    assert count.input_tokens == plain.usage.input_tokens > 5
    assert "document" in str(bad)
    segs = endpoint.segments(llm, 1.0)
    assert sum(len(calls) for _, calls in segs) == 4  # count_tokens and the refused calls sampled nothing
    for ep, calls in segs:
        check_tokens(ep, calls)


# ---- OpenAI Responses ----


def test_responses_reasoning_and_function_calls_record_exactly_what_chat_records():
    q = qwen3_tokenizer()

    async def codex(client, llm):
        items = [{"role": "user", "content": [{"type": "input_text", "text": "What is 3*4+5?"}]}]
        first = await client.responses.create(model=llm.model, instructions="Be brief.", input=items,
                                              tools=[RESPONSES_TOOL], store=False)
        [call] = [item for item in first.output if item.type == "function_call"]
        items += [item.model_dump(exclude_none=True) for item in first.output]
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "17"})
        second = await client.responses.create(model=llm.model, instructions="Be brief.", input=items,
                                               tools=[RESPONSES_TOOL])
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model=llm.model, input="hi", previous_response_id=second.id)
        return first, second, e.value.body
    chat_llm, _ = chat_episode(ScriptEngine(q, [THINK_CALL, THINK_ANSWER]), q, chat_tool_turns)
    llm, (first, second, error) = chat_episode(ScriptEngine(q, [THINK_CALL, THINK_ANSWER]), q, codex)
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    assert first.output[0].content[0].text == "I should compute." and first.status == "completed"
    assert json.loads(first.output[1].arguments) == {"code": "print(3*4+5)"} and first.output[1].name == "python"
    assert [item.type for item in second.output] == ["reasoning", "message"] and second.output_text == "It is 17."
    assert second.usage.output_tokens == len(q.encode(THINK_ANSWER))
    assert error["param"] == "previous_response_id"
    assert record(llm) == record(chat_llm)


def test_responses_streamed_as_the_sdk_parses_it(tok):
    engine = ScriptEngine(tok, ["I guess 4<|im_end|>", "I guess 4<|im_end|>", "4 5 6", "4 5 6"])

    async def codex(client, llm):
        plain = await client.responses.create(model=llm.model, input="Guess my number from 1 to 7.")
        async with client.responses.stream(model=llm.model, input="Guess my number from 1 to 7.") as stream:
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            streamed = await stream.get_final_response()
        cut = await client.responses.create(model=llm.model, input="Guess my number.", max_output_tokens=3)
        raw = await client.responses.create(model=llm.model, input="Guess my number.", stream=True)
        kinds = [e.type async for e in raw]
        return plain, deltas, streamed, cut, kinds
    llm, (plain, deltas, streamed, cut, kinds) = chat_episode(engine, tok, codex)
    assert plain.output_text == "I guess 4" and "".join(deltas) == "I guess 4" and streamed.output_text == "I guess 4"
    assert [(i.type, i.status) for i in streamed.output] == [(i.type, i.status) for i in plain.output]
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert "response.output_item.done" in kinds


def test_the_openai_agents_sdk_runs_a_tool_and_streams(tok):
    agents = pytest.importorskip("agents", reason="openai-agents is in requirements.txt")
    agents.set_tracing_disabled(True)  # no network: traces would go to OpenAI
    ran = []

    @agents.function_tool
    def python(code: str) -> str:
        """Run Python code."""
        ran.append(code)
        return "17"
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(3*4+5)"}}\n</tool_call><|im_end|>'
    engine = ScriptEngine(tok, [call, "It is 17.<|im_end|>", call, "It is 17.<|im_end|>"])

    async def sdk(client, llm):
        model = agents.OpenAIResponsesModel(model=llm.model, openai_client=client)
        calc = agents.Agent(name="calc", instructions="Be brief.", tools=[python], model=model)
        result = await agents.Runner.run(calc, "What is 3*4+5?")
        streamed = agents.Runner.run_streamed(calc, "What is 3*4+5?")
        events = [e.type async for e in streamed.stream_events()]
        return result.final_output, streamed.final_output, events
    llm, (final, streamed, events) = chat_episode(engine, tok, sdk)
    assert final == streamed == "It is 17." and ran == ["print(3*4+5)"] * 2 and "raw_response_event" in events
    segs = endpoint.segments(llm, 1.0)
    assert [len(calls) for _, calls in segs] == [2, 2]  # the second run starts the conversation anew
    for ep, calls in segs:
        check_tokens(ep, calls)


# ---- logprobs ----


def test_chat_and_completions_return_the_engines_logprobs(tok):
    async def ask(client, llm):
        msgs = [{"role": "user", "content": "Guess my number from 1 to 7."}]
        chat = await client.chat.completions.create(model=llm.model, messages=msgs, logprobs=True)
        streamed = await client.chat.completions.create(model=llm.model, messages=msgs, logprobs=True, stream=True)
        chunks = [c async for c in streamed]
        text = await client.completions.create(model=llm.model, prompt="I guess", logprobs=1)
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model=llm.model, prompt="I guess", logprobs=2)
        return chat, chunks, text, e.value.body
    llm, (chat, chunks, text, error) = chat_episode(dense_engine(tok), tok, ask)
    calls = [c for _, c, _ in llm.calls]
    assert [t.logprob for t in chat.choices[0].logprobs.content] == calls[0].logprobs
    assert [t.token for t in chat.choices[0].logprobs.content] == [tok.decode([i]) for i in calls[0].ids]
    assert [t.logprob for c in chunks if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.content] == calls[1].logprobs
    assert text.choices[0].logprobs.token_logprobs == calls[2].logprobs and error["param"] == "logprobs"
    assert all(lp < 0 for lp in calls[0].logprobs) and torch.tensor(calls[2].logprobs).isfinite().all()


def test_a_hosted_tool_is_left_out_of_the_prompt_and_counted(tok):
    """Codex sends a hosted `web_search` tool the run cannot serve: the request is answered, the tool is not rendered,
    and the episode counts it (episode/hosted_tools_dropped)."""
    async def codex(client, llm):
        tools = [RESPONSES_TOOL, {"type": "web_search"}]
        return await client.responses.create(model=llm.model, input="Search, then compute.", tools=tools)
    llm, reply = chat_episode(ScriptEngine(tok, ["ok<|im_end|>"]), tok, codex)
    assert reply.output_text == "ok"
    [(ep, calls)] = endpoint.segments(llm, 1.0)
    check_tokens(ep, calls)
    text = tok.decode(ep.ids)
    assert '"python"' in text and "web_search" not in text and ep.info["hosted_tools_dropped"] == 1
