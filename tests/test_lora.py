"""LoRA (lora_rank > 0): only the adapters train, the engine and checkpoints get merged weights, FSDP agrees, resume."""
import json
import os
import subprocess
import sys

import pytest
import torch

import config
import train
from model_moe import ModelConfig, Transformer, add_lora, merge_lora
from test_train import one_and_two_ranks, same_checkpoints, same_tensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def dense_dir(tmp_path):
    """A small dense model (so the MLP projections are targets too) saved as a Hugging Face directory."""
    c = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8)
    Transformer(c).init_weights(0, std=0.2).save_pretrained(tmp_path / "base")
    return str(tmp_path / "base")


def test_only_adapters_train_and_hold_optimizer_state(tmp_path):
    path = dense_dir(tmp_path)
    cfg = config.load(["--lora_rank=4", f"--lora_targets={TARGETS}", "--lr=1e-2"])
    torch.manual_seed(0)
    model = train.build_model(cfg, 0, torch.device("cpu"), False, path)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    trainable = {k for k, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in k for k in trainable)
    assert len(trainable) == 2 * 7 * 2  # A and B, 7 targets, 2 layers
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)  # as train.main builds it
    ids = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # B starts at 0, so A's gradient is 0 in the first step: two steps move both
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
        assert {k for k, p in model.named_parameters() if p.grad is not None} == trainable
        opt.step()
    after = model.state_dict()
    for k, v in base.items():
        assert torch.equal(v, after[k]) != (k in trainable), k  # the base bit-exactly as it was; every adapter moved
    assert sum(len(s) > 0 for s in opt.state.values()) == len(trainable) == len(opt.state)


def test_merged_weights_compute_what_the_adapters_do(tmp_path):
    c = ModelConfig.load(dense_dir(tmp_path))
    lora = add_lora(Transformer.from_pretrained(tmp_path / "base"), 4, 2.0, TARGETS.split(","))
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if n.endswith("lora_B"):
                p.normal_(0, 0.3)  # (a fresh B is 0: the test would pass with no merge at all)
    merged, adapters = merge_lora(lora, lora.state_dict())
    assert len(adapters) == 2 * 7 * 2 and not any(".lora_" in k for k in merged)
    plain = Transformer(c)
    plain.load_state_dict(merged, strict=True)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b, base = lora(ids), plain(ids), Transformer.from_pretrained(tmp_path / "base")(ids)
    assert (a - b).abs().max() < 1e-5
    assert (a - base).abs().max() > 1e-2  # the adapters do change the output


def test_experts_and_unknown_targets_are_refused(tmp_path):
    c = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, head_dim=8, num_experts=4)
    for targets in (["w_gate"], ["q_proj", "gate_proj"]):  # the MoE model has no dense gate_proj
        with pytest.raises(ValueError, match="experts"):
            add_lora(Transformer(c), 4, 1.0, targets)


def test_fsdp_two_ranks_equal_one_process_with_lora(tmp_path):
    one, two = one_and_two_ranks(tmp_path, "lora")
    assert one["grads"] and all(".lora_" in k for k in one["grads"])  # the frozen base has no gradient
    same_tensors(one, two, ("grads", "weights", "published"))
    # published: only the adapted weights, merged, under the base names
    assert sorted(one["published"]) == sorted(k for k in one["weights"] if k.endswith(("_proj.weight")))
    base = Transformer.from_pretrained(str(tmp_path / "two.pt.base")).state_dict()
    for k, v in one["weights"].items():
        if ".lora_" not in k:
            assert torch.equal(v, base[k]) and torch.equal(two["weights"][k], base[k]), k
        if k in one["published"]:
            assert (one["published"][k] - v).abs().max() > 1e-4, k  # merged: not the frozen base


def run_train(out, *args):
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "guess.py"),
           f"--out_dir={out}", "--prompts_per_step=4", "--ckpt_every=0", "--max_staleness=0", "--lora_rank=4",
           "--lr=5e-3", *args]
    r = subprocess.run(cmd, env=ENV, cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def test_checkpoint_is_merged_for_transformers_and_resume_restores_the_adapters(tmp_path):
    full = run_train(tmp_path / "a", "--max_steps=4")
    run_train(tmp_path / "b", "--max_steps=2")
    resumed = run_train(tmp_path / "b", "--max_steps=4", "--resume")
    for x, y in zip(full, resumed):  # adapters (and their optimizer state) restored: the same steps 3 and 4
        assert x["reward/mean"] == y["reward/mean"] and x["loss/policy"] == y["loss/policy"]
        assert x["grad/norm"] == y["grad/norm"], x["step"]
    same_checkpoints(tmp_path / "a" / "ckpt", tmp_path / "b" / "ckpt")  # adapters, optimizer state, merged weights
    ckpt, init = tmp_path / "a" / "ckpt", tmp_path / "a" / "tiny-init"
    trainer = torch.load(ckpt / "trainer.pt", weights_only=False)
    adapters = trainer["adapters"]
    assert len(adapters) == 2 * 4 * 4 and len(trainer["optimizer"]["state"]) == len(adapters)  # (A, B) x qkvo x L
    ours, base = Transformer.from_pretrained(ckpt), Transformer.from_pretrained(init)
    changed = {k for k, v in base.state_dict().items() if not torch.equal(v, ours.state_dict()[k])}
    assert changed == {k.replace("lora_A", "weight") for k in adapters if k.endswith("lora_A")}
    lora = add_lora(base, 4, 16.0 / 4, "q_proj,k_proj,v_proj,o_proj".split(","))
    lora.load_state_dict(adapters, strict=False)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt)).eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b, c = hf(ids).logits, ours(ids), lora(ids)
    assert (a - b).abs().max() < 1e-4 and (b - c).abs().max() < 1e-5
