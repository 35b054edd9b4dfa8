"""tools/agentkit.py: helpers agent programs import (the framework uses none of them). Token level: prompt_ids,
turn_suffix and model_turn build an agent.Episode turn by turn; chat level: openai_client, an OpenAI client on the
episode's endpoint; CLI harnesses (agents/claude_code.py, agents/codex.py): claude_code_cli, codex_cli, cli_episode.
Beside it, tools/sandbox.py runs the code a model writes for its tools."""
import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

# the CLI harnesses tests/install_harnesses.sh installs
HARNESSES = Path(__file__).resolve().parent.parent / ".harnesses" / "node_modules" / ".bin"


# conversations grow by appending token ids, never by re-rendering
def prompt_ids(tok, text: str) -> list[int]:
    """The opening user turn and the assistant header, as the chat template renders it."""
    s = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok.encode(s, add_special_tokens=False)


def turn_suffix(tok, text: str, role: str = "user") -> list[int]:
    """Ids that continue a chat after an assistant turn that ended with <|im_end|>: a new turn + assistant header."""
    # Special tokens split the text before BPE runs, so these ids equal what a full render would give here.
    return tok.encode(f"\n<|im_start|>{role}\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


async def model_turn(llm, ep) -> str:
    """One model turn appended to ep; returns its text, decoded only to show the environment."""
    completion = await (llm.generate(ep.ids, images=ep.images) if ep.images else llm.generate(ep.ids))
    ep.append_completion(completion)
    end = llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    if not completion.ids or completion.ids[-1] != end:  # cut off at max_new_tokens: we close the turn (mask 0)
        ep.append([end])
    return llm.tokenizer.decode(completion.ids, skip_special_tokens=True)


def openai_client(llm):
    """An `openai.AsyncOpenAI` on this episode's endpoint, for chat agents. verify=False: the endpoint is plain HTTP
    on loopback, and a default client loads the CA certificates (blocking the rollout's loop) each time one is made."""
    import openai  # here: only chat agents need it
    # no client timeout: the episode's is episode_timeout
    return openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0, timeout=None,
                              http_client=openai.DefaultAsyncHttpxClient(verify=False))


# ---- CLI harnesses as agents ----


def find_cli(name):
    """-> the path of the CLI `name`: .harnesses/ first, then PATH."""
    local = HARNESSES / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"no {name!r} in {HARNESSES} or on PATH: install it with tests/install_harnesses.sh")
    return found


async def run_cli(argv, env, cwd):
    """Run the CLI in its own process group -> (exit code, stderr). Cancelled (episode_timeout), or done: the group
    is killed, so no shell the CLI started outlives the episode."""
    proc = await asyncio.create_subprocess_exec(*argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                start_new_session=True)
    try:
        _, err = await proc.communicate()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group has already ended
            pass
        if proc.returncode is None:
            await proc.wait()
    return proc.returncode, err.decode(errors="replace")


def answer_in_file(work, expected):
    """-> (reward, whether answer.txt exists in work): 1.0 when it holds `expected` and nothing else."""
    answer = Path(work, "answer.txt")
    if not answer.is_file():
        return 0.0, False
    return float(answer.read_text(errors="replace").strip() == str(expected)), True


def claude_code_cli(llm, prompt, max_output=None):
    """`claude -p prompt` headless, every tool allowed, on the episode's endpoint -> (argv, env); env holds only what
    it needs beyond PATH and HOME: no traffic to anything but the endpoint. max_output: its tokens a reply (its own:
    32k)."""
    argv = [find_cli("claude"), "-p", prompt, "--model", llm.model, "--permission-mode", "bypassPermissions"]
    env = {
        "ANTHROPIC_BASE_URL": llm.base_url.removesuffix("/v1"),  # the CLI appends /v1/messages itself
        "ANTHROPIC_API_KEY": llm.api_key,
        # no telemetry, error reports, update checks or feature flags (NONESSENTIAL alone sufficed in 2.1.332)
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        # lets root bypass permissions: the episode's sandbox is the rollout's business, not the CLI's
        "IS_SANDBOX": "1",
    }
    if max_output:
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(max_output)
    return argv, env


def codex_cli(llm, prompt, codex_home):
    """`codex exec prompt` with the episode as a custom Responses provider -> (argv, env). No plugin sync (GitHub,
    chatgpt.com), no metrics (ab.chatgpt.com), no hosted web search; its config, sessions and logs in codex_home."""
    provider = {"name": "nanomolt", "base_url": llm.base_url, "env_key": "NANOMOLT_API_KEY", "wire_api": "responses"}
    config = {f"model_providers.nanomolt.{key}": value for key, value in provider.items()}
    config |= {"model_provider": "nanomolt", "features.plugins": False, "analytics.enabled": False,
               "web_search": "disabled"}
    overrides = [arg for key, value in config.items() for arg in ("-c", f"{key}={json.dumps(value)}")]  # TOML values
    # its own sandbox (a bundled bubblewrap) needs user namespaces, which a container may not allow
    argv = [find_cli("codex"), "exec", "-m", llm.model, *overrides, "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox", prompt]
    return argv, {"NANOMOLT_API_KEY": llm.api_key, "CODEX_HOME": str(codex_home)}


async def cli_episode(command, expected, llm):
    """One episode of a CLI harness in a fresh temporary HOME and work directory; command(home) -> (argv, env).
    -> the chat agent's result: the reward answer.txt earned (expected: what it should hold), the exit code.

    A model that writes nonsense (an untrained one, a reply cut at max_new_tokens) can make the CLI give up with a
    non-zero exit code: the policy's doing, the episode trains. A CLI that made no model call at all (not installed,
    misconfigured, crashed at start) is an agent error: nothing was sampled to train on."""
    with tempfile.TemporaryDirectory(prefix="cli_episode_", ignore_cleanup_errors=True) as tmp:
        home = os.path.join(tmp, "home")
        work = os.path.join(tmp, "work")
        os.mkdir(home)
        os.mkdir(work)
        argv, env = command(home)
        code, err = await run_cli(argv, env | {"PATH": os.environ["PATH"], "LANG": "C.UTF-8", "HOME": home}, work)
        reward, exists = answer_in_file(work, expected)
    if not llm.calls:  # it never reached the endpoint: a broken setup, not a policy's episode
        raise RuntimeError(f"{argv[0]} exited with code {code} before any model call: {err[-2000:]}")
    return {"reward": reward, "info": {"exit_code": code, "answer_file": float(exists)}}
