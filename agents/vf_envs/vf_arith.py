"""vf_arith: a verifiers (0.4.0) taskset, written the way verifiers' docs write one, trained unchanged by
agents/verifiers_env.py: one question, one reply (single turn), scored by its @vf.reward.

Two splits of in-memory questions: `train` (the default) and `test`, for held-out evaluation
(`{"vf_env": "vf_arith", "vf_config": {"split": "test"}}` in --eval_file)."""
import re

import verifiers.v1 as vf

SPLITS = {"train": [(3, 4), (2, 7), (5, 5), (8, 1), (6, 3), (9, 2), (4, 4), (7, 6)],
          "test": [(2, 2), (6, 5), (9, 9), (1, 8)]}


class ArithData(vf.TaskData):
    answer: int


class ArithTask(vf.Task[ArithData]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        """1 if the reply's last integer is the answer."""
        numbers = re.findall(r"-?\d+", trace.last_reply)
        return float(bool(numbers) and int(numbers[-1]) == self.data.answer)


class ArithConfig(vf.TasksetConfig):
    split: str = "train"


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self) -> list[ArithTask]:
        return [ArithTask(ArithData(prompt=f"What is {a}+{b}?", answer=a + b), self.config.task)
                for a, b in SPLITS[self.config.split]]


__all__ = ["ArithTaskset"]
