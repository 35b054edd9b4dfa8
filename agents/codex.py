"""codex: OpenAI's Codex CLI, unchanged, as the agent. Each episode runs `codex exec` headless in a fresh work directory
with a fresh HOME and CODEX_HOME, the episode's endpoint as a custom provider on its Responses API; it asks for a*b+c
written into answer.txt, and the reward is 1.0 when that file holds the number, else 0.0 (tools/agentkit.py's
cli_episode: a non-zero exit trains, a CLI that made no call is an agent error). The rollout builds the episodes from
the endpoint's record of the CLI's calls, its instructions and tools included (~8.7k tokens on Qwen3's tokenizer: give
engine_max_len room). Codex sends no output limit of its own: the run's max_new_tokens caps each reply. Install the
CLI with tests/install_harnesses.sh (into .harnesses/), or put `codex` on PATH."""
import os

from tools.agentkit import cli_episode, codex_cli

PROMPT = "Compute {a}*{b}+{c} and write the result, only the number, into the file answer.txt in this directory."


def command(llm, prompt, home):
    """codex exec with its CODEX_HOME inside the episode's HOME: nothing shared between episodes"""
    codex_home = os.path.join(home, ".codex")
    os.mkdir(codex_home)
    return codex_cli(llm, prompt, codex_home)


async def run(task, llm):
    return await cli_episode(lambda home: command(llm, PROMPT.format(**task), home),
                             task["a"] * task["b"] + task["c"], llm)
