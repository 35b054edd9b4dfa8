"""claude_code: Claude Code, the real CLI, unchanged, as the agent. Each episode runs `claude -p` headless in a fresh
work directory with a fresh HOME, the episode's endpoint as its Anthropic Messages API; it asks for a*b+c written into
answer.txt, and the reward is 1.0 when that file holds the number, else 0.0. The rollout builds the episodes from the
endpoint's record of the CLI's calls, its system prompt and tools included (~11.7k tokens on Qwen3's tokenizer: give
engine_max_len room). Install the CLI with tests/install_harnesses.sh (into .harnesses/), or put `claude` on PATH.

Exit codes: a model that writes nonsense (an untrained one, a reply cut at max_new_tokens) can make the CLI give up
with a non-zero exit code. That is the policy's doing, not a broken agent: when the endpoint recorded calls, the
episode trains with the reward the work directory earned, and info says the exit code. A CLI that made no call at
all (not installed, misconfigured, crashed at start) is an agent error: nothing was sampled to train on."""
import os
import tempfile

from tools.agentkit import answer_in_file, find_cli, run_cli

PROMPT = "Compute {a}*{b}+{c} and write the result, only the number, into the file answer.txt in this directory."
MAX_OUTPUT_TOKENS = 1024  # per reply when the task names none: the CLI's own (32k) would fill a context


def cli_env(task, llm, home):
    """Only what the CLI needs: the episode's endpoint, no traffic to anything else, a HOME of its own."""
    max_output = task.get("max_new_tokens") or MAX_OUTPUT_TOKENS
    return {
        "PATH": os.environ["PATH"],
        "LANG": "C.UTF-8",
        "HOME": home,
        "ANTHROPIC_BASE_URL": llm.base_url.removesuffix("/v1"),  # the CLI appends /v1/messages itself
        "ANTHROPIC_API_KEY": llm.api_key,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output),
        # no telemetry, error reports, update checks or feature flags: the endpoint is all it may reach
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        # lets root bypass permissions: the episode's sandbox is the rollout's business, not the CLI's
        "IS_SANDBOX": "1",
    }


async def run(task, llm):
    prompt = PROMPT.format(**task)
    argv = [find_cli("claude"), "-p", prompt, "--model", llm.model, "--permission-mode", "bypassPermissions"]
    with tempfile.TemporaryDirectory(prefix="claude_code_", ignore_cleanup_errors=True) as tmp:
        home = os.path.join(tmp, "home")
        work = os.path.join(tmp, "work")
        os.mkdir(home)
        os.mkdir(work)
        code, err = await run_cli(argv, cli_env(task, llm, home), work)
        reward, exists = answer_in_file(work, task["a"] * task["b"] + task["c"])
    if not llm.calls:  # it never reached the endpoint: a broken setup, not a policy's episode
        raise RuntimeError(f"claude exited with code {code} before any model call: {err[-2000:]}")
    return {"reward": reward, "info": {"exit_code": code, "answer_file": float(exists)}}
