"""model_moe.py against transformers' own Qwen3 / Qwen3-MoE, on random tiny configs."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

from model_moe import KVCache, Transformer

V = 96


def hf_model(moe, tied, gqa=True, seed=0, **kw):
    torch.manual_seed(seed)
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2 if gqa else 4, head_dim=8, tie_word_embeddings=tied, rope_theta=5e4 + seed)
    if moe:
        c = Qwen3MoeConfig(**common, **{"moe_intermediate_size": 16, "num_experts": 6, "num_experts_per_tok": 2,
                                        "mlp_only_layers": [1], **kw})
    else:
        c = Qwen3Config(**common, **kw)
    m = AutoModelForCausalLM.from_config(c).float().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)  # large weights so routing and attention are far from uniform
    return m


def padded_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    mask[2, 6:] = 0  # right padding
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


@pytest.mark.parametrize("moe,tied,gqa,norm_topk", [(False, False, True, True), (False, True, False, True),
                                                    (True, False, True, True), (True, True, True, False)])
def test_parity_with_transformers(tmp_path, moe, tied, gqa, norm_topk):
    hf = hf_model(moe, tied, gqa, **({"norm_topk_prob": norm_topk} if moe else {}))
    hf.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(str(tmp_path)).eval()
    ids, mask, pos = padded_batch()
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, position_ids=pos).logits
        out = ours(ids, positions=pos, pad_mask=mask.bool())
    assert out.shape == (3, 9, V)
    diff = (ref - out)[mask.bool()].abs().max().item()
    assert diff <= 1e-4, diff


@pytest.mark.parametrize("moe", [False, True])
def test_round_trip_our_save_to_transformers(tmp_path, moe):
    hf = hf_model(moe, tied=False)
    hf.save_pretrained(tmp_path / "a")
    ours = Transformer.from_pretrained(str(tmp_path / "a"))
    ours.save_pretrained(str(tmp_path / "b"))
    keys = set(load_file(str(tmp_path / "b" / "model.safetensors")))
    if moe:
        assert "model.layers.0.mlp.experts.5.down_proj.weight" in keys  # per-expert keys, as published
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "b")).float().eval()
    ids, mask, pos = padded_batch(1)
    with torch.no_grad():
        a = hf(ids, attention_mask=mask, position_ids=pos).logits
        b = back(ids, attention_mask=mask, position_ids=pos).logits
    assert (a - b)[mask.bool()].abs().max() <= 1e-5


def test_sharded_checkpoint(tmp_path):
    hf = hf_model(True, tied=False)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    ours = Transformer.from_pretrained(str(tmp_path)).eval()
    ids = torch.randint(0, V, (2, 5))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max() <= 1e-4


def test_kv_cache_rows_of_different_lengths(tmp_path):
    hf_model(True, tied=True).save_pretrained(tmp_path)
    m = Transformer.from_pretrained(str(tmp_path)).eval()
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, V, (n,), generator=g) for n in (12, 9, 15)]
    prompt_lens, n_decode = [5, 3, 8], 4
    cache = KVCache(m.config, n_slots=4, max_len=32)
    slots = torch.tensor([2, 0, 3])  # any free slots
    with torch.no_grad():
        for s, slot, p in zip(seqs, slots, prompt_lens):  # prefill each row on its own
            m(s[None, :p], cache=cache, slots=slot[None])
        for step in range(n_decode):  # then decode all rows together, each at its own position
            ids = torch.stack([s[p + step] for s, p in zip(seqs, prompt_lens)])[:, None]
            pos = torch.tensor([p + step for p in prompt_lens])[:, None]
            inc = m(ids, positions=pos, cache=cache, slots=slots)
            for b, s in enumerate(seqs):
                full = m(s[None, :prompt_lens[b] + step + 1])[0, -1]
                assert (inc[b, 0] - full).abs().max() <= 1e-5


def test_routing_capture_and_replay(tmp_path):
    # top-1 with renormalised weights: each combine weight is exactly 1, so replaying the captured
    # experts must reproduce the original logits even after the router is perturbed
    hf_model(True, tied=False, num_experts_per_tok=1, norm_topk_prob=True).save_pretrained(tmp_path)
    m = Transformer.from_pretrained(str(tmp_path))
    ids = torch.randint(0, V, (2, 7))
    with torch.no_grad():
        logits, routing = m(ids, return_routing=True)
        assert routing.shape == (2, 2, 7, 1)  # (moe layers 0 and 2, B, T, top_k)
        assert torch.equal(m(ids, routing=routing), logits)
        for i in (0, 2):
            m.model.layers[i].mlp.gate.weight.add_(torch.randn_like(m.model.layers[i].mlp.gate.weight))
        free, free_routing = m(ids, return_routing=True)
        replayed, replay_routing = m(ids, routing=routing, return_routing=True)
    assert not torch.equal(free_routing, routing) and (free - logits).abs().max() > 1e-3
    assert torch.equal(replay_routing, routing) and (replayed - logits).abs().max() <= 1e-6


def test_replay_router_gradient(tmp_path):
    hf_model(True, tied=False).save_pretrained(tmp_path)  # top-2: the combine weights depend on the router
    m = Transformer.from_pretrained(str(tmp_path))
    ids = torch.randint(0, V, (2, 7))
    with torch.no_grad():
        _, routing = m(ids, return_routing=True)
    m(ids, routing=routing).square().mean().backward()
    assert m.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_bad_checkpoints(tmp_path):
    hf_model(True, tied=False).save_pretrained(tmp_path / "ok")
    with pytest.raises(FileNotFoundError, match="config.json"):
        Transformer.from_pretrained(str(tmp_path / "nothing"))
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    (tmp_path / "arch").mkdir()
    (tmp_path / "arch" / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        Transformer.from_pretrained(str(tmp_path / "arch"))
    (tmp_path / "nofile").mkdir()
    (tmp_path / "nofile" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        Transformer.from_pretrained(str(tmp_path / "nofile"))
    sd = load_file(str(tmp_path / "ok" / "model.safetensors"))
    sd["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(5, 32)
    (tmp_path / "shape").mkdir()
    (tmp_path / "shape" / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(tmp_path / "shape" / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.self_attn.q_proj.weight"):
        Transformer.from_pretrained(str(tmp_path / "shape"))
    del sd["model.layers.1.self_attn.q_proj.weight"]
    save_file(sd, str(tmp_path / "shape" / "model.safetensors"))
    with pytest.raises(ValueError, match="q_proj"):
        Transformer.from_pretrained(str(tmp_path / "shape"))
