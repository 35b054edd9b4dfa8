# Images on CPU: a tiny Qwen3-VL-MoE learns by RL alone to count 1..4 squares in 16x16 images (16 image tokens, one
# a 4x4-pixel cell); one sampled token answers. Groups of 8 share an image. README: "Images".
out_dir = "out/image_count"
patch_size = 2
task = "count"
max_turns = 1
max_new_tokens = 1
group_size = 8
prompts_per_step = 16
max_steps = 200
max_staleness = 0  # on-policy, lr 3e-4
lr = 3e-4
filter_groups = True  # a policy that always says one digit gets 0.25, and its groups all-equal rewards: skipped
eval_every = 20  # the trained groups are the filtered ones: held-out prompts say what it can do
