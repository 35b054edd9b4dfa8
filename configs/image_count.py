# An image task on CPU: the tiny MoE plus a small vision encoder (2 blocks over the 16 4x4 patches of a
# 16x16 RGB image) learns from scratch, by RL alone, to count 1..4 colored squares ("How many squares?").
# The reply is one sampled token; its digit answers. Random replies score ~0.003 (a digit is one token in
# ~380); one fixed digit scores 0.25; more needs the image. Groups of 8 share an image, so GRPO compares
# answers to the same picture. Measured on 2 CPU cores (~1.2 s/step): reward ~0.004 at first, ~0.25 by
# step 120 (digits found), 0.5-0.8 by step 200 with seeds 0 and 2; seed 1 settled on one digit (~0.29).
# lr 3e-4 and on-policy batches: with lr >= 5e-4 or max_staleness=1 the policy settles on one digit first.
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
prompts_per_step = 16
max_steps = 200
max_staleness = 0
lr = 3e-4
