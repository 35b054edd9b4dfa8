"""
train.py: the one asynchronous RL loop. FSDP2 trainer; rank 0 owns the rollout process.

Algorithm, per optimizer step v (weights version v -> v+1):
  1. take batch_size finished episodes from the rollout queue (sampled by versions v - max_staleness .. v;
     an episode with an older token is dropped and counted, and the rollout may start another)
  2. advantages per episode from the rewards of its group (estimators.ADVANTAGES)
  3. recompute every token's logprob with the same model code, replaying the experts chosen at
     generation; check the trained ids are the sampled ids; log the mismatch with the engine's logprobs
  4. per-token policy loss x off-policy correction pi_v / pi_rollout (estimators.CORRECTIONS), aggregated
     over the whole step; backward; clip the global gradient norm; AdamW
  5. publish the weights to the engine as version v+1 (shared memory); log; checkpoint every N steps
One update per batch: the PPO/GSPO/CISPO ratio is 1 at the update (so the clip bounds are inactive) and
everything off-policy, staleness and engine numerics alike, goes through the correction weight, as in the
decoupled PPO objective of AReaL (arXiv:2505.24298).

Launch:
  python train.py --config configs/guess.py                                    # one process
  torchrun --standalone --nproc_per_node=2 train.py --config configs/guess.py  # FSDP2 over 2 ranks
"""
import json
import math
import os
import shutil
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import agent
import config
import estimators as est
import rollout
from model_moe import ModelConfig, Transformer, save_pretrained


# ---- distributed: the same script runs under python and torchrun ----

def compute_init():
    """-> (rank, world, device). Under torchrun, one process group (nccl on GPU, gloo on CPU)."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    if "RANK" not in os.environ:
        return 0, 1, device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def full_state(model, world):
    """The whole (unsharded) state dict on rank 0, on CPU; an empty dict on other ranks."""
    if world == 1:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ---- the policy ----

def latest_checkpoint(cfg):
    """<out_dir>/ckpt, or ckpt.old if a crash (even kill -9) came between the two renames of a save."""
    for name in ("ckpt", "ckpt.old"):
        if os.path.isfile(os.path.join(cfg.out_dir, name, "trainer.pt")):
            return os.path.join(cfg.out_dir, name)
    return None


def same_architecture(a_dir, b_dir, expected=None):
    """Refuse to continue from weights of another architecture or vocabulary, naming the difference."""
    def load(d):
        with open(os.path.join(d, "config.json")) as f:
            return ModelConfig.from_hf(json.load(f), d).__dict__
    a, b = load(a_dir), expected.__dict__ if expected else load(b_dir)
    diff = [f"{k}: {a[k]} vs {b[k]}" for k in a if k != "max_position_embeddings" and a[k] != b[k]]
    if diff:
        raise ValueError(f"{a_dir} does not match {b_dir}: {'; '.join(diff)} (use another out_dir)")


def build_model(cfg, rank, world, device, reference=False):
    """-> (model, tokenizer_dir). "tiny": a small MoE and tokenizer made here from scratch, no download.
    reference: the initial weights (for the KL term), even when resuming."""
    path = cfg.model
    if cfg.model == "tiny":
        path = os.path.join(cfg.out_dir, "tiny-init")
        if rank == 0 and not os.path.isdir(path):
            agent.make_tokenizer(path + ".tmp")
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(path if os.path.isdir(path) else path + ".tmp") if rank == 0 else None
        vocab = len(tok) if rank == 0 else 0
        vision = dict(vision_layers=2, vision_hidden=cfg.tiny_hidden // 2, image_size=cfg.image_size,
                      patch_size=cfg.patch_size, image_token_id=tok.convert_tokens_to_ids(agent.IMAGE_PAD) if tok else -1)
        c = ModelConfig(vocab_size=vocab, hidden_size=cfg.tiny_hidden,
                        intermediate_size=2 * cfg.tiny_hidden, num_hidden_layers=cfg.tiny_layers,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=cfg.tiny_hidden // 4,
                        num_experts=cfg.tiny_experts, num_experts_per_tok=cfg.tiny_top_k,
                        moe_intermediate_size=cfg.tiny_hidden, max_position_embeddings=cfg.engine_max_len,
                        **(vision if cfg.tiny_vision else {}))
        if rank == 0 and not os.path.isdir(path):
            torch.manual_seed(cfg.seed)
            Transformer(c).init_weights(cfg.seed).save_pretrained(path + ".tmp")
            os.replace(path + ".tmp", path)
        elif rank == 0:  # made by an earlier run in this out_dir: it must be the model asked for now
            same_architecture(path, "the tiny_* settings", expected=c)
        if world > 1:
            dist.barrier()
    ckpt = latest_checkpoint(cfg) if cfg.resume and not reference else None
    if ckpt:
        same_architecture(ckpt, path)
        path = ckpt
    model = Transformer.from_pretrained(path, dtype=getattr(torch, cfg.dtype), device=device)
    if world > 1:  # FSDP2: one unit per block, the root holds embeddings, final norm and lm_head
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        # GPU: bf16 compute, fp32 reductions. CPU (gloo): keep the gathered weights from forward to backward,
        # as one all-gather fewer per block is worth more than the memory on a small CPU model
        gpu = device.type == "cuda"
        kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) if gpu else \
            dict(reshard_after_forward=False)
        for block in model.model.layers:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
    return model, path


# ---- batches: episodes -> padded tensors ----

def collate(msgs, device):
    """Episode messages -> dict of (B, T) tensors, right-padded; routing (L, B, T, k) with -1 padding."""
    T = max(m["tokens"].shape[1] for m in msgs)
    B = len(msgs)
    tok = torch.zeros(3, B, T, dtype=torch.long)
    tok[2] = -1
    logp = torch.zeros(B, T)
    for b, m in enumerate(msgs):
        n = m["tokens"].shape[1]
        tok[:, b, :n] = m["tokens"]
        logp[b, :n] = m["logprobs"]
    images = [m["images"] for m in msgs if m.get("images") is not None]  # (N_b, C, H, W) each, in row order
    batch = {"ids": tok[0], "loss_mask": tok[1].float(), "versions": tok[2], "rollout_logp": logp,
             "routing": None, "images": torch.cat(images) if images else None}  # the pixels the engine saw
    if msgs[0]["routing"] is not None:
        r0 = msgs[0]["routing"]
        routing = torch.full((r0.shape[1], B, T, r0.shape[2]), -1, dtype=torch.int16)
        for b, m in enumerate(msgs):
            routing[:, b, :m["routing"].shape[0]] = m["routing"].transpose(0, 1)
        batch["routing"] = routing
    return {k: (v.to(device) if v is not None else None) for k, v in batch.items()}


def split_batch(msgs, advantages, world, budget):
    """Rank 0: the step's episodes -> per rank, a list of micro-batches of (msg, advantage) pairs. Sorted by
    length and dealt in turn, so the ranks get similar work and a micro-batch pads little; a micro-batch
    holds at most `budget` padded tokens (or one episode). Every rank gets the same number of micro-batches,
    some maybe empty: FSDP's collectives pair up forward by forward across the ranks."""
    pairs = sorted(zip(msgs, advantages), key=lambda p: -p[0]["tokens"].shape[1])
    ranks = []
    for r in range(world):
        mbs = []
        for p in pairs[r::world]:
            if mbs and (len(mbs[-1]) + 1) * mbs[-1][0][0]["tokens"].shape[1] <= budget:
                mbs[-1].append(p)
            else:
                mbs.append([p])
        ranks.append(mbs)
    n = max(1, *map(len, ranks))
    return [mbs + [[] for _ in range(n - len(mbs))] for mbs in ranks]


def train_step(model, opt, share, cfg, version, world, ref=None):
    """Forward/backward over this rank's micro-batches, then one optimizer step.
    share: {"micro_batches" (from split_batch), "num_tokens", "num_seqs"} with step-wide token/sequence counts.
    Returns summed metrics of this rank (reduced across ranks by the caller)."""
    device = next(model.parameters()).device
    sums = dict.fromkeys(["loss", "tokens", "mm_abs", "mm_kl", "mm_tokens", "stale_sum", "clip", "corr", "entropy", "kl",
                          "router_aux", "flips", "flip_n"], 0.0)
    stale_max, stale_hist = 0, [0] * (cfg.max_staleness + 1)
    opt.zero_grad(set_to_none=True)  # (gradients stay readable after the step, for tests and debugging)
    for pairs in share["micro_batches"]:
        if not pairs:  # this rank has no episodes here but still joins FSDP's collectives
            model(torch.zeros(1, 2, dtype=torch.long, device=device)).sum().mul(0).backward()
            continue
        mb, adv = [m for m, _ in pairs], [a for _, a in pairs]
        b = collate(mb, device)
        ids, mask = b["ids"], b["loss_mask"][:, 1:]  # token t is predicted at position t-1
        for row, m, msg in zip(ids, b["loss_mask"].bool(), mb):  # token identity: we train what was sampled
            if not torch.equal(row[m].cpu(), msg["engine_ids"]):
                raise AssertionError(f"episode {msg['index']}: trained token ids differ from the engine's sampled ids")
        sel = mask.bool()  # logits only where the next token is trained: the rest of lm_head is wasted work
        at, targets = F.pad(sel, (0, 1)), ids[:, 1:][sel]

        def token_logp(m):  # -> logits (n, V) at the trained positions, logp (B, T-1) with 0 elsewhere
            lg = m(ids, routing=b["routing"], images=b["images"], logits_at=at).float() / cfg.temperature
            return lg, torch.zeros_like(mask).masked_scatter(sel, torch.log_softmax(lg, -1).gather(-1, targets[:, None])[:, 0])
        logits, logp = token_logp(model)  # experts replayed
        rollout_logp, versions = b["rollout_logp"][:, 1:], b["versions"][:, 1:]
        A = torch.tensor(adv, device=device)[:, None].expand_as(logp)  # (B, T-1)
        w, corr_frac = est.CORRECTIONS[cfg.correction](old_logp=logp.detach(), rollout_logp=rollout_logp,
                                                       loss_mask=mask, low=cfg.correction_low, high=cfg.correction_high)
        per_tok, clip_frac = est.POLICY_LOSSES[cfg.policy_loss](
            logp=logp, old_logp=logp.detach(), advantages=A, loss_mask=mask, clip_low=cfg.clip_low,
            clip_high=cfg.clip_high, dual_clip=cfg.dual_clip or None)
        per_tok = per_tok * w
        ent = torch.zeros_like(mask).masked_scatter(sel, est.entropy(logits=logits if cfg.entropy_coef else logits.detach()))
        if cfg.entropy_coef:
            per_tok = per_tok - cfg.entropy_coef * ent
        if ref is not None:  # KL to the frozen initial policy, on the sampled tokens
            with torch.no_grad():
                ref_logp = token_logp(ref)[1]
            kl = est.KL[cfg.kl_estimator](logp=logp, ref_logp=ref_logp)  # (B, T-1)
            per_tok = per_tok + cfg.kl_coef * kl
            sums["kl"] += (kl.detach() * mask).sum().item()
        loss = est.AGGREGATIONS[cfg.aggregation](per_token=per_tok, loss_mask=mask, num_tokens=share["num_tokens"],
                                                 num_seqs=share["num_seqs"], norm_const=cfg.max_new_tokens * cfg.max_turns)
        aux = model.aux_loss * len(mb) / share["num_seqs"] if model.aux_loss is not None else torch.zeros(())  # (MoE) this
        # micro-batch's load-balancing loss, by its share of the step. FSDP averages gradients over ranks; the
        # aggregation already divides by the step-wide counts
        ((loss + cfg.router_aux_coef * aux) * world).backward()
        sums["router_aux"] += aux.item()
        if model.flips is not None:  # (MoE) replayed (position, layer)s whose experts the current router would not pick
            flips, n = model.flips.tolist()
            sums["flips"], sums["flip_n"] = sums["flips"] + flips, sums["flip_n"] + n
        # ---- consistency metrics: staleness and trainer-vs-engine mismatch on current-version tokens ----
        n_tok = mask.sum().item()
        stale = (version - versions)[sel]
        fresh = sel & (versions == version)
        d = (logp.detach() - rollout_logp)[fresh]
        sums["loss"] += loss.item()
        sums["tokens"] += n_tok
        sums["mm_abs"] += d.abs().sum().item()
        sums["mm_kl"] += est.kl_k3(logp=rollout_logp[fresh], ref_logp=logp.detach()[fresh]).sum().item()
        sums["mm_tokens"] += d.numel()
        sums["stale_sum"] += stale.sum().item()
        sums["clip"] += clip_frac.item() * n_tok
        sums["corr"] += corr_frac.item() * n_tok
        sums["entropy"] += (ent.detach() * mask).sum().item()
        if stale.numel():
            stale_max = max(stale_max, int(stale.max()))
            for s, c in zip(*torch.unique(stale, return_counts=True)):
                stale_hist[min(int(s), cfg.max_staleness)] += int(c)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    if math.isfinite(grad_norm):  # every rank sees the same reduced norm, so all skip together
        opt.step()
    return sums, stale_max, stale_hist, grad_norm


def reduce_metrics(sums, stale_max, stale_hist, world):
    if world == 1:
        return sums, stale_max, stale_hist
    keys = list(sums)
    t = torch.tensor([sums[k] for k in keys] + stale_hist, dtype=torch.float64)
    dist.all_reduce(t)
    m = torch.tensor([stale_max], dtype=torch.float64)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    return dict(zip(keys, t[:len(keys)].tolist())), int(m.item()), [int(x) for x in t[len(keys):].tolist()]


# ---- checkpoints: a Hugging Face directory + trainer state, written atomically ----

def save_checkpoint(cfg, model, opt, state, tokenizer_dir, rank, world):
    full = full_state(model, world)
    if world > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        osd = opt.state_dict()
    if rank == 0:
        final, tmp = os.path.join(cfg.out_dir, "ckpt"), os.path.join(cfg.out_dir, f"ckpt.tmp-{state['step']}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            save_pretrained(tmp, model.config, full)
            for f in os.listdir(tokenizer_dir):  # the tokenizer travels with the weights
                if f.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                    shutil.copy(os.path.join(tokenizer_dir, f), tmp)
            torch.save({"optimizer": osd, "rng": torch.get_rng_state(), **state}, os.path.join(tmp, "trainer.pt"))
        except OSError as e:
            raise RuntimeError(f"checkpoint write failed at step {state['step']} ({e}); {final} is left as it was") from e
        # swap in the new checkpoint: a crash at any point leaves ckpt or ckpt.old complete
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        if os.path.isdir(final):
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    if world > 1:
        dist.barrier()


def load_trainer_state(cfg, model, opt, world):
    ckpt = latest_checkpoint(cfg) if cfg.resume else None
    if ckpt is None:
        return {"step": 0, "data_position": 0}
    state = torch.load(os.path.join(ckpt, "trainer.pt"), weights_only=False)
    if world > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(model, opt, state["optimizer"], options=StateDictOptions(full_state_dict=True))
    else:
        opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return state


# ---- logging: metrics.jsonl, one console line, episodes dumped for reading ----

class Logger:
    def __init__(self, cfg, rank, step):
        self.on = rank == 0
        self.wandb = None
        if not self.on:
            return
        path = os.path.join(cfg.out_dir, "metrics.jsonl")
        lines = open(path).read().splitlines() if os.path.exists(path) else []
        with open(path, "w") as f:  # on resume keep exactly the steps the checkpoint has
            f.writelines(l + "\n" for l in lines[:step])
        self.f = open(path, "a")
        if cfg.wandb_project:
            try:
                import wandb
                self.wandb = wandb.init(project=cfg.wandb_project, config=config.to_dict(cfg), resume="allow")
            except ImportError:
                print("wandb is not installed; logging to metrics.jsonl only", file=sys.stderr)

    def log(self, m):
        if not self.on:
            return
        self.f.write(json.dumps(m) + "\n")
        self.f.flush()
        if self.wandb:
            self.wandb.log(m, step=m["step"])
        mm = m["mismatch/logprob_abs_diff"]
        print(f"step {m['step']:4d} | reward {m['reward/mean']:.3f} | loss {m['loss/policy']:+.4f} | "
              f"stale {m['staleness/mean']:.2f}/{m['staleness/max']} | mismatch {'-' if mm is None else f'{mm:.1e}'} | "
              f"{m['time/step']:.2f}s (wait {m['time/wait_rollout']:.2f}s) | tok/s {m['throughput/rollout_tokens_per_s']:.0f}",
              flush=True)


def dump_episodes(cfg, step, msgs, tokenizer, n=4):
    with open(os.path.join(cfg.out_dir, "episodes.jsonl"), "a") as f:
        for m in msgs[:n]:
            ids, mask = m["tokens"][0].tolist(), m["tokens"][1].tolist()
            f.write(json.dumps({"step": step, "index": m["index"], "reward": m["reward"], "info": m["info"],
                                "text": tokenizer.decode(ids),
                                "tokens": [[tokenizer.decode([t]), k] for t, k in zip(ids, mask)]}) + "\n")


# ---- the loop ----

def take_batch(cfg, ro, version, counters):
    """Rank 0: prompts_per_step whole groups, less their episodes past the staleness bound (dropped and
    counted), in data order. -> (msgs, wait seconds)."""
    t0, msgs, n_groups = time.perf_counter(), [], 0
    while n_groups < cfg.prompts_per_step:
        group = ro.get()
        fresh = [m for m in group if (version - m["tokens"][2][m["tokens"][1] == 1].min()).item() <= cfg.max_staleness]
        counters["dropped_stale"] += len(group) - len(fresh)
        if not fresh:  # nothing left of the group: let the rollout start another
            ro.drop(1)
            continue
        msgs, n_groups = msgs + fresh, n_groups + 1
    return sorted(msgs, key=lambda m: m["index"]), time.perf_counter() - t0


STOP = {"signal": None}  # set by SIGTERM / Ctrl-C; the loop checkpoints and exits at the next step


def main(argv=None):
    cfg = config.load(argv)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda num, _: STOP.update(signal=signal.Signals(num).name))
    if cfg.task_file:
        agent.load_task_file(cfg.task_file)  # a malformed line stops the run here, naming file and line
    rank, world, device = compute_init()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // (world + 1)) if device.type == "cpu" else 8)
    os.makedirs(cfg.out_dir, exist_ok=True)
    torch.manual_seed(cfg.seed + rank)
    model, path = build_model(cfg, rank, world, device)
    tokenizer_dir = path
    ref = build_model(cfg, rank, world, device, reference=True)[0].requires_grad_(False) if cfg.kl_coef else None
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, eps=cfg.adam_eps)
    state = load_trainer_state(cfg, model, opt, world)
    step, data_position = state["step"], state["data_position"]
    logger = Logger(cfg, rank, step)
    weights = full_state(model, world)
    ro = tokenizer = None
    if rank == 0:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(config.to_dict(cfg), f, indent=2)
        ro = rollout.start_rollout(cfg, model.config, weights, step, data_position, tokenizer_dir)
    counters = {"dropped_stale": 0, "bad_steps": 0, "skipped_steps": 0}
    last_stats, last_t = None, time.perf_counter()
    try:
        while step < cfg.max_steps:
            t_step = time.perf_counter()
            # ---- 1. a batch from the rollout queue; rank 0 sends every rank its share ----
            shares = [None] * world
            wait = 0.0
            stop = STOP["signal"]
            if rank == 0 and stop is None:
                try:
                    msgs, wait = take_batch(cfg, ro, step, counters)
                except RuntimeError as e:  # the rollout process died: every rank stops, with a checkpoint
                    stop = f"error: {e}"
            if world > 1:  # one decision for all ranks (a signal may reach them at different times)
                flag = [stop]
                dist.broadcast_object_list(flag, src=0)
                stop = flag[0]
            if stop is not None:
                save_checkpoint(cfg, model, opt, {"step": step, "data_position": data_position}, tokenizer_dir, rank, world)
                if stop.startswith("error"):
                    raise RuntimeError(f"{stop}; checkpoint of step {step} written to {cfg.out_dir}/ckpt")
                print(f"{stop}: checkpoint of step {step} written to {cfg.out_dir}/ckpt; exiting", flush=True)
                break
            if rank == 0:
                rewards = torch.tensor([m["reward"] for m in msgs])
                adv = est.ADVANTAGES[cfg.advantage](rewards=rewards, group_ids=torch.tensor([m["group"] for m in msgs]))
                n_tok = sum(float(m["tokens"][1].sum()) for m in msgs)
                shares = [{"micro_batches": mbs, "num_tokens": n_tok, "num_seqs": float(len(msgs))}
                          for mbs in split_batch(msgs, adv.tolist(), world, cfg.micro_batch_tokens)]
            if world > 1:
                out = [None]
                dist.scatter_object_list(out, shares if rank == 0 else None, src=0)
                share = out[0]
            else:
                share = shares[0]
            # ---- 2-4. recompute, loss, backward, step ----
            t_train = time.perf_counter()
            sums, smax, shist, gnorm = train_step(model, opt, share, cfg, step, world, ref)
            sums, smax, shist = reduce_metrics(sums, smax, shist, world)
            if not math.isfinite(gnorm):  # the step was skipped; too many in a row ends the run
                counters["bad_steps"] += 1
                counters["skipped_steps"] += 1
                if counters["bad_steps"] >= cfg.max_bad_steps:
                    raise RuntimeError(f"{counters['bad_steps']} non-finite gradient norms in a row at step {step + 1}")
            else:
                counters["bad_steps"] = 0
            t_train = time.perf_counter() - t_train
            step += 1
            # ---- 5. publish weights as version `step` ----
            t_sync = time.perf_counter()
            weights = full_state(model, world)
            if rank == 0:
                ro.publish(weights, step)
            t_sync = time.perf_counter() - t_sync
            # ---- log ----
            if rank == 0:
                stats = max((m["stats"] for m in msgs), key=lambda st: st["tokens_generated"])  # the latest
                now = time.perf_counter()
                gen = stats["tokens_generated"] - (last_stats["tokens_generated"] if last_stats else 0)
                data_position = max(data_position, max(m["index"] for m in msgs) + 1)  # the rollout resumes at a group start
                info_keys = sorted({k for m in msgs for k in m["info"]})
                metrics = {
                    "step": step, "policy_version": step, "reward/mean": rewards.mean().item(),
                    "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
                    "tokens/trained": sums["tokens"], "staleness/mean": sums["stale_sum"] / max(sums["tokens"], 1),
                    "staleness/max": smax, "staleness/hist": shist,
                    "mismatch/logprob_abs_diff": sums["mm_abs"] / sums["mm_tokens"] if sums["mm_tokens"] else None,
                    "mismatch/kl": sums["mm_kl"] / sums["mm_tokens"] if sums["mm_tokens"] else None,
                    "mismatch/tokens": sums["mm_tokens"], "loss/policy": sums["loss"],
                    "loss/clip_frac": sums["clip"] / max(sums["tokens"], 1),
                    "loss/correction_frac": sums["corr"] / max(sums["tokens"], 1),
                    "loss/entropy": sums["entropy"] / max(sums["tokens"], 1), "grad/norm": gnorm,
                    "loss/kl_ref": sums["kl"] / max(sums["tokens"], 1), "loss/router_aux": sums["router_aux"],
                    "routing/flip_frac": sums["flips"] / sums["flip_n"] if sums["flip_n"] else None,
                    "train/skipped_steps": counters["skipped_steps"],
                    "time/step": now - t_step, "time/wait_rollout": wait, "time/train": t_train, "time/weight_sync": t_sync,
                    "throughput/rollout_tokens_per_s": gen / max(now - last_t, 1e-9),
                    "throughput/train_tokens_per_s": sums["tokens"] / max(t_train, 1e-9),
                    **{f"rollout/{k}": v for k, v in stats.items() if k in ("agent_errors", "agent_timeouts", "malformed")},
                    "rollout/dropped_stale": counters["dropped_stale"],
                    **{f"episode/{k}": sum(m["info"].get(k, 0.0) for m in msgs) / len(msgs) for k in info_keys},
                }
                last_stats, last_t = stats, now
                logger.log(metrics)
                if cfg.dump_every and step % cfg.dump_every == 0:
                    dump_episodes(cfg, step, msgs, tokenizer)
            if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == cfg.max_steps:
                save_checkpoint(cfg, model, opt, {"step": step, "data_position": data_position}, tokenizer_dir, rank, world)
    finally:
        if ro is not None:
            ro.close()
        if world > 1:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
