"""TRL's GRPOTrainer on the work `python bench.py trl` gives it; run under TRL's own interpreter (a venv that sees
nanomolt's packages, e.g. `python -m venv --system-site-packages`):
    python tests/trl_arith.py --config configs/guess.py --task=arith ... --model=DIR --max_steps=N --out_dir=D
The prompts are nanomolt's: its task stream and agentkit.prompt_ids, checked against TRL's own chat rendering.
Writes <out_dir>/metrics.jsonl with train.py's keys for each step's wall time and mean reward."""
import json
import os
import re
import sys
import tempfile
import time

import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import agent  # noqa: E402
from tools import agentkit
import config  # noqa: E402

cfg = config.load(sys.argv[1:])
assert cfg.task == "arith" and cfg.max_turns == 1, "the script rewards arith's single answer only"
tok = AutoTokenizer.from_pretrained(cfg.model)
tasks = [agent.make_task("arith", g * cfg.group_size, seed=cfg.seed, group_size=cfg.group_size)
         for g in range(cfg.max_steps * cfg.prompts_per_step)]
questions = [cfg.arith_prompt.format(**t) for t in tasks]
msgs = [[{"role": "user", "content": q}] for q in questions]
for m, q in zip(msgs, questions):  # TRL renders a conversational prompt with the chat template itself
    ids = tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert ids == agentkit.prompt_ids(tok, q), "TRL would sample from other prompt ids than nanomolt"
data = Dataset.from_dict({"prompt": msgs, "answer": [t["a"] + t["b"] for t in tasks]})


def reward(completions, answer, **_):  # as agent.load_agent("arith"): the completion's last integer is the answer
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(bool(n) and int(n[-1]) == a) for n, a in zip((re.findall(r"-?\d+", t) for t in texts), answer)]


class StepTimes(TrainerCallback):
    """Wall time between optimizer steps (the first from the start of training)."""
    def on_train_begin(self, *_, **__):
        self.t = [time.perf_counter()]

    def on_step_end(self, *_, **__):
        self.t.append(time.perf_counter())


with tempfile.TemporaryDirectory() as out:
    # bf16 autocast and gradient checkpointing are on by TRL's default: autocast as --dtype asks (bfloat16: its
    # default), no recompute (nanomolt's work: activations kept)
    args = GRPOConfig(
        output_dir=out, use_cpu=True, seed=cfg.seed, max_steps=cfg.max_steps, report_to="none", save_strategy="no",
        logging_steps=1, shuffle_dataset=False, per_device_train_batch_size=cfg.batch_size,
        num_generations=cfg.group_size, max_completion_length=cfg.max_new_tokens, temperature=cfg.temperature,
        top_k=cfg.top_k, top_p=cfg.top_p, learning_rate=cfg.lr, lr_scheduler_type="constant", warmup_steps=0,
        adam_epsilon=cfg.adam_eps, weight_decay=cfg.weight_decay, max_grad_norm=cfg.grad_clip, beta=cfg.kl_coef,
        dataloader_num_workers=0, bf16=cfg.dtype == "bfloat16", gradient_checkpointing=False)
    model = AutoModelForCausalLM.from_pretrained(cfg.model)
    timer = StepTimes()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok,
                          callbacks=[timer])
    trainer.train()
times = [b - a for a, b in zip(timer.t, timer.t[1:])]
rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
os.makedirs(cfg.out_dir, exist_ok=True)
with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "w") as f:  # the keys of train.py's that bench.py reads
    f.writelines(json.dumps({"step": i + 1, "time/step": t, "reward/mean": r, "trl_version": trl.__version__}) + "\n"
                 for i, (t, r) in enumerate(zip(times, rewards)))
