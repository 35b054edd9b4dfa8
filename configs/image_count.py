# Images on CPU: a tiny Qwen3-VL-MoE learns by RL alone to count 1..4 squares in a 16x16 image (4x4 patches,
# merged 2x2: 4 image tokens, the defaults); one sampled token answers. Groups of 8 share an image. README: "Images".
out_dir = "out/image_count"
model = "tiny"
tiny_vision = True
task = "count"
max_turns = 1
max_new_tokens = 1
group_size = 8
prompts_per_step = 16
max_steps = 200
max_staleness = 0  # on-policy, lr 3e-4: higher lr or max_staleness=1 settle on one digit more often
lr = 3e-4
