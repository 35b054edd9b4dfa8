# Qwen3-0.6B on GPUs, the tool-using calc chat agent, embedded engine (`huggingface-cli download Qwen/Qwen3-0.6B
# --local-dir /models/Qwen3-0.6B` first):  torchrun --standalone --nproc_per_node=8 train.py --config <this file>
out_dir = "out/qwen3-0.6b-calc"
model = "/models/Qwen3-0.6B"
dtype = "bfloat16"
task = "calc"
max_new_tokens = 256
engine_max_len = 2048
engine_slots = 128
group_size = 16
prompts_per_step = 32
micro_batch_tokens = 16384  # padded tokens per forward/backward
lr = 1e-6
weight_decay = 0.01
max_staleness = 2
queue_size = 128  # groups
max_steps = 500
