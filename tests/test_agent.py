"""agent.py: tokenizer, Episode bookkeeping, built-in tasks against a scripted fake llm, loading, task streams."""
import asyncio
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import agent
from agent import Episode, load_agent, make_task, make_tokenizer
from tools.agentkit import prompt_ids, turn_suffix
from rollout import check_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def end_id(tok):
    return tok.convert_tokens_to_ids("<|im_end|>")


class ScriptLLM:
    """Stands in for the engine: returns scripted turns as 'sampled' ids, and records each call as
    rollout.Policy does (prompt, completion, images). The code under test is the task."""

    def __init__(self, tok, turns, close=True, n_moe=0):
        self.tokenizer, self.turns, self.close, self.n_moe = tok, list(turns), close, n_moe
        self.prompts, self.sampled, self.calls = [], [], []

    async def generate(self, ids):
        k = len(self.prompts)
        self.prompts.append(list(ids))
        out = self.tokenizer.encode(self.turns[k], add_special_tokens=False) + ([end_id(self.tokenizer)] * self.close)
        self.sampled.append(out)
        routing = None
        if self.n_moe:  # experts = (position + turn) % 4, last sampled row unknown as on a real engine
            T = len(ids) + len(out)
            routing = ((torch.arange(T)[:, None, None] + k) % 4).expand(T, self.n_moe, 2).clone()
            routing[-1] = -1
        c = SimpleNamespace(ids=out, logprobs=[-0.5 - k - 0.01 * i for i in range(len(out))],
                            versions=[k + 10] * len(out), routing=routing)
        self.calls.append((list(ids), c, None))
        return c


def run(fn, task, llm):
    return asyncio.run(fn(task, llm))


# ---- tokenizer ----
def test_tokenizer_loads_and_renders_chatml(tok):
    assert 300 <= len(tok) <= 512
    msgs = [{"role": "user", "content": "Guess my number from 1 to 7."}, {"role": "assistant", "content": "5"}]
    s = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert s == ("<|im_start|>user\nGuess my number from 1 to 7.<|im_end|>\n"
                 "<|im_start|>assistant\n5<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(tok.encode(s, add_special_tokens=False)) == s
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image_pad|>"]:  # the special tokens
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] == tok.convert_tokens_to_ids(t) < 4, t


def test_digits_are_single_tokens(tok):
    for number in ["0123456789", "12345", "x=907"]:
        ids = tok.encode(number, add_special_tokens=False)
        digits = [tok.decode([i]) for i in ids if tok.decode([i]).isdigit()]
        assert digits == [ch for ch in number if ch.isdigit()]
    assert len({tok.encode(str(d), add_special_tokens=False)[0] for d in range(10)}) == 10
    assert not [t for t in tok.get_vocab() if len(t) > 1 and t.isdigit()]  # no merged digits anywhere


def test_the_tiny_tokenizer_is_the_one_its_tool_trains(tmp_path):
    """assets/tiny_tokenizer.json is frozen (the default run's tokens depend on its merges) and honest: the tool
    that trains it writes it again byte for byte; make_tokenizer saves it as AutoTokenizer loads it."""
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_tokenizer.py"), str(tmp_path / "trained.json")],
                   check=True, capture_output=True)
    assert (tmp_path / "trained.json").read_bytes() == (agent.ASSETS / "tiny_tokenizer.json").read_bytes()
    make_tokenizer(str(tmp_path / "a"))
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "trained.json").read_bytes()


def test_appending_turns_equals_rendering(tok):
    # The agent never re-renders; its appended ids must still be what the template would give.
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "5"},
            {"role": "user", "content": "higher"}]
    full = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)
    grown = (prompt_ids(tok, "hi") + tok.encode("5", add_special_tokens=False) + [end_id(tok)]
             + turn_suffix(tok, "higher"))
    assert grown == full


# ---- guess ----
def guess_task(**kw):
    return {"secret": 5, "guess_max": 7, "max_turns": 3, **kw}


def test_guess_found_episode_layout(tok):
    llm = ScriptLLM(tok, ["3", "I say 7", "5"])
    ep = run(agent.load_agent("guess"), guess_task(), llm)
    assert ep.reward == 1.0 and ep.info == {"turns": 3, "invalid": 0}
    s1, s2, s3 = llm.sampled
    prompt = prompt_ids(tok, "Guess my number from 1 to 7.")
    fb1, fb2 = turn_suffix(tok, "3 is too low"), turn_suffix(tok, "7 is too high")  # 3 < 5, then 7 > 5
    assert ep.ids == prompt + s1 + fb1 + s2 + fb2 + s3
    assert ep.loss_mask == ([0] * len(prompt) + [1] * len(s1) + [0] * len(fb1) + [1] * len(s2) + [0] * len(fb2)
                            + [1] * len(s3))
    # Each generate call saw exactly the episode so far: the conversation is the token stream.
    assert llm.prompts == [prompt, prompt + s1 + fb1, prompt + s1 + fb1 + s2 + fb2]
    sampled = [i for i, m in enumerate(ep.loss_mask) if m]
    assert [ep.ids[i] for i in sampled] == s1 + s2 + s3
    logprobs, versions, _, _ = check_tokens(ep, llm.calls)  # the engine's record, laid over the episode
    assert [logprobs[i] for i in sampled] == [-0.5 - k - 0.01 * i for k, s in enumerate(llm.sampled)
                                              for i in range(len(s))]
    assert [versions[i] for i in sampled] == [10] * len(s1) + [11] * len(s2) + [12] * len(s3)
    assert all(logprobs[i] == 0.0 and versions[i] == -1 for i, m in enumerate(ep.loss_mask) if not m)
    ep.validate(len(tok))


def test_guess_not_found_within_max_turns(tok):
    llm = ScriptLLM(tok, ["1", "2", "6", "5"])
    ep = run(agent.load_agent("guess"), guess_task(), llm)
    assert ep.reward == 0.0 and ep.info["turns"] == 3 and len(llm.prompts) == 3  # the 4th (right) guess never asked
    text = tok.decode(ep.ids)
    assert "1 is too low" in text and "2 is too low" in text and "too high" not in text  # no feedback after the last


def test_guess_invalid_turn(tok):
    llm = ScriptLLM(tok, ["hmm", "5"])
    ep = run(agent.load_agent("guess"), guess_task(), llm)
    assert ep.reward == 1.0 and ep.info == {"turns": 2, "invalid": 1}
    assert llm.prompts[1][-len(turn_suffix(tok, "say a number")):] == turn_suffix(tok, "say a number")


def test_cut_off_turn_gets_im_end_unsampled(tok):
    llm = ScriptLLM(tok, ["2", "5"], close=False)  # engine hit max_new_tokens: no <|im_end|> sampled
    ep = run(agent.load_agent("guess"), guess_task(), llm)
    i = len(prompt_ids(tok, "Guess my number from 1 to 7.")) + len(llm.sampled[0])
    assert ep.ids[i] == end_id(tok) and ep.loss_mask[i] == 0 and check_tokens(ep, llm.calls)[1][i] == -1
    assert ep.ids[-1] == end_id(tok) and ep.loss_mask[-1] == 0
    assert end_id(tok) not in [t for t, m in zip(ep.ids, ep.loss_mask) if m]
    assert llm.prompts[1] == ep.ids[:len(llm.prompts[1])]


# ---- routing: rollout.check_tokens merges the engine's record of each call ----
def test_routing_latest_computation_wins(tok):
    llm = ScriptLLM(tok, ["1", "5"], n_moe=3)
    ep = run(agent.load_agent("guess"), guess_task(), llm)
    T, routing = len(ep.ids), check_tokens(ep, llm.calls)[2]
    assert routing.shape == (T, 3, 2) and routing.dtype == torch.int16
    n2 = len(llm.prompts[1]) + len(llm.sampled[1])  # rows the second call covered
    assert routing[: n2 - 1, 0, 0].tolist() == [(t + 1) % 4 for t in range(n2 - 1)]  # second call overwrote the first
    assert (routing[n2 - 1:] == -1).all()  # the last sampled token was never fed to the model


def test_routing_keeps_old_rows_where_new_is_unknown():
    ep, calls = Episode(), []

    def complete(ids, routing):  # an engine call on the episode so far, as rollout.Policy records it
        c = SimpleNamespace(ids=ids, logprobs=[-1.0] * len(ids), versions=[len(calls)] * len(ids), routing=routing)
        calls.append((list(ep.ids), c, None))
        ep.append_completion(c)
    ep.append([1, 2])
    complete([3], torch.full((3, 1, 2), 7))
    ep.append([4])
    assert check_tokens(ep, calls)[2][:, 0, 0].tolist() == [7, 7, 7, -1]
    new = torch.full((5, 1, 2), 9)
    new[:2] = -1  # e.g. a prefix-cache hit: the engine did not recompute these
    complete([5], new)
    assert check_tokens(ep, calls)[2][:, 0, 0].tolist() == [7, 7, 9, 9, 9]
    complete([6], torch.zeros(3, 1, 2))
    with pytest.raises(ValueError, match="routing"):
        check_tokens(ep, calls)


# ---- arith ----
@pytest.mark.parametrize("answer,reward", [("7", 1.0), ("3 + 4 = 7", 1.0), ("7 or 8", 0.0), ("8", 0.0),
                                           ("", 0.0), ("17", 0.0)])
def test_arith_reward(tok, answer, reward):
    ep = run(agent.load_agent("arith"), {"a": 3, "b": 4}, ScriptLLM(tok, [answer]))
    assert ep.reward == reward and ep.ids[: len(prompt_ids(tok, "3+4="))] == prompt_ids(tok, "3+4=")
    ep = run(agent.load_agent("arith"), {"a": 3, "b": 4, "arith_prompt": "What is {a} + {b}?"}, ScriptLLM(tok, [answer]))
    assert ep.reward == reward and ep.ids[: len(prompt_ids(tok, "What is 3 + 4?"))] == prompt_ids(tok, "What is 3 + 4?")


# ---- loading agents and making tasks ----
def test_load_agent(tmp_path, tok):
    guess = load_agent("guess")  # a built-in task is an agent file in agents/, loaded by name
    assert guess.__globals__["__file__"] == str(agent.AGENTS_DIR / "guess.py")
    assert load_agent(str(agent.AGENTS_DIR / "guess.py")) is not guess  # the same file by path: loaded anew
    with pytest.raises(FileNotFoundError, match="guess"):  # the error lists the built-in tasks
        load_agent("nope")
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_agent(str(tmp_path / "nope.py"))
    (tmp_path / "norun.py").write_text("def run(task, llm):\n    pass\n")  # not async
    with pytest.raises(ValueError, match="norun.py"):
        load_agent(str(tmp_path / "norun.py"))
    (tmp_path / "mine.py").write_text("from agent import load_agent\narith = load_agent('arith')\n"
                                      "async def run(task, llm):\n    return await arith(task, llm)\n")
    ep = run(load_agent(str(tmp_path / "mine.py")), {"a": 1, "b": 1}, ScriptLLM(tok, ["2"]))
    assert ep.reward == 1.0


def test_make_task_deterministic_and_grouped():
    knobs = dict(seed=3, group_size=4, guess_max=7, max_turns=5, tool_timeout=2.0, tool_memory_mb=64)
    tasks = [make_task("guess", i, **knobs) for i in range(40)]
    assert tasks == [make_task("guess", i, **knobs) for i in range(40)]
    key = lambda t: (t["secret"], t["a"], t["b"], t["c"], t["seed"])  # noqa: E731
    for g in range(10):
        group = tasks[4 * g: 4 * g + 4]
        assert {t["group"] for t in group} == {g} and len({key(t) for t in group}) == 1
    assert len({key(t) for t in tasks}) > 5  # groups differ
    assert {t["secret"] for t in tasks} <= set(range(1, 8))
    assert tasks[0]["max_turns"] == 5 and tasks[0]["tool_timeout"] == 2.0 and tasks[0]["tool_memory_mb"] == 64
    assert [key(make_task("guess", i, **{**knobs, "seed": 4})) for i in range(0, 40, 4)] != [key(t) for t in tasks[::4]]


# ---- Episode.validate ----
def good_episode(**completion):
    ep = Episode()
    ep.append([1, 2, 3])
    c = SimpleNamespace(**{**dict(ids=[4, 5], logprobs=[-0.1, -0.2], versions=[0, 0], routing=None), **completion})
    ep.append_completion(c)
    return ep, [([1, 2, 3], c, None)]


@pytest.mark.parametrize("break_it,match", [
    (lambda e: e.ids.__setitem__(0, 50), "vocab"),
    (lambda e: e.ids.__setitem__(0, -1), "vocab"),
    (lambda e: e.loss_mask.append(0), "lengths"),
    (lambda e: setattr(e, "reward", math.nan), "reward"),
    (lambda e: setattr(e, "reward", math.inf), "reward"),
    (lambda e: setattr(e, "loss_mask", [0] * 5), "no sampled"),
    (lambda e: e.loss_mask.__setitem__(0, 2), "loss_mask"),
])
def test_validate_catches_malformed(break_it, match):
    good_episode()[0].validate(vocab_size=50)
    ep, _ = good_episode()
    break_it(ep)
    with pytest.raises(ValueError, match=match):
        ep.validate(vocab_size=50)


@pytest.mark.parametrize("completion,match", [  # an engine record the trainer must not see: check_tokens refuses it
    (dict(logprobs=[-0.1]), "lengths"),
    (dict(versions=[0, 0, 0]), "lengths"),
    (dict(routing=torch.zeros(4, 1, 2, dtype=torch.int16)), "routing"),
    (dict(routing=torch.zeros(5, 2, dtype=torch.int16)), "routing"),
    (dict(versions=[0, -1]), "version"),
    (dict(logprobs=[math.nan, -0.2]), "logprob"),
])
def test_check_tokens_catches_a_malformed_engine_record(completion, match):
    check_tokens(*good_episode())
    with pytest.raises(ValueError, match=match):
        check_tokens(*good_episode(**completion))


def test_task_file_rows_join_tasks_and_bad_lines_are_named(tmp_path):
    good = tmp_path / "tasks.jsonl"
    good.write_text('{"a": 2, "b": 40}\n\n{"a": 5, "b": 6}\n')
    t0 = agent.make_task("arith", 0, seed=0, group_size=2, task_file=str(good))
    t3 = agent.make_task("arith", 3, seed=0, group_size=2, task_file=str(good))
    t5 = agent.make_task("arith", 5, seed=0, group_size=2, task_file=str(good))
    assert (t0["a"], t0["b"]) == (2, 40) and (t3["a"], t3["b"]) == (5, 6) and (t5["a"], t5["b"]) == (2, 40)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n{"a": 2,,}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        agent.load_task_file(str(bad))
    (tmp_path / "list.jsonl").write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"list.jsonl:2: expected a JSON object, got list"):
        agent.load_task_file(str(tmp_path / "list.jsonl"))
