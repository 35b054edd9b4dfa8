# A real model on GPUs: Qwen3-0.6B (dense) learning the tool-using calc task with the embedded engine.
# Needs: a CUDA machine, the checkpoint downloaded beforehand (nothing is fetched at run time), e.g.
#   huggingface-cli download Qwen/Qwen3-0.6B --local-dir /models/Qwen3-0.6B
#   torchrun --standalone --nproc_per_node=8 train.py --config configs/qwen3_0p6b_gpu.py
# FSDP2 shards the fp32 master weights over the ranks and computes in bfloat16 (MixedPrecisionPolicy);
# the rollout process (on rank 0's host) keeps an fp32 copy on GPU 0 and refreshes it every step.
out_dir = "out/qwen3-0.6b-calc"
model = "/models/Qwen3-0.6B"
dtype = "float32"
task = "calc"
max_turns = 3
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
ckpt_every = 50
policy_loss = "ppo"
correction = "tis"
