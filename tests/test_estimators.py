import math
import statistics
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import estimators as E  # noqa: E402

torch.manual_seed(0)
CLIP = dict(clip_low=0.2, clip_high=0.28, dual_clip=None)


def t(x, **kw):
    return torch.tensor(x, dtype=torch.float64, **kw)


# ---- advantages ----
# Uneven groups with arbitrary ids: {7: [1, 0, 0.5]}, {-3: [2, 4]}, {42: [3]} (a group of one).
REWARDS = [1.0, 0.0, 0.5, 2.0, 4.0, 3.0]
GROUPS = [7, 7, 7, -3, -3, 42]
DEV = [0.5, -0.5, 0.0, -1.0, 1.0, 0.0]  # reward minus its group mean, by hand
BATCH_DEV = [r - 1.75 for r in REWARDS]  # batch mean is 10.5 / 6
S2 = math.sqrt(2)  # unbiased std of [2, 4]; the std of [1, 0, 0.5] is 0.5
EXPECTED = {
    "grpo": [1.0, -1.0, 0.0, -1 / S2, 1 / S2, 0.0],
    "dr_grpo": DEV,
    "rloo": [1 - 0.25, 0 - 0.75, 0.5 - 0.5, 2 - 4, 4 - 2, 0.0],  # minus the mean of the others
    "reinforce_pp": [d / statistics.stdev(REWARDS) for d in BATCH_DEV],
    "reinforce_pp_baseline": [d / statistics.stdev(DEV) for d in DEV],  # DEV already has mean 0
    "batch_mean": BATCH_DEV,
}


@pytest.mark.parametrize("name", E.ADVANTAGES)
def test_advantages_hand_example(name):
    adv = E.ADVANTAGES[name](rewards=t(REWARDS), group_ids=torch.tensor(GROUPS))
    torch.testing.assert_close(adv, t(EXPECTED[name]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", E.ADVANTAGES)
def test_advantages_degenerate_groups(name):
    # an all-equal group of six and a group of one; in fp32, 0.9 * 6 / 6 != 0.9, so this needs care
    rewards = torch.full((7,), 0.9)
    adv = E.ADVANTAGES[name](rewards=rewards, group_ids=torch.tensor([3, 3, 3, 3, 3, 3, 9]))
    assert torch.equal(adv, torch.zeros(7))
    single = E.ADVANTAGES[name](rewards=torch.tensor([5.0]), group_ids=torch.tensor([0]))
    assert torch.equal(single, torch.zeros(1))


# ---- policy losses ----
def batch(B=4, T=6, off_policy=0.0):
    """Random logp with grad, a ragged loss_mask with a masked prompt token, and per-sequence A."""
    logp = (-torch.rand(B, T, dtype=torch.float64) * 3).requires_grad_()
    old_logp = logp.detach() + off_policy * torch.randn(B, T, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[:, 0] = 0  # prompt
    for b in range(B):
        mask[b, T - b:] = 0  # padding of different lengths
    adv = torch.randn(B, 1, dtype=torch.float64).expand(B, T)
    return logp, old_logp, mask, adv


@pytest.mark.parametrize("name", E.POLICY_LOSSES)
def test_on_policy_gradient_is_reinforce(name):
    logp, old_logp, mask, adv = batch()
    loss, frac = E.POLICY_LOSSES[name](logp=logp, old_logp=old_logp, advantages=adv, loss_mask=mask, **CLIP)
    (grad,) = torch.autograd.grad(E.token_mean(per_token=loss, loss_mask=mask), logp)
    (ref,) = torch.autograd.grad(E.token_mean(per_token=-adv * logp, loss_mask=mask), logp)
    torch.testing.assert_close(grad, ref)
    assert frac.item() == 0


@pytest.mark.parametrize("agg", E.AGGREGATIONS)
@pytest.mark.parametrize("name", [*E.POLICY_LOSSES, *E.KL])
def test_masked_tokens_get_zero_gradient(name, agg):
    logp, old_logp, mask, adv = batch(off_policy=0.3)
    if name in E.KL:
        per_token = E.KL[name](logp=logp, ref_logp=old_logp)
    else:
        per_token, _ = E.POLICY_LOSSES[name](logp=logp, old_logp=old_logp, advantages=adv, loss_mask=mask,
                                             clip_low=0.2, clip_high=0.28, dual_clip=3.0)
        assert torch.all(per_token[mask == 0] == 0)
    E.AGGREGATIONS[agg](per_token=per_token, loss_mask=mask, num_tokens=None, num_seqs=None,
                        norm_const=None).backward()
    assert torch.all(logp.grad[mask == 0] == 0)
    assert torch.any(logp.grad[mask == 1] != 0)


def test_ppo_clipping_hand_example():
    # ratios 1.5 (A>0), 0.5 (A<0): clipped; 1.1 (A<0), 0.9 (A>0): the clip is not binding
    old_logp = t([[0.0, 0.0, 0.0, 0.0]])
    logp = t([[math.log(1.5), math.log(0.5), math.log(1.1), math.log(0.9)]], requires_grad=True)
    adv, mask = t([[1.0, -1.0, -1.0, 1.0]]), torch.ones(1, 4, dtype=torch.float64)
    loss, frac = E.ppo(logp=logp, old_logp=old_logp, advantages=adv, loss_mask=mask,
                       clip_low=0.2, clip_high=0.2, dual_clip=None)
    torch.testing.assert_close(loss, t([[-1.2, 0.8, 1.1, -0.9]]))
    assert frac.item() == 0.5
    E.token_mean(per_token=loss, loss_mask=mask).backward()
    torch.testing.assert_close(logp.grad, t([[0.0, 0.0, 1.1 / 4, -0.9 / 4]]))  # d(-rA)/dlogp = -rA
    # clip-higher: 1 + 0.6 lets the 1.5 ratio through, the low bound still binds
    _, frac = E.ppo(logp=logp, old_logp=old_logp, advantages=adv, loss_mask=mask,
                    clip_low=0.2, clip_high=0.6, dual_clip=None)
    assert frac.item() == 0.25


def test_dual_clip_bounds_negative_advantage_loss():
    logp = t([[math.log(5.0), math.log(2.0)]], requires_grad=True)
    adv, mask = t([[-1.0, -1.0]]), torch.ones(1, 2, dtype=torch.float64)
    loss, frac = E.ppo(logp=logp, old_logp=torch.zeros(1, 2, dtype=torch.float64), advantages=adv,
                       loss_mask=mask, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    torch.testing.assert_close(loss, t([[3.0, 2.0]]))  # -rA = 5 capped at -cA = 3; 2 < 3 untouched
    assert frac.item() == 0.5  # ratio 5: dual clip; ratio 2 with A<0 is above 1+eps, which never binds
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, t([[0.0, 2.0]]))


def test_gspo_uses_length_normalised_sequence_ratio():
    # sampled log ratios 0.1 and -0.3 -> s = exp(-0.1); the padded position's huge ratio is ignored
    logp = t([[-1.0, -2.0, -0.5]], requires_grad=True)
    old_logp = t([[-1.1, -1.7, -50.0]])
    mask, adv = t([[1.0, 1.0, 0.0]]), t([[2.0, 2.0, 2.0]])
    loss, frac = E.gspo(logp=logp, old_logp=old_logp, advantages=adv, loss_mask=mask, **CLIP)
    s = math.exp(-0.1)
    torch.testing.assert_close(loss, t([[-2 * s, -2 * s, 0.0]]))
    E.seq_mean_token_mean(per_token=loss, loss_mask=mask).backward()
    torch.testing.assert_close(logp.grad, t([[-s, -s, 0.0]]))  # d(-sA)/dlogp_t = -sA/|y|
    # s = 0.905 is below 1 - 0.05, but with A > 0 the clip does not bind; with A < 0 it clips all
    _, frac = E.gspo(logp=logp, old_logp=old_logp, advantages=-adv, loss_mask=mask,
                     clip_low=0.05, clip_high=0.05, dual_clip=None)
    assert frac.item() == 1.0


def test_cispo_clips_the_weight_not_the_gradient():
    logp = t([[math.log(3.0), math.log(0.1)]], requires_grad=True)
    adv, mask = t([[1.0, 1.0]]), torch.ones(1, 2, dtype=torch.float64)
    loss, frac = E.cispo(logp=logp, old_logp=torch.zeros(1, 2, dtype=torch.float64), advantages=adv,
                         loss_mask=mask, clip_low=1.0, clip_high=0.2, dual_clip=None)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, t([[-1.2, -0.1]]))  # upper bound binds; no lower bound
    assert frac.item() == 0.5


@pytest.mark.parametrize("name", E.POLICY_LOSSES)
def test_extreme_log_ratios_stay_finite(name):
    logp = torch.tensor([[100.0, -100.0, 100.0, -100.0]], requires_grad=True)  # fp32, where exp(100) = inf
    old_logp, adv = torch.zeros(1, 4), torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    for dual_clip in (None, 3.0):
        for agg in E.AGGREGATIONS.values():
            loss, frac = E.POLICY_LOSSES[name](logp=logp, old_logp=old_logp, advantages=adv,
                                               loss_mask=torch.ones(1, 4), clip_low=0.2, clip_high=0.2,
                                               dual_clip=dual_clip)
            (grad,) = torch.autograd.grad(agg(per_token=loss, loss_mask=torch.ones(1, 4)), logp)
            assert torch.isfinite(loss).all() and torch.isfinite(grad).all() and torch.isfinite(frac)


# ---- train-vs-rollout corrections ----
@pytest.mark.parametrize("name,frac,weights", [
    ("tis", 2 / 7, [[2.0, 2.0, 1.0], [0.4, 1.6, None], [0.3, 0.6, None]]),
    ("mis", 4 / 7, [[0.0, 0.0, 1.0], [0.0, 1.0, None], [0.0, 1.0, None]]),
    ("seq_mis", 5 / 7, [[0.0, 0.0, 0.0], [1.0, 1.0, None], [0.0, 0.0, None]]),  # 9^(1/3) > 2, 0.8, 0.42 < 0.5
    ("none", 0.0, [[1.0, 1.0, 1.0], [1.0, 1.0, None], [1.0, 1.0, None]]),
])
def test_corrections_hand_example(name, frac, weights):
    # ratios pi_old / pi_rollout per row, 7 sampled tokens; the pad ratio of 100 must be ignored
    ratios = t([[3.0, 3.0, 1.0], [0.4, 1.6, 100.0], [0.3, 0.6, 100.0]])
    old_logp = (ratios.log() - 1.0).requires_grad_()
    mask = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    w, f = E.CORRECTIONS[name](old_logp=old_logp, rollout_logp=t([[-1.0] * 3] * 3), loss_mask=mask,
                               low=0.5, high=2.0)
    assert not w.requires_grad
    assert f.item() == pytest.approx(frac)
    torch.testing.assert_close(w[mask == 1], t([x for row in weights for x in row if x is not None]))


@pytest.mark.parametrize("name", E.CORRECTIONS)
def test_corrections_extreme_log_ratios_stay_finite(name):
    old_logp = t([[100.0, -100.0, 0.0]]).float()
    w, f = E.CORRECTIONS[name](old_logp=old_logp, rollout_logp=torch.zeros(1, 3), loss_mask=torch.ones(1, 3),
                               low=0.5, high=2.0)
    assert torch.isfinite(w).all() and torch.isfinite(f)


# ---- KL and entropy ----
def test_kl_hand_example():
    logp, ref_logp = t([[math.log(0.5), -1.0]], requires_grad=True), t([[math.log(0.25), -1.0]])
    r = math.log(0.5)  # ref_logp - logp on the first token; the second has pi == ref
    for name, want in {"k1": -r, "k2": r * r / 2, "k3": math.exp(r) - 1 - r}.items():
        torch.testing.assert_close(E.KL[name](logp=logp, ref_logp=ref_logp), t([[want, 0.0]]))
    extreme = t([[100.0, -100.0]], requires_grad=True).float()
    for fn in E.KL.values():
        (grad,) = torch.autograd.grad(fn(logp=extreme, ref_logp=torch.zeros(1, 2)).sum(), extreme)
        assert torch.isfinite(grad).all()


def test_entropy():
    logits = torch.tensor([[[0.0, 0.0, -1e9], [0.0, math.log(3.0), -1e9], [1e4, 1e4, 1e4]]])  # [1, 3, 3]
    want = [math.log(2), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), math.log(3)]
    torch.testing.assert_close(E.entropy(logits=logits), torch.tensor([want]))


# ---- aggregation ----
def test_aggregation_denominators():
    x, mask = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), t([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    cases = [  # (name, kwargs, expected): sampled values are [1, 2] and [4]
        ("token_mean", {}, 7 / 3), ("token_mean", {"num_tokens": 10.0}, 0.7),
        ("seq_mean_token_mean", {}, (1.5 + 4) / 2), ("seq_mean_token_mean", {"num_seqs": 4.0}, 5.5 / 4),
        ("seq_mean_token_sum", {}, (3 + 4) / 2), ("seq_mean_token_sum", {"num_seqs": 5.0}, 7 / 5),
        ("seq_mean_token_sum_norm", {}, (3 / 3 + 4 / 3) / 2),  # norm_const defaults to T = 3
        ("seq_mean_token_sum_norm", {"norm_const": 10.0, "num_seqs": 5.0}, 0.7 / 5),
    ]
    for name, kw, want in cases:
        assert E.AGGREGATIONS[name](per_token=x, loss_mask=mask, **kw).item() == pytest.approx(want), name


@pytest.mark.parametrize("agg", E.AGGREGATIONS)
def test_micro_batches_sum_to_full_batch_gradient(agg):
    logp, old_logp, mask, adv = batch(B=4, T=6, off_policy=0.3)
    step = dict(num_tokens=mask.sum().item(), num_seqs=4.0, norm_const=6.0)  # step-wide counts

    def grad(rows):
        loss, _ = E.ppo(logp=logp[rows], old_logp=old_logp[rows], advantages=adv[rows],
                        loss_mask=mask[rows], **CLIP)
        return torch.autograd.grad(E.AGGREGATIONS[agg](per_token=loss, loss_mask=mask[rows], **step), logp)[0]

    torch.testing.assert_close(grad(slice(0, 2)) + grad(slice(2, 4)), grad(slice(0, 4)))


# ---- evaluation ----
@pytest.mark.parametrize("n,k", [(1, 1), (4, 1), (4, 2), (4, 4), (7, 3), (10, 5)])
def test_pass_at_k_is_the_fraction_of_k_subsets_that_hold_a_pass(n, k):
    """Chen et al.'s estimator against brute force: over every k-subset of the n samples, does one pass?"""
    import itertools
    g = torch.Generator().manual_seed(n * 10 + k)
    passed = torch.rand(6, n, generator=g) < torch.rand(6, 1, generator=g)  # (P, n), some rows all-fail or all-pass
    passed[0], passed[1] = False, True
    brute = [statistics.mean(any(row[i] for i in s) for s in itertools.combinations(range(n), k))
             for row in passed.tolist()]
    got = E.pass_at_k(passed=passed, k=k)
    assert got.shape == (6,) and torch.allclose(got, t(brute), atol=1e-12)
    assert got[0] == 0 and got[1] == 1
    if k == 1:  # pass@1 is the fraction of samples that pass
        assert torch.allclose(got, passed.double().mean(-1))
