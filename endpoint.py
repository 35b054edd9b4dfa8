"""endpoint.py: an OpenAI-compatible endpoint, so an agent can be any program that speaks the chat API. One aiohttp
server per rollout process; each episode's base URL is http://127.0.0.1:PORT/ep/<id>/v1. Chat messages are rendered
with the chat template; when the prompt starts with a segment's so far, its ids are kept and only the rest is
tokenized, else (Qwen3 drops earlier <think> blocks, the agent edits its history) a new segment: one more trained
episode. Images come as image_url content parts with data: URLs, each becoming its run of <|image_pad|> tokens."""
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
# the engine has no penalties, seed, logprobs, n > 1: a request may set them only to values that change nothing
FIXED = {"n": 1, "best_of": 1, "echo": False, "presence_penalty": 0, "frequency_penalty": 0,
         "logit_bias": {}, "logprobs": False, "top_logprobs": 0, "seed": None}
MAX_PIXELS = 1 << 24  # an image's pixels, as sent and after resizing (Qwen3-VL's processor's longest_edge)


async def serve(tokenizer, sampling: dict, stop_ids, model: str = "policy") -> dict:
    """Serve on a free port of 127.0.0.1 in the running loop; sampling (no request changes it), stop_ids: the run's."""
    server = {"tok": tokenizer, "sampling": sampling, "model": model, "stop": set(stop_ids),
              "episodes": weakref.WeakValueDictionary()}  # an episode's llm; it goes when the rollout drops it
    app = web.Application(client_max_size=64 << 20)
    for path, fn in [("chat/completions", _chat), ("completions", _complete)]:
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
        if not hmac.compare_digest(request.headers.get("Authorization", "").encode(), f"Bearer {llm.api_key}".encode()):
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
            kind, choice, usage = await fn(server, llm, body)
        head = {"id": f"nanomolt-{time.monotonic_ns()}", "model": server["model"], "created": int(time.time())}
        if body.get("stream"):
            return await _stream(request, head, kind, choice, usage, body)
        return web.json_response(head | {"object": kind, "choices": [dict(index=0, **choice)], "usage": usage})
    except ValueError as e:  # the engine refused it: too long a prompt, a bad id
        code = "context_length_exceeded" if "max_len" in str(e) else None
        raise _error(str(e), code and ("prompt" if fn is _complete else "messages"), code) from None
    except RuntimeError as e:  # not the request's fault: a server failed (the rollout stops), the episode is closed
        raise _error(str(e), http=web.HTTPServiceUnavailable) from None


async def _stream(request, head, kind, choice, usage, body):
    """The answer as server-sent events, as the OpenAI clients parse them: the reply in one chunk once sampled (tool
    calls as deltas with their index), then the finish reason, the usage if stream_options asks, [DONE]."""
    if kind == "chat.completion":
        message = choice["message"]
        delta = {"role": "assistant", "content": message["content"]}
        if "tool_calls" in message:
            delta["tool_calls"] = [dict(call, index=i) for i, call in enumerate(message["tool_calls"])]
        chunks = [{"delta": delta, "finish_reason": None}, {"delta": {}, "finish_reason": choice["finish_reason"]}]
    else:
        chunks = [choice | {"finish_reason": None}, {"text": "", "finish_reason": choice["finish_reason"]}]
    kind = kind.replace("chat.completion", "chat.completion.chunk")
    events = [head | {"object": kind, "choices": [dict(index=0, **chunk)]} for chunk in chunks]
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append(head | {"object": kind, "choices": [], "usage": usage})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for event in events:
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    return response


def _error(message, param=None, code=None, http=web.HTTPBadRequest):
    """An OpenAI-style error body (what the agent's client raises) as an aiohttp exception, for the handler to raise."""
    kind = "server_error" if http.status_code >= 500 else "invalid_request_error"
    error = {"message": message, "type": kind, "param": param, "code": code}
    return http(text=json.dumps({"error": error}), content_type="application/json")


async def _sample(server, llm, body, text, ids=None, images=()):
    """Sample after the longest segment the prompt (text, or token ids when given) extends, else in a new segment; the
    record changes only once the engine answered. -> (text sampled up to a stop string, finish_reason, usage, ids)"""
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
    cut = min((sampled.index(s) for s in stop if s in sampled), default=None)
    if cut is not None:  # a stop string ends the turn: the tokens after the one that completes it were never shown
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
    return sampled[:cut], finish, usage, out.ids


async def _chat(server, llm, body):
    """One chat turn: the messages rendered with the chat template (with tools), sampled, tool calls parsed."""
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
    content, finish, usage, ids = await _sample(server, llm, body, text, images=sum(images, []))
    end = server["tok"].decode(ids[-1:]) if ids[-1:] and ids[-1] in server["stop"] else ""  # the engine stopped on it
    content = content.removesuffix(end)
    msg = {"role": "assistant", "content": content}
    if tools and "<tool_call>" in content:
        calls = _tool_calls(content)
        llm.counts["malformed_tool_calls" if calls is None else "tool_calls"] += 1
        if calls:
            msg["content"], msg["tool_calls"] = content[:content.index("<tool_call>")].removesuffix("\n"), calls
            finish = "tool_calls"
    return "chat.completion", {"message": msg, "finish_reason": finish}, usage


async def _complete(server, llm, body):
    """A completion of one prompt (text or token ids): the text sampled, special tokens included, and its token_ids."""
    p, n = body.get("prompt"), len(server["tok"])
    if not (isinstance(p, str) and p or isinstance(p, list) and p and all(type(i) is int and 0 <= i < n for i in p)):
        raise _error(f"prompt must be a non-empty string or list of token ids in [0, {n}), one prompt", "prompt")
    text, finish, usage, ids = await _sample(server, llm, body, *((p, None) if isinstance(p, str) else ("", p)))
    return "text_completion", {"text": text, "token_ids": ids, "finish_reason": finish}, usage


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
    # arguments as a JSON string, as OpenAI sends them; the template writes a string back verbatim
    return [{"id": f"call_{i}", "type": "function", "function": {"name": c["name"], "arguments": json.dumps(
        c.get("arguments", {}), ensure_ascii=False)}} for i, c in enumerate(calls)] or None
