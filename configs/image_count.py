# An image task on CPU: the tiny MoE plus a small vision encoder (2 blocks over the 16 4x4 patches of a
# 16x16 RGB image), from scratch and by RL alone, learns to count 1..4 colored squares. The reply's first
# digit answers (max_new_tokens=1: one sampled token). Random replies score ~0.003 (a digit is 1 token in ~380);
# always the same number, 0.25; reading the image is needed for more.
#   python train.py --config configs/image_count.py
out_dir = "out/image_count"
model = "tiny"
tiny_vision = True
task = "count"
image_size = 16
patch_size = 4
max_turns = 1
max_new_tokens = 1
group_size = 8
prompts_per_step = 8
max_steps = 100
max_staleness = 1
lr = 1e-3
