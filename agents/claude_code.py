"""claude_code: Claude Code, the real CLI, unchanged, as the agent. Each episode runs `claude -p` headless in a fresh
work directory with a fresh HOME, the episode's endpoint as its Anthropic Messages API; it asks for a*b+c written into
answer.txt, and the reward is 1.0 when that file holds the number, else 0.0 (tools/agentkit.py's cli_episode: a
non-zero exit trains, a CLI that made no call is an agent error). The rollout builds the episodes from the endpoint's
record of the CLI's calls, its system prompt and tools included (~11.7k tokens on Qwen3's tokenizer: give
engine_max_len room). Install the CLI with tests/install_harnesses.sh (into .harnesses/), or put `claude` on PATH."""
from tools.agentkit import claude_code_cli, cli_episode

PROMPT = "Compute {a}*{b}+{c} and write the result, only the number, into the file answer.txt in this directory."
MAX_OUTPUT_TOKENS = 1024  # per reply when the task names none: the CLI's own (32k) would fill a context


async def run(task, llm):
    max_output = task.get("max_new_tokens") or MAX_OUTPUT_TOKENS
    return await cli_episode(lambda home: claude_code_cli(llm, PROMPT.format(**task), max_output),
                             task["a"] * task["b"] + task["c"], llm)
