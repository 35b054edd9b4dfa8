"""train.py: the one asynchronous RL loop. FSDP2 trainer; rank 0 owns the rollout process.

Algorithm, per optimizer step v (weights version v -> v+1):
  1. take prompts_per_step finished groups from the rollout queue (sampled by versions v - max_staleness .. v;
     an episode with an older token is dropped and counted, and the rollout may start another)
  2. advantages per episode from the rewards of its group (estimators.ADVANTAGES); gae: per token from a critic's
     values (estimators.gae), the critic (a value model) trained beside the policy on estimators.value_loss
  3. recompute every token's logprob with the same model code under the engine's sampling filter, replaying
     the experts chosen at generation; check the trained ids are the sampled ids; log the mismatch
  4. ppo_epochs x mini_batches updates: per-token policy loss on the ratio pi / pi_old (clipped) times the
     off-policy correction pi_old / pi_rollout (estimators.CORRECTIONS), the decoupled PPO objective of AReaL
     (arXiv:2505.24298); pi_old is the recompute before the first update. Backward, clip the norm, AdamW.
     With one update (the default) the ratio is 1 and everything off-policy goes through the correction.
  5. publish the weights to the engine as version v+1; log; checkpoint every N steps

Launch:
  python train.py --config configs/guess.py                                    # one process
  torchrun --standalone --nproc_per_node=2 train.py --config configs/guess.py  # FSDP2 over 2 ranks"""
import datetime
import itertools
import json
import math
import os
import resource
import shutil
import signal
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: threads that wait sleep, not spin
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

import agent
import config
import engine
import estimators as est
import rollout
from model_moe import LoRALinear, ModelConfig, Transformer, add_lora, convert_gguf, merge_lora, save_pretrained

# ---- distributed: the same script runs under python and torchrun ----


def compute_init(cfg):
    """-> (rank, world, device, fsdp); gloo for CPU tensors in collectives; FSDP2's dtype, offload: a group of one"""
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif cfg.cpu_offload:  # the weights are in CPU memory already
        raise ValueError("config: cpu_offload=True moves weights off a GPU, and this machine has none")
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    elif cfg.dtype != "float32" or cfg.cpu_offload:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), device, dist.is_initialized()


FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_state(model, fsdp, changed=False, merged=True, cpu=True):
    """-> rank 0: the whole state dict ({} elsewhere; on the CPU unless cpu=False), LoRA merged unless merged=False"""
    if fsdp:  # every rank sends its shards, rank 0 alone keeps the whole (FULL's cpu_offload)
        sd = get_model_state_dict(model, options=FULL if cpu else StateDictOptions(full_state_dict=True))
        if dist.get_rank():
            return {}
    else:
        sd = {k: v.detach().to("cpu" if cpu else v.device) for k, v in model.state_dict().items()}
    lora = {n for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    sd = {k: v for k, v in sd.items() if not changed or k.rpartition(".")[0] in lora}
    return merge_lora(model, sd)[0] if merged else sd

# ---- the policy ----


def latest_checkpoint(cfg):
    """<out_dir>/ckpt, or ckpt.old if a crash (even kill -9) came between the two renames of a save."""
    dirs = [os.path.join(cfg.out_dir, name) for name in ("ckpt", "ckpt.old")]
    return next((d for d in dirs if os.path.isfile(os.path.join(d, "trainer.pt"))), None)


def same_architecture(a_dir, b_dir, expected=None):
    """Refuse to continue from weights of another architecture or vocabulary, naming the difference."""
    a, b = ModelConfig.load(a_dir).__dict__, (expected or ModelConfig.load(b_dir)).__dict__
    if diff := [f"{k}: {a[k]} vs {b[k]}" for k in a if k != "max_position_embeddings" and a[k] != b[k]]:
        raise ValueError(f"{a_dir} does not match {b_dir}: {'; '.join(diff)} (use another out_dir)")


def tiny_init(cfg, rank, fsdp):
    """The "tiny" model: a small MoE and a tokenizer made here from scratch (no download), in <out_dir>/tiny-init."""
    path = os.path.join(cfg.out_dir, "tiny-init")
    if rank == 0:
        if not os.path.isdir(path):
            agent.make_tokenizer(path + ".tmp")
        tok = agent.load_tokenizer(path if os.path.isdir(path) else path + ".tmp")
        D, s = cfg.tiny_hidden // 2, cfg.tiny_hidden // 8  # tiny Qwen3-VL-MoE: a 3-block tower, DeepStack from each
        tower = dict(depth=3, hidden_size=D, intermediate_size=2 * D, num_heads=2, in_channels=3, spatial_merge_size=2,
                     temporal_patch_size=2, patch_size=cfg.patch_size, out_hidden_size=cfg.tiny_hidden,
                     num_position_embeddings=(cfg.image_size // cfg.patch_size) ** 2,
                     deepstack_visual_indexes=[0, 1, 2])  # as every Qwen3-VL checkpoint (SGLang assumes 3)
        vision = dict(vision=tower | {"hidden_act": "gelu_pytorch_tanh"}, image_token_id=tok.convert_tokens_to_ids(
            agent.IMAGE_PAD), mrope_section=[s - 2 * (s // 3), s // 3, s // 3])
        mc = ModelConfig(vocab_size=len(tok), hidden_size=cfg.tiny_hidden, intermediate_size=2 * cfg.tiny_hidden,
                         num_hidden_layers=cfg.tiny_layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=cfg.tiny_hidden // 4, num_experts=cfg.tiny_experts,
                         num_experts_per_tok=cfg.tiny_top_k, moe_intermediate_size=cfg.tiny_hidden,
                         max_position_embeddings=cfg.engine_max_len, **(vision if cfg.tiny_vision else {}))
        if not os.path.isdir(path):
            torch.manual_seed(cfg.seed)
            Transformer(mc).init_weights(cfg.seed).save_pretrained(path + ".tmp")
            os.replace(path + ".tmp", path)
        else:  # made by an earlier run in this out_dir: it must be the model asked for now
            same_architecture(path, "the tiny_* settings", expected=mc)
    if fsdp:
        dist.barrier()
    return path


def shard(model, cfg, device):
    """FSDP2, a unit per block; reshard_after_forward auto: on GPUs (memory), not on CPU (one all-gather fewer)"""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=getattr(torch, cfg.dtype), reduce_dtype=torch.float32),
              reshard_after_forward={"auto": device.type == "cuda", "true": True}.get(cfg.reshard_after_forward, False),
              offload_policy=CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy())  # the step's AdamW on CPU
    for block in model.model.layers:
        fully_shard(block, **kw)
    return fully_shard(model, **kw)


def build_model(cfg, rank, device, fsdp, path, frozen=False, adapters=None, critic=False):
    """The policy (frozen: a reference or teacher; critic: a value model, lm_head a scalar head) from a HF directory;
    float32 master weights, `dtype` computes; `adapters`: a resumed run's LoRA adapters (rank 0; critic: weights)."""
    targets = cfg.lora_targets.split(",") if cfg.lora_rank and not frozen and not critic else []  # none: no change

    def adapt(net):
        if critic:  # the head made where the model is (meta, CPU, GPU)
            net.lm_head = torch.nn.Linear(net.config.hidden_size, 1, device=net.model.norm.weight.device)
            torch.nn.init.zeros_(net.lm_head.weight)
            torch.nn.init.zeros_(net.lm_head.bias)
        return add_lora(net, cfg.lora_rank, cfg.lora_alpha / max(cfg.lora_rank, 1), targets)
    if fsdp:
        with torch.device("meta"):
            model = adapt(Transformer(ModelConfig.load(path)))
        shard(model, cfg, device).to_empty(device="cpu" if cfg.cpu_offload else device)  # the shards' home
        full = adapt(Transformer.from_pretrained(path)).state_dict() | (adapters or {}) if rank == 0 else {}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    else:
        model = adapt(Transformer.from_pretrained(path, device=device))
        model.load_state_dict(adapters or {}, strict=False)
    model.checkpointing = cfg.activation_checkpointing and not frozen
    if cfg.compile and not frozen:  # fuses the element-wise work between matmuls
        model.forward = torch.compile(model.forward)
    for name, param in model.named_parameters():  # LoRA: the base frozen (no gradient, no optimizer state)
        param.requires_grad_(not frozen and (not targets or ".lora_" in name))
    return model

# ---- batches: episodes -> padded tensors ----


def collate(msgs, device, image_token=-1):
    """Episode messages -> dict of (B, T) tensors, right-padded, routing (L, B, T, k); "packed": packed_rows'."""
    for m in msgs:  # token identity: we train what was sampled
        if not torch.equal(m["ids"][m["loss_mask"].bool()], m["engine_ids"]):
            raise AssertionError(f"episode {m['index']}: trained token ids differ from the engine's sampled ids")

    def pad(key, value):
        return torch.nn.utils.rnn.pad_sequence([m[key] for m in msgs], batch_first=True, padding_value=value).to(device)
    b = {"ids": pad("ids", 0), "loss_mask": pad("loss_mask", 0).float(), "versions": pad("versions", -1),
         "rollout_logp": pad("logprobs", 0.0),  # routing: (B, T, L, k) -> (L, B, T, k)
         "routing": pad("routing", -1).permute(2, 0, 1, 3) if msgs[0]["routing"] is not None else None,
         "index": [m["index"] for m in msgs], "images": [x.to(device) for m in msgs for x in m.get("images") or ()]}
    return b | {"packed": packed_rows(msgs, device, image_token)}


def shared_prompt(ms, image_token=-1):
    """-> how many first tokens all of ms have alike (ids, replayed experts, images), none trained nor predicting one;
    0 where an image's placeholders lie past them (M-RoPE moves all positions after an image)"""
    n, images = min(len(m["ids"]) for m in ms) - 1, [m.get("images") or [] for m in ms]
    same = torch.stack([(m["ids"][:n] == ms[0]["ids"][:n]) & (m["loss_mask"][1:n + 1] == 0) for m in ms]).all(0)
    if ms[0]["routing"] is not None:
        same &= torch.stack([(m["routing"][:n] == ms[0]["routing"][:n]).flatten(1).all(1) for m in ms]).all(0)
    P = int(same.cumprod(0).sum())
    alike = all(len(x) == len(images[0]) and all(map(torch.equal, x, images[0])) for x in images)
    return P if alike and not any((m["ids"][P:] == image_token).any() for m in ms) else 0


def packed_rows(msgs, device, image_token=-1):
    """The forward's rows: a group's episodes (consecutive in msgs) that share a prompt (shared_prompt) at least as
    long as their rests go in one row, the prompt once, then each rest as segment 1, 2, ... seeing the prompt and itself
    at its own positions; "at": before each trained token, in msgs' order. Same logits, fewer tokens; {}: none."""
    rows = []
    for ms in (list(run) for _, run in itertools.groupby(msgs, key=lambda m: m.get("group"))):
        P = shared_prompt(ms, image_token)
        rows += [(ms, P)] if P * len(ms) >= sum(len(m["ids"]) - P for m in ms) else [([m], 0) for m in ms]

    def cat(value, f):  # f(message, segment) over each row: the prompt (segment 0) once, then each one's rest
        return torch.nn.utils.rnn.pad_sequence([torch.cat([f(ms[0], 0)[:P], *(f(m, s + 1)[P:] for s, m in enumerate(
            ms))]) for ms, P in rows], batch_first=True, padding_value=value).to(device)
    return {} if len(rows) == len(msgs) else {
        "ids": cat(0, lambda m, s: m["ids"]), "positions": cat(0, lambda m, s: torch.arange(len(m["ids"]))),
        "at": cat(False, lambda m, s: torch.nn.functional.pad(m["loss_mask"][1:] != 0, (0, 1))),
        "segments": cat(-1, lambda m, s: torch.full_like(m["ids"], s)),
        "images": [x.to(device) for ms, _ in rows for x in ms[0].get("images") or ()],
        "routing": cat(-1, lambda m, s: m["routing"]).permute(2, 0, 1, 3) if msgs[0]["routing"] is not None else None}


# An empty micro-batch (split_batch) still runs, the reference's forward too, on two untrained tokens: it adds exactly 0
EMPTY = {"ids": torch.zeros(2, dtype=torch.long), "loss_mask": torch.zeros(2), "versions": torch.full((2,), -1),
         "logprobs": torch.zeros(2), "routing": None, "engine_ids": torch.zeros(0, dtype=torch.long), "index": -1}


def split_batch(msgs, advantages, world, budget):
    """One update's episodes -> per rank, micro-batches of (msg, advantage) pairs: by length, a group's together, dealt
    in turn, each <= `budget` padded tokens (or one episode); as many on every rank (some empty): collectives pair."""
    pairs = sorted(zip(msgs, advantages), key=lambda p: -len(p[0]["ids"]))
    first = {m["group"]: i for i, (m, _) in reversed(list(enumerate(pairs)))}  # where each group's longest is
    pairs.sort(key=lambda p: first[p[0]["group"]])  # stable: each group's longest first
    ranks = [[] for _ in range(world)]
    for r, mbs in enumerate(ranks):
        for p in pairs[r::world]:
            if mbs and (len(mbs[-1]) + 1) * max(len(q[0]["ids"]) for q in mbs[-1] + [p]) <= budget:
                mbs[-1].append(p)
            else:
                mbs.append([p])
    n = max(1, *map(len, ranks))
    return [mbs + [[] for _ in range(n - len(mbs))] for mbs in ranks]


def make_shares(msgs, advantages, world, cfg):
    """The batch -> each rank's share: per update (mini-batch, data order), micro-batches, token and episode counts"""
    parts = torch.arange(len(msgs)).tensor_split(min(cfg.mini_batches, len(msgs)))  # none empty, sizes within one
    minis = [([msgs[i] for i in p.tolist()], [advantages[i] for i in p.tolist()]) for p in parts]
    counts = [(float(sum(m["loss_mask"].sum() for m in ms)), float(len(ms))) for ms, _ in minis]
    per_rank = [split_batch(ms, adv, world, cfg.micro_batch_tokens) for ms, adv in minis]
    return [{"mini_batches": [p[r] for p in per_rank], "counts": counts} for r in range(world)]


def advantages(cfg, msgs):
    """-> (len(msgs),) one per message; a chat episode's segments (one index) count once in the group's baseline and
    share its advantage (opd: GRPO's, weighted; gae: the reward itself, made per-token in train_step, by the critic)."""
    if cfg.advantage == "gae":
        return torch.tensor([float(m["reward"]) for m in msgs])
    episodes, of = torch.unique(torch.tensor([m["index"] for m in msgs]), return_inverse=True)  # of: (len(msgs),)
    first = torch.zeros(len(episodes), dtype=torch.long).scatter_(0, of, torch.arange(len(msgs)))  # a message each
    rewards, groups = (torch.tensor([m[k] for m in msgs])[first] for k in ("reward", "group"))  # (E,) each
    name, coef = ("grpo", cfg.opd_reward_coef) if cfg.advantage == "opd" else (cfg.advantage, 1.0)
    return (est.ADVANTAGES[name](rewards=rewards, group_ids=groups) * coef)[of]

# ---- one optimizer step: recompute -> loss -> metrics ----


def token_logp(model, b, cfg, logits=None, filtered=True):
    """-> logits (n, V) before each trained token; logp (B, T-1) of each (0 elsewhere) under the engine's filter
    (temperature, top-k, top-p; filtered=False: temperature only: a KL to a reference compares models, not samplers)."""
    sel, ids = b["loss_mask"][:, 1:].bool(), b["ids"]  # token t is predicted at position t-1
    at = torch.nn.functional.pad(sel, (0, 1))
    if logits is None:  # packed: the same logits, in the same order, from rows that hold each shared prompt once
        f = b.get("packed") or {"ids": ids, "at": at, "routing": b["routing"], "images": b["images"]}
        logits = model(f["ids"], f.get("positions"), routing=f["routing"] if b["routing"] is not None else None,
                       images=f["images"], logits_at=f["at"], aux_mask=f["at"], segments=f.get("segments")).float()
    k, p = (cfg.top_k, cfg.top_p) if filtered else (0, 1.0)
    logp = engine.filtered_logp(logits, temperature=cfg.temperature, top_k=k, top_p=p)
    # a token outside the filter of these weights (a stale one) has probability 0: a finite floor, no gradient
    tok_logp = logp.gather(-1, ids[:, 1:][sel][:, None])[:, 0].clamp(min=-1e4)
    return logits, torch.zeros_like(b["loss_mask"][:, 1:]).masked_scatter(sel, tok_logp)


def values(critic, b):
    """-> (B, T-1) V(s_t) where token t's logit would be (0 elsewhere), from the packed rows too; it routes by itself"""
    sel = b["loss_mask"][:, 1:].bool()
    f = b.get("packed") or {"ids": b["ids"], "images": b["images"], "at": torch.nn.functional.pad(sel, (0, 1))}
    out = critic(f["ids"], f.get("positions"), images=f["images"], logits_at=f["at"], segments=f.get("segments"))
    return torch.zeros_like(b["loss_mask"][:, 1:]).masked_scatter(sel, out[:, 0].float())


def micro_loss(model, b, cfg, counts, adv, world, critic=None):
    """-> (loss to backward, its LOSS_KEYS metrics, pi_old's logp); a critic's value loss joins (gradient: its own)."""
    mask = b["loss_mask"][:, 1:]
    logits, logp = token_logp(model, b, cfg)  # experts replayed
    old = b.get("old_logp", logp.detach())
    # on-policy distillation: per-token advantage log pi_teacher - log pi_old (0 without a teacher)
    distill = est.distill_advantage(teacher_logp=b.get("teacher_logp", old), old_logp=old, loss_mask=mask)
    A = b.get("advantages", adv[:, None].expand_as(logp)) + distill  # (B, T-1): gae's per token, else the episode's
    w, corr_frac = est.CORRECTIONS[cfg.correction](old_logp=old, rollout_logp=b["rollout_logp"][:, 1:],
                                                   loss_mask=mask, low=cfg.correction_low, high=cfg.correction_high)
    per_tok, clip_frac = est.POLICY_LOSSES[cfg.policy_loss](logp=logp, old_logp=old, advantages=A, loss_mask=mask,
        clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip or None)
    ent = est.entropy(logits=logits if cfg.entropy_coef else logits.detach())  # (n,)
    per_tok = per_tok * w - cfg.entropy_coef * torch.zeros_like(mask).masked_scatter(mask.bool(), ent)
    kl = torch.zeros_like(mask)
    if "ref_logp" in b:  # KL to the frozen initial policy, on the sampled tokens
        raw = token_logp(model, b, cfg, logits, filtered=False)[1] if cfg.top_k or cfg.top_p < 1 else logp
        kl = est.KL[cfg.kl_estimator](logp=raw, ref_logp=b["ref_logp"])  # (B, T-1)
        per_tok = per_tok + cfg.kl_coef * kl
    loss = est.AGGREGATIONS[cfg.aggregation](per_token=per_tok, loss_mask=mask, num_tokens=max(counts[0], 1),
                                             num_seqs=max(counts[1], 1), norm_const=cfg.max_new_tokens * cfg.max_turns)
    n_real = sum(i >= 0 for i in b["index"])  # (MoE) the load-balancing loss by this micro-batch's share of episodes
    aux = model.aux_loss * n_real / max(counts[1], 1) if model.aux_loss is not None else mask.new_zeros(())
    v_loss = v_clip = loss.new_zeros(())
    if critic is not None:
        per_v, v_clip = est.value_loss(values=values(critic, b), old_values=b["old_values"], returns=b["returns"],
                                       loss_mask=mask, clip=cfg.value_clip)
        v_loss = est.token_mean(per_token=per_v, loss_mask=mask, num_tokens=max(counts[0], 1))
    n_tok = mask.sum()
    flips = model.flips if model.flips is not None else mask.new_zeros(2)
    m = torch.stack([loss.detach(), clip_frac * n_tok, corr_frac * n_tok, ent.detach().sum(),
                     (kl.detach() * mask).sum(), aux.detach(), -distill.sum(), *flips, v_loss.detach(), v_clip * n_tok])
    # FSDP averages gradients over ranks; the aggregation already divides by the update's counts
    return (loss + cfg.router_aux_coef * aux + v_loss) * world, m, old


LOSS_KEYS = ["loss", "clip", "corr", "entropy", "kl", "router_aux", "distill_gap", "flips", "flip_n", "value", "v_clip"]
CONSISTENCY_KEYS = ["tokens", "mm_abs", "mm_kl", "mm_tokens", "stale_sum", "ret", "ret2", "err", "err2"]  # once a step


def consistency(b, old_logp, version, max_staleness):
    """Staleness and trainer-vs-engine mismatch (on the current weights' tokens) -> CONSISTENCY_KEYS + histogram"""
    sel = b["loss_mask"][:, 1:].bool()  # (B, T-1): token t, predicted at t-1
    versions, rollout_logp = b["versions"][:, 1:], b["rollout_logp"][:, 1:]  # (B, T-1) each, as sel
    stale, fresh = (version - versions)[sel], sel & (versions == version)
    d, kl = (old_logp - rollout_logp)[fresh], est.kl_k3(logp=rollout_logp[fresh], ref_logp=old_logp[fresh])
    hist = torch.bincount(stale.clamp(max=max_staleness), minlength=max_staleness + 1)
    ret = b.get("returns", torch.zeros_like(old_logp))[sel]  # gae: explained variance's sums (of returns, errors)
    err = ret - b.get("old_values", torch.zeros_like(old_logp))[sel]
    return torch.cat([torch.stack([sel.sum(), d.abs().sum(), kl.sum(), fresh.sum(), stale.sum(), ret.sum(),
                                   (ret ** 2).sum(), err.sum(), (err ** 2).sum()]).double(), hist])


def train_step(model, opt, share, cfg, version, world, ref=None, teacher=None, critic=None):
    """This rank's share (make_shares) of a step: recompute, then ppo_epochs x mini-batch updates. critic: gae's (value
    model, its optimizer). -> (this rank's summed metrics: LOSS_KEYS + CONSISTENCY_KEYS + histogram; gradient norms)"""
    device = torch.device("cuda") if cfg.cpu_offload else next(model.parameters()).device  # offload: on CPU
    batches = [[(collate([m for m, _ in mb] or [EMPTY], device, model.config.image_token_id),
                 torch.tensor([a for _, a in mb] or [0.]).to(device)) for mb in mini] for mini in share["mini_batches"]]
    several = cfg.ppo_epochs * len(batches) > 1
    value_net, copt = critic or (None, None)
    with torch.no_grad():  # ---- recompute: what the batch is scored against, before any update ----
        for b, adv in (x for mini in batches for x in mini):
            # teacher and reference route by themselves: not the sampler's experts (the KL's anchor: the initial router)
            for key, frozen in (("ref_logp", ref), ("teacher_logp", teacher)):
                if frozen is not None:
                    b[key] = token_logp(frozen, b | {"routing": None}, cfg, filtered=False)[1]
            if several:  # pi_old for every mini-batch now; a single update takes it from its own forward
                b["old_logp"] = token_logp(model, b, cfg)[1]
            if value_net is not None:  # values by the critic of now: a stale episode is valued afresh (async is fine)
                # the reward at each message's last sampled token (a chat episode's segments: each ends with the reward)
                mask = b["loss_mask"][:, 1:]
                last = torch.nn.functional.one_hot(mask.cumsum(1).argmax(1), mask.shape[1]) * mask  # (B, T-1)
                b["old_values"] = values(value_net, b)
                b["advantages"], b["returns"] = est.gae(rewards=last * adv[:, None], values=b["old_values"],
                                                        loss_mask=mask, gamma=cfg.gae_gamma, lam=cfg.gae_lambda)
        if value_net is not None:  # whitened over the step's trained tokens, on all ranks (verl's, OpenRLHF's default)
            mbs = [b for mini in batches for b, _ in mini]
            n = sum(torch.stack([b["loss_mask"][:, 1:].sum(), b["advantages"].sum(), b["advantages"].square().sum()])
                    for b in mbs)  # tokens, sum, sum of squares (advantages are 0 off the trained tokens)
            if world > 1:
                dist.all_reduce(n)
            mean = n[1] / n[0].clamp(min=1)
            std = (n[2] / n[0].clamp(min=1) - mean ** 2).clamp(min=0).sqrt()
            for b in mbs:
                b["advantages"] = (b["advantages"] - mean) / (std + est.EPS) * b["loss_mask"][:, 1:]
    losses, checks = 0, 0  # summed metric vectors: LOSS_KEYS of every update, consistency's of the first epoch
    norms = []
    for epoch in range(cfg.ppo_epochs):  # ---- updates ----
        for mini, counts in zip(batches, share["counts"]):
            for optimizer in filter(None, (opt, copt)):
                optimizer.zero_grad(set_to_none=True)  # (gradients stay readable after the step: tests, debugging)
            for b, adv in mini:
                loss, metrics, old = micro_loss(model, b, cfg, counts, adv, world, value_net)
                loss.backward()
                losses = losses + metrics
                if epoch == 0:
                    checks = checks + consistency(b, old, version, cfg.max_staleness)
            totals = [torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.grad_clip)  # before clipping; FSDP: DTensors
                      for net in (model, value_net) if net is not None]
            norm = [float(g.full_tensor() if hasattr(g, "full_tensor") else g) for g in totals]
            norms.append(norm[0] if all(map(math.isfinite, norm)) else math.nan)  # a critic's inf skips both, counted
            # the same norm and counts on every rank: all skip together (no sampled token: AdamW would use momentum)
            if math.isfinite(norms[-1]) and counts[0]:
                for optimizer in filter(None, (opt, copt)):
                    optimizer.step()
    return torch.cat([losses.double(), checks]), norms


def reduce_metrics(vec, world):
    """Sum the ranks' metric vectors (on the device: NCCL has no CPU tensors) -> (sums by key, staleness histogram)."""
    if world > 1:
        dist.all_reduce(vec)
    v, n = vec.tolist(), len(LOSS_KEYS) + len(CONSISTENCY_KEYS)
    return dict(zip(LOSS_KEYS + CONSISTENCY_KEYS, v[:n])), [int(x) for x in v[n:]]


def step_metrics(step, msgs, s, hist, norms, times, counters, stats, rollout_rate, gae=False):
    """The metrics.jsonl line of a step (s: the reduced sums). reward/ and episode/ average over episodes (a chat
    episode's segments count once); gae: critic/explained_variance = 1 - Var(return - value) / Var(return)."""
    episodes = list({m["index"]: m for m in msgs}.values())
    rewards = torch.tensor([m["reward"] for m in episodes])
    tok, n = max(s["tokens"], 1), len(norms)  # the means' denominators: trained tokens, updates
    mm = s["mm_tokens"]
    var_ret, var_err = (s[x + "2"] / tok - (s[x] / tok) ** 2 for x in ("ret", "err"))
    return {
        "step": step, "policy_version": step, "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0, "tokens/trained": s["tokens"],
        "staleness/mean": s["stale_sum"] / tok, "staleness/hist": hist,  # max: over the batch, trained at step - 1
        "staleness/max": max(step - 1 - m["versions"][m["loss_mask"] == 1].min().item() for m in msgs),
        "mismatch/logprob_abs_diff": s["mm_abs"] / mm if mm else None, "mismatch/kl": s["mm_kl"] / mm if mm else None,
        "mismatch/tokens": mm, "loss/policy": s["loss"] / n, "loss/clip_frac": s["clip"] / (tok * n),
        "loss/correction_frac": s["corr"] / (tok * n), "loss/entropy": s["entropy"] / (tok * n),
        "loss/kl_ref": s["kl"] / (tok * n), "loss/router_aux": s["router_aux"] / n,
        "loss/distill_reverse_kl": s["distill_gap"] / (tok * n),  # mean log pi - log pi_teacher: 0 at the teacher
        "routing/flip_frac": s["flips"] / s["flip_n"] if s["flip_n"] else None,
        "grad/norm": torch.tensor(norms, dtype=torch.float64).nanmean().item(), "train/updates": n,  # skipped: nan
        "train/skipped_steps": counters["skipped_steps"], **{f"time/{k}": v for k, v in times.items()},
        "throughput/rollout_tokens_per_s": rollout_rate, "throughput/train_tokens_per_s": s["tokens"] / times["train"],
        "memory/peak_mb": (torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available()  # rank 0's, so far
                           else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),  # CPU: resident set
        **{f"rollout/{k}": (stats | counters)[k] for k in (*rollout.COUNTS, "dropped_stale", "filtered_groups")},
        **{f"episode/{k}": sum(m["info"].get(k, 0.0) for m in episodes) / len(episodes)
           for k in sorted({k for m in episodes for k in m["info"]})},
        **({"critic/value_loss": s["value"] / n, "critic/clip_frac": s["v_clip"] / (tok * n),
            "critic/explained_variance": 1 - var_err / var_ret if var_ret > 1e-12 else None} if gae else {}),
    }

# ---- checkpoints: a Hugging Face directory + trainer state, written atomically ----


def save_checkpoint(cfg, model, opt, state, tokenizer_dir, rank, fsdp, critic=None):
    full, state["adapters"] = merge_lora(model, full_state(model, fsdp, merged=False))  # (state: this save's copy)
    osd = get_optimizer_state_dict(model, opt, options=FULL)  # keyed by parameter name, FSDP or not
    if critic is not None:
        state["critic"] = full_state(critic[0], fsdp, merged=False)
        state["critic_optimizer"] = get_optimizer_state_dict(*critic, options=FULL)
    if rank == 0:
        final, tmp = os.path.join(cfg.out_dir, "ckpt"), os.path.join(cfg.out_dir, f"ckpt.tmp-{state['step']}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            save_pretrained(tmp, model.config, full)
            agent.save_tokenizer(tokenizer_dir, tmp)  # the tokenizer travels with the weights
            torch.save({"optimizer": osd, "rng": torch.get_rng_state(), **state}, os.path.join(tmp, "trainer.pt"))
        except OSError as e:
            raise RuntimeError(f"checkpoint write failed at step {state['step']} ({e}); {final} is as it was") from e
        old = final + ".old"  # swap in the new checkpoint: a crash at any point leaves ckpt or ckpt.old complete
        if os.path.isdir(final):  # ckpt.old goes only for a ckpt (resumed from ckpt.old, it is the only checkpoint)
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    if fsdp:
        dist.barrier()


def load_trainer_state(saved, model, opt, critic=None):
    """saved: trainer.pt's dict (empty or None: a fresh start) -> all but the weights; restores optimizers and rng."""
    counters = dict.fromkeys(["dropped_stale", "filtered_groups", "bad_steps", "skipped_steps"], 0)
    state = {"step": 0, "data_position": 0, "rollout_counts": None} | (saved or {})
    if saved:
        state.pop("critic", None)
        for m, o, key in [(model, opt, "optimizer")] + ([(*critic, "critic_optimizer")] if critic else []):
            set_optimizer_state_dict(m, o, state.pop(key), options=StateDictOptions(full_state_dict=True))
        torch.set_rng_state(state.pop("rng"))
    return state | {"counters": counters | state.get("counters", {}) | (state.get("resume") or {}).get("counters", {})}


RUN_FILES = ("metrics.jsonl", "episodes.jsonl", "ckpt", "ckpt.old", "tiny-init", "engine_weights", "rollouts", "eval")


def check_out_dir(cfg):
    """A new run never destroys an earlier one's files: resume it, or say to overwrite it (rank 0 deletes them)."""
    if cfg.resume or cfg.eval_only or not any(os.path.exists(os.path.join(cfg.out_dir, f)) for f in RUN_FILES[:4]):
        return
    if not cfg.overwrite:
        raise ValueError(f"{cfg.out_dir} holds an earlier run (metrics.jsonl or ckpt): continue it with --resume, "
                         f"replace it with --overwrite, or choose another --out_dir")
    for path in (os.path.join(cfg.out_dir, f) for f in RUN_FILES if os.environ.get("RANK", "0") == "0"):
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)

# ---- logging: metrics.jsonl, one console line, episodes dumped for reading ----


class Logger:
    """Each metrics line to <out_dir>/metrics.jsonl (eval_only: eval/), to W&B (wandb_project), to the console."""
    def __init__(self, cfg, step, state):
        self.cfg = cfg
        self.start, self.t0 = step, time.perf_counter()  # where and when this process began: its rate
        self.to_wandb = lambda m, step: None  # without wandb_project, nothing
        self.path = os.path.join(cfg.out_dir, "eval" if cfg.eval_only else "", "metrics.jsonl")
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        lines = open(self.path).readlines() if os.path.exists(self.path) else []  # resume: the checkpoint's steps
        open(self.path, "w").writelines(x for x in lines if cfg.eval_only or json.loads(x)["step"] <= step)
        open(os.path.join(os.path.dirname(self.path), "config.json"), "w").write(json.dumps(vars(cfg), indent=2))
        if cfg.wandb_project:
            import wandb
            # resumed: W&B drops steps below a run's latest: rewind to the checkpoint's step, log the later ones anew
            rewind = {"resume_from": f"{state['wandb_id']}?_step={step}"} if "wandb_id" in state else {}
            run = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run or None, config=vars(cfg), dir=cfg.out_dir,
                             **rewind)
            state["wandb_id"], self.to_wandb = run.id, run.log

    def log(self, m):
        with open(self.path, "a") as f:
            f.write(json.dumps(m) + "\n")
        self.to_wandb(m, step=m["step"])
        parts = [f"step {m['step']:4d}/{self.cfg.max_steps}"]
        if "reward/mean" in m:  # (an evaluation's own line has no reward)
            mm = m.get("mismatch/logprob_abs_diff")
            parts += [f"reward {m['reward/mean']:.3f}", f"loss {m['loss/policy']:+.4f}",
                      f"stale {m['staleness/mean']:.2f}/{m['staleness/max']}",
                      f"mismatch {'-' if mm is None else f'{mm:.1e}'}",
                      f"{m['time/step']:.2f}s (wait {m['time/wait_rollout']:.2f}s)"]
        evals = [f"pass@{j} {m[f'eval/pass@{j}']:.3f}" for j in sorted({1, self.cfg.eval_samples})
                 if f"eval/pass@{j}" in m]
        if evals:
            parts.append("eval " + " ".join(evals))
        elapsed = time.perf_counter() - self.t0
        rate = (m["step"] - self.start) / elapsed
        eta = datetime.timedelta(seconds=round((self.cfg.max_steps - m["step"]) / rate)) if rate > 0 else "?"
        parts.append(f"{rate:.2f} steps/s, {datetime.timedelta(seconds=round(elapsed))} elapsed, ETA {eta}")
        print(" | ".join(parts), flush=True)


def log_pending(logger, ro, pending):
    """Log the line held for its evaluation (pending: [] or [line]) with its eval/ metrics (Rollout.eval_result's)."""
    while pending:
        logger.log(pending.pop() | ro.eval_result(stop=past_grace))


def dump_episodes(cfg, step, msgs, advantages, tokenizer, n_groups=2):
    """The first groups of a batch, whole, each episode token by token (rollout.dump_row), to episodes.jsonl."""
    groups = sorted({m["group"] for m in msgs})[:n_groups]
    with open(os.path.join(cfg.out_dir, "episodes.jsonl"), "a") as f:
        for m, adv in zip(msgs, advantages):
            if m["group"] in groups:
                row = {"step": step, "index": m["index"], "advantage": adv} | rollout.dump_row(m, tokenizer)
                f.write(json.dumps(row) + "\n")

# ---- the loop ----


STOP = {"signal": None, "at": 0.0, "grace": 10.0}  # set by SIGTERM / Ctrl-C: the loop checkpoints and exits


def past_grace():
    """A signal came more than stop_grace seconds ago: waits on running episodes give up (the run must end)."""
    return STOP["signal"] is not None and time.monotonic() - STOP["at"] > STOP["grace"]


def take_batch(cfg, ro, version, counters):
    """Rank 0: prompts_per_step whole groups, less episodes past the staleness bound (dropped, counted), in data order
    -> (msgs, wait s); msgs None: a stop signal came. Replay (no rollout): what a rollout_dump run trained here."""
    if ro is None:
        path = os.path.join(cfg.replay, f"step_{version + 1}.pt")
        if not os.path.isfile(path):
            raise RuntimeError(f"replay: {path} is missing ({cfg.replay} holds {len(os.listdir(cfg.replay))} steps)")
        return torch.load(path, weights_only=False), 0.0
    t0_wait = time.perf_counter()
    groups = []
    filtered = 0  # groups filtered out in a row
    while len(groups) < cfg.prompts_per_step:
        if STOP["signal"] or ro.died:  # before every group: with filter_groups on a solved task groups come, each
            return None, time.perf_counter() - t0_wait  # filtered
        group = ro.get(stop=lambda: STOP["signal"])  # None: nothing for a second, a signal, or a dead rollout
        if group is None:
            continue
        if group[0]["index"] < 0:  # evaluation episodes (negative indices) never leave the rollout process
            raise AssertionError(f"evaluation episode {group[0]['index']} reached the trainer")
        fresh = [m for m in group if version - m["versions"][m["loss_mask"] == 1].min().item() <= cfg.max_staleness]
        counters["dropped_stale"] += len(group) - len(fresh)
        uniform = len({m["reward"] for m in fresh}) == 1  # (never an empty group: it has no rewards)
        if not fresh or (cfg.filter_groups and uniform):  # nothing (informative) left: let the rollout start another
            ro.drop(1)
            if uniform:  # DAPO's dynamic sampling: all rewards equal, no signal
                counters["filtered_groups"] += 1
                filtered += 1
            if filtered >= cfg.max_filtered_groups:
                raise RuntimeError(f"{filtered} groups in a row filtered out: all rewards equal (max_filtered_groups)")
            continue
        groups.append(fresh)
        filtered = 0
    msgs = sorted([m for group in groups for m in group], key=lambda m: m["index"])
    wait = time.perf_counter() - t0_wait
    if cfg.rollout_dump:  # every trained batch, all its tensors: what replay=<out_dir>/rollouts trains on
        os.makedirs(os.path.join(cfg.out_dir, "rollouts"), exist_ok=True)
        torch.save(msgs, os.path.join(cfg.out_dir, "rollouts", f"step_{version + 1}.pt"))
    return msgs, wait


def next_batch(cfg, ro, step, counters, rank, world):
    """Rank 0 takes the batch and sends it to every rank, packed, with one decision to stop (a signal may reach the
    ranks at different times) -> (msgs, wait s, stop: None, the signal's name, or "error: ...")."""
    msgs, wait = None, 0.0  # take_batch's (rank 0 alone has msgs)
    stop = STOP["signal"]
    if rank == 0 and stop is None:
        try:
            msgs, wait = take_batch(cfg, ro, step, counters)
        except RuntimeError as e:  # (filtered groups without end): every rank stops, with a checkpoint
            stop = f"error: {e}"
        if msgs is None and stop is None:
            stop = STOP["signal"] or f"error: {ro.died}"  # a signal came while waiting, or the rollout died
    if world > 1:
        out = [(stop, rollout.pack(msgs) if msgs else None)]  # packed: numpy arrays pickle by value
        dist.broadcast_object_list(out, src=0)
        stop, packed = out[0]
        if rank and packed:  # rank 0 keeps its own
            msgs = rollout.unpack(packed)
    return msgs, wait, stop


def cpu_threads(cfg):
    """A trainer rank's torch threads on CPU: cpu_threads, or a share of this node's cores (its ranks', rollout's)."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return cfg.cpu_threads or max(1, (os.cpu_count() or 1) // (ranks_here + 1))


def main(argv=None):
    """The run, step by step as the module docstring says; a signal or a dead rollout ends it, checkpointed."""
    cfg = config.load(argv)
    STOP["grace"] = cfg.stop_grace
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda num, _: STOP.update(signal=signal.Signals(num).name, at=time.monotonic()))
    for path in filter(None, (cfg.task_file, cfg.eval_file)):
        agent.load_task_file(path)  # a malformed line stops the run here, naming file and line
    check_out_dir(cfg)  # on every rank, before anything is written
    rank, world, device, fsdp = compute_init(cfg)
    torch.set_num_threads(cpu_threads(cfg) if device.type == "cpu" else 8)
    os.makedirs(cfg.out_dir, exist_ok=True)
    torch.manual_seed(cfg.seed + rank)

    # ---- the policy (from the latest checkpoint when resuming), the frozen reference and teacher ----
    init = tiny_init(cfg, rank, fsdp) if cfg.model == "tiny" else cfg.model
    if init.endswith(".gguf"):  # dequantized once into <file>.hf, which also holds the tokenizer
        init = convert_gguf(init) if rank == 0 else init + ".hf"
        if fsdp:
            dist.barrier()
    ckpt = latest_checkpoint(cfg) if cfg.resume or cfg.eval_only else None
    if cfg.resume and not ckpt:  # never a restart at step 0 that truncates the metrics of the run asked for
        raise ValueError(f"--resume: no checkpoint in {cfg.out_dir} (ckpt/ or ckpt.old/ with trainer.pt)")
    if ckpt:
        same_architecture(ckpt, init)
    tokenizer_dir = ckpt or init  # the weights' own tokenizer
    saved = torch.load(os.path.join(ckpt, "trainer.pt"), weights_only=False) if ckpt else {}
    if rank == 0:  # every long wait says what it is
        print(f"loading the policy from {tokenizer_dir} ({world} rank(s), {device})", flush=True)
    base = init if cfg.lora_rank else tokenizer_dir  # LoRA: the checkpoint's adapters (its merged weights: for engines)
    model = build_model(cfg, rank, device, fsdp, base, adapters=saved.get("adapters"))
    ref = build_model(cfg, rank, device, fsdp, init, frozen=True) if cfg.kl_coef else None
    teacher = build_model(cfg, rank, device, fsdp, cfg.teacher, frozen=True) if cfg.advantage == "opd" else None

    def adamw(params, lr):  # fused: one kernel a tensor, on CPU too
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay, eps=cfg.adam_eps, fused=True)

    opt = None if cfg.eval_only else adamw([p for p in model.parameters() if p.requires_grad], cfg.lr)
    critic = None  # gae: (the value model, its optimizer); saved: its weights
    if cfg.advantage == "gae" and not cfg.eval_only:
        value_net = build_model(cfg, rank, device, fsdp, cfg.critic or init, adapters=saved.get("critic"), critic=True)
        critic = (value_net, adamw(value_net.parameters(), cfg.critic_lr))
    state = load_trainer_state(None if cfg.eval_only else saved, model, opt, critic)  # what checkpoints carry on
    step = (saved or state)["step"]  # eval_only: the checkpoint's step, no optimizer
    counters = state["counters"]

    # ---- the rollout process (rank 0), sampling with the weights handed to it ----
    weights = full_state(model, fsdp)
    changed = cfg.lora_rank > 0 and cfg.weights_in_memory  # LoRA: only what changes (a directory needs all)
    on_gpu = cfg.engine == "torch" and device.type == "cuda"  # published GPU to GPU (rollout.start_rollout)
    tokenizer = agent.load_tokenizer(tokenizer_dir) if rank == 0 else None
    logger = Logger(cfg, step, state) if rank == 0 else None
    ro = None  # rank 0's, but none with replay
    pending_eval = []  # the line of a step being evaluated, logged before the next publish (log_pending)
    if rank == 0:
        if not cfg.replay:
            print(f"starting the rollout process ({cfg.engine} engine)", flush=True)
            resume = state.get("resume") or {}  # deterministic: the settled groups, the admission state
            ro = rollout.start_rollout(cfg, model.config, weights, step, state["data_position"], tokenizer_dir,
                                       resume.get("rollout", state["rollout_counts"]), resume.get("dropped", 0))
            ro.held.extend(resume.get("held", []))
        if cfg.eval_only or cfg.eval_at_start and step == 0:
            ro.evaluate(step)
            pending_eval.append({"step": step, "policy_version": step})
            print(f"evaluating step {step} on {cfg.eval_prompts} x {cfg.eval_samples} held-out episodes", flush=True)
        if not cfg.eval_only:
            print(f"waiting for the first batch ({cfg.batch_size} episodes of {cfg.task})", flush=True)
    last_generated, t_last_line = 0, time.perf_counter()  # the rollout's tokens at the last metrics line: its rate
    try:
        while step < cfg.max_steps and not cfg.eval_only:
            t0_step = time.perf_counter()
            # ---- 1. a batch from the rollout queue, or every rank stops, checkpointed ----
            msgs, wait, stop = next_batch(cfg, ro, step, counters, rank, world)
            if stop is not None:
                log_pending(logger, ro, pending_eval)
                save_checkpoint(cfg, model, opt, state | {"step": step}, tokenizer_dir, rank, fsdp, critic)
                if stop.startswith("error"):
                    raise RuntimeError(f"{stop}; checkpoint of step {step} written to {cfg.out_dir}/ckpt")
                print(f"{stop}: checkpoint of step {step} written to {cfg.out_dir}/ckpt; exiting", flush=True)
                break
            # ---- 2. advantages (opd: GRPO's of the task reward, weighted; the teacher's come per token), shares ----
            episode_advantages = advantages(cfg, msgs).tolist()
            share = make_shares(msgs, episode_advantages, world, cfg)[rank]  # every rank deals alike
            # ---- 3-4. recompute, loss, backward, optimizer steps ----
            t0_train = time.perf_counter()
            vec, norms = train_step(model, opt, share, cfg, step, world, ref, teacher, critic)
            sums, hist = reduce_metrics(vec, world)
            skipped = not all(math.isfinite(g) for g in norms)  # the update skipped; max_bad_steps in a row end the run
            counters["skipped_steps"] += skipped
            counters["bad_steps"] = counters["bad_steps"] + 1 if skipped else 0
            if counters["bad_steps"] >= cfg.max_bad_steps:
                raise RuntimeError(f"{counters['bad_steps']} non-finite gradient norms in a row at step {step + 1}")
            dt_train = time.perf_counter() - t0_train
            dt_handout = t0_train - t0_step - wait  # advantages and shares
            step += 1
            # ---- 5. publish the weights as version `step`; log; checkpoint ----
            if ro is not None and cfg.deterministic:  # publish once all the last version admitted has ended
                settled = ro.settle(past_grace)
                if settled is None and STOP["signal"]:  # the checkpoint then resumes as a non-deterministic run does
                    print(f"{STOP['signal']}: episodes still running after stop_grace: the resume will not be exact")
                exact_resume = {"rollout": settled, "held": list(ro.held), "counters": dict(counters),
                                "dropped": ro.link.dropped.value}  # counters as now: a resume counts the held again
                state["resume"] = None if settled is None else exact_resume
            t0_eval = time.perf_counter()
            log_pending(logger, ro, pending_eval)  # the last version's evaluation ends before its weights do
            t0_sync = time.perf_counter()
            weights = full_state(model, fsdp, changed, cpu=not on_gpu)
            if ro is not None:
                ro.publish(weights, step)
            del weights  # a whole copy of the model (on a GPU, in its memory): not kept through the next step
            dt_eval = t0_sync - t0_eval
            dt_sync = time.perf_counter() - t0_sync
            if rank == 0:  # the step's metrics line (held back while its evaluation runs), episodes dumped
                stats = max((m["stats"] for m in msgs), key=lambda st: st["tokens_generated"])  # the latest
                state["rollout_counts"] = {k: stats[k] for k in rollout.COUNTS}
                state["data_position"] = max(state["data_position"], max(m["index"] for m in msgs) + 1)
                t_line = time.perf_counter()
                times = dict(step=t_line - t0_step, wait_rollout=wait, handout=dt_handout, train=dt_train,
                             weight_sync=dt_sync, wait_eval=dt_eval)
                rate = (stats["tokens_generated"] - last_generated) / max(t_line - t_last_line, 1e-9)  # tokens/s
                metrics = step_metrics(step, msgs, sums, hist, norms, times, counters, stats, rate, critic is not None)
                if cfg.eval_every and ro is not None and step % cfg.eval_every == 0:  # the line waits for it
                    ro.evaluate(step)
                    pending_eval.append(metrics)
                else:
                    logger.log(metrics)
                last_generated, t_last_line = stats["tokens_generated"], t_line
                if cfg.dump_every and step % cfg.dump_every == 0:
                    dump_episodes(cfg, step, msgs, episode_advantages, tokenizer)
            if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == cfg.max_steps:
                log_pending(logger, ro, pending_eval)  # the metrics lines of the checkpoint's steps are all written
                save_checkpoint(cfg, model, opt, state | {"step": step}, tokenizer_dir, rank, fsdp, critic)
        log_pending(logger, ro, pending_eval)  # eval_only's
    finally:
        if ro is not None:
            ro.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
