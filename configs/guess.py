# The CPU default: the embedded torch engine, a tiny MoE made from scratch (8 experts, top-2), and the
# multi-turn guess-the-number game (secret in 1..7, five turns, "4 is too low" style feedback).
# A guess is one sampled token (a digit); the agent closes the turn with <|im_end|> (mask 0).
# Random play scores ~0.02; a fixed sequence of guesses at most 5/7; >= 0.9 needs the feedback.
#   torchrun --standalone --nproc_per_node=2 train.py --config configs/guess.py
out_dir = "out/guess"
model = "tiny"
task = "guess"
guess_max = 7
max_turns = 5
max_new_tokens = 1
group_size = 8
prompts_per_step = 8
max_steps = 600
max_staleness = 1
lr = 1e-3
