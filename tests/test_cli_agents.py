"""The CLI harnesses as agent programs: agents/claude_code.py and agents/codex.py train unchanged in a real train.py
run. The model is a tiny random Qwen3-shaped dense model with Qwen3's own tokenizer, its context long enough for each
harness's system prompt and tools; the episodes dumped hold that prompt, trained token-exactly. The CLIs come from
tests/install_harnesses.sh (into .harnesses/); the tests skip without them."""
import json
import time

import pytest
from test_endpoint import qwen3_tokenizer
from test_harnesses import harness
from test_train import metrics, run_train

from model_moe import ModelConfig, Transformer

MAX_LEN = 16384  # Claude Code's prompt is ~11.7k tokens on Qwen3's tokenizer, Codex's ~8.7k, plus the replies


def tiny_qwen3(path):
    """A random Qwen3-shaped dense model of 2 narrow layers, Qwen3's tokenizer beside it -> its directory"""
    tok = qwen3_tokenizer()
    c = ModelConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=MAX_LEN)
    Transformer(c).init_weights(0, std=0.1).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return str(path)


def train_cli_agent(tmp_path, task):
    """train.py --task=task for 2 steps of 2 episodes (one prompt), every episode dumped -> the dumped episodes"""
    model = tiny_qwen3(tmp_path / "model")
    out = tmp_path / "out"
    # the CLI's own output budget (tens of thousands of tokens a reply) would fill the context: replies stay short
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"max_new_tokens": 16}) + "\n")
    t0 = time.perf_counter()
    r = run_train(out, f"--task={task}", f"--model={model}", f"--task_file={tasks}", "--max_steps=2",
                  "--prompts_per_step=1", "--group_size=2", "--concurrent_agents=2", "--engine_slots=2",
                  f"--engine_max_len={MAX_LEN}", "--max_new_tokens=16", "--episode_timeout=240", "--eval_every=0",
                  "--dump_every=1", "--micro_batch_tokens=16384", "--router_aux_coef=0", timeout=500)
    print(f"train.py --task={task}: {time.perf_counter() - t0:.0f} s")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = metrics(out)
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["rollout/agent_errors"] == m["rollout/malformed"] == 0, m
        assert m["tokens/trained"] > 0, m
        diff = m.get("mismatch/logprob_abs_diff")
        assert diff is None or diff < 1e-5, m  # float32: the trainer recomputes the engine's logprobs
    rows = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    # a random model's replies are cut at max_new_tokens: Claude Code retries then exits 1, Codex exits 1 on the
    # incomplete response; the episodes train all the same (the agents' docstrings), their exit codes in info
    assert len(rows) >= 4 and all("exit_code" in row["info"] and sum(row["mask"]) > 0 for row in rows)
    print("tokens per episode:", [len(row["ids"]) for row in rows], [row["info"]["exit_code"] for row in rows])
    return rows


@pytest.mark.slow
def test_claude_code_trains_as_an_agent_program(tmp_path):
    harness("claude")
    rows = train_cli_agent(tmp_path, "claude_code")
    # Claude Code's own system prompt, headless ("You are a Claude agent, built on Anthropic's Claude Agent SDK."),
    # and the task's file, in the tokens trained on
    assert all("Claude Agent SDK" in row["text"] and "answer.txt" in row["text"] for row in rows)


@pytest.mark.slow
def test_codex_trains_as_an_agent_program(tmp_path):
    harness("codex")
    rows = train_cli_agent(tmp_path, "codex")
    # Codex's own instructions ("You are a coding agent running in the Codex CLI, ...")
    assert all("Codex CLI" in row["text"] and "answer.txt" in row["text"] for row in rows)
