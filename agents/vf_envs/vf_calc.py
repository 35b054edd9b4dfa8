"""vf_calc: a verifiers (0.4.0) taskset with a tool, written the way verifiers' docs write one: a Toolset with one
Python function (`multiply`), served over MCP once per worker and offered to the model as `calc_multiply`; the
harness calls it when the model asks and answers with its result, so an episode is a multi-turn chat."""
import re

import verifiers.v1 as vf

QUESTIONS = [(3, 4, 5), (7, 8, 2), (6, 9, 1), (4, 4, 4), (12, 3, 7), (5, 11, 6)]


class CalcToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    async def multiply(self, a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b


class CalcData(vf.TaskData):
    answer: int


class CalcTask(vf.Task[CalcData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        """1 if the last reply's last integer is the answer."""
        numbers = re.findall(r"-?\d+", trace.last_reply)
        return float(bool(numbers) and int(numbers[-1]) == self.data.answer)


class CalcConfig(vf.TasksetConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    @classmethod
    def toolsets(cls, config: CalcConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]

    def load(self) -> list[CalcTask]:
        return [CalcTask(CalcData(prompt=f"What is {a}*{b}+{c}? Use the multiply tool.", answer=a * b + c),
                         self.config.task) for a, b, c in QUESTIONS]


__all__ = ["CalcTaskset"]

if __name__ == "__main__":  # verifiers starts the tool server as `python -m vf_calc`
    CalcToolset.run()
