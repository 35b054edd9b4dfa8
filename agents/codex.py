"""codex: OpenAI's Codex CLI, unchanged, as the agent. Each episode runs `codex exec` headless in a fresh work directory
with a fresh HOME and CODEX_HOME, the episode's endpoint as a custom provider on its Responses API; it asks for a*b+c
written into answer.txt, and the reward is 1.0 when that file holds the number, else 0.0. The rollout builds the
episodes from the endpoint's record of the CLI's calls, its instructions and tools included (~8.7k tokens on Qwen3's
tokenizer: give engine_max_len room). Codex sends no output limit of its own: the run's max_new_tokens caps each
reply. Install the CLI with tests/install_harnesses.sh (into .harnesses/), or put `codex` on PATH.

Exit codes: a model that writes nonsense (an untrained one, a reply cut at max_new_tokens) can make the CLI give up
with a non-zero exit code. That is the policy's doing, not a broken agent: when the endpoint recorded calls, the
episode trains with the reward the work directory earned, and info says the exit code. A CLI that made no call at
all (not installed, misconfigured, crashed at start) is an agent error: nothing was sampled to train on."""
import json
import os
import tempfile

from tools.agentkit import answer_in_file, find_cli, run_cli

PROMPT = "Compute {a}*{b}+{c} and write the result, only the number, into the file answer.txt in this directory."


def cli_env(llm, home, codex_home):
    """Only what the CLI needs: the endpoint's key (the provider reads it from NANOMOLT_API_KEY), HOMEs of its own."""
    return {
        "PATH": os.environ["PATH"],
        "LANG": "C.UTF-8",
        "HOME": home,
        "CODEX_HOME": codex_home,  # its config, sessions and logs: nothing shared between episodes
        "NANOMOLT_API_KEY": llm.api_key,
    }


def overrides(llm):
    """-c key=value (a TOML value) for each setting: the episode as a custom Responses provider, no plugin sync
    (GitHub, chatgpt.com), no metrics, no hosted web search (a hosted tool the run cannot serve)"""
    provider = {"name": "nanomolt", "base_url": llm.base_url, "env_key": "NANOMOLT_API_KEY", "wire_api": "responses"}
    config = {f"model_providers.nanomolt.{key}": value for key, value in provider.items()}
    config |= {"model_provider": "nanomolt", "features.plugins": False, "analytics.enabled": False,
               "web_search": "disabled"}
    return [arg for key, value in config.items() for arg in ("-c", f"{key}={json.dumps(value)}")]  # JSON is TOML here


async def run(task, llm):
    prompt = PROMPT.format(**task)
    # its own sandbox (a bundled bubblewrap) needs user namespaces, which a container may not allow
    argv = [find_cli("codex"), "exec", "-m", llm.model, *overrides(llm), "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox", prompt]
    with tempfile.TemporaryDirectory(prefix="codex_", ignore_cleanup_errors=True) as tmp:
        home = os.path.join(tmp, "home")
        codex_home = os.path.join(tmp, "codex_home")
        work = os.path.join(tmp, "work")
        for path in (home, codex_home, work):
            os.mkdir(path)
        code, err = await run_cli(argv, cli_env(llm, home, codex_home), work)
        reward, exists = answer_in_file(work, task["a"] * task["b"] + task["c"])
    if not llm.calls:  # it never reached the endpoint: a broken setup, not a policy's episode
        raise RuntimeError(f"codex exited with code {code} before any model call: {err[-2000:]}")
    return {"reward": reward, "info": {"exit_code": code, "answer_file": float(exists)}}
