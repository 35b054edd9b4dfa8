"""tools/agentkit.py: helpers agent programs import (the framework uses none of them). Token level: prompt_ids,
turn_suffix and model_turn build an agent.Episode turn by turn; chat level: openai_client, an OpenAI client on the
episode's endpoint; CLI harnesses (agents/claude_code.py, agents/codex.py): find_cli, run_cli, answer_in_file. Beside
it, tools/sandbox.py runs the code a model writes for its tools."""
import asyncio
import os
import shutil
import signal
import subprocess
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
