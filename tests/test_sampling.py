"""The HF engine's sampler: exact categorical draws (exponential race), greedy and top-p rows,
log-probs under each row's tempered distribution, logit bias and presence/frequency penalties
applied before temperature (the log-probs then the reshaped distribution's), and alternatives."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from rollout.engines.base import SamplingParams
from rollout.engines.sampling import RowSampler


def _sampler(temps: list[float], top_ps: list[float], seed: int, **extra) -> RowSampler:
    params = [SamplingParams(temperature=t, top_p=p, **extra) for t, p in zip(temps, top_ps)]
    return RowSampler(params, torch.Generator().manual_seed(seed))


def _draws(sampler: RowSampler, logits: torch.Tensor, n: int) -> torch.Tensor:
    return torch.stack([sampler(logits)[0] for _ in range(n)])  # [n, B]


def test_draws_follow_the_tempered_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, 1.5]])
    sampler = _sampler([0.7], [1.0], 0)
    counts = torch.bincount(_draws(sampler, logits, 20_000)[:, 0], minlength=6)
    expected = torch.softmax(logits[0] / 0.7, -1) * 20_000
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


def test_rows_keep_their_own_settings() -> None:
    """Row 0 greedy, row 1 at temperature 1 with top-p 0.6 (the top token holds 0.525: the second is needed, no more),
    row 2 at temperature 2: each row's log-prob is its token's under its own temperature."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [3.0, 2.9, -5.0, -5.0], [1.0, 0.0, 0.5, -1.0]])
    sampler = _sampler([0.0, 1.0, 2.0], [1.0, 0.6, 1.0], 1)
    draws = _draws(sampler, logits, 4000)
    assert set(draws[:, 0].tolist()) == {1}
    assert set(draws[:, 1].tolist()) == {0, 1}
    assert set(draws[:, 2].tolist()) == {0, 1, 2, 3}
    tokens, logps, alts = sampler(logits)
    assert alts is None
    temps = torch.tensor([1.0, 1.0, 2.0]).unsqueeze(-1)
    want = torch.log_softmax(logits / temps, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logps, want)


def test_all_greedy_is_the_argmax_and_needs_no_noise() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(3)
    before = gen.get_state()
    tokens, _, _ = RowSampler([SamplingParams(temperature=0.0)] * 5, gen)(logits)
    assert torch.equal(tokens, logits.argmax(-1)) and torch.equal(gen.get_state(), before)


def test_logit_bias_and_penalties_reshape_what_is_sampled_and_its_logprobs() -> None:
    """Bias +100 forces a token, -100 bans one; a frequency penalty of 2 lowers a token once per
    earlier occurrence, presence once in all; the log-prob is the reshaped distribution's."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 3)
    params = [SamplingParams(temperature=1.0, logit_bias=((3, 100.0),)),
              SamplingParams(temperature=0.0, logit_bias=((0, -100.0),)),
              SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=2.0)]
    sampler = RowSampler(params, torch.Generator().manual_seed(4))
    assert sampler.needs_outputs
    outputs = [[], [], [0, 0, 1]]
    tokens, logps, _ = sampler(logits, outputs)
    assert tokens[:2].tolist() == [3, 1]
    shaped = torch.tensor([2.0 - 2 * 2.0 - 0.5, 1.0 - 2.0 - 0.5, 0.0, -1.0])
    want = torch.log_softmax(shaped, -1)[tokens[2]]
    torch.testing.assert_close(logps[2], want)
    assert logps[0].item() > -1e-6  # forced: probability 1 under the biased distribution
    draws = torch.stack([sampler(logits, outputs)[0][2] for _ in range(20_000)])
    counts = torch.bincount(draws, minlength=4)
    assert chisquare(counts.numpy(), (torch.softmax(shaped.double(), -1) * 20_000).numpy()).pvalue > 1e-3


def test_alternatives_are_the_most_likely_tokens_per_row() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [3.0, 2.9, -5.0, -5.0]])
    params = [SamplingParams(temperature=1.0, top_logprobs=2), SamplingParams(temperature=1.0)]
    _, _, alts = RowSampler(params, torch.Generator().manual_seed(5))(logits)
    want = torch.log_softmax(logits[0], -1)
    assert [t for t, _ in alts[0]] == [1, 3] and alts[1] == []
    assert [round(v, 5) for _, v in alts[0]] == [round(want[1].item(), 5), round(want[3].item(), 5)]
