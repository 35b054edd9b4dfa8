"""count: how many squares (1..4) does the image show? The environment answers each reply with a new image, for
max_turns turns; a reply's first digit is its answer; the reward is the fraction answered right."""
import random
import re

import torch

from agent import IMAGE_PAD, Episode
from tools.agentkit import model_turn, prompt_ids, turn_suffix

PROMPT = "How many squares?"


def squares(rng: random.Random, size: int, k: int, cell: int = 4) -> torch.Tensor:
    """A black (3, size, size) image with k cell x cell squares at distinct grid cells, each a random bright color."""
    img = torch.zeros(3, size, size)
    grid = size // cell
    for j in rng.sample(range(grid * grid), k):
        row, col = divmod(j, grid)
        color = torch.tensor([rng.randint(77, 255) / 255 for _ in "rgb"])[:, None, None]  # 8 bits, as a PNG holds
        img[:, row * cell:(row + 1) * cell, col * cell:(col + 1) * cell] = color
    return img


async def run(task: dict, llm) -> Episode:
    ep = Episode()
    tok = llm.tokenizer
    rng = random.Random(task["seed"])
    size = task.get("image_size", 16)
    # the image's placeholders: <|image_pad|> once per token, a token per 2 x 2 patches (a special token: one id each)
    text = IMAGE_PAD * (size // task.get("patch_size", 4) // 2) ** 2 + PROMPT
    right = 0
    for turn in range(1, task["max_turns"] + 1):
        k = rng.randint(1, 4)
        if turn == 1:
            ids = prompt_ids(tok, text)
        else:
            ids = turn_suffix(tok, text)  # the environment answers with an image
        ep.append_image(squares(rng, size, k), ids)
        digit = re.search(r"\d", await model_turn(llm, ep))
        if digit is not None and int(digit.group()) == k:
            right += 1
    ep.reward = right / task["max_turns"]
    ep.info = {"turns": turn}
    return ep
