"""guess: find a secret in 1..guess_max from too-low / too-high feedback within max_turns model turns. The default
task, and the model of a token-level agent: the episode is built id by id, the prompt and each feedback appended as
environment tokens (loss_mask 0), each model turn as the engine's own sampled ids (loss_mask 1), so the trainer
trains exactly what was sampled; the text is decoded only to read the guess. Reward 1 if found."""
import re

from agent import Episode
from tools.agentkit import model_turn, prompt_ids, turn_suffix

PROMPT = "Guess my number from 1 to {}."
# Feedback repeats the guess ("4 is too low"): the last message then holds all a simple strategy needs,
# which is what lets a tiny model learn the game from scratch in minutes.
TOO_LOW, TOO_HIGH = "{} is too low", "{} is too high"


def feedback(number, secret):
    if number is None:
        return "say a number"
    if number == secret:
        return "correct"
    if number > secret:
        return TOO_HIGH.format(number)
    return TOO_LOW.format(number)


async def run(task: dict, llm) -> Episode:
    ep = Episode()
    tok = llm.tokenizer
    ep.append(prompt_ids(tok, PROMPT.format(task["guess_max"])))
    invalid = 0
    for turn in range(1, task["max_turns"] + 1):
        reply = await model_turn(llm, ep)
        digit = re.search(r"[1-9]", reply)  # the first digit is the guess
        number = int(digit.group()) if digit else None
        if number is None:
            invalid += 1
        said = feedback(number, task["secret"])
        if said == "correct" or turn == task["max_turns"]:
            break  # no feedback after the last turn: it would be tokens nothing learns from
        ep.append(turn_suffix(tok, said))
    ep.reward = float(said == "correct")
    ep.info = {"turns": turn, "invalid": invalid}
    return ep
