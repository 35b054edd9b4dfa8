"""endpoint.py: the episode's endpoint, so an agent can be any program that speaks OpenAI's chat or completions,
Anthropic's Messages or OpenAI's Responses API (the last two translated to a chat turn). One aiohttp server per rollout
process; an episode's base URL is http://127.0.0.1:PORT/ep/<id>/v1. Chat messages are rendered with the chat template;
when the prompt starts with a segment's so far, its ids are kept and only the rest is tokenized, else (Qwen3 drops
earlier <think> blocks, the agent edits its history) a new segment: one more trained episode."""
import base64
import functools
import hmac
import io
import json
import re
import secrets
import time
import weakref

import numpy as np
import torch
from aiohttp import web
from PIL import Image

import agent as agent_mod

TOOL_CALL = re.compile(r"<tool_call>\n?(.*?)\n?</tool_call>", re.S)  # the Qwen / Hermes format
# the engine has no penalties, seed, n > 1, alternatives' logprobs: only values that change nothing pass
FIXED = {"n": 1, "best_of": 1, "echo": False, "presence_penalty": 0, "frequency_penalty": 0,
         "logit_bias": {}, "top_logprobs": 0, "seed": None}
MAX_PIXELS = 1 << 24  # an image's pixels, as sent and after resizing (Qwen3-VL's processor's longest_edge)


async def serve(tokenizer, sampling: dict, stop_ids, model: str = "policy") -> dict:
    """Serve on a free port of 127.0.0.1 in the running loop; sampling (no request changes it), stop_ids: the run's."""
    server = {"tok": tokenizer, "sampling": sampling, "model": model, "stop": set(stop_ids),
              "episodes": weakref.WeakValueDictionary()}  # an episode's llm; it goes when the rollout drops it
    app = web.Application(client_max_size=64 << 20)
    routes = {"chat/completions": _chat, "completions": _complete, "messages": _messages,
              "messages/count_tokens": _count_tokens, "responses": _responses}
    for path, fn in routes.items():
        app.router.add_post(f"/ep/{{ep}}/v1/{path}", functools.partial(_handle, server, fn))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    server["port"], server["runner"] = runner.addresses[0][1], runner
    return server


def attach(server: dict, llm):
    """Give an episode's llm (a rollout.Policy) its base URL and API key; -> llm."""
    eid = secrets.token_urlsafe(16)  # both unguessable: any local process (tool code too) can reach the port
    llm.api_key = secrets.token_urlsafe(32)
    server["episodes"][eid] = llm
    llm.base_url = f"http://127.0.0.1:{server['port']}/ep/{eid}/v1"
    llm.model = server["model"]
    return llm


def segments(llm, result) -> list:
    """A chat agent's `result` (a reward, or {"reward", "info"}) -> (Episode, its engine calls) for each segment."""
    reward, info = (result.get("reward"), result.get("info", {})) if isinstance(result, dict) else (result, {})
    if not isinstance(reward, (int, float)):
        raise TypeError(f"a chat agent returns a float or a dict with 'reward', got {type(result).__name__}")
    if not llm.segs:  # a segment starts with a call the engine answered
        raise ValueError("the chat agent made no call to the endpoint")
    if clash := {"segments", "truncated"} & set(info):  # the rollout's (its own tool_calls wins over the endpoint's)
        raise ValueError(f"the chat agent's info sets {sorted(clash)}: the rollout's")
    for seg in llm.segs:
        seg["ep"].reward, seg["ep"].info = float(reward), dict(llm.counts, **info, segments=len(llm.segs))
    return [(s["ep"], s["calls"]) for s in llm.segs]


async def _handle(server, fn, request):
    try:
        llm = server["episodes"].get(request.match_info["ep"])
        if llm is None:
            raise _error("unknown episode (ended, or never started)", code="episode_not_found", http=web.HTTPNotFound)
        # OpenAI's clients send a Bearer token, Anthropic's an x-api-key header
        given = request.headers.get("x-api-key") or request.headers.get("Authorization", "").removeprefix("Bearer ")
        if not hmac.compare_digest(given.encode(), llm.api_key.encode()):
            raise _error("wrong or no API key (llm.api_key)", code="invalid_api_key", http=web.HTTPUnauthorized)
        if request.content_type != "application/json":
            raise _error(f"Content-Type must be JSON, not {request.content_type}", http=web.HTTPUnsupportedMediaType)
        body = await request.json()  # not JSON: a ValueError, a 400 below
        if not isinstance(body, dict):
            raise _error("the body must be a JSON object")
        # the run's sampling (or an evaluation's) is the distribution the trainer assumes: a harness's own is answered
        # with it and counted; one answer, no extras
        sampling = server["sampling"] | llm.sampling
        for key, value in (sampling | FIXED).items():
            if body.get(key) is None or body[key] == value:
                continue
            if key not in sampling:
                raise _error(f"{key}={body[key]!r} is not supported: the run samples with {key}={value!r}", key)
            llm.counts["sampling_overridden"] += 1
        async with llm.lock:  # one call of an episode at a time: each extends the record it was matched to
            reply, events = await fn(server, llm, body)
        if not body.get("stream"):
            return web.json_response(reply)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await response.write("".join(events).encode())  # sampled already: all the events at once
        return response
    except ValueError as e:  # the engine refused it: too long a prompt, a bad id
        code = "context_length_exceeded" if "max_len" in str(e) else None
        raise _error(str(e), code and ("prompt" if fn is _complete else "messages"), code) from None
    except (KeyError, TypeError, AttributeError, IndexError) as e:  # a Messages or Responses body of the wrong shape
        raise _error(f"malformed request: {type(e).__name__}: {e}") from None
    except RuntimeError as e:  # not the request's fault: a server failed (the rollout stops), the episode is closed
        raise _error(str(e), http=web.HTTPServiceUnavailable) from None


def _sse(data, name=None):
    """One server-sent event; Anthropic's and the Responses API's carry their type in an event: line too."""
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(data) if isinstance(data, dict) else data}\n\n"


def _openai(server, body, kind, choice, usage):
    """-> (an OpenAI completion's body, its stream: the reply in one chunk, the finish reason, usage if asked)"""
    head = {"id": f"nanomolt-{time.monotonic_ns()}", "model": server["model"], "created": int(time.time())}
    reply = head | {"object": kind, "choices": [dict(index=0, **choice)], "usage": usage}
    if kind == "chat.completion":
        message = choice["message"]
        delta = {"role": "assistant", "content": message["content"]}
        if "tool_calls" in message:
            delta["tool_calls"] = [dict(call, index=i) for i, call in enumerate(message["tool_calls"])]
        first = {"delta": delta, "logprobs": choice.get("logprobs")}
        chunks = [first | {"finish_reason": None}, {"delta": {}, "finish_reason": choice["finish_reason"]}]
    else:
        chunks = [choice | {"finish_reason": None}, {"text": "", "finish_reason": choice["finish_reason"]}]
    kind = kind.replace("chat.completion", "chat.completion.chunk")
    events = [head | {"object": kind, "choices": [dict(index=0, **chunk)]} for chunk in chunks]
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append(head | {"object": kind, "choices": [], "usage": usage})
    return reply, [_sse(event) for event in events + ["[DONE]"]]


def _error(message, param=None, code=None, http=web.HTTPBadRequest):
    """An OpenAI-style error body (what the agent's client raises) as an aiohttp exception, for the handler to raise."""
    kind = "server_error" if http.status_code >= 500 else "invalid_request_error"
    error = {"message": message, "type": kind, "param": param, "code": code}
    return http(text=json.dumps({"error": error}), content_type="application/json")


async def _sample(server, llm, body, text, ids=None, images=()):
    """Sample after the longest segment the prompt (text, or token ids when given) extends, else in a new segment; the
    record changes only once the engine answered. -> (text up to a stop string, finish_reason, usage, Completion, the
    stop string or None)"""
    tok = server["tok"]
    max_new = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_new is not None and not (isinstance(max_new, int) and max_new > 0):
        raise _error(f"max_tokens={max_new!r} must be a positive integer", "max_tokens")
    stop = [body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop") or []
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise _error("stop must be a string or a list of non-empty strings", "stop")
    prompt, kind = (text, "text") if ids is None else (ids, "ids")
    seg = max((s for s in llm.segs
               if prompt[:len(s[kind])] == s[kind] and all(map(torch.equal, s["ep"].images, images))),
              key=lambda s: len(s[kind]), default=None)  # (and the images it has, the prompt's first ones)
    if ids is None:
        ids = (seg["ids"] if seg else []) + tok.encode(text[len(seg["text"]) if seg else 0:], add_special_tokens=False)
    out = await llm.generate(ids, max_new, images)
    sampled = tok.decode(out.ids)
    hit = min((s for s in stop if s in sampled), key=sampled.index, default=None)  # the first stop string sampled
    cut = None if hit is None else sampled.index(hit)
    if hit is not None:  # a stop string ends the turn: the tokens after the one that completes it were never shown
        end = min(sampled.index(s) + len(s) for s in stop if s in sampled)
        # shown: the kept tokens' text length, grown by what each adds to the 3 before it (a character can span tokens)
        kept, shown = 0, 0
        piece = ""
        while kept < len(out.ids) and (shown < end or piece.endswith("\ufffd")):  # linear, unlike decoding each prefix
            kept += 1
            piece = tok.decode(out.ids[max(kept - 4, 0):kept])
            shown += len(piece) - len(tok.decode(out.ids[max(kept - 4, 0):kept - 1]))
        del out.ids[kept:], out.logprobs[kept:], out.versions[kept:]  # in place: llm.calls holds this record
        out.routing = None if out.routing is None else out.routing[:len(ids) + kept]
    if seg is None:
        ep = agent_mod.Episode()
        seg = {"ep": ep, "ids": ep.ids, "calls": [], "text": ""}
        llm.segs.append(seg)
    seg["ep"].append(ids[len(seg["ids"]):])  # seg["ids"] is seg["ep"].ids: Episode appends in place
    seg["ep"].images += images[len(seg["ep"].images):]  # the pixels the engine saw
    seg["ep"].append_completion(out)
    seg["calls"].append(llm.calls[-1])
    seg["text"] = (text or tok.decode(ids)) + sampled[:cut]
    finish = "stop" if cut is not None or (out.ids and out.ids[-1] in server["stop"]) else "length"
    usage = dict(prompt_tokens=len(ids), completion_tokens=len(out.ids), total_tokens=len(ids) + len(out.ids))
    return sampled[:cut], finish, usage, out, hit


async def _chat(server, llm, body):
    """An OpenAI chat completion; logprobs: the engine's of each token sampled (top_logprobs, alternatives: none)."""
    msg, finish, usage, out, _ = await _chat_turn(server, llm, body)
    choice = {"message": msg, "finish_reason": finish}
    if body.get("logprobs"):
        pieces = server["tok"].batch_decode([[i] for i in out.ids])  # each sampled token's text
        choice["logprobs"] = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                          for t, lp in zip(pieces, out.logprobs)]}
    return _openai(server, body, "chat.completion", choice, usage)


def _render(server, llm, body):
    """A chat request's messages, rendered by the chat template with its tools -> (text, images)"""
    msgs, tools = body.get("messages"), body.get("tools")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and
                                                         isinstance(m.get("content") or "", (str, list)) for m in msgs):
        raise _error("messages must be a non-empty list of objects with a role and content", "messages")
    msgs = [dict(m, content=m.get("content") or "") for m in msgs]  # templates want a string, also with tool calls
    images = [_content(server, llm, m, f"messages[{i}].content") for i, m in enumerate(msgs)]
    try:
        text = server["tok"].apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # a template's error (jinja's, a bad tool's) is the request's, not the rollout's
        raise _error(f"the chat template cannot render these messages: {e}", "messages") from e
    return text, sum(images, [])


async def _chat_turn(server, llm, body):
    """One chat turn: the messages rendered, sampled, tool calls parsed -> (message, finish, usage, out, hit)"""
    text, images = _render(server, llm, body)
    content, finish, usage, out, hit = await _sample(server, llm, body, text, images=images)
    ids = out.ids
    end = server["tok"].decode(ids[-1:]) if ids[-1:] and ids[-1] in server["stop"] else ""  # the engine stopped on it
    content = content.removesuffix(end)
    msg = {"role": "assistant", "content": content}
    if body.get("tools") and "<tool_call>" in content:
        calls = _tool_calls(content)
        llm.counts["malformed_tool_calls" if calls is None else "tool_calls"] += 1
        if calls:
            msg["content"], msg["tool_calls"] = content[:content.index("<tool_call>")].removesuffix("\n"), calls
            finish = "tool_calls"
    return msg, finish, usage, out, hit


async def _complete(server, llm, body):
    """A completion of one prompt (text or token ids): the text sampled, special tokens included, and its token_ids"""
    p, n = body.get("prompt"), len(server["tok"])
    if not (isinstance(p, str) and p or isinstance(p, list) and p and all(type(i) is int and 0 <= i < n for i in p)):
        raise _error(f"prompt must be a non-empty string or list of token ids in [0, {n}), one prompt", "prompt")
    if body.get("logprobs") not in (None, 0, 1):  # more would be the alternatives': the engine keeps none
        raise _error(f"logprobs={body['logprobs']!r} is not supported: 0 or 1 (the sampled token's)", "logprobs")
    text, finish, usage, out, _ = await _sample(server, llm, body, *((p, None) if isinstance(p, str) else ("", p)))
    choice = {"text": text, "token_ids": out.ids, "finish_reason": finish}
    if body.get("logprobs") is not None:
        pieces = server["tok"].batch_decode([[i] for i in out.ids])  # each sampled token's text
        choice["logprobs"] = {"tokens": pieces, "token_logprobs": out.logprobs}
    return _openai(server, body, "text_completion", choice, usage)


# ---- the Anthropic Messages and OpenAI Responses wires: translated to a chat turn and back ----


def _part(block, tools=None):
    """An Anthropic or Responses content block -> the chat content part it means (a text, or an image's data: URL)."""
    if block["type"] in ("text", "input_text", "output_text"):
        return {"type": "text", "text": block["text"]}
    if block["type"] == "image":  # Anthropic's: {"source": {"type": "base64", "media_type": ..., "data": ...}}
        url = f"data:{block['source']['media_type']};base64,{block['source']['data']}"
        return {"type": "image_url", "image_url": {"url": url}}
    if block["type"] == "input_image":
        return {"type": "image_url", "image_url": {"url": block["image_url"]}}
    if block["type"] == "tool_reference":  # a deferred tool Claude Code's ToolSearch loaded (tools: by name)
        return {"type": "text", "text": json.dumps(tools[block["tool_name"]], ensure_ascii=False)}
    raise _error(f"a content block of type {block['type']!r} is not supported (text and images are)")


def _parts(content, tools=None):
    """A string, or a list of content blocks -> chat content"""
    return content if isinstance(content, str) else [_part(block, tools) for block in content]


def _text(content):
    """Chat content (a string or text parts) -> its text"""
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def _assistant(thinking, text, calls):
    """An assistant turn's parts, sent back -> the chat message as sampled (thinking in its tags, Qwen3's layout)"""
    content = text if thinking is None else f"<think>\n{thinking}\n</think>\n\n{text}"
    return {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})


def _reply_parts(msg):
    """A chat reply -> (its thinking or None, its text, its tool calls): what each wire puts in blocks or items"""
    head, tag, tail = msg["content"].partition("</think>")
    thinking = head.removeprefix("<think>").strip("\n") if tag else None
    return thinking, tail.lstrip("\n") if tag else head, msg.get("tool_calls", [])


NOT_PARTS = ("thinking", "redacted_thinking", "tool_use", "tool_result")  # the other blocks: text and images


def _from_anthropic(body):
    """An Anthropic Messages request -> its chat request (tool_use: tool calls, tool_result: tool messages)"""
    system = _text(_parts(body.get("system") or ""))
    msgs = [{"role": "system", "content": system}] if system else []
    defs = {t["name"]: {"name": t["name"], "description": t.get("description", ""), "parameters": t["input_schema"]}
            for t in body.get("tools") or []}
    for m in body["messages"]:
        blocks = [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"]
        parts = [_part(b) for b in blocks if b["type"] not in NOT_PARTS]
        for b in blocks:
            if b["type"] == "tool_result":
                content = _parts(b.get("content", ""), defs)
                msgs.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": content})
        if m["role"] == "assistant":
            thinking = next((b["thinking"] for b in blocks if b["type"] == "thinking"), None)
            calls = [{"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": json.dumps(
                b["input"], ensure_ascii=False)}} for b in blocks if b["type"] == "tool_use"]
            msgs.append(_assistant(thinking, _text(parts), calls))
        elif parts:
            msgs.append({"role": m["role"], "content": parts})
    # a deferred tool (defer_loading) is left out until a tool_reference loads it, as on Anthropic's API
    tools = [{"type": "function", "function": defs[t["name"]]} for t in body.get("tools") or []
             if not t.get("defer_loading")]
    return {"messages": msgs, "tools": tools or None, "max_tokens": body.get("max_tokens"),
            "stop": body.get("stop_sequences")}


async def _messages(server, llm, body):
    """Anthropic's Messages API (Claude Code's wire): a chat turn as content blocks, streamed as the SDK parses them"""
    msg, finish, usage, out, hit = await _chat_turn(server, llm, _from_anthropic(body))
    thinking, text, calls = _reply_parts(msg)
    blocks = [] if thinking is None else [{"type": "thinking", "thinking": thinking, "signature": ""}]
    blocks += [{"type": "text", "text": text}] if text or not calls else []
    blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                "input": json.loads(c["function"]["arguments"])} for c in calls]
    stop = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "stop_sequence" if hit else "end_turn"}
    tokens = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}
    reply = {"id": f"msg_{time.monotonic_ns()}", "type": "message", "role": "assistant", "model": server["model"],
             "content": blocks, "stop_reason": stop[finish], "stop_sequence": hit, "usage": tokens}
    events = [("message_start", {"message": reply | {"content": [], "stop_reason": None, "stop_sequence": None}})]
    for i, block in enumerate(blocks):
        empty = {"text": {"text": ""}, "thinking": {"thinking": ""}, "tool_use": {"input": {}}}[block["type"]]
        delta = {"text": {"type": "text_delta", "text": block.get("text")},
                 "thinking": {"type": "thinking_delta", "thinking": block.get("thinking")},
                 "tool_use": {"type": "input_json_delta", "partial_json": json.dumps(block.get("input"))}}
        events += [("content_block_start", {"index": i, "content_block": block | empty}),
                   ("content_block_delta", {"index": i, "delta": delta[block["type"]]}),
                   ("content_block_stop", {"index": i})]
    events += [("message_delta", {"delta": {"stop_reason": stop[finish], "stop_sequence": hit}, "usage": tokens}),
               ("message_stop", {})]
    return reply, [_sse({"type": name} | data, name) for name, data in events]


async def _count_tokens(server, llm, body):
    """Anthropic's count_tokens: the prompt's tokens as a Messages request would render it, nothing sampled."""
    text, _ = _render(server, llm, _from_anthropic(body))
    return {"input_tokens": len(server["tok"].encode(text, add_special_tokens=False))}, []


def _from_responses(body):
    """A Responses request -> its chat request: the reasoning, message and function_call items of a turn one message"""
    items = [{"role": "user", "content": body["input"]}] if isinstance(body["input"], str) else body["input"]
    msgs = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    for item in items:
        kind = item.get("type", "message")
        if kind in ("reasoning", "function_call") or item.get("role") == "assistant":  # a part of an assistant turn
            turn = msgs[-1] if msgs and "calls" in msgs[-1] else None  # the turn being put together
            if turn is None or kind == "reasoning" and (turn["text"] or turn["calls"]):  # a reasoning item opens one
                turn = {"thinking": None, "text": "", "calls": []}
                msgs.append(turn)
        if kind == "reasoning":
            turn["thinking"] = _text(item.get("content") or item["summary"])
        elif kind == "function_call":
            turn["calls"].append({"id": item["call_id"], "type": "function",
                                  "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": item["call_id"], "content": _parts(item["output"])})
        elif kind == "message" and item["role"] == "assistant":
            turn["text"] += _text(_parts(item["content"]))
        elif kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            msgs.append({"role": role, "content": _parts(item["content"])})
        else:
            raise _error(f"input items of type {kind!r} are not supported", "input")
    msgs = [_assistant(m["thinking"], m["text"], m["calls"]) if "calls" in m else m for m in msgs]
    functions = []  # a namespace tool (Codex's) groups function tools: the model sees each as a flat one
    for tool in body.get("tools") or []:
        functions += tool["tools"] if tool["type"] == "namespace" else [tool]
    # a hosted tool (web_search, ...) the run cannot serve is left out (_responses counts it)
    tools = [{"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                               "parameters": t.get("parameters") or {}}}
             for t in functions if t["type"] == "function"]
    return {"messages": msgs, "tools": tools or None, "max_tokens": body.get("max_output_tokens")}


async def _responses(server, llm, body):
    """OpenAI's Responses API (Codex's, the Agents SDK's default): a chat turn as output items; nothing is stored"""
    if body.get("previous_response_id") is not None:
        raise _error("previous_response_id: no response is stored here; send the whole input", "previous_response_id")
    msg, finish, usage, out, _ = await _chat_turn(server, llm, _from_responses(body))
    hosted = [t for t in body.get("tools") or [] if t["type"] not in ("function", "namespace")]  # web_search, ...
    llm.counts["hosted_tools_dropped"] += len(hosted)
    thinking, text, calls = _reply_parts(msg)
    rid = time.monotonic_ns()
    output = [] if thinking is None else [{"type": "reasoning", "id": f"rs_{rid}", "summary": [],
                                          "content": [{"type": "reasoning_text", "text": thinking}]}]
    if text or not calls:
        output.append({"type": "message", "id": f"msg_{rid}", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": text, "annotations": []}]})
    # a call of a namespace's function names the namespace too: Codex finds the tool by both
    spaces = {f["name"]: t["name"] for t in body.get("tools") or [] if t["type"] == "namespace" for f in t["tools"]}
    for i, call in enumerate(calls):
        name = call["function"]["name"]
        output.append({"type": "function_call", "id": f"fc_{rid}_{i}", "call_id": call["id"], "name": name,
                       "arguments": call["function"]["arguments"], "status": "completed"})
        if name in spaces:
            output[-1]["namespace"] = spaces[name]
    status = "incomplete" if finish == "length" else "completed"
    tokens = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
              "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
              "output_tokens_details": {"reasoning_tokens": 0}}
    reply = {"id": f"resp_{rid}", "object": "response", "created_at": int(time.time()), "model": server["model"],
             "status": status, "error": None, "output": output, "usage": tokens, "parallel_tool_calls": True,
             "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
             "tool_choice": "auto", "tools": body.get("tools") or []}
    events = [("response.created", {"response": reply | {"status": "in_progress", "output": [], "usage": None}})]
    for i, item in enumerate(output):
        at = {"output_index": i, "item_id": item["id"]}
        if item["type"] == "message":  # the text in one delta, into a part that starts empty
            part = item["content"][0]
            events += [("response.output_item.added", {"output_index": i, "item": item | {"content": []}}),
                       ("response.content_part.added", at | {"content_index": 0, "part": part | {"text": ""}}),
                       ("response.output_text.delta", at | {"content_index": 0, "delta": part["text"]}),
                       ("response.output_text.done", at | {"content_index": 0, "text": part["text"]}),
                       ("response.content_part.done", at | {"content_index": 0, "part": part})]
        else:
            events.append(("response.output_item.added", {"output_index": i, "item": item}))
        events.append(("response.output_item.done", {"output_index": i, "item": item}))
    events.append((f"response.{status}", {"response": reply}))
    return reply, [_sse({"type": name, "sequence_number": n} | data, name) for n, (name, data) in enumerate(events)]


def _content(server, llm, msg, where):
    """msg's content parts -> its text (an image: <|image_pad|> per token, in <|vision_start|> ... <|vision_end|> where
    the vocabulary has them); -> its images, (3, H, W) in [0, 1], resized as Qwen3-VL's processor (smart_resize)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize  # slow to import: not at start
    mc = getattr(llm.engine, "c", None)  # the engine's model config; None: it takes no images
    images, text = [], ""
    parts = msg["content"] if isinstance(msg["content"], list) else [{"type": "text", "text": msg["content"]}]
    for j, part in enumerate(p if isinstance(p, dict) else {} for p in parts):
        at = f"{where}[{j}]"
        if part.get("type") == "text" and isinstance(part.get("text"), str):
            text += part["text"]
            continue
        url = part["image_url"].get("url") if isinstance(part.get("image_url"), dict) else None
        if not (part.get("type") == "image_url" and isinstance(url, str) and url.startswith("data:")):
            raise _error(f"{at}: a part is {{'type': 'text', 'text': ...}} or {{'type': 'image_url', 'image_url': "
                         "{'url': 'data:image/png;base64,...'}} (only data: URLs: a rollout has no network)", at)
        if not (mc and mc.vision):
            raise _error(f"{at}: an image, but the engine takes none (no vision tower, or vLLM)", at)
        factor = mc.vision["patch_size"] * mc.vision["spatial_merge_size"]  # a side is a multiple of it
        try:
            data = base64.b64decode(re.fullmatch(r"data:image/(?:png|jpeg);base64,(.*)", url, re.S)[1], validate=True)
            img = Image.open(io.BytesIO(data), formats=["PNG", "JPEG"])
            if img.width * img.height > MAX_PIXELS:
                raise _error(f"{at}: an image of {img.width}x{img.height} pixels is over {MAX_PIXELS}", at)
            H, W = smart_resize(img.height, img.width, factor=factor, min_pixels=factor * factor, max_pixels=MAX_PIXELS)
            pixels = torch.tensor(np.asarray(img.convert("RGB").resize((W, H), Image.BICUBIC)))  # (H, W, 3) uint8
        except (TypeError, ValueError, OSError, Image.DecompressionBombError) as e:  # no match, ...
            raise _error(f"{at}: not a PNG or JPEG data: URL (data:image/png;base64,...): {e}", at) from None
        images.append(pixels.permute(2, 0, 1) / 255)
        pad = server["tok"].convert_ids_to_tokens(mc.image_token_id) * int(np.prod(mc.grid(images[-1])))
        text += f"<|vision_start|>{pad}<|vision_end|>" if "<|vision_start|>" in server["tok"].get_vocab() else pad
    msg["content"] = text
    return images


def _tool_calls(text):
    """Every <tool_call>{"name": ..., "arguments": {...}}</tool_call> in text -> OpenAI tool_calls; None: one is bad."""
    try:
        calls = [json.loads(m.group(1)) for m in TOOL_CALL.finditer(text)]
    except ValueError:
        return None
    if not all(isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments", {}), dict)
               for c in calls):
        return None
    # arguments as a JSON string, as OpenAI sends them (the template writes a string back verbatim); ids unique in the
    # conversation: Claude Code takes a repeated one for an interrupted call
    return [{"id": f"call_{secrets.token_hex(8)}", "type": "function", "function": {
        "name": c["name"], "arguments": json.dumps(c.get("arguments", {}), ensure_ascii=False)}} for c in calls] or None
