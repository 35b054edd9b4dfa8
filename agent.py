"""agent.py: what the framework and agent programs share: Episode, Completion, tokenizers, agent and task loading."""
import functools
import inspect
import json
import math
import os
import random
import runpy
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

# ---- tokenizer: a tiny byte-level BPE for models trained from scratch ----
ASSETS = Path(__file__).with_name("assets")
# ChatML as in Qwen3's template, minus thinking: a system turn, tools, tool calls and tool results in its
# <tool_call> / <tool_response> format (what endpoint.py parses). Frozen, as the tokenizer's merges are.
CHAT_TEMPLATE = ASSETS.joinpath("chat_template.jinja").read_text()
IMAGE_PAD = "<|image_pad|>"  # an image is one IMAGE_PAD per 2 x 2 patches


def make_tokenizer(path: str) -> None:
    """Save the tiny models' tokenizer, no download: assets' 384-id BPE (tools/make_tokenizer.py), one token a digit."""
    os.makedirs(path, exist_ok=True)
    shutil.copy(ASSETS / "tiny_tokenizer.json", os.path.join(path, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": 4096,
              "clean_up_tokenization_spaces": False}
    Path(path, "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def stop_ids(tok, model_dir):
    """Every end-of-turn id: the tokenizer's eos, <|im_end|> if it has one, and generation_config.json's eos ids."""
    ids = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else None}
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        eos = json.load(open(path)).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos])
    return sorted(i for i in ids if i is not None)


@functools.lru_cache(maxsize=4)
def load_tokenizer(path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def save_tokenizer(src, dst):
    """The tokenizer (its chat template too, in whatever file it came) and generation_config.json beside weights."""
    load_tokenizer(src).save_pretrained(dst)
    if os.path.isfile(os.path.join(src, "generation_config.json")):
        shutil.copy(os.path.join(src, "generation_config.json"), dst)


# ---- the episode: one typed record from rollout to loss ----
@dataclass
class Episode:
    """What the agent decides; sampled tokens' logprobs, versions and experts are the engine's (check_tokens)."""
    ids: list[int] = field(default_factory=list)  # the whole conversation, exactly the tokens the engine saw
    loss_mask: list[int] = field(default_factory=list)  # 1 on tokens the policy sampled, 0 on everything else
    reward: float = 0.0
    info: dict = field(default_factory=dict)  # numbers to log (turns, tool_errors, ...)
    images: list = field(default_factory=list)  # (C, H, W) float tensors in [0, 1], in the order of their placeholders

    def append(self, ids: list[int]) -> None:
        """Prompt, tool or environment tokens: in the sequence, never trained on."""
        self.ids += ids
        self.loss_mask += [0] * len(ids)

    def append_image(self, image: torch.Tensor, ids: list[int]) -> None:
        """An image observation, (3, H, W) floats in [0, 1]; ids hold its placeholders (<|image_pad|>s), mask 0."""
        self.append(ids)
        self.images.append(image)

    def append_completion(self, completion) -> None:
        """An engine result for prompt = self.ids: its sampled ids completion.ids, trained on."""
        self.ids += completion.ids
        self.loss_mask += [1] * len(completion.ids)

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError on an episode the trainer must not see."""
        if len(self.ids) != len(self.loss_mask):
            raise ValueError(f"lengths differ: ids {len(self.ids)}, loss_mask {len(self.loss_mask)}")
        if any(not 0 <= i < vocab_size for i in self.ids):
            raise ValueError(f"token id outside vocab [0, {vocab_size})")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask must be 0 or 1")
        if not any(self.loss_mask):
            raise ValueError("no sampled token (loss_mask is all 0)")
        if not math.isfinite(self.reward):
            raise ValueError(f"non-finite reward {self.reward}")


@dataclass
class Completion:
    ids: list  # sampled token ids (the stop token included when it was sampled)
    logprobs: list  # logprob of each sampled id under the distribution it was drawn from
    versions: list  # policy version of the weights that sampled each id
    routing: torch.Tensor | None  # (len(prompt) + len(ids), n_moe_layers, top_k) int16, -1 where not computed


class ContextFull(ValueError):
    """The conversation has reached the engine's max_len: the rollout trains the episode so far as truncated."""


AGENTS_DIR = Path(__file__).with_name("agents")  # the built-in tasks: agent files, as a user writes one


@functools.lru_cache(maxsize=16)
def load_agent(name: str):
    """`run` of an agent file (a path, or a name in agents/): `async def run(task, llm)` -> an Episode or a reward."""
    path = AGENTS_DIR / f"{name}.py"
    if not path.is_file():
        path = Path(name)
    if not path.is_file():
        builtin = ", ".join(sorted(p.stem for p in AGENTS_DIR.glob("*.py")))
        raise FileNotFoundError(f"agent {name!r} is neither a task in agents/ ({builtin}) nor an existing file")
    run = runpy.run_path(str(path), run_name=f"nanomolt_agent_{path.stem}").get("run")
    if not inspect.iscoroutinefunction(run):
        raise ValueError(f"agent file {name!r} does not define `async def run(task, llm)`")
    return run


@functools.lru_cache(maxsize=4)
def load_task_file(path: str) -> list[dict]:
    """JSONL, one JSON object per prompt, merged into its task dict; a bad line names the file and line."""
    rows = []
    for n, line in filter(lambda nl: nl[1].strip(), enumerate(Path(path).read_text().splitlines(), 1)):  # not blank
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no tasks in the file")
    return rows


def make_task(name_or_path: str, index: int, *, seed: int, group_size: int, guess_max: int = 7, max_turns: int = 3,
              tool_timeout: float = 5.0, tool_memory_mb: int = 256, task_file: str = "", **knobs) -> dict:
    """The task dict of episode `index`. A pure function of (seed, index): a resumed run continues the same stream."""
    group = index // group_size  # a group shares one prompt, so its baseline compares like with like
    rng = random.Random(seed * 1_000_003 + group)
    # Every field is drawn for every task, left to right (seed last: for user agents' own draws): none shifts another
    task = dict(knobs, task=name_or_path, index=index, group=group, guess_max=guess_max, max_turns=max_turns,
                tool_timeout=tool_timeout, tool_memory_mb=tool_memory_mb, secret=rng.randint(1, guess_max),
                a=rng.randint(1, 9), b=rng.randint(1, 9), c=rng.randint(1, 9), seed=rng.getrandbits(32))
    rows = load_task_file(task_file) if task_file else [{}]  # a data set: its rows, one per group, override the draws
    return task | rows[group % len(rows)]
