"""Policy losses against hand-computed cases; masked NaNs; trajectory-balance gradients."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call

from learner.losses import LogZ, LossInputs, make_log_z, policy_loss
from learner.losses.config import PPOLossConfig, TrajectoryBalanceConfig
from learner.losses.ppo import aggregate
from learner.losses.trajectory_balance import trajectory_balance_loss

NAN, INF = float("nan"), float("inf")
D = torch.float64


def t(rows, dtype=D):
    return torch.tensor(rows, dtype=dtype)


def ppo_case(**overrides) -> LossInputs:
    """One row, four positions: tokens 0-1 are turn 0, token 2 is turn 1, position 3 is
    padding full of NaN/inf that must never reach the loss or the gradient.

    log ratio lp - old = [+.5, -.5, 0]; advantages [1, -1, 2];
    old - behaviour = [0, .2, 1.0] -> token TIS weights [1, e^.2, min(e, 2) = 2].
    """
    fields = dict(
        logprobs=t([[-1.0, -1.5, -0.3, NAN]]).requires_grad_(),
        old_logprobs=t([[-1.5, -1.0, -0.3, NAN]]),
        behaviour_logprobs=t([[-1.5, -1.2, -1.3, INF]]),
        advantages=t([[1.0, -1.0, 2.0, NAN]]),
        mask=t([[1.0, 1.0, 1.0, 0.0]]),
        turn_ids=torch.tensor([[0, 0, 1, -1]]),
    )
    fields.update(overrides)
    return LossInputs(**fields)


def test_ppo_token_tis_hand_case():
    # token 0: r = e^.5 = 1.6487 > 1.2 with A = 1 -> min(1.6487, 1.2) = 1.2; loss -1 * 1.2.
    # token 1: r = e^-.5 = .6065 < .8 with A = -1 -> min(-.6065, -.8) = -.8; loss e^.2 * .8.
    # token 2: r = 1, A = 2 -> 2; w = 2; loss -4.  token-mean over 3 tokens.
    inputs = ppo_case()
    loss, metrics = policy_loss(inputs, PPOLossConfig())
    expected = (-1.2 + math.exp(0.2) * 0.8 - 4.0) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["clip_frac"] == pytest.approx(2 / 3)
    assert metrics["tis_mean"] == pytest.approx((1 + math.exp(0.2) + 2) / 3)
    assert metrics["tis_capped_frac"] == pytest.approx(1 / 3)
    assert metrics["ratio_mean"] == pytest.approx((math.exp(0.5) + math.exp(-0.5) + 1) / 3)
    # extremes over the action tokens only (the NaN padding is not a token)
    assert metrics["ratio_min"] == pytest.approx(math.exp(-0.5))
    assert metrics["ratio_max"] == pytest.approx(math.exp(0.5))
    loss.backward()
    # Tokens 0 and 1 are clipped (no gradient); token 2: d(-w r A / 3)/dlp = -2 * 2 / 3.
    # The NaN padding gets exactly 0.
    torch.testing.assert_close(inputs.logprobs.grad, t([[0.0, 0.0, -4 / 3, 0.0]]))


def test_ppo_turn_level_tis_and_no_tis():
    # Turn 0: geometric mean of e^0 and e^.2 = e^.1 on both tokens; turn 1: min(e, 2) = 2.
    loss, metrics = policy_loss(ppo_case(), PPOLossConfig(tis="turn"))
    w = math.exp(0.1)
    assert loss.item() == pytest.approx((-1.2 * w + 0.8 * w - 4.0) / 3, rel=1e-12)
    assert metrics["tis_mean"] == pytest.approx((2 * w + 2) / 3)
    loss, _ = policy_loss(ppo_case(), PPOLossConfig(tis="none"))
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.0) / 3, rel=1e-12)


def test_ppo_turn_tis_needs_turn_ids():
    with pytest.raises(ValueError, match="turn_ids"):
        policy_loss(ppo_case(turn_ids=torch.tensor([[0, -1, 1, -1]])), PPOLossConfig(tis="turn"))


def test_ppo_per_token_clip_overrides():
    # a2tgpo widens token 0's upper range to .7: r = 1.6487 < 1.7 is no longer clipped,
    # so its term is -r * A and its gradient -r / 3. NaN override on padding is ignored.
    inputs = ppo_case(clip_low=t([[0.2, 0.2, 0.2, NAN]]), clip_high=t([[0.7, 0.2, 0.2, NAN]]))
    loss, metrics = policy_loss(inputs, PPOLossConfig())
    r = math.exp(0.5)
    assert loss.item() == pytest.approx((-r + math.exp(0.2) * 0.8 - 4.0) / 3, rel=1e-12)
    assert metrics["clip_frac"] == pytest.approx(1 / 3)
    loss.backward()
    assert inputs.logprobs.grad[0, 0].item() == pytest.approx(-r / 3, rel=1e-12)


def test_aggregations():
    # Row 0: tokens 1, 2; row 1: token 3; row 2: no tokens (NaN everywhere).
    x = t([[1.0, 2.0, NAN], [3.0, NAN, NAN], [NAN, NAN, NAN]])
    m = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]]) > 0
    assert aggregate(x, m, "token-mean").item() == pytest.approx(6 / 3)
    assert aggregate(x, m, "seq-mean-token-sum").item() == pytest.approx((3 + 3) / 2)
    assert aggregate(x, m, "seq-mean-token-mean").item() == pytest.approx((1.5 + 3) / 2)
    empty = torch.zeros(3, 3, dtype=torch.bool)
    assert aggregate(x, empty, "token-mean").item() == 0.0


def test_ppo_seq_aggregation_uses_rows():
    # Two rows: row 0 = the hand case's tokens 0 and 1, row 1 = token 2.
    # Per-token losses: -1.2, .8 e^.2 | -4.
    inputs = ppo_case(
        logprobs=t([[-1.0, -1.5], [-0.3, NAN]]).requires_grad_(),
        old_logprobs=t([[-1.5, -1.0], [-0.3, NAN]]),
        behaviour_logprobs=t([[-1.5, -1.2], [-1.3, NAN]]),
        advantages=t([[1.0, -1.0], [2.0, NAN]]), mask=t([[1.0, 1.0], [1.0, 0.0]]),
        turn_ids=torch.tensor([[0, 0], [1, -1]]))
    a, b, c = -1.2, 0.8 * math.exp(0.2), -4.0
    loss, _ = policy_loss(inputs, PPOLossConfig(agg="seq-mean-token-sum"))
    assert loss.item() == pytest.approx(((a + b) + c) / 2, rel=1e-12)
    loss, _ = policy_loss(inputs, PPOLossConfig(agg="seq-mean-token-mean"))
    assert loss.item() == pytest.approx(((a + b) / 2 + c) / 2, rel=1e-12)


def test_ppo_k3_kl_and_entropy_bonus():
    # ref - lp = [.5, -.5, 0]: k3 = e^d - d - 1 = [e^.5 - 1.5, e^-.5 - .5, 0].
    inputs = ppo_case(ref_logprobs=t([[-0.5, -2.0, -0.3, NAN]]),
                      entropy=t([[0.3, 0.6, 0.9, NAN]]))
    cfg = PPOLossConfig(kl_coef=0.1, entropy_coef=0.01)
    loss, metrics = policy_loss(inputs, cfg)
    pg = (-1.2 + math.exp(0.2) * 0.8 - 4.0) / 3
    kl = (math.exp(0.5) - 1.5 + math.exp(-0.5) - 0.5 + 0.0) / 3
    ent = (0.3 + 0.6 + 0.9) / 3
    assert metrics["kl"] == pytest.approx(kl, rel=1e-12)
    assert metrics["entropy"] == pytest.approx(ent, rel=1e-12)
    assert loss.item() == pytest.approx(pg + 0.1 * kl - 0.01 * ent, rel=1e-12)
    loss.backward()
    # Token 2 gradient: PG -4/3 plus KL 0.1 * (1 - e^(ref - lp)) / 3 = 0 at d = 0.
    # Token 0: PG 0 (clipped) plus 0.1 * (1 - e^.5) / 3.
    grad = inputs.logprobs.grad[0]
    assert grad[0].item() == pytest.approx(0.1 * (1 - math.exp(0.5)) / 3, rel=1e-12)
    assert grad[2].item() == pytest.approx(-4 / 3, rel=1e-12)
    assert grad[3].item() == 0.0
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(ppo_case(), PPOLossConfig(kl_coef=0.1))


def test_masked_garbage_never_leaks():
    # Same tokens, padding filled with 0 instead of NaN/inf: identical loss and gradient.
    dirty = ppo_case(ref_logprobs=t([[-1.0, -1.5, -0.3, NAN]]), entropy=t([[1, 1, 1, INF]]))
    clean = ppo_case(
        logprobs=t([[-1.0, -1.5, -0.3, 0.0]]).requires_grad_(),
        old_logprobs=t([[-1.5, -1.0, -0.3, 0.0]]), behaviour_logprobs=t([[-1.5, -1.2, -1.3, 0]]),
        advantages=t([[1.0, -1.0, 2.0, 0.0]]), ref_logprobs=t([[-1.0, -1.5, -0.3, 0.0]]),
        entropy=t([[1.0, 1.0, 1.0, 0.0]]))
    cfg = PPOLossConfig(tis="turn", kl_coef=0.5, entropy_coef=0.1)
    for inputs in (dirty, clean):
        loss, metrics = policy_loss(inputs, cfg)
        loss.backward()
        assert all(math.isfinite(v) for v in metrics.values())
    assert dirty.logprobs.grad.tolist() == clean.logprobs.grad.tolist()
    assert torch.isfinite(dirty.logprobs.grad).all()


def test_float32_and_bf16_inputs_compute_in_float32():
    inputs = ppo_case(logprobs=t([[-1.0, -1.5, -0.3, NAN]], torch.bfloat16).requires_grad_())
    loss, _ = policy_loss(inputs, PPOLossConfig())
    assert loss.dtype == torch.float32
    loss.backward()
    assert inputs.logprobs.grad.dtype == torch.bfloat16


# ---------------------------------------------------------------- trajectory balance
def tb_case(task_ids=(0, 1)) -> LossInputs:
    """Row 0: action log-probs -1, -2 (sum -3), log R = 0. Row 1: -0.5 (sum -0.5),
    log R = -1, plus a NaN padding position. Row 2 has no action tokens (left out)."""
    return LossInputs(
        logprobs=t([[-1.0, -2.0], [-0.5, NAN], [NAN, NAN]]).requires_grad_(),
        old_logprobs=torch.zeros(3, 2, dtype=D), behaviour_logprobs=torch.zeros(3, 2, dtype=D),
        advantages=torch.zeros(3, 2, dtype=D), mask=t([[1, 1], [1, 0], [0, 0]]),
        turn_ids=torch.tensor([[0, 0], [1, -1], [-1, -1]]),
        task_ids=None if task_ids is None else torch.tensor([*task_ids, 0]),
        log_rewards=t([0.0, -1.0, NAN]))


def test_trajectory_balance_learned_log_z():
    # log Z = [1.0, 0.2]: delta0 = 1 - 3 - 0 = -2; delta1 = .2 - .5 + 1 = .7;
    # loss = (4 + .49) / 2.
    log_z = LogZ(2).double()
    with torch.no_grad():
        log_z.table.weight.copy_(t([[1.0], [0.2]]))
    inputs = tb_case()
    loss, metrics = policy_loss(inputs, TrajectoryBalanceConfig(), log_z)
    assert loss.item() == pytest.approx(2.245, rel=1e-12)
    assert metrics["log_z_mean"] == pytest.approx(0.6)
    loss.backward()
    # d/d logprob of row 0 = 2 * delta0 / 2 = -2; row 1: .7; d/d log Z = same per task.
    torch.testing.assert_close(inputs.logprobs.grad, t([[-2.0, -2.0], [0.7, 0.0], [0.0, 0.0]]))
    assert log_z.table.weight.grad.squeeze(-1).tolist() == pytest.approx([-2.0, 0.7])


def test_trajectory_balance_batch_mean():
    # d = log R - log P_F = [3, -.5]; log Z := mean 1.25; delta = [-1.75, 1.75].
    cfg = TrajectoryBalanceConfig(log_z="batch_mean")
    loss, _ = policy_loss(tb_case(task_ids=None), cfg)
    assert loss.item() == pytest.approx(1.75 ** 2, rel=1e-12)
    loss, _ = policy_loss(tb_case(task_ids=(7, 7)), cfg)  # same task: same mean
    assert loss.item() == pytest.approx(1.75 ** 2, rel=1e-12)
    loss, _ = policy_loss(tb_case(task_ids=(0, 1)), cfg)  # each row its own task: delta 0
    assert loss.item() == pytest.approx(0.0, abs=1e-12)


def test_trajectory_balance_reward_floor_and_errors():
    # log R = -inf is raised to the floor -20: delta0 = 0 - 3 + 20 = 17 (log Z init 0).
    inputs = tb_case()
    inputs.log_rewards = t([-INF, -1.0, NAN])
    loss, _ = policy_loss(inputs, TrajectoryBalanceConfig(max_tasks=2), make_log_z(
        TrajectoryBalanceConfig(max_tasks=2)).double())
    assert loss.item() == pytest.approx((17 ** 2 + 0.5 ** 2) / 2, rel=1e-12)
    with pytest.raises(ValueError, match="LogZ"):
        policy_loss(tb_case(), TrajectoryBalanceConfig())
    with pytest.raises(ValueError, match="task id"):
        LogZ(1)(torch.tensor([1]))
    assert make_log_z(TrajectoryBalanceConfig(log_z="batch_mean")) is None


@pytest.mark.parametrize("mode", ["learned", "batch_mean"])
def test_trajectory_balance_gradcheck(mode):
    """Numerical vs analytic gradient of the TB loss (float64), through the summed action
    log-probs and, for the learned form, through the log Z table."""
    torch.manual_seed(0)
    cfg = TrajectoryBalanceConfig(log_z=mode, max_tasks=3)
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    task_ids = torch.tensor([0, 2, 0, 1])
    log_rewards = t([-0.3, -1.2, 0.4, 0.0])
    log_z = LogZ(3).double()

    def loss_of(logprobs: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        inputs = LossInputs(
            logprobs=logprobs, old_logprobs=torch.zeros_like(logprobs),
            behaviour_logprobs=torch.zeros_like(logprobs), advantages=torch.zeros_like(logprobs),
            mask=mask, turn_ids=torch.zeros_like(mask, dtype=torch.long),
            task_ids=task_ids, log_rewards=log_rewards)
        module = None
        if mode == "learned":
            module = _Bound(log_z, table)
        return trajectory_balance_loss(inputs, cfg, module)[0]

    logprobs = (-torch.rand(4, 4, dtype=D)).requires_grad_()
    table = torch.randn(3, 1, dtype=D, requires_grad=True)
    assert torch.autograd.gradcheck(loss_of, (logprobs, table))


class _Bound(torch.nn.Module):
    """Calls a LogZ with an explicit weight tensor, so gradcheck can perturb it."""

    def __init__(self, log_z: LogZ, weight: torch.Tensor) -> None:
        super().__init__()
        self.log_z, self.weight = log_z, weight

    def forward(self, task_ids: torch.Tensor) -> torch.Tensor:
        return functional_call(self.log_z, {"table.weight": self.weight}, (task_ids,))


def test_log_rewards_are_log_outcome_with_a_floor_for_non_positive_or_missing():
    from learner.losses import log_rewards

    out = log_rewards(torch.tensor([1.0, 0.5, 0.0, -1.0, float("nan"), 1e-12], dtype=torch.float64), -20.0)
    # log 1 = 0; log 0.5; a GFlowNet reward must be positive, so 0, negative (format penalty)
    # and missing outcomes get the floor; log 1e-12 = -27.6 is raised to the floor too
    torch.testing.assert_close(out, torch.tensor([0.0, math.log(0.5), -20.0, -20.0, -20.0, -20.0],
                                                 dtype=torch.float64))


def test_unknown_loss_type():
    class Fake:
        type = "dpo"

    with pytest.raises(ValueError, match="ppo"):
        policy_loss(ppo_case(), Fake())  # type: ignore[arg-type]
