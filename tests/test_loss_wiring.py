"""The loss options through the trainer (train.train_step / micro_loss), each against a loss written out here by hand,
one episode at a time from full forwards: a knob that micro_loss dropped, mis-signed or routed to the wrong function
changes the loss or its gradient. The pure functions are tested on their own in test_estimators.py."""
import copy

import pytest
import torch

import config
import train
from test_real_use import tiny_setup

NORM = 8 * 3  # max_new_tokens x max_turns, seq_mean_token_sum_norm's constant


def logp_of(net, m, temperature=1.0, replay=True):
    """One episode's full forward, experts replayed (replay=False: a teacher or reference routes by itself)
    -> logits (T-1, V) before each token, log pi of each (T-1,)."""
    routing = m["routing"].permute(1, 0, 2)[:, None].long() if replay else None
    logits = net(m["ids"][None], routing=routing)[0, :-1].float()
    return logits, torch.log_softmax(logits / temperature, -1).gather(-1, m["ids"][1:, None])[:, 0]


def reference(model, msgs, cfg, adv, ref=None, teacher=None, old_shift=None):
    """The loss of one update, by hand: per episode, full-sequence logits; the formulas of the papers."""
    per_seq, n_tok = [], sum(float(m["loss_mask"][1:].sum()) for m in msgs)
    for i, m in enumerate(msgs):
        mask = m["loss_mask"][1:].float()
        logits, lp = logp_of(model, m, cfg.temperature)
        old = lp.detach() - (0 if old_shift is None else old_shift[i])
        A = torch.full_like(lp, adv[i])
        if teacher is not None:  # per-token advantage log pi_teacher - log pi_old
            A = A + logp_of(teacher, m, cfg.temperature, replay=False)[1].detach() - old
        ratio = torch.exp(lp - old)
        pg = -torch.minimum(ratio * A, ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * A)
        if cfg.dual_clip:
            pg = torch.where(A < 0, torch.minimum(pg, -cfg.dual_clip * A), pg)
        r_c = torch.exp(old - m["logprobs"][1:])  # pi_old / pi_rollout
        if cfg.correction == "seq_mis":
            r_c = torch.exp(((old - m["logprobs"][1:]) * mask).sum() / mask.sum()).expand_as(r_c)
        band = ((r_c >= cfg.correction_low) & (r_c <= cfg.correction_high)).float()  # mis, seq_mis
        w = {"none": torch.ones_like(r_c), "tis": r_c.clamp(max=cfg.correction_high)}.get(cfg.correction, band)
        p = torch.softmax(logits, -1)
        ent = -(p * torch.log_softmax(logits, -1)).sum(-1)  # a bonus: entropy_coef > 0 raises it
        tok = pg * w - cfg.entropy_coef * ent
        if ref is not None:
            d = logp_of(ref, m, cfg.temperature, replay=False)[1].detach() - lp  # log ref - log pi
            tok = tok + cfg.kl_coef * {"k1": -d, "k2": d ** 2 / 2, "k3": d.exp() - 1 - d}[cfg.kl_estimator]
        s = (tok * mask).sum()
        per_seq.append({"token_mean": s / n_tok * len(msgs), "seq_mean_token_mean": s / mask.sum(),
                        "seq_mean_token_sum": s, "seq_mean_token_sum_norm": s / NORM}[cfg.aggregation])
    return sum(per_seq) / len(msgs)


def grads_of(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


OPTIONS = [[], ["--correction=mis", "--correction_low=0.7", "--correction_high=1.3"],
           ["--correction=seq_mis", "--correction_low=0.8", "--correction_high=1.25"], ["--correction=none"],
           ["--entropy_coef=0.05"], ["--aggregation=seq_mean_token_mean"], ["--aggregation=seq_mean_token_sum"],
           ["--aggregation=seq_mean_token_sum_norm"], ["--kl_coef=0.3", "--kl_estimator=k1"],
           ["--kl_coef=0.3", "--kl_estimator=k2"], ["--kl_coef=0.3", "--kl_estimator=k3"]]


@pytest.mark.parametrize("args", OPTIONS, ids=lambda a: ",".join(a) or "default")
def test_a_train_step_computes_the_hand_built_loss_and_gradient(args):
    cfg = config.load(["--max_staleness=0", "--grad_clip=1e9", "--micro_batch_tokens=24", *args])
    model, msgs = tiny_setup()
    ref = tiny_setup(seed=1)[0].requires_grad_(False) if cfg.kl_coef else None
    adv = [1.0, -0.5, 2.0, 0.0, -1.5, 0.7, -0.2, 1.1]
    mine = copy.deepcopy(model)
    expected = reference(mine, msgs, cfg, adv, ref=ref)
    expected.backward()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    share = train.make_shares(msgs, adv, 1, cfg)[0]
    assert len(share["mini_batches"][0]) > 1  # several micro-batches: their sum is the batch's loss
    vec, norms = train.train_step(model, opt, share, cfg, 0, 1, ref)
    sums = train.reduce_metrics(vec, 1)[0]
    assert abs(sums["loss"] - expected.item()) < 1e-5, (sums["loss"], expected.item())
    assert torch.allclose(grads_of(model), grads_of(mine), atol=1e-5, rtol=1e-4)
    assert abs(norms[0] - grads_of(mine).norm().item()) < 1e-4


@pytest.mark.parametrize("args", [["--clip_low=0.1", "--clip_high=0.1"], ["--dual_clip=1.5"]])
def test_clipping_and_dual_clip_apply_to_the_ratio(args):
    """Ratios away from 1 (pi_old given, as after an earlier update): the clip and the dual clip take effect."""
    cfg = config.load(["--max_staleness=0", *args])
    model, msgs = tiny_setup()
    mine = copy.deepcopy(model)
    adv = torch.tensor([1.0, -0.5, 2.0, -3.0, -1.5, 0.7, -0.2, 1.1])
    g = torch.Generator().manual_seed(5)
    shift = [2 * torch.randn(len(m["ids"]) - 1, generator=g) for m in msgs]  # log pi - log pi_old, per token
    b = train.collate(msgs, torch.device("cpu"))
    with torch.no_grad():
        lp = train.token_logp(model, b, cfg)[1]
    b["old_logp"] = lp - torch.nn.utils.rnn.pad_sequence(shift, batch_first=True)
    counts = (float(sum(m["loss_mask"][1:].sum() for m in msgs)), float(len(msgs)))
    loss, m, _ = train.micro_loss(model, b, cfg, counts, adv, 1)
    expected = reference(mine, msgs, cfg, adv.tolist(), old_shift=shift)
    assert m[1] > 0  # some tokens clipped
    assert abs(loss.item() - expected.item()) < 1e-5, (loss.item(), expected.item())
    if cfg.dual_clip:  # the cap changes the loss: without it the same ratios give another one
        plain = reference(mine, msgs, config.load(["--max_staleness=0"]), adv.tolist(), old_shift=shift)
        assert abs(plain.item() - expected.item()) > 1e-3


def test_distilling_from_another_teacher_is_the_reverse_kl_gradient():
    """advantage=opd: the per-token advantage log pi_teacher - log pi_old, its loss and gradient, and the logged gap
    (log pi - log pi_teacher), against the hand-built ones; a teacher unlike the student, so a flipped sign shows."""
    cfg = config.load(["--max_staleness=0", "--advantage=opd", "--teacher=other", "--grad_clip=1e9"])
    model, msgs = tiny_setup()
    teacher = tiny_setup(seed=3)[0].requires_grad_(False)
    adv = [0.5, -0.5] * 4  # opd_reward_coef x GRPO's, as main hands it over
    mine, start = copy.deepcopy(model), copy.deepcopy(model)
    expected = reference(mine, msgs, cfg, adv, teacher=teacher)
    expected.backward()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    vec, _ = train.train_step(model, opt, train.make_shares(msgs, adv, 1, cfg)[0], cfg, 0, 1, teacher=teacher)
    sums = train.reduce_metrics(vec, 1)[0]
    assert abs(sums["loss"] - expected.item()) < 1e-5, (sums["loss"], expected.item())
    assert torch.allclose(grads_of(model), grads_of(mine), atol=1e-5, rtol=1e-4)
    with torch.no_grad():  # the logged gap: sum of log pi_old - log pi_teacher over the sampled tokens
        gap = sum(float(((logp_of(start, m)[1] - logp_of(teacher, m, replay=False)[1]) * m["loss_mask"][1:]).sum())
                  for m in msgs)
    assert gap > 1 and abs(sums["distill_gap"] - gap) < 1e-4, (sums["distill_gap"], gap)  # the teachers differ


def test_collate_refuses_ids_that_differ_from_the_sampled_ones():
    """The trainer's own token check: a trained id that is not the engine's sampled one (changed, or one more or
    less) stops the step, naming the episode."""
    _, msgs = tiny_setup()
    train.collate(msgs, torch.device("cpu"))  # as sampled: fine
    for bad in (lambda e: e.clone().index_fill_(0, torch.tensor([2]), 7 if e[2] != 7 else 8), lambda e: e[:-1],
                lambda e: torch.cat([e, e[:1]])):
        wrong = [dict(m) for m in msgs]
        wrong[5]["engine_ids"] = bad(wrong[5]["engine_ids"])
        with pytest.raises(AssertionError, match="episode 5: trained token ids differ from the engine's sampled ids"):
            train.collate(wrong, torch.device("cpu"))


def prompt_msgs(model, prompt=10, n=9, seed=2):
    """n episodes in GRPO groups of 3, each group's sharing a prompt of `prompt` tokens (none trained), then an answer
    of 2-5 tokens, some trained: a GRPO group of short answers to one prompt (experts recorded per episode)."""
    g, msgs = torch.Generator().manual_seed(seed), []
    for i in range(n):
        if i % 3 == 0:
            head = torch.randint(0, 49, (prompt,), generator=g)
        ids = torch.cat([head, torch.randint(0, 49, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)])
        mask = torch.cat([torch.zeros(prompt, dtype=torch.long), (torch.rand(len(ids) - prompt, generator=g) < .7)])
        mask[-1] = 1
        with torch.no_grad():
            routing = model(ids[None], return_routing=True)[1][:, 0].transpose(0, 1).short()  # (T, L, k)
        msgs.append({"ids": ids, "loss_mask": mask.long(), "versions": torch.where(mask == 1, 0, -1),
                     "routing": routing, "logprobs": -torch.rand(len(ids), generator=g) * mask,
                     "engine_ids": ids[mask == 1], "reward": float(i % 2), "group": i // 3, "index": i, "info": {},
                     "images": []})
    return msgs


@pytest.mark.parametrize("args", [[], ["--policy_loss=gspo"], ["--correction=seq_mis"], ["--entropy_coef=0.05"],
                                  ["--aggregation=seq_mean_token_mean"], ["--kl_coef=0.3", "--kl_estimator=k3"]],
                         ids=lambda a: ",".join(a) or "default")
def test_a_group_sharing_a_prompt_is_one_row_with_the_same_loss_and_gradient(args):
    """collate packs a group's episodes that share a prompt into one row (the prompt once): the forward computes
    fewer tokens, and every loss, sequence-level ones too, and its gradient are those of one row per episode."""
    cfg = config.load(["--max_staleness=0", "--grad_clip=1e9", "--micro_batch_tokens=4096", *args])
    model, ref = tiny_setup()[0], tiny_setup(seed=1)[0].requires_grad_(False)
    msgs = prompt_msgs(model)
    b = train.collate(msgs, torch.device("cpu"))
    assert b["packed"]["ids"].numel() < 0.6 * b["ids"].numel()  # 3 rows of 9 + 3 answers, not 9 of 12-15
    adv = torch.tensor([1.0, -0.5, 2.0, 0.0, -1.5, 0.7, -0.2, 1.1, 0.3])
    counts = (float(sum(m["loss_mask"][1:].sum() for m in msgs)), float(len(msgs)))
    out = []
    for packed in (True, False):
        net, bb = copy.deepcopy(model), dict(b) if packed else {k: v for k, v in b.items() if k != "packed"}
        if cfg.kl_coef:
            bb["ref_logp"] = train.token_logp(ref, bb | {"routing": None}, cfg, filtered=False)[1]
        loss, m, _ = train.micro_loss(net, bb, cfg, counts, adv, 1)
        loss.backward()
        out.append((loss.detach(), m, grads_of(net)))
    (l1, m1, g1), (l2, m2, g2) = out
    assert abs(l1 - l2) < 1e-6 and torch.allclose(m1[:7], m2[:7], atol=1e-5), (l1, l2, m1, m2)
    assert torch.allclose(g1, g2, atol=1e-6, rtol=1e-5)
    if not args:  # and through train_step, against the loss by hand
        opt, mine = torch.optim.SGD(model.parameters(), lr=1e-3), copy.deepcopy(model)
        expected = reference(mine, msgs, cfg, adv.tolist())
        expected.backward()
        vec, _ = train.train_step(model, opt, train.make_shares(msgs, adv.tolist(), 1, cfg)[0], cfg, 0, 1)
        assert abs(train.reduce_metrics(vec, 1)[0]["loss"] - expected.item()) < 1e-5
        assert torch.allclose(grads_of(model), grads_of(mine), atol=1e-5, rtol=1e-4)


def test_the_critic_values_a_group_sharing_a_prompt_from_its_packed_row():
    """advantage=gae's critic takes the packed rows too: fewer tokens through it, the same values and gradients."""
    critic = tiny_setup()[0]
    critic.lm_head = torch.nn.Linear(critic.config.hidden_size, 1)  # train.build_model's value head, not zeroed here
    b = train.collate(prompt_msgs(critic), torch.device("cpu"))
    out = []
    for packed in (True, False):
        net, bb, seen = copy.deepcopy(critic), dict(b) if packed else {k: v for k, v in b.items() if k != "packed"}, []
        net.register_forward_pre_hook(lambda m, args: seen.append(args[0].numel()))
        v = train.values(net, bb)
        (v * torch.linspace(-1, 1, v.shape[1])).sum().backward()
        out.append((v.detach(), grads_of(net), seen))
    (v1, g1, n1), (v2, g2, n2) = out
    assert n1[0] < 0.6 * n2[0], (n1, n2)  # one forward of 3 rows of ~9 + 3 answers, not 9 rows of 12-15
    assert (v1 != 0).sum() == b["loss_mask"][:, 1:].sum() and torch.allclose(v1, v2, atol=1e-6), (v1 - v2).abs().max()
    assert (g1 - g2).norm() < 1e-6 * g2.norm(), (g1 - g2).norm() / g2.norm()  # summation order differs: relative


def test_a_shared_prompt_stops_before_a_trained_token_and_where_experts_differ():
    model = tiny_setup()[0]
    msgs = prompt_msgs(model)[:3]
    assert train.shared_prompt(msgs) == 9  # the 10-token prompt less its last: each answer's first is predicted there
    msgs[1]["loss_mask"][7] = 1  # a trained token at 7: shared are 0..5, the logits of 6 are this episode's
    assert train.shared_prompt(msgs) == 6
    msgs[2]["routing"][3, 0, 0] = (msgs[2]["routing"][3, 0, 0] + 1) % 4  # other experts replayed at 3
    assert train.shared_prompt(msgs) == 3
