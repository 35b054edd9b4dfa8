# The CPU default: a tiny MoE from scratch (8 experts, top-2) learns the multi-turn guess-the-number game
# (secret in 1..5, four turns, "4 is too high" feedback) with the embedded engine. README: "The default run".
out_dir = "out/guess"
guess_max = 5
max_turns = 4
max_new_tokens = 1  # a guess is one sampled digit; the agent closes the turn with <|im_end|> (mask 0)
group_size = 8
prompts_per_step = 8
max_steps = 700
lr = 5e-4
adam_eps = 1e-6  # with 1e-8 most runs collapsed to a near-uniform policy (README, "Stability of the tiny MoE")
router_aux_coef = 0.01  # without it two experts per layer took ~90% of the tokens
eval_every = 10  # held-out prompts (README, "Evaluation"): 16 x 4 episodes, a batch's worth, every 10 steps
eval_prompts = 16
