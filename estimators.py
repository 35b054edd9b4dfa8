"""The math of the RL objective, and nothing else: tensors in, tensors out. Five families of sibling functions,
one keyword-only signature per family, chosen by name from the dict beside them:

    adv     = ADVANTAGES[name](rewards=..., group_ids=...)           # [N], one per episode
    adv, R  = gae(rewards=..., values=..., loss_mask=..., ...)       # [B, T] per token, from a learned critic
    loss, f = POLICY_LOSSES[name](logp=..., old_logp=..., ...)       # [B, T] per-token loss
    w, f    = CORRECTIONS[name](old_logp=..., rollout_logp=..., ...) # [B, T] detached weights
    loss    = AGGREGATIONS[name](per_token=w * loss + beta * KL[k](...), loss_mask=..., ...)

Per-token tensors are [B, T]; logp is the log-prob of the token sampled at each position. loss_mask is 1 on
tokens the policy sampled, 0 on prompt, tool, environment and padding tokens; every average is over those."""
import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: any ratio past this is clipped or masked anyway, and exp stays finite
EPS = 1e-6              # added to a std before dividing, so an all-equal group cannot divide by zero


def _masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over tokens where mask is 1 (over dim; None: all), 0 where nothing is sampled."""
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def _clamp(log_ratio: Tensor) -> Tensor:
    # clamp *before* exp: exp(100) is inf in fp32, and inf * 0 in backward is NaN even where a mask drops it
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


# ---- advantages: per-episode scalars from per-episode rewards ----
# rewards, group_ids: [N] (a prompt's episodes share an int id; sizes vary) -> [N], spread over sampled tokens
def _centre(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Reward minus its group mean, the group's unbiased std (0 for a group of one) and the group's size, each [N]."""
    _, idx, count = torch.unique(group_ids, return_inverse=True, return_counts=True)  # idx: [N] in 0..G-1; count: [G]
    zeros = rewards.new_zeros(len(count))  # [G]
    # Shift each group by its own max first so an all-equal group is exactly 0 before any sum:
    # 0.1 + 0.1 + 0.1 != 0.3 in floats, and a 1e-9 residue divided by (1e-9 + EPS) is not zero.
    shifted = rewards - zeros.scatter_reduce(0, idx, rewards, "amax", include_self=False)[idx]  # [N], group max 0
    dev = shifted - (zeros.index_add(0, idx, shifted) / count)[idx]  # [N]
    return dev, (zeros.index_add(0, idx, dev**2) / (count - 1).clamp(min=1)).sqrt()[idx], count[idx]


def grpo(*, rewards: Tensor, group_ids: Tensor) -> Tensor:
    """GRPO, Shao et al. 2024 (https://arxiv.org/abs/2402.03300): (r - group mean) / (group std + EPS).
    std is unbiased; a group of one or an all-equal group gets advantage 0."""
    dev, std, _ = _centre(rewards, group_ids)
    return dev / (std + EPS)


def dr_grpo(*, rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr. GRPO, Liu et al. 2025 (https://arxiv.org/abs/2503.20783): r - group mean, no std division,
    because dividing by std up-weights prompts that are nearly always solved or nearly always failed."""
    return _centre(rewards, group_ids)[0]


def rloo(*, rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO, Kool et al. 2019 / Ahmadian et al. 2024 (https://arxiv.org/abs/2402.14740): r minus the mean of the
    *other* episodes of its group (independent of the episode): n/(n-1) * (r - group mean); a group of one: 0."""
    dev, _, n = _centre(rewards, group_ids)
    return dev * n / (n - 1).clamp(min=1)


def reinforce_pp(*, rewards: Tensor, group_ids: Tensor) -> Tensor:
    """REINFORCE++, Hu 2025 (https://arxiv.org/abs/2501.03262): rewards whitened across the batch, groups ignored."""
    return grpo(rewards=rewards, group_ids=torch.zeros_like(group_ids))


def reinforce_pp_baseline(*, rewards: Tensor, group_ids: Tensor) -> Tensor:
    """REINFORCE++-baseline (https://arxiv.org/abs/2501.03262): Dr. GRPO's, whitened: the batch sets the scale."""
    return reinforce_pp(rewards=_centre(rewards, group_ids)[0], group_ids=group_ids)


def batch_mean(*, rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Plain REINFORCE (Williams 1992) with a batch-mean baseline, no std division, for one sample per prompt."""
    return _centre(rewards, torch.zeros_like(group_ids))[0]


def distill_advantage(*, teacher_logp: Tensor, old_logp: Tensor, loss_mask: Tensor) -> Tensor:
    """On-policy distillation (https://arxiv.org/abs/2306.13649; thinkingmachines.ai/blog/on-policy-distillation): a
    sampled token's advantage log pi_teacher - log pi_student [B, T], 0 off the mask: descends the reverse KL."""
    return (teacher_logp - old_logp) * loss_mask


ADVANTAGES = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo, "reinforce_pp": reinforce_pp,
              "reinforce_pp_baseline": reinforce_pp_baseline, "batch_mean": batch_mean}


# ---- a learned value model (advantage="gae"): per-token advantages and the critic's loss, [B, T] ----
def gae(*, rewards: Tensor, values: Tensor, loss_mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """GAE, Schulman et al. 2016 (https://arxiv.org/abs/1506.02438), over sampled tokens only: delta_t = r_t + gamma
    V_next - V_t, A_t = delta_t + gamma lam A_next, next being the row's next *sampled* token: prompt, tool and
    environment tokens between turns are skipped (no actions; verl's and AReaL's multi-turn way). V = 0 past a row's
    last sampled token (the episode ended). -> (advantages, returns = advantages + values), 0 where loss_mask is 0."""
    adv = torch.zeros_like(values)
    next_v = next_a = values.new_zeros(len(values))  # [B]: V and A at each row's next sampled token
    for t in reversed(range(values.shape[1])):  # a scan backward over positions
        sampled = loss_mask[:, t].bool()
        a = rewards[:, t] + gamma * next_v - values[:, t] + gamma * lam * next_a
        adv[:, t] = torch.where(sampled, a, 0.0)
        next_v, next_a = torch.where(sampled, values[:, t], next_v), torch.where(sampled, a, next_a)
    return adv, (adv + values) * loss_mask


def value_loss(*, values: Tensor, old_values: Tensor, returns: Tensor, loss_mask: Tensor, clip: float):
    """PPO's clipped value loss (OpenAI baselines ppo2; verl, OpenRLHF): 0.5 max((V - R)^2, (V_c - R)^2) per token, V_c
    = old + clip(V - old, -clip, clip), so V moves at most `clip` from the advantages' values unless toward the return.
    -> (loss [B, T], masked; the fraction of sampled tokens where the clipped term won: no gradient there)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    err, err_clipped = (values - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * torch.maximum(err, err_clipped) * loss_mask, _masked_mean(err_clipped > err, loss_mask)


# ---- policy losses: per-token loss [B, T] (zero where loss_mask is 0) and a clip fraction ----
# logp [B, T]: the current policy, with grad; old_logp [B, T]: the policy the batch is scored against (the
# trainer's recompute before the first update), no grad. clip_frac: the fraction of sampled tokens clipped.
def ppo(*, logp: Tensor, old_logp: Tensor, advantages: Tensor, loss_mask: Tensor,
        clip_low: float, clip_high: float, dual_clip: float | None = None) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate, Schulman et al. 2017 (https://arxiv.org/abs/1707.06347), per token: -min(r A, clip(r) A)
    with r = pi/pi_old clipped to [1 - clip_low, 1 + clip_high]; clip_high > clip_low is DAPO's clip-higher
    (https://arxiv.org/abs/2503.14476), room to raise rare tokens' probability. dual_clip = c > 1 caps the loss of A < 0
    tokens at -c A, Ye et al. 2020 (https://arxiv.org/abs/1912.09729). Masked."""
    ratio = _clamp(logp - old_logp).exp()  # [B, T]
    unclipped, clipped = ratio * advantages, ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = clipped < unclipped  # min chose the flat branch: no gradient for this token
    if dual_clip is not None:
        cap = -dual_clip * advantages  # with A < 0 and r -> inf, -r A is unbounded; Ye et al. cap it at -c A
        dual = (advantages < 0) & (loss > cap)
        loss, was_clipped = torch.where(dual, cap, loss), was_clipped | dual  # both finite: where's backward is safe
    return loss * loss_mask, _masked_mean(was_clipped, loss_mask)


def gspo(*, logp: Tensor, old_logp: Tensor, advantages: Tensor, loss_mask: Tensor,
         clip_low: float, clip_high: float, dual_clip: float | None = None) -> tuple[Tensor, Tensor]:
    """GSPO, Zheng et al. 2025 (https://arxiv.org/abs/2507.18071): one ratio per sequence, s = exp(mean of log r over
    its sampled tokens, padding excluded), clipped as in ppo() (the paper: ~3e-4 / 4e-4). GSPO-token form: every token
    gets the value s and the gradient s * grad logp_t, so under seq_mean_token_mean the gradient is exactly GSPO's; a
    whole sequence clips together. Masked."""
    seq_log_ratio = _masked_mean(_clamp(logp - old_logp), loss_mask, -1)  # [B]
    # value sg(s), gradient flows through each token's own logp; logp - logp.detach() is exactly 0
    return ppo(logp=seq_log_ratio.detach()[:, None] + logp - logp.detach(), old_logp=torch.zeros_like(logp),
               advantages=advantages, loss_mask=loss_mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)


def cispo(*, logp: Tensor, old_logp: Tensor, advantages: Tensor, loss_mask: Tensor,
          clip_low: float, clip_high: float, dual_clip: float | None = None) -> tuple[Tensor, Tensor]:
    """CISPO, MiniMax-M1 2025 (https://arxiv.org/abs/2506.13585): loss = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A *
    logp clips the importance *weight*, not the update: clipped tokens (PPO drops them, and the rare "fork" tokens with
    them) still get gradient. The paper bounds only above: clip_low >= 1. clip_frac: tokens out of either bound;
    dual_clip is ignored (the weight is bounded). Only the gradient is meaningful; masked."""
    ratio = _clamp(logp - old_logp).exp()  # [B, T]
    weight = ratio.clamp(1 - clip_low, 1 + clip_high).detach()
    clipped = (ratio < 1 - clip_low) | (ratio > 1 + clip_high)
    return -weight * advantages * logp * loss_mask, _masked_mean(clipped, loss_mask)


POLICY_LOSSES = {"ppo": ppo, "gspo": gspo, "cispo": cispo}


# ---- train-vs-rollout correction: detached weights [B, T] on ratio pi_old / pi_rollout ----
# The engine (bf16 kernels, other batching) samples from pi_rollout, not quite the trainer's recompute pi_old;
# the weight multiplies the per-token policy loss. frac: the sampled tokens it truncated or masked.
def tis(*, old_logp: Tensor, rollout_logp: Tensor, loss_mask: Tensor, low: float, high: float):
    """Truncated IS per token, min(ratio, high): Yao et al. 2025 (https://fengyao.notion.site/off-policy-rl),
    after IMPALA's truncation (https://arxiv.org/abs/1802.01561). low is unused; there is no lower bound."""
    ratio = _clamp(old_logp - rollout_logp).exp().detach()  # [B, T]
    return ratio.clamp(max=high), _masked_mean(ratio > high, loss_mask)


def mis(*, old_logp: Tensor, rollout_logp: Tensor, loss_mask: Tensor, low: float, high: float):
    """IcePop's masked IS per token (https://arxiv.org/abs/2510.18855): out of [low, high] dropped, not reweighted."""
    ratio = _clamp(old_logp - rollout_logp).exp().detach()  # [B, T]
    keep = (ratio >= low) & (ratio <= high)
    return keep.to(ratio.dtype), _masked_mean(~keep, loss_mask)


def seq_mis(*, old_logp: Tensor, rollout_logp: Tensor, loss_mask: Tensor, low: float, high: float):
    """Sequence-level masked IS (Liu, Li et al. 2025, https://richardli.xyz/post/rl-collapse-training-inference): mis()
    on each sequence's geometric-mean ratio, which unlike the product does not fail long sequences by length alone."""
    seq_log_ratio = _masked_mean(_clamp(old_logp - rollout_logp).detach(), loss_mask, -1)[:, None].expand_as(old_logp)
    return mis(old_logp=seq_log_ratio, rollout_logp=torch.zeros_like(old_logp), loss_mask=loss_mask, low=low, high=high)


def none(*, old_logp: Tensor, rollout_logp: Tensor, loss_mask: Tensor, low: float, high: float):
    """No correction: weight 1 everywhere, nothing clipped."""
    return torch.ones_like(old_logp), old_logp.new_zeros(())


CORRECTIONS = {"tis": tis, "mis": mis, "seq_mis": seq_mis, "none": none}


# ---- KL to a reference policy, per token [B, T], from sampled tokens only ----
# Schulman's estimators (http://joschu.net/blog/kl-approx.html), r = ref_logp - logp. As *values* each estimates
# KL(pi || ref); as *loss terms* they differ (Tang & Munos 2025, https://arxiv.org/abs/2506.09477): k1's expected
# gradient is 0, k2's grad KL(pi || ref), k3's (GRPO's) grad KL(ref || pi). Unmasked: aggregation masks.
def kl_k1(*, logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = -r = logp - ref_logp. Unbiased, but negative half the time."""
    return logp - ref_logp


def kl_k2(*, logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = r^2 / 2. Biased but low variance; as a loss its expected gradient is the reverse-KL one."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(*, logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = exp(r) - 1 - r >= 0. Unbiased and low variance; r is clamped before exp."""
    r = _clamp(ref_logp - logp)
    return r.exp() - 1 - r


KL = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def entropy(*, logits: Tensor) -> Tensor:
    """Entropy of the next-token distribution, [B, T, V] -> [B, T], fp32 via log_softmax (no overflow). Unmasked."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, T, V]; a [B, T, V] fp32 copy, chunk if big
    return -(logp.exp() * logp).sum(-1)  # exp underflows to exactly 0 where logp is very negative


# ---- aggregation: [B, T] per-token loss -> scalar ----
# Micro-batches take the step-wide counts (over all micro-batches and ranks), so their gradients sum to the full
# batch's. Where data parallelism averages gradients over ranks, the trainer multiplies the loss by world size.
def token_mean(*, per_token: Tensor, loss_mask: Tensor, num_tokens: float | None = None,
               num_seqs: float | None = None, norm_const: float | None = None) -> Tensor:
    """Sum over sampled tokens / num_tokens, the step's sampled-token count (this batch's if None). Every token
    weighs the same, so long sequences weigh more (DAPO, https://arxiv.org/abs/2503.14476)."""
    return (per_token * loss_mask).sum() / (loss_mask.sum().clamp(min=1) if num_tokens is None else num_tokens)


def seq_mean_token_mean(*, per_token: Tensor, loss_mask: Tensor, num_tokens: float | None = None,
                        num_seqs: float | None = None, norm_const: float | None = None) -> Tensor:
    """Mean over each sequence's sampled tokens, then sum / num_seqs (the step's sequence count; this
    batch's B if None). Original GRPO (https://arxiv.org/abs/2402.03300): every sequence weighs the same."""
    return _masked_mean(per_token, loss_mask, -1).sum() / (per_token.shape[0] if num_seqs is None else num_seqs)


def seq_mean_token_sum(*, per_token: Tensor, loss_mask: Tensor, num_tokens: float | None = None,
                       num_seqs: float | None = None, norm_const: float | None = None) -> Tensor:
    """Sum over each sequence's sampled tokens, then sum / num_seqs (this batch's B if None)."""
    return seq_mean_token_sum_norm(per_token=per_token, loss_mask=loss_mask, num_seqs=num_seqs, norm_const=1)


def seq_mean_token_sum_norm(*, per_token: Tensor, loss_mask: Tensor, num_tokens: float | None = None,
                            num_seqs: float | None = None, norm_const: float | None = None) -> Tensor:
    """Sum over each sequence's sampled tokens / norm_const, then sum / num_seqs (B if None). Dr. GRPO
    (https://arxiv.org/abs/2503.20783): a constant instead of each length removes the length bias. norm_const
    defaults to T, this batch's padded length; pass the max generation length to keep it across micro-batches."""
    per_seq = (per_token * loss_mask).sum(-1) / (per_token.shape[-1] if norm_const is None else norm_const)
    return per_seq.sum() / (per_token.shape[0] if num_seqs is None else num_seqs)


AGGREGATIONS = {"token_mean": token_mean, "seq_mean_token_mean": seq_mean_token_mean,
                "seq_mean_token_sum": seq_mean_token_sum, "seq_mean_token_sum_norm": seq_mean_token_sum_norm}


# ---- evaluation ----
def pass_at_k(*, passed: Tensor, k: int) -> Tensor:
    """passed [P, n] bool (n samples per prompt, k <= n) -> [P] float64: Chen et al. 2021's unbiased pass@k
    (https://arxiv.org/abs/2107.03374), 1 - C(n - c, k) / C(n, k) for c passes, as the paper's product of 1 - k/i."""
    n, c = passed.shape[-1], passed.sum(-1, keepdim=True)  # c [P, 1]
    i = torch.arange(1, n + 1, dtype=torch.float64)  # [n]
    return 1 - torch.where(i > n - c, 1 - k / i, 1.0).prod(-1)
