# The CPU default: the embedded torch engine, a tiny MoE made from scratch (8 experts, top-2), and the
# multi-turn guess-the-number game. Learns from reward ~0.1 to >0.9 on two CPU cores.
#   torchrun --standalone --nproc_per_node=2 train.py --config configs/guess.py
out_dir = "out/guess"
model = "tiny"
task = "guess"
guess_max = 7
max_turns = 4
max_new_tokens = 4
group_size = 8
prompts_per_step = 8
max_steps = 200
max_staleness = 1
lr = 2e-3
