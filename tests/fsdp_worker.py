"""Run by tests/test_train.py under torchrun (2 gloo ranks) and in one process: one train_step on a fixed
batch; rank 0 saves the full gradients and updated weights for the test to compare. With `vision`, a model with
a vision tower (Qwen3-VL's), and one episode has an image: the longest, so split_batch gives it to rank 0's first
micro-batch, and rank 1's tower runs on no image in that forward (and in its empty last micro-batch)."""
import os
import sys

import torch
import torch.distributed as dist

import config
import train
from model_moe import ModelConfig, Transformer

VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, in_channels=3, patch_size=4, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=4, deepstack_visual_indexes=[0],
              hidden_act="gelu_pytorch_tanh")


def make_msgs(model, n, seed):
    g, c = torch.Generator().manual_seed(seed), model.config
    msgs = []
    for i in range(n):
        T = int(torch.randint(6, 14, (1,), generator=g))
        ids = torch.randint(0, c.vocab_size - 1, (T,), generator=g)  # the last id is the image placeholder
        images = []
        if c.vision and i == 0:  # a (3, 16, 8) image: 2 x 1 tokens
            ids = torch.cat([ids[:2], torch.full((2,), c.image_token_id), ids[2:]])
            T, images = T + 2, [torch.rand(3, 16, 8, generator=g)]
        mask = (torch.rand(T, generator=g) < 0.6).long()
        mask[0], mask[-1] = 0, 1
        with torch.no_grad():
            _, routing = model(ids[None], return_routing=True, images=images)  # (L, 1, T, k)
        msgs.append({"ids": ids, "loss_mask": mask, "versions": torch.where(mask == 1, 0, -1),
                     "logprobs": -torch.rand(T, generator=g) * mask, "routing": routing[:, 0].transpose(0, 1).short(),
                     "engine_ids": ids[mask == 1], "reward": float(i % 3), "group": i // 3, "index": i, "info": {}, "images": images})
    return msgs


def main(out, mode="", *args):
    """mode: "vision" (images on one rank only), "kl" (a reference model: ranks with an empty micro-batch must
    still run its forward), "mini" (two updates per batch: the mini-batches are the same on 1 and 2 ranks), "lora"
    (LoRA adapters through train.build_model: frozen base and adapters sharded together; also saves what a publish
    of the changed weights sends), "gae" (a critic through train.build_model, trained beside the policy: two steps, the
first moves its zero value head, so the second's gradients reach the whole critic; two mini-batches: clipped values)."""
    vision = mode == "vision"
    cfg = config.load(["--micro_batch_tokens=24", "--grad_clip=0.5", "--max_staleness=0"] +
                      {"kl": ["--kl_coef=0.05"], "mini": ["--mini_batches=2", "--policy_loss=cispo"],
                       "lora": ["--lora_rank=4", "--lora_alpha=8"],
                       "gae": ["--advantage=gae", "--mini_batches=2", "--value_clip=0.05", "--gae_gamma=0.9"]
                       }.get(mode, []) + list(args))
    rank, world, device, _ = train.compute_init(cfg)
    c = ModelConfig(vocab_size=51, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                    **(dict(vision=VISION, mrope_section=[2, 1, 1], image_token_id=50) if vision else {}))
    model = Transformer(c).init_weights(0, std=0.2)
    ref = Transformer(c).init_weights(1, std=0.2).requires_grad_(False) if mode == "kl" else None
    msgs = make_msgs(model, 7, 1)
    model.checkpointing = cfg.activation_checkpointing  # as train.build_model sets it (after make_msgs: no_grad)
    base, critic = out + ".base", None
    if mode in ("lora", "gae") and rank == 0:
        model.save_pretrained(base)
    if mode == "gae":
        if world > 1:
            dist.barrier()
        net = train.build_model(cfg, rank, device, world > 1, base, critic=True)
        critic = net, torch.optim.SGD(net.parameters(), lr=0.5)
    if mode == "lora":  # the base saved once; adapters given (B nonzero: A gets gradients too), as on a resume
        if rank == 0:
            g = torch.Generator().manual_seed(2)
            adapters = {f"{n}.lora_{ab}": torch.randn(*shape, generator=g) * 0.3 for n, m in model.named_modules()
                        if n.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
                        for ab, shape in (("A", (4, m.in_features)), ("B", (m.out_features, 4)))}
        if world > 1:
            dist.barrier()
        model = train.build_model(cfg, rank, device, world > 1, base, adapters=adapters if rank == 0 else None)
    elif world > 1:  # as train.build_model shards (args: e.g. --reshard_after_forward=true, the GPU's pattern)
        for m in [model] + ([ref] if ref is not None else []):
            train.shard(m, cfg, device)
    # SGD: the update is linear in the gradient, so equal gradients must give equal weights (Adam's first
    # step, g / (|g| + eps), would turn 1e-9 rounding differences of near-zero gradients into lr-sized ones)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    import estimators
    adv = estimators.grpo(rewards=torch.tensor([m["reward"] for m in msgs]), group_ids=torch.tensor([m["group"] for m in msgs]))
    adv = train.advantages(cfg, msgs) if critic else adv  # gae: the rewards
    share = train.make_shares(msgs, adv.tolist(), world, cfg)[rank]
    for _ in range(2 if critic else 1):
        vec = train.train_step(model, opt, share, cfg, 0, world, ref, critic=critic)[0]
    nets = [("", model)] + ([("critic.", critic[0])] if critic else [])
    grads = {pre + k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for pre, net in nets for k, p in net.named_parameters() if p.grad is not None}
    weights = {pre + k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
               for pre, net in nets for k, p in net.named_parameters()}
    sums = train.reduce_metrics(vec, world)[0]  # over the ranks: the critic's value loss, clip count, EV sums
    metrics = torch.tensor([sums[k] for k in ("loss", "value", "v_clip", "ret2", "err2")])
    published = train.full_state(model, world > 1, changed=mode == "lora")  # what a publish sends (2 ranks: gathered)
    if rank == 0:
        torch.save({"grads": grads, "weights": weights, "published": published, "metrics": metrics}, out)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
        # once in a CI run (not in 22 runs here) a rank aborted after this point ("terminate called without an active exception":
        # gloo threads torn down during interpreter finalization); the results are saved and compared by the test
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:])
