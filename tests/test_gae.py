"""PPO with a learned value model (advantage=gae): the estimator's math, the clipped value loss, FSDP, resume."""

import pytest
import torch

import config
import estimators as est
from test_train import metrics, one_and_two_ranks, run_and_resume, run_train, same_checkpoints, same_tensors


def test_gae_skips_the_tokens_between_turns_and_matches_a_hand_computation():
    """Row 0: a prompt token, two sampled tokens (turn 1, an intermediate reward 0.5), two environment tokens, one
    sampled (turn 2), one tool token, the last sampled (turn 3, reward 1), padding. Values at unsampled positions are
    garbage (9): they must never enter. gamma 0.9, lambda 0.8, by hand (gamma * lambda = 0.72), backward:
      pos 7: delta = 1 - 0.4 = 0.6, A = 0.6;  pos 5: delta = 0.9 * 0.4 - 0.3 = 0.06, A = 0.06 + 0.72 * 0.6 = 0.492
      pos 2: delta = 0.5 + 0.9 * 0.3 - 0.2 = 0.57, A = 0.57 + 0.72 * 0.492 = 0.92424
      pos 1: delta = 0.9 * 0.2 - 0.1 = 0.08, A = 0.08 + 0.72 * 0.92424 = 0.7454528
    Row 1, one sampled token at the end of the row: A = r - V."""
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0, 0, 0, 1]]).float()
    values = torch.tensor([[9, 0.1, 0.2, 9, 9, 0.3, 9, 0.4, 9], [9, 9, 9, 9, 9, 9, 9, 9, 0.25]])
    rewards = torch.zeros(2, 9)
    rewards[0, 2], rewards[0, 7], rewards[1, 8] = 0.5, 1.0, 1.0
    adv, ret = est.gae(rewards=rewards, values=values, loss_mask=mask, gamma=0.9, lam=0.8)
    want = torch.zeros(2, 9)
    want[0, [1, 2, 5, 7]] = torch.tensor([0.7454528, 0.92424, 0.492, 0.6])
    want[1, 8] = 0.75
    assert torch.allclose(adv, want, atol=1e-6), adv
    assert torch.allclose(ret, (want + values) * mask, atol=1e-6)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()
    # gamma = lambda = 1: every sampled token's advantage is the (undiscounted) return to go minus its value
    adv1, _ = est.gae(rewards=rewards, values=values, loss_mask=mask, gamma=1.0, lam=1.0)
    assert torch.allclose(adv1[0, [1, 2, 5, 7]], torch.tensor([1.5, 1.5, 1.0, 1.0]) - values[0, [1, 2, 5, 7]])
    # lambda = 0: the one-step TD error, the next *sampled* token's value bootstrapping
    adv0, _ = est.gae(rewards=rewards, values=values, loss_mask=mask, gamma=0.9, lam=0.0)
    assert torch.allclose(adv0[0, [1, 2, 5, 7]], torch.tensor([0.08, 0.57, 0.06, 0.6]), atol=1e-6)


def test_value_loss_clips_values_that_moved_too_far():
    """old 0, return 1, clip 0.2: V = 0.5 and 1.5 moved past the clip and the clipped term is worse: the loss is
    the clipped one, gradient 0; V = -0.5 moved too, but away from the return: unclipped, gradient V - R; V = 0.1 is
    within the clip. A padding token (mask 0) gets no gradient and is not counted."""
    v = torch.tensor([[0.5, 1.5, -0.5, 0.1, 7.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1, 0]]).float()
    loss, frac = est.value_loss(values=v, old_values=torch.zeros(1, 5), returns=torch.ones(1, 5), loss_mask=mask,
                                clip=0.2)
    assert frac.item() == 0.5
    assert torch.allclose(loss, torch.tensor([[0.32, 0.32, 1.125, 0.405, 0.0]]))
    loss.sum().backward()
    assert torch.allclose(v.grad, torch.tensor([[0.0, 0.0, -1.5, -0.9, 0.0]]))


def test_config_critic_needs_gae():
    with pytest.raises(ValueError, match="critic"):
        config.load(["--critic=/some/dir"])
    with pytest.raises(ValueError, match="gae_lambda"):
        config.load(["--advantage=gae", "--gae_lambda=1.5"])


def test_fsdp_two_ranks_equal_one_process_with_a_critic(tmp_path):
    """The critic sharded by train.build_model like the policy; whitening over both ranks' tokens; value clipping
    on the second mini-batch. Gradients and weights of both models, and the summed value metrics, agree."""
    one, two = one_and_two_ranks(tmp_path, "gae")
    same_tensors(one, two, ("grads", "weights"))
    assert torch.allclose(one["metrics"], two["metrics"], rtol=1e-5, atol=1e-7), (one["metrics"], two["metrics"])
    critic_grads = {k: g for k, g in one["grads"].items() if k.startswith("critic.")}
    assert critic_grads["critic.lm_head.weight"].abs().max() > 0  # the value head
    assert critic_grads["critic.model.layers.0.self_attn.q_proj.weight"].abs().max() > 0  # and the body below it
    assert one["metrics"][1] > 0 and one["metrics"][2] > 0  # a value loss, and some values clipped


def test_gae_run_logs_the_critic_and_resumes_exactly(tmp_path):
    """4 on-policy steps; 2, then --resume to 4: the same metrics, bitwise the same policy and critic (weights and
    AdamW state). The critic's value loss falls from its zero head's, its explained variance is logged."""
    args = ["--max_staleness=0", "--advantage=gae", "--gae_gamma=0.9", "--eval_every=0", "--critic_lr=3e-3"]
    full = run_train(tmp_path / "a", *args, "--max_steps=4")
    assert full.returncode == 0, full.stderr[-3000:]
    run_and_resume(tmp_path / "b", *args, half=2, steps=4)
    ma, mb = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [m["step"] for m in mb] == list(range(1, 5))
    for x, y in zip(ma, mb):
        for key in ("reward/mean", "loss/policy", "grad/norm", "critic/value_loss", "critic/explained_variance"):
            assert x[key] == y[key], (x["step"], key, x[key], y[key])
    assert all(m["critic/clip_frac"] == 0 for m in ma) and any(m["critic/value_loss"] > 0 for m in ma)  # 1 update
    assert all(m["critic/explained_variance"] is None or m["critic/explained_variance"] <= 1 for m in ma)
    same_checkpoints(tmp_path / "a" / "ckpt", tmp_path / "b" / "ckpt")
    sa, sb = (torch.load(tmp_path / d / "ckpt" / "trainer.pt", weights_only=False) for d in ("a", "b"))
    assert sa["critic"].keys() == sb["critic"].keys() and "lm_head.bias" in sa["critic"]
    assert all(torch.equal(sa["critic"][k], sb["critic"][k]) for k in sa["critic"]), "critic weights"
    assert sa["critic"]["lm_head.weight"].abs().max() > 0  # it trained
    oa, ob = sa["critic_optimizer"]["state"], sb["critic_optimizer"]["state"]
    assert oa.keys() == ob.keys() and len(oa) > 0
    assert all(torch.equal(oa[k][n], ob[k][n]) for k in oa for n in oa[k]), "critic optimizer state"


def test_gae_with_images_lora_and_a_critic_directory(tmp_path):
    """The critic beside a LoRA policy on the image task: the value model is the tiny Qwen3-VL-MoE too (it sees the
    pixels the policy saw), all of it trained while the policy trains only its adapters; then a critic from a directory
    (`critic`: the first run's initial weights) in a second run. Both run and log finite critic metrics."""
    args = ["--task=count", "--tiny_vision=true", "--patch_size=2", "--max_turns=1", "--max_new_tokens=1",
            "--advantage=gae", "--lora_rank=4", "--max_staleness=0", "--eval_every=0", "--max_steps=2"]
    first = run_train(tmp_path / "a", *args)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_train(tmp_path / "b", *args, f"--critic={tmp_path / 'a' / 'tiny-init'}")
    assert second.returncode == 0, second.stderr[-3000:]
    for out in ("a", "b"):
        ms = metrics(tmp_path / out)
        assert len(ms) == 2 and all(torch.isfinite(torch.tensor(m["critic/value_loss"])) for m in ms)
        saved = torch.load(tmp_path / out / "ckpt" / "trainer.pt", weights_only=False)
        assert any(k.startswith("visual.") for k in saved["critic"])  # a vision critic
        assert saved["critic"]["lm_head.weight"].shape[0] == 1  # a scalar head (rewards are 0 here: it stays 0)
        assert saved["adapters"] and all(".lora_" in k for k in saved["adapters"])  # the policy: LoRA
        assert not any(".lora_" in k for k in saved["critic"])  # the critic: no adapters, all of it trained
