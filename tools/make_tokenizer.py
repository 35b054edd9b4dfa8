"""python tools/make_tokenizer.py [OUT]: trains the tiny byte-level BPE tokenizer of the "tiny" models (models trained
from scratch) and writes its tokenizer.json to OUT (default: assets/tiny_tokenizer.json, which agent.make_tokenizer
copies). The asset is frozen: text added to the corpus changes every merge, and with them the default run's tokens
(tests/test_agent.py checks that this tool still writes the asset byte for byte)."""
import os
import random
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image_pad|>"]
# the built-in tasks' text (agents/), as the corpus has it
GUESS = "Guess my number from 1 to {}."
FEEDBACK = ["{} is too low", "{} is too high", "correct", "say a number"]
CALC = "What is {}*{}+{}? You may write `calc: <python expression>`."


def corpus(rng: random.Random):
    """Synthetic text of the built-in tasks: merges go to the words the tasks use, nothing else."""
    for _ in range(2000):
        a, b, c, n = (rng.randint(1, 9) for _ in range(4))
        yield from ["user\nassistant\ntool\nsystem\n", GUESS.format(n), *(f.format(a) for f in FEEDBACK),
                    f"I guess {a}.", CALC.format(a, b, c), f"calc: {a}*{b}+{c}", f"The answer is {a * b + c}.",
                    f"{a}+{b}=", "error: exit code 1\nTraceback (most recent call last):\n  File \"main.py\"",
                    "error: timed out", "NameError: name 'x' is not defined", "SyntaxError: invalid syntax",
                    "ZeroDivisionError"]


def train(vocab_size: int = 384) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # every digit is its own token, so a tiny model reads and writes numbers digit by digit
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # all 256 bytes: any text
    tok.train_from_iterator(corpus(random.Random(0)), trainer)  # same corpus, same merges
    return tok


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "assets", "tiny_tokenizer.json")
    train().save(out)
    print(f"wrote {out}")
