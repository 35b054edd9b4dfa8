"""Environments from hubs, run as ordinary agent files: reasoning-gym's generators and scorers, unmocked
(agents/reasoning_gym.py), through the chat endpoint and train.py."""
import json
import os
import re

import pytest
import reasoning_gym
from test_endpoint import ScriptEngine, chat_episode, dense_engine
from test_train import ROOT, metrics, run_train

import agent
import endpoint
from rollout import check_tokens

RG_FILE = os.path.join(ROOT, "configs", "rg_chain_sum.jsonl")  # {"rg_task": "chain_sum", "rg_config": {...}}
CHAIN_SUM = {"rg_task": "chain_sum", "rg_config": {"min_terms": 2, "max_terms": 3, "max_digits": 2}}


def rg_episode(engine, tok, task):
    """One reasoning_gym episode through the endpoint -> (its result, the episode, its engine calls)."""
    llm, result = chat_episode(engine, tok, lambda client, llm: agent.load_agent("reasoning_gym")(task, llm))
    [(ep, calls)] = endpoint.segments(llm, result)
    return result, ep, calls


@pytest.mark.parametrize("task", [{"seed": 11}, {"seed": 12, **CHAIN_SUM}, {"seed": 13, "rg_task": "leg_counting"}])
def test_reasoning_gym_episodes_are_token_exact_and_scored_in_0_1(tok, task):
    """A random model's reply to a generated question: built token-exactly, scored by the generator in [0, 1]."""
    result, ep, calls = rg_episode(dense_engine(tok, max_len=1024, max_new_tokens=16), tok, task)
    check_tokens(ep, calls)
    assert 0.0 <= result["reward"] <= 1.0 and set(result["info"]) == {"tagged", "exact"}
    question = reasoning_gym.create_dataset(task.get("rg_task", "chain_sum"), seed=task["seed"], size=1,
                                            **task.get("rg_config", {}))[0]["question"]
    assert question in tok.decode(ep.ids)  # the generator's problem of this seed, in the chat template


@pytest.mark.parametrize("rg", [{}, CHAIN_SUM, {"rg_task": "products"}])
def test_a_right_answer_scores_1_and_a_wrong_one_0(tok, rg):
    """Scripted replies, scored by the generator's own score_answer: the tag's answer, or the last number without one."""
    task = {"seed": 5, **rg}
    data = reasoning_gym.create_dataset(rg.get("rg_task", "chain_sum"), seed=5, size=1, **rg.get("rg_config", {}))
    right = data[0]["answer"]
    wrong = str(int(right) + 1)
    replies = {f"Let me add.\n<answer>{right}</answer>": (1.0, 1.0), f"<answer>{wrong}</answer>": (0.0, 1.0),
               f"Adding them up\n{right}": (1.0, 0.0), f"{right} is close.\n{wrong}": (0.0, 0.0), "": (0.0, 0.0),
               f"The answer is {right}.": (1.0, 0.0)}
    for reply, (reward, tagged) in replies.items():
        result, ep, calls = rg_episode(ScriptEngine(tok, [reply + "<|im_end|>"]), tok, task)
        assert result == {"reward": reward, "info": {"tagged": tagged, "exact": reward}}, reply
        check_tokens(ep, calls)


@pytest.mark.slow
def test_reasoning_gym_trains_and_evaluates_on_held_out_seeds(tmp_path):
    """train.py on a reasoning-gym generator named by the task file, with its held-out evaluation every step."""
    r = run_train(tmp_path, "--task=reasoning_gym", f"--task_file={RG_FILE}", f"--eval_file={RG_FILE}",
                  "--max_steps=2", "--prompts_per_step=2", "--group_size=2", "--engine_max_len=1024",
                  "--max_new_tokens=8", "--eval_every=1", "--eval_prompts=2", "--eval_samples=2")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = metrics(tmp_path)
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["eval/episodes"] == 4 and m["eval/failed"] == 0 and 0 <= m["eval/pass@1"] <= 1, m
        assert m["tokens/trained"] > 0 and m["rollout/agent_errors"] == m["rollout/malformed"] == 0
        assert 0 <= m["reward/mean"] <= 1
    # the held-out problems (other seeds) are none of those trained on (step 2's episodes, dumped)
    held_out = {problem(row["text"]) for row in dump(os.path.join(tmp_path, "eval", "step_1.jsonl"))}
    trained = {problem(row["text"]) for row in dump(os.path.join(tmp_path, "episodes.jsonl"))}
    assert len(held_out) == 2 and trained and not held_out & trained


def dump(path):
    return [json.loads(line) for line in open(path)]


def problem(text):
    """The chain_sum question in an episode's text ("22 + 61 =")."""
    return re.search(r"arithmetic problem: ([^\n]*)", text).group(1)
