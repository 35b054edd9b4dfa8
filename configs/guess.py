# The CPU default: the embedded torch engine, a tiny MoE made from scratch (8 experts, top-2), and the
# multi-turn guess-the-number game (secret in 1..5, four turns, "4 is too high" style feedback).
# A guess is one sampled token (a digit); the agent closes the turn with <|im_end|> (mask 0).
# Random play scores ~0.02; a fixed sequence of guesses at most 4/5; >= 0.9 needs the feedback.
#   torchrun --standalone --nproc_per_node=2 train.py --config configs/guess.py
out_dir = "out/guess"
model = "tiny"
task = "guess"
guess_max = 5
max_turns = 4
max_new_tokens = 1
group_size = 8
prompts_per_step = 8
max_steps = 700
max_staleness = 1
lr = 5e-4
# Stability (README, "The default run"): with AdamW's usual eps=1e-8 every parameter moved by ~lr per step
# however tiny its gradient (most here are 1e-8..1e-6), the logits of never-sampled tokens drifted up
# together and 4 of 5 two-rank runs collapsed to a near-uniform policy; eps=1e-6 damps those updates.
adam_eps = 1e-6
router_aux_coef = 0.01  # without it two experts per layer took ~90% of the tokens
