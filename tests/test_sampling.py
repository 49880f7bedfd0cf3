"""The HF engine's sampler: exact categorical draws (exponential race), greedy and top-p rows,
and log-probs under each row's tempered distribution."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from rollout.engines.sampling import RowSampler


def _draws(sampler: RowSampler, logits: torch.Tensor, n: int) -> torch.Tensor:
    return torch.stack([sampler(logits)[0] for _ in range(n)])  # [n, B]


def test_draws_follow_the_tempered_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, 1.5]])
    sampler = RowSampler([0.7], [1.0], torch.Generator().manual_seed(0))
    counts = torch.bincount(_draws(sampler, logits, 20_000)[:, 0], minlength=6)
    expected = torch.softmax(logits[0] / 0.7, -1) * 20_000
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


def test_rows_keep_their_own_settings() -> None:
    """Row 0 greedy, row 1 at temperature 1 with top-p 0.6 (the top token holds 0.525: the second is needed, no more),
    row 2 at temperature 2: each row's log-prob is its token's under its own temperature."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [3.0, 2.9, -5.0, -5.0], [1.0, 0.0, 0.5, -1.0]])
    sampler = RowSampler([0.0, 1.0, 2.0], [1.0, 0.6, 1.0], torch.Generator().manual_seed(1))
    draws = _draws(sampler, logits, 4000)
    assert set(draws[:, 0].tolist()) == {1}
    assert set(draws[:, 1].tolist()) == {0, 1}
    assert set(draws[:, 2].tolist()) == {0, 1, 2, 3}
    tokens, logps = sampler(logits)
    temps = torch.tensor([1.0, 1.0, 2.0]).unsqueeze(-1)
    want = torch.log_softmax(logits / temps, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logps, want)


def test_all_greedy_is_the_argmax_and_needs_no_noise() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(3)
    before = gen.get_state()
    tokens, _ = RowSampler([0.0] * 5, [1.0] * 5, gen)(logits)
    assert torch.equal(tokens, logits.argmax(-1)) and torch.equal(gen.get_state(), before)
