"""A warm start for the chat `calc` task: a tiny dense model trained by cross-entropy on the assistant tokens of
synthetic transcripts, rendered as the endpoint renders them (the tiny chat template, the python tool): a tool call,
its result, the answer. The code always uses the question's numbers, but computes a*b+c in a fraction `right` of the
transcripts and a*b-c in the rest: the model learns the format and copying, and leaves one token (+ or -) to chance,
right about `right` of the time. RL has to learn that choice from the reward alone.
    python tests/warm_start.py OUT_DIR [--right 0.3]
    python train.py --model=OUT_DIR --task=calc --max_turns=2 --max_new_tokens=64 --engine_max_len=512 --lr=2e-4"""
import argparse
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import agent  # noqa: E402
from model_moe import ModelConfig, Transformer  # noqa: E402


def transcript(rng, right):
    a, b, c = (rng.randint(1, 9) for _ in range(3))  # as make_task draws them
    op = "+" if rng.random() < right else "-"
    out = a * b + c if op == "+" else a * b - c  # never a*b+c: c >= 1
    call = {"id": "call_0", "type": "function",
            "function": {"name": "python", "arguments": json.dumps({"code": f"print({a}*{b}{op}{c})"})}}
    return [{"role": "user", "content": agent.load_agent("calc").__globals__["PROMPT"].format(a, b, c)},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": str(out)},
            {"role": "assistant", "content": f"The answer is {out}."}]


def encode(tok, msgs):
    """-> (ids, loss mask): each assistant turn as the template renders it, through its <|im_end|> (what the engine
    samples); the text between turns tokenized on its own, as the endpoint tokenizes a prompt's new part."""
    def render(m, gen):
        return tok.apply_chat_template(m, tools=[agent.load_agent("calc").__globals__["PYTHON_TOOL"]], tokenize=False, add_generation_prompt=gen)
    ids, mask, done = [], [], ""
    for i in (i for i, m in enumerate(msgs) if m["role"] == "assistant"):
        prompt, full = render(msgs[:i], True), render(msgs[:i + 1], False)
        turn = full[len(prompt):full.index("<|im_end|>", len(prompt)) + len("<|im_end|>")]
        p, t = (tok.encode(s, add_special_tokens=False) for s in (prompt[len(done):], turn))
        ids, mask, done = ids + p + t, mask + [0] * len(p) + [1] * len(t), prompt + turn
    return ids, mask


def main(out, right=0.3, max_steps=1000, seed=0, batch=8, lr=2e-3):
    """Until the loss nears its floor (the entropy of the one choice): copying the question's numbers is learned
    suddenly (seed 0: 475 steps, 114 s on 2 cores; at batch 16, 361 steps, 171 s; at lr 4e-3, 990 steps).
    -> the number of steps."""
    agent.make_tokenizer(out)
    tok, rng = agent.load_tokenizer(out), random.Random(seed)
    model = Transformer(ModelConfig(vocab_size=len(tok))).init_weights(seed)  # the tiny preset's size, dense
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in range(max_steps):
        rows = [encode(tok, transcript(rng, right)) for _ in range(batch)]
        T = max(len(ids) for ids, _ in rows)
        ids = torch.tensor([ids + [0] * (T - len(ids)) for ids, _ in rows])
        mask = torch.tensor([m + [0] * (T - len(m)) for _, m in rows], dtype=torch.float32)[:, 1:]
        logp = torch.log_softmax(model(ids[:, :-1]), -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
        if sum(losses[-20:]) / 20 < 0.012:
            model.save_pretrained(out)
            return step + 1
    raise RuntimeError(f"the loss was {sum(losses[-20:]) / 20:.3f} after {max_steps} steps (copying not learned)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--right", type=float, default=0.3)
    a = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"{main(a.out, a.right)} steps", flush=True)
