"""model_moe.py: the policy. A Qwen3-style decoder (dense or mixture-of-experts) in plain PyTorch that also runs Llama
and Qwen2 checkpoints (no q/k norm; Qwen2's q/k/v biases; Llama 3 RoPE scaling), GGUF files included. Names mirror
Hugging Face's, so a checkpoint loads key for key; only experts convert (stacked [E, out, in] here, per expert on disk).
One forward serves training and generation (a KV cache, one slot per request): engine and trainer run the same code. MoE
routing is captured and replayed ("routing replay", arXiv:2510.11370): replay fixes which experts run, the router still
gets gradient through the combine weights. Qwen3-VL (dense or MoE): a vision tower's features replace <|image_pad|>
placeholders (and join the first decoder layers: DeepStack), positions are 3D (M-RoPE)."""
import json
import math
import os
from dataclasses import dataclass, field, fields
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.utils.checkpoint import checkpoint

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3", "LlamaForCausalLM": "llama",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3VLForConditionalGeneration": "qwen3",
                 "Qwen3VLMoeForConditionalGeneration": "qwen3"}  # -> family
LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass
class ModelConfig:
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256  # dense MLP width
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    num_experts: int = 0  # 0 = dense model (Qwen3ForCausalLM)
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    family: str = "qwen3"  # qwen3 (q/k RMSNorm; Qwen3-MoE when num_experts > 0), llama, qwen2 (q/k/v biases)
    attention_bias: bool = False  # biases on q, k, v and o (Llama's and Qwen3's attention_bias)
    rope_scaling: dict = None  # Llama 3 RoPE scaling, LLAMA3_ROPE's keys; None: plain RoPE
    vision: dict = None  # Qwen3-VL: its vision_config (depth, hidden_size, num_heads, patch_size, ...); None: text only
    image_token_id: int = -1  # id of <|image_pad|>; -1: none
    mrope_section: list = None  # Qwen3-VL's M-RoPE: how many rotary frequencies the t, h and w positions take

    def is_moe_layer(self, i):
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def n_moe_layers(self):
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def grid(self, image):
        """(C, H, W) image -> (h, w), the grid of its placeholder tokens: one per merge x merge patches."""
        side = self.vision["patch_size"] * self.vision["spatial_merge_size"]  # pixels
        return image.shape[-2] // side, image.shape[-1] // side

    def check_placeholders(self, n, images):
        if n != sum(tokens := [h * w for h, w in map(self.grid, images)]):
            raise ValueError(f"{n} image placeholders (token id {self.image_token_id}) for {len(images)} images "
                             f"of {tokens} tokens")

    @classmethod
    def load(cls, path):
        cfg_path = Path(path, "config.json")
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{cfg_path}: missing (not a Hugging Face model directory)")
        return cls.from_hf(json.loads(cfg_path.read_text()), cfg_path)

    @classmethod
    def from_hf(cls, hf, path="config.json"):
        arch = (hf.get("architectures") or ["?"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"{path}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
        if vision := hf.get("vision_config"):  # Qwen3-VL: the decoder's settings are in text_config
            top = {k: hf[k] for k in ("image_token_id", "tie_word_embeddings") if k in hf}
            hf = hf["text_config"] | top | {"vision": vision}
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        rope = {"rope_type": rope.get("type", "default"), **rope}  # "type": the older configs' name
        # what these families may set and this model does not implement is refused by name, never ignored
        for key, ok in [("rope_type", ("default", "llama3")), ("hidden_act", ("silu",)), ("mlp_bias", (False,)),
                        ("use_sliding_window", (False,)), ("partial_rotary_factor", (1.0,)),
                        ("mrope_interleaved", (True,))]:  # the vision tower is transformers': it reads its own
            if (value := {**hf, **rope}.get(key, ok[0])) not in ok:
                raise ValueError(f"{path}: {key}={value!r} is not supported (supported: {', '.join(map(repr, ok))})")
        kw = {f.name: hf[f.name] for f in fields(cls) if f.name in hf and hf[f.name] is not None}
        return cls(**kw | dict(
            family=ARCHITECTURES[arch], rope_theta=hf.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling={k: rope[k] for k in LLAMA3_ROPE} if rope["rope_type"] == "llama3" else None,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            mrope_section=rope.get("mrope_section") if vision else None,
            num_experts=hf.get("num_experts", hf.get("num_local_experts", 0)) if "Moe" in arch else 0))

    def to_hf(self):
        hf = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("family", "rope_scaling", "vision",
                                                                                  "image_token_id", "mrope_section")}
        moe = self.num_experts > 0
        arch = "Qwen3MoeForCausalLM" if moe else next(a for a, f in ARCHITECTURES.items() if f == self.family)
        rope = {"rope_type": "llama3" if self.rope_scaling else "default", "rope_theta": self.rope_theta}
        rope |= {"mrope_section": self.mrope_section, "mrope_interleaved": True} if self.vision else {}
        hf |= dict(architectures=[arch], model_type="qwen3_moe" if moe else self.family, hidden_act="silu",
                   rope_parameters={**rope, **(self.rope_scaling or {})}, torch_dtype="float32",
                   num_local_experts=self.num_experts)
        if not self.vision:
            return hf
        vl = "qwen3_vl_moe" if moe else "qwen3_vl"  # Qwen3-VL: the decoder's settings go in text_config
        return dict(architectures=[("Qwen3VLMoe" if moe else "Qwen3VL") + "ForConditionalGeneration"], model_type=vl,
                    text_config=hf | {"model_type": vl + "_text"}, vision_config=self.vision, torch_dtype="float32",
                    image_token_id=self.image_token_id, tie_word_embeddings=self.tie_word_embeddings)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):  # normalise in fp32 like the reference, then scale in the input dtype
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


def inv_freq(mc: ModelConfig, device):
    """-> (hd/2,) rotary frequencies, fp32 as in the reference. Llama 3 scaling (arXiv:2407.21783) divides by
    factor those of wavelength > original_max / low_freq_factor, keeps those < original_max / high_freq_factor."""
    f = 1.0 / mc.rope_theta ** (torch.arange(0, mc.head_dim, 2, dtype=torch.int64, device=device).float() / mc.head_dim)
    if scaling := mc.rope_scaling:
        lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
        keep = ((scaling["original_max_position_embeddings"] * f / (2 * math.pi) - lo) / (hi - lo)).clamp(0, 1)
        f = (1 - keep) * f / scaling["factor"] + keep * f  # keep: 0 .. 1, linear in original_max / wavelength between
    return f


class Attention(nn.Module):
    def __init__(self, mc: ModelConfig):
        super().__init__()
        self.nh, self.nkv = mc.num_attention_heads, mc.num_key_value_heads  # query heads, key/value heads
        self.hd = mc.head_dim
        qkv_bias = mc.attention_bias or mc.family == "qwen2"  # Qwen2: biases on q, k, v, none on o
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(mc.hidden_size, n * self.hd, bias=qkv_bias)
                                                 for n in (self.nh, self.nkv, self.nkv))
        self.o_proj = nn.Linear(self.nh * self.hd, mc.hidden_size, bias=mc.attention_bias)
        norm = (lambda: RMSNorm(self.hd, mc.rms_norm_eps)) if mc.family == "qwen3" else nn.Identity  # per head
        self.q_norm, self.k_norm = norm(), norm()

    def forward(self, x, cos, sin, mask, cache=None):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.nh, self.hd)).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_norm(self.k_proj(x).view(B, T, self.nkv, self.hd)).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        # RoPE, rotate-half as in the checkpoints: t * cos + cat(-t2, t1) * sin; sin comes signed, so one flip swaps
        q, k = (t * cos + t.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * sin for t in (q, k))
        if cache is not None:  # write this call's keys at their positions, attend over the slot's history
            k, v = cache(k, v)
        if x.is_cpu and x.dtype != torch.float32:  # by hand (SDPA's bf16 backward is slow), G heads stacked on T
            s = q.unflatten(1, (self.nkv, -1)).flatten(2, 3) @ k.transpose(-1, -2) * self.hd ** -0.5  # (B, nkv, G*T, n)
            p = s.unflatten(2, (-1, T)).masked_fill(~mask[:, None, None], -torch.inf).softmax(-1, dtype=torch.float32)
            y = (p.to(v.dtype).flatten(2, 3) @ v).unflatten(2, (-1, T)).flatten(1, 2)  # (B, nh, T, hd)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=self.nkv != self.nh)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (nn.Linear(i, o, bias=False)
                                                        for i, o in ((dim, hidden), (dim, hidden), (hidden, dim)))

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LoRALinear(nn.Module):
    """LoRA (arXiv:2106.09685) on a frozen linear layer: y = x W^T + b + scale * (x A^T) B^T with A (r, in) random and
    B (out, r) zero, so training starts at the base model. Keys: weight, bias (the base's), lora_A, lora_B."""
    def __init__(self, base: nn.Linear, rank, scale):
        super().__init__()
        self.weight, self.bias = base.weight, base.bias  # the frozen base layer's, under its keys
        self.scale = scale
        self.lora_A = nn.Parameter(base.weight.new_empty(rank, base.in_features).normal_(0, base.in_features ** -0.5))
        self.lora_B = nn.Parameter(base.weight.new_zeros(base.out_features, rank))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + self.scale * F.linear(F.linear(x, self.lora_A), self.lora_B)


def add_lora(model, rank, scale, targets):
    """Each linear layer whose last name is in targets -> LoRALinear (never MoE experts, lm_head); none named: error."""
    for name, m in list(model.named_modules()):
        if type(m) is nn.Linear and name.rpartition(".")[2] in targets and name != "lm_head":
            model.set_submodule(name, LoRALinear(m, rank, scale))
    if missing := set(targets) - {n.rpartition(".")[2] for n, m in model.named_modules() if type(m) is LoRALinear}:
        raise ValueError(f"config: lora_targets {sorted(missing)}: no such linear layer (MoE experts, lm_head: never)")
    return model


def merge_lora(model, sd):
    """The model's state dict sd (whole, or its LoRA layers') -> (the merged one: W + scale * B @ A under the base
    names, what engines and transformers load; the adapters alone). sd {}: ({}, {})."""
    adapters = {k: v for k, v in sd.items() if ".lora_" in k}
    merged = {k: v for k, v in sd.items() if k not in adapters}
    for n, m in model.named_modules() if sd else ():
        if isinstance(m, LoRALinear):
            merged[f"{n}.weight"] = merged[f"{n}.weight"] + m.scale * adapters[f"{n}.lora_B"] @ adapters[f"{n}.lora_A"]
    return merged, adapters


class MoE(nn.Module):
    """Softmax router, top-k experts, SwiGLU experts stored stacked; tokens grouped per expert."""
    def __init__(self, mc: ModelConfig):
        super().__init__()
        E, H = mc.num_experts, mc.hidden_size
        ffn = mc.moe_intermediate_size  # an expert's hidden width
        self.top_k, self.norm_topk_prob = mc.num_experts_per_tok, mc.norm_topk_prob
        self.gate = nn.Linear(H, E, bias=False)  # the router
        self.w_gate, self.w_up, self.w_down = (nn.Parameter(torch.empty(E, *s)) for s in ((ffn, H), (ffn, H), (H, ffn)))

    @torch.compiler.disable  # under torch.compile (train.py's compile): CPU's grouped_mm traces only in bfloat16
    def forward(self, x, replay=None, aux_mask=None):
        """x (..., H) -> (y (..., H), experts (..., k)). aux_mask (...) bool: tokens aux_loss counts (None: all)."""
        shape, x = x.shape, x.reshape(-1, x.shape[-1])  # x: (N, H)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # (N, E)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        self.flips = None  # with replay: (replayed positions where this router would pick other experts, positions)
        if replay is not None:  # the experts are given (-1: not recorded, route freely);
            replay = replay.reshape(-1, self.top_k).to(x.device, torch.long)  # the weights still come
            rec = replay[:, 0] >= 0  # from (and train) this router
            flipped = (experts.sort(-1).values != replay.sort(-1).values).any(-1)  # (N,)
            self.flips = torch.stack([flipped[rec].sum(), rec.sum()])
            experts = torch.where(replay >= 0, replay, experts)
            weights = probs.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        E, k = len(self.w_gate), self.top_k  # experts, experts per token
        flat = experts.flatten()  # (N*k,) in token order
        counts = torch.bincount(flat, minlength=E)
        # load balancing (arXiv:2101.03961, Switch): E * sum_e share_e * mean prob_e over kept tokens; 1 when balanced
        self.aux_loss = None
        if torch.is_grad_enabled():
            keep = torch.ones(len(x), device=x.device) if aux_mask is None else aux_mask.reshape(-1).to(probs.dtype)
            n = keep.sum().clamp(min=1)
            share = torch.zeros(E, device=x.device).index_add(0, flat, keep.repeat_interleave(k)) / (n * k)
            self.aux_loss = E * (share * (probs * keep[:, None]).sum(0) / n).sum()
        # grouped by expert: one grouped matmul per projection (a matmul per expert over its rows, no host sync)
        order, ends = flat.argsort(stable=True), counts.cumsum(0).to(torch.int32)  # expert e's rows end at ends[e]
        xs = x[order // k]  # (N*k, H)
        h = F.silu(F.grouped_mm(xs, self.w_gate.mT, offs=ends)) * F.grouped_mm(xs, self.w_up.mT, offs=ends)
        out = F.grouped_mm(h, self.w_down.mT, offs=ends)[order.argsort()]  # (N*k, H) in token order
        y = (out.view(-1, k, x.shape[-1]) * weights[..., None].to(x.dtype)).sum(1)  # each token's k rows, weighted
        return y.reshape(shape), experts.reshape(*shape[:-1], self.top_k)


class Block(nn.Module):
    def __init__(self, mc: ModelConfig, i):
        super().__init__()
        self.input_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps)
        self.self_attn = Attention(mc)
        self.post_attention_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps)
        self.mlp = MoE(mc) if mc.is_moe_layer(i) else MLP(mc.hidden_size, mc.intermediate_size)

    def forward(self, x, cos, sin, mask, cache=None, replay=None, aux_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        h = self.post_attention_layernorm(x)
        h, experts = self.mlp(h, replay, aux_mask) if isinstance(self.mlp, MoE) else (self.mlp(h), None)
        return x + h, experts


class KVCache:
    """One slot per request: k, v (L, S, nkv, max_len, hd). A row's token at position p sits at index p of its slot:
    rows of any lengths share a batch; a freed slot is reused uncleared (stale entries lie past the new positions)."""
    def __init__(self, mc: ModelConfig, n_slots, max_len, dtype=torch.float32, device="cpu"):
        shape = (mc.num_hidden_layers, n_slots, mc.num_key_value_heads, max_len, mc.head_dim)
        self.k, self.v = torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    def bind(self, slots, positions):
        """For one forward of rows in slots (B,) at positions (B, T): -> n_keys and update(i, k, v), which writes
        layer i's k, v (B, nkv, T, hd) in and returns the slots' keys and values (B, nkv, n_keys, hd)."""
        nkv, max_len, hd = self.k.shape[2:]
        n_keys = int(positions.max()) + 1
        # row of each (slot, head, position) in a layer's (S * nkv * max_len, hd) view: one index_copy_ a write
        heads = torch.arange(nkv, device=slots.device)[:, None]
        at = ((slots[:, None, None] * nkv + heads) * max_len + positions[:, None]).flatten()  # (B * nkv * T,)
        # slots first, first+1, ... (the engine's rows when all slots are busy): read them as a view, no copy
        first = int(slots[0])
        in_order = torch.equal(slots, torch.arange(first, first + len(slots), device=slots.device))

        def update(i, k, v):
            for cache, new in ((self.k[i], k), (self.v[i], v)):
                cache.view(-1, hd).index_copy_(0, at, new.reshape(-1, hd))
            kv = self.k[i, :, :, :n_keys], self.v[i, :, :, :n_keys]  # (S, nkv, n_keys, hd) each, views
            return [t[first:first + len(slots)] if in_order else t.index_select(0, slots) for t in kv]
        return n_keys, update


def patches(images, vision):
    """(C, H, W) images in [0, 1] -> (their patches (N, C * T * p * p), grid_thw (n, 3)) as Qwen3-VL's processor makes
    them: scaled to [-1, 1], the frame repeated T = temporal_patch_size times, patches grouped merge x merge."""
    p, m, T = (vision[k] for k in ("patch_size", "spatial_merge_size", "temporal_patch_size"))
    rows = []
    for im in images:  # (C, h/m, m, p, w/m, m, p) -> (h/m, w/m, m, m, C, p, p): merge blocks in raster order
        x = ((im - 0.5) / 0.5).reshape(len(im), im.shape[1] // p // m, m, p, im.shape[2] // p // m, m, p)
        x = x.permute(1, 4, 2, 5, 0, 3, 6).unsqueeze(-3)
        rows.append(x.expand(*x.shape[:5], T, p, p).reshape(-1, len(im) * T * p * p))
    return torch.cat(rows), torch.tensor([[1, im.shape[1] // p, im.shape[2] // p] for im in images], device=im.device)


class Transformer(nn.Module):
    def __init__(self, mc: ModelConfig):
        super().__init__()
        self.config = mc
        self.model = nn.Module()  # the nesting only mirrors Hugging Face key names
        self.model.embed_tokens = nn.Embedding(mc.vocab_size, mc.hidden_size)
        self.model.layers = nn.ModuleList(Block(mc, i) for i in range(mc.num_hidden_layers))
        self.model.norm = RMSNorm(mc.hidden_size, mc.rms_norm_eps)
        self.lm_head = nn.Linear(mc.hidden_size, mc.vocab_size, bias=False)
        self.checkpointing = False  # activation checkpointing: each block recomputed in backward (replay included)
        if mc.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if mc.vision:  # Qwen3-VL's vision tower (arXiv:2511.21631), transformers' own: it neither samples nor routes
            from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionConfig, Qwen3VLVisionModel
            self.visual = Qwen3VLVisionModel(Qwen3VLVisionConfig(**mc.vision))  # keys model.visual.* on disk

    @torch.no_grad()
    def init_weights(self, seed=0, std=0.02):
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            one = name.endswith(("norm.weight", "norm1.weight", "norm2.weight"))  # RMSNorm's and LayerNorm's
            p.copy_(torch.ones_like(p) if one else torch.randn(p.shape, generator=gen, device=gen.device) * std)
        return self

    def forward(self, ids, positions=None, segments=None, cache=None, slots=None, routing=None,
                return_routing=False, images=None, logits_at=None, aux_mask=None, rope_shift=None):
        """ids (B, T) -> logits (B, T, vocab) [, routing (n_moe_layers, B, T, top_k)]; positions (B, T). segments
        (B, T): a token sees the earlier ones of its segment and of segment 0 (train.packed_rows: a shared prompt, then
        each episode's rest); padding as -1 is invisible (left or right). routing: experts to replay. cache/slots:
        KVCache and each row's slot (B,). images: (C, H, W) floats in [0, 1], one per run of placeholders. rope_shift
        (B,): the engine's decode's M-RoPE offset. logits_at (B, T) bool: only these positions' logits, as (n, vocab).
        aux_mask (B, T) bool: where aux_loss (load balancing) counts."""
        mc, (B, T) = self.config, ids.shape
        positions = torch.arange(T, device=ids.device).expand(B, T) if positions is None else positions
        x = self.model.embed_tokens(ids)  # (B, T, C)
        images = list(images if images is not None else [])
        at = ids == mc.image_token_id  # (B, T): the image placeholders
        deep = []  # DeepStack's features: one (n, C) per early decoder layer
        if images and not mc.vision:
            raise ValueError("images given, but this model has no vision tower (not a Qwen3-VL model)")
        if mc.vision and not images and torch.is_grad_enabled():  # under FSDP every rank's tower gets gradients
            x = x + 0 * sum(p.sum() for p in self.visual.parameters())  # (zeros), a rank without images too
        if images:  # image i's tokens replace its run of placeholders, in row-major order
            mc.check_placeholders(int(at.sum()), images)
            rope = self.visual.rotary_pos_emb  # its buffer, not in the state dict: made anew (meta, FSDP's to_empty)
            rope.inv_freq = rope.compute_axial_rope_parameters(rope.config, ids.device)[0]
            out = self.visual(*patches(images, mc.vision))  # tokens (n, C) and DeepStack's [(n, C)]
            feats, deep = out.pooler_output, out.deepstack_features
            x = x.masked_scatter(at[..., None], feats.to(x.dtype))  # fills the True positions in row-major order
        pos = positions if rope_shift is None else positions + rope_shift[:, None].to(positions.device)
        pos = self.mrope(ids, pos, images) if mc.vision else pos[None]  # (3|1, B, T)
        j = torch.arange(mc.head_dim // 2)
        # interleaved M-RoPE: frequency j turns with axis j % 3 (t, h, w) while within its mrope_section, else with t
        axes = torch.where(j < 3 * torch.tensor(mc.mrope_section)[j % 3], j % 3, 0) if mc.vision else j * 0
        freqs = pos[axes].permute(1, 2, 0)[:, None].float() * inv_freq(mc, ids.device)  # (B, 1, T, hd/2)
        cos, sin = torch.cat((freqs, freqs), -1).cos().to(x.dtype), torch.cat((-freqs, freqs), -1).sin().to(x.dtype)
        if cache is not None:
            n_keys, kv = cache.bind(slots, positions)
            mask = torch.arange(n_keys, device=ids.device) <= positions[..., None]  # (B, T, n_keys), as below
        else:
            mask = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril().expand(B, T, T)
            if segments is not None:  # a token always sees itself (no empty rows)
                mask = mask & ((segments[:, None, :] == segments[:, :, None]) | (segments[:, None, :] == 0))
        routes = []  # each MoE layer's experts (B, T, top_k); routing[len(routes)] is the next MoE layer's
        for i, layer in enumerate(self.model.layers):
            replay = routing[len(routes)] if routing is not None and isinstance(layer.mlp, MoE) else None
            run = partial(checkpoint, layer, use_reentrant=False) if self.checkpointing and x.requires_grad else layer
            x, experts = run(x, cos, sin, mask, partial(kv, i) if cache is not None else None, replay, aux_mask)
            if experts is not None:
                routes.append(experts)
            if i < len(deep):  # DeepStack: an intermediate vision block's features added to the image tokens
                x = x + torch.zeros_like(x).masked_scatter(at[..., None], deep[i].to(x.dtype))
        moe = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]
        self.aux_loss = sum(m.aux_loss for m in moe) / len(moe) if moe and moe[0].aux_loss is not None else None
        self.flips = sum(m.flips for m in moe) if moe and moe[0].flips is not None else None  # over the layers
        logits = self.lm_head(self.model.norm(x if logits_at is None else x[logits_at]))
        return (logits, torch.stack(routes) if routes else None) if return_routing else logits

    def mrope(self, ids, pos, images):
        """-> (3, B, T) M-RoPE positions (t, h, w) from pos (B, T): a text token at p is at (p, p, p); an image's h x w
        tokens from p are at (p, p + row, p + col), and the text after it goes on from p + max(h, w)."""
        out = pos[None].repeat(3, 1, 1)
        at = (ids == self.config.image_token_id).nonzero().tolist()  # (row, position) of each placeholder left
        for im in images:
            (h, w), (b, t) = self.config.grid(im), at[0]  # the image's grid; its first placeholder's row, position
            thw = torch.stack(torch.meshgrid(torch.arange(1), torch.arange(h), torch.arange(w), indexing="ij"))
            out[:, b, t:t + h * w] = out[0, b, t] + thw.flatten(1).to(out.device)  # (3, h * w)
            out[:, b, t + h * w:] += max(h, w) - h * w
            at = at[h * w:]  # the next image's placeholders
        return out

    # ---- Hugging Face checkpoints ----
    @classmethod
    def from_pretrained(cls, path, dtype=torch.float32, device="cpu"):
        """path: a Hugging Face directory, or a .gguf file (converted once, into convert_gguf's default out_dir)."""
        path = convert_gguf(str(path)) if str(path).endswith(".gguf") else path
        mc, index = ModelConfig.load(path), Path(path, "model.safetensors.index.json")
        with torch.device("meta"):
            model = cls(mc)
        # a sharded checkpoint lists its files in the index; a missing file raises FileNotFoundError, naming it
        files = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else ["model.safetensors"]
        state = {k: t for name in sorted(files) for k, t in load_file(os.path.join(path, name)).items()}
        expected = to_hf_state(model.state_dict(), mc)
        missing = [k for k in expected if k not in state]
        extra = [k for k in state if k not in expected and not (k == "lm_head.weight" and mc.tie_word_embeddings)]
        if missing or extra:
            raise ValueError(f"{path}: missing {missing[:5]}, unexpected {extra[:5]} (checkpoint vs config.json)")
        for k, t in expected.items():  # Qwen3-VL-MoE's fused experts: the Hub's layout or transformers' (transposed)
            if state[k].shape != t.shape and not (k.endswith("_proj") and state[k].mT.shape == t.shape):
                raise ValueError(f"{path}: {k} has shape {tuple(state[k].shape)}, config.json expects {tuple(t.shape)}")
        own = from_hf_state({k: state[k].to(device, dtype) for k in expected}, mc)
        own.setdefault("lm_head.weight", own["model.embed_tokens.weight"])  # tied: not on disk
        model.load_state_dict(own, strict=True, assign=True)
        if mc.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model

    def save_pretrained(self, path, state_dict=None):
        """Write config.json + model.safetensors. state_dict: a full (gathered) state dict, for FSDP."""
        save_pretrained(path, self.config, self.state_dict() if state_dict is None else state_dict)


def to_hf_state(sd, mc: ModelConfig):
    """Our state dict -> Hugging Face keys: experts per expert (Qwen3-VL-MoE: fused as on the Hub, gate_up_proj
    (E, H, 2I) gate first, down_proj (E, I, H)); tied lm_head dropped; Qwen3-VL's decoder under model.language_model."""
    out = {}
    for k, t in sd.items():
        pre, _, name = k.rpartition(".")
        if name in ("w_gate", "w_down") and mc.vision:
            w = torch.cat([t, sd[f"{pre}.w_up"]], 1) if name == "w_gate" else t
            out[f"{pre}.experts.{'gate_up' if name == 'w_gate' else 'down'}_proj"] = w.mT
        elif name in ("w_gate", "w_up", "w_down") and not mc.vision:  # w_gate[e] is expert e's gate_proj.weight
            out.update({f"{pre}.experts.{e}.{name[2:]}_proj.weight": t[e] for e in range(len(t))})
        elif name != "w_up" and not (k == "lm_head.weight" and mc.tie_word_embeddings):
            out[k] = t
    if not mc.vision:
        return out
    return {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else
             k.replace("visual.", "model.visual.", 1)): t for k, t in out.items()}


def from_hf_state(hf, mc: ModelConfig):
    """Hugging Face keys -> our state dict: per-expert tensors (checkpoints) stacked, transformers' fused ones split."""
    hf = {k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): t for k, t in hf.items()}
    out = {k: t for k, t in hf.items() if ".experts." not in k}
    for pre in dict.fromkeys(k.split(".experts.")[0] for k in hf if ".experts." in k):  # each MoE layer's mlp
        if f"{pre}.experts.gate_up_proj" in hf:  # transformers 5's in memory: (E, 2I, H), gate first; the Hub's
            gate_up, down = hf[f"{pre}.experts.gate_up_proj"], hf[f"{pre}.experts.down_proj"]  # Qwen3-VL-MoE:
            ffn, width = mc.moe_intermediate_size, mc.hidden_size  # (E, H, 2I) and (E, I, H): the pair of shapes tells
            if (gate_up.shape[1:], down.shape[1:]) == ((width, 2 * ffn), (ffn, width)):  # them apart, even at H == 2I
                gate_up, down = gate_up.mT, down.mT
            out[f"{pre}.w_gate"], out[f"{pre}.w_up"] = (t.contiguous() for t in gate_up.chunk(2, dim=1))
            out[f"{pre}.w_down"] = down.contiguous()
            continue
        for w in ("gate", "up", "down"):
            out[f"{pre}.w_{w}"] = torch.stack([hf[f"{pre}.experts.{e}.{w}_proj.weight"] for e in range(mc.num_experts)])
    return out


def save_pretrained(path, mc: ModelConfig, sd, hf_config=None):
    """config.json (hf_config, default mc.to_hf()) + model.safetensors of our state dict sd."""
    os.makedirs(path, exist_ok=True)
    hf = {k: t.detach().contiguous().cpu() for k, t in to_hf_state(sd, mc).items()}
    save_file(hf, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    Path(path, "config.json").write_text(json.dumps(hf_config or mc.to_hf(), indent=2))


def convert_gguf(gguf_path, out_dir=None):
    """GGUF file -> out_dir (its path + ".hf"; reused), fp32 HF weights by transformers (needs gguf, accelerate)."""
    out_dir = out_dir or gguf_path + ".hf"
    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer
    print(f"converting {gguf_path} to {out_dir} (once: later runs reuse it)", flush=True)
    folder, name = os.path.split(os.path.abspath(gguf_path))
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers refuses to save a model it marks quantized: its config minus that, plus the architecture
    hf_config = {k: v for k, v in hf.config.to_dict().items() if k != "quantization_config"}
    hf_config["architectures"] = [type(hf).__name__]
    mc = ModelConfig.from_hf(hf_config, gguf_path)  # an unsupported model fails here, before anything is written
    save_pretrained(out_dir + ".tmp", mc, from_hf_state(hf.state_dict(), mc), hf_config=hf_config)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir + ".tmp")
    os.replace(out_dir + ".tmp", out_dir)  # whole or not at all: a killed conversion is redone
    return out_dir
