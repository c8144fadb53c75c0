"""Every objective and option of gsm8kctl.training.losses against values computed by hand."""

import math

import pytest
import torch

from gsm8kctl.training import losses

# ---------------------------------------------------------------------------------------------
# Per-sample: advantages, uniform groups, implicit KL


def test_group_advantages_mixed_uniform_and_single_groups():
    rewards = [1, 0, 0, 1, 1, 1, -1]
    groups = ["a", "a", "a", "a", "b", "b", "c"]
    adv = losses.group_advantages(rewards, groups)
    # group a: mean 0.5, sample std sqrt((4 × 0.25) / 3) = 0.57735
    std = math.sqrt(1 / 3)
    assert adv[0] == pytest.approx(0.5 / (std + 1e-4))
    assert adv[1] == pytest.approx(-0.5 / (std + 1e-4))
    assert adv[0] == pytest.approx(0.865876, abs=1e-5)
    # uniform group b and single-member group c: zero advantage
    assert adv[4:] == [0.0, 0.0, 0.0]
    assert losses.uniform_groups(rewards, groups) == {"b", "c"}


def test_group_advantages_without_std_is_dr_grpo():
    rewards, groups = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0], ["a", "a", "a", "a", "b", "b"]
    assert losses.group_advantages(rewards, groups, divide_by_std=False) == pytest.approx(
        [0.75, -0.25, -0.25, -0.25, 0.0, 0.0])
    scaled = losses.group_advantages(rewards, groups)
    assert scaled[0] == pytest.approx(0.75 / (0.5 + 1e-4))  # sample std of (1, 0, 0, 0) is 0.5


def test_group_advantages_three_values():
    adv = losses.group_advantages([1, 0, -1], ["g"] * 3)
    # mean 0, std = sqrt((1 + 0 + 1) / 2) = 1
    assert adv == pytest.approx([1 / 1.0001, 0.0, -1 / 1.0001])


def test_implicit_kl_k1_k3_and_shaped_reward():
    old, ref = [-1.0, -2.0], [-1.5, -1.0]
    assert losses.implicit_kl(old, ref, "k1") == pytest.approx(-0.5)  # 0.5 + (-1)
    # k3: d = ref − old = (−0.5, 1): (e^−0.5 + 0.5 − 1) + (e − 1 − 1)
    k3 = (math.exp(-0.5) - 0.5) + (math.e - 2)
    assert losses.implicit_kl(old, ref, "k3") == pytest.approx(k3)
    assert k3 == pytest.approx(0.824812, abs=1e-6)
    assert losses.shaped_reward(1.0, old, ref, 0.1, "k1") == pytest.approx(1.05)
    assert losses.shaped_reward(1.0, old, ref, 0.1, "k3") == pytest.approx(1 - 0.0824812, abs=1e-6)
    assert losses.shaped_reward(1.0, None, None, 0.0) == 1.0
    with pytest.raises(ValueError):
        losses.implicit_kl(old, ref, "k2")
    with pytest.raises(ValueError):
        losses.shaped_reward(1.0, None, ref, 0.1)


def test_implicit_kl_shapes_advantages():
    # Two correct answers, one far from the reference: it gets the lower advantage.
    r = [losses.shaped_reward(1.0, [-1.0], [-1.0], 0.5), losses.shaped_reward(1.0, [-1.0], [-3.0], 0.5)]
    assert r == pytest.approx([1.0, 0.0])
    assert losses.group_advantages(r, ["g", "g"]) == pytest.approx([0.5 / (math.sqrt(0.5) + 1e-4),
                                                                    -0.5 / (math.sqrt(0.5) + 1e-4)])


# ---------------------------------------------------------------------------------------------
# Per-token losses


def _t(rows, grad=False):
    return torch.tensor(rows, dtype=torch.float32, requires_grad=grad)


def test_sft_token_mean_normalizer_and_accumulation():
    new = _t([[-0.5, -1.0, -2.0]], grad=True)
    mask = torch.tensor([[False, True, True]])
    loss, sums = losses.policy_loss(new, mask, objective="sft")
    assert loss.item() == pytest.approx(1.5)  # (1 + 2) / 2 tokens; the prompt token is ignored
    assert float(sums["tokens"]) == 2 and float(sums["loss_sum"]) == pytest.approx(3.0)
    loss.backward()
    assert new.grad.flatten().tolist() == pytest.approx([0.0, -0.5, -0.5])
    # per-token over a larger normaliser (the whole step), then ÷ 2 accumulation passes
    loss2, _ = losses.policy_loss(new, mask, objective="sft", normalizer=6, accumulation_passes=2)
    assert loss2.item() == pytest.approx(3.0 / 6 / 2)


def test_reinforce_weights_and_relu():
    new = _t([[-1.0, -1.0], [-2.0, -3.0]], grad=True)
    mask = torch.ones(2, 2, dtype=torch.bool)
    w = torch.tensor([2.0, -1.0])
    loss, _ = losses.policy_loss(new, mask, objective="reinforce", weights=w)
    # (2·1 + 2·1 − 1·2 − 1·3) / 4
    assert loss.item() == pytest.approx(-0.25)
    loss.backward()
    assert new.grad.flatten().tolist() == pytest.approx([-0.5, -0.5, 0.25, 0.25])  # −w / N
    relu, _ = losses.policy_loss(new, mask, objective="reinforce", weights=w, relu_weights=True)
    assert relu.item() == pytest.approx(1.0)  # (2 + 2 + 0 + 0) / 4
    with pytest.raises(ValueError):
        losses.policy_loss(new, mask, objective="reinforce")


@pytest.mark.parametrize("w,expected_loss,clipped_token", [(1.0, -0.9, 0), (-1.0, 1.1, 1)])
def test_grpo_clip(w, expected_loss, clipped_token):
    old = _t([[-1.0, -1.0, -1.0]])
    rho = [1.5, 0.5, 1.0]
    new = (old + torch.log(torch.tensor([rho]))).detach().requires_grad_(True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, sums = losses.policy_loss(new, mask, objective="grpo", weights=torch.tensor([w]), old=old, epsilon=0.2)
    # w=+1: −min(1.5, 1.2) − min(0.5, 0.8) − 1 = −2.7;  w=−1: 1.5 + 0.8 + 1 = 3.3; both / 3
    assert loss.item() == pytest.approx(expected_loss)
    s = losses.summarize(sums)
    assert s["ratio_mean"] == pytest.approx(1.0)
    assert s["clip_frac"] == pytest.approx(1 / 3)
    loss.backward()
    grad = new.grad[0].tolist()
    # d/dnew of −ρw/3 is −ρw/3 where unclipped; zero where the clip is active
    for i in range(3):
        if i == clipped_token:
            assert grad[i] == 0.0
        else:
            assert grad[i] == pytest.approx(-rho[i] * w / 3, rel=1e-5)


def test_grpo_clip_higher_widens_only_the_upper_bound():
    # DAPO's clip-higher: rho 1.25 with w > 0 is clipped at 1 + 0.2 but not at 1 + 0.28; the lower
    # bound stays at 1 - epsilon (rho 0.5 with w < 0 is clipped either way).
    old = _t([[-1.0, -1.0]])
    new = (old + torch.log(torch.tensor([[1.25, 0.5]]))).detach().requires_grad_(True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    for eps_high, grad0 in ((None, 0.0), (0.28, -1.25 / 2)):
        new.grad = None
        loss, sums = losses.policy_loss(new, mask, objective="grpo", weights=torch.tensor([1.0]), old=old,
                                        epsilon=0.2, epsilon_high=eps_high)
        loss.backward()
        assert new.grad[0, 0].item() == pytest.approx(grad0, rel=1e-5)
        assert losses.summarize(sums)["clip_frac"] == pytest.approx(0.5 if eps_high is None else 0.0)
    neg = (old + torch.log(torch.tensor([[0.5, 1.0]]))).detach().requires_grad_(True)
    loss, _ = losses.policy_loss(neg, mask, objective="grpo", weights=torch.tensor([-1.0]), old=old,
                                 epsilon=0.2, epsilon_high=0.28)
    loss.backward()
    assert neg.grad[0, 0].item() == 0.0  # 0.5 < 1 - 0.2 with w < 0: the lower clip holds


def test_grpo_needs_old_and_unknown_old_means_ratio_one():
    new = _t([[-1.0, -2.0]], grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError):
        losses.policy_loss(new, mask, objective="grpo", weights=torch.tensor([1.0]))
    old = _t([[-5.0, 0.0]])
    old_mask = torch.tensor([[False, False]])
    loss, sums = losses.policy_loss(new, mask, objective="grpo", weights=torch.tensor([1.0]),
                                    old=old, old_mask=old_mask)
    assert loss.item() == pytest.approx(-1.0)  # ρ = 1 everywhere: −(1 + 1) / 2
    assert losses.summarize(sums)["ratio_mean"] is None


def test_explicit_k3_kl_penalty():
    new = _t([[-1.0, -2.0]], grad=True)
    ref = _t([[-1.5, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, sums = losses.policy_loss(new, mask, objective="sft", ref=ref, kl_coef=0.5)
    k = [math.exp(-0.5) + 0.5 - 1, math.e - 1 - 1]  # exp(ref−new) − (ref−new) − 1
    assert loss.item() == pytest.approx((1 + 2 + 0.5 * sum(k)) / 2)
    assert losses.summarize(sums)["kl"] == pytest.approx(sum(k) / 2)
    loss.backward()
    # d/dnew [−new + β(e^{ref−new} − ref + new − 1)] = −1 + β(1 − e^{ref−new}), / N
    assert new.grad[0].tolist() == pytest.approx(
        [(-1 + 0.5 * (1 - math.exp(-0.5))) / 2, (-1 + 0.5 * (1 - math.e)) / 2], rel=1e-5)
    # reference known: KL reported even with kl_coef 0, and the loss unchanged
    loss0, sums0 = losses.policy_loss(new, mask, objective="sft", ref=ref)
    assert loss0.item() == pytest.approx(1.5) and float(sums0["kl_sum"]) == pytest.approx(sum(k))
    with pytest.raises(ValueError):
        losses.policy_loss(new, mask, objective="sft", kl_coef=0.5)


def test_sums_aggregate_over_passes():
    total: dict = {}
    for rows in ([[-1.0, -3.0]], [[-2.0, 0.0]]):
        _, part = losses.policy_loss(_t(rows), torch.tensor([[True, True]]), objective="sft")
        losses.add_sums(total, part)
    assert losses.summarize(total)["loss_per_token"] == pytest.approx(1.5)  # 6 / 4
    with pytest.raises(ValueError):
        losses.policy_loss(_t([[0.0]]), torch.tensor([[True]]), objective="ppo")
