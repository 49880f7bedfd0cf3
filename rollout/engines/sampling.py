"""Sampling the next token of every row of a decoding batch (the HF engine's sampler).

Settings are fixed for a batch's life, so what can be decided once (is any row greedy, does any
use top-p, one temperature for all) is decided when the sampler is built, not at every token.
Sampling uses the exponential race: ``argmax(p_i / E_i)`` with ``E_i ~ Exp(1)`` picks token
``i`` with probability ``p_i / sum(p)``, an exact categorical draw that costs one noise tensor
and an argmax, several times cheaper on CPU than ``torch.multinomial``.
"""

from __future__ import annotations

import torch


class RowSampler:
    """``sampler(logits [B, V]) -> (tokens [B], log-probs [B])``; log-probs are under each row's
    tempered distribution (before top-p), what the learner's importance ratios compare with."""

    def __init__(self, temperatures: list[float], top_ps: list[float], generator: torch.Generator,
                 device: str | torch.device = "cpu",
                 row_generators: list[torch.Generator | None] | None = None) -> None:
        self.gen = generator
        self.own = [(i, g) for i, g in enumerate(row_generators or []) if g is not None]
        """Rows with a generator of their own (a seeded request): their noise comes from it."""
        greedy = [t <= 0 for t in temperatures]
        self.all_greedy = all(greedy)
        self.greedy = torch.tensor(greedy, device=device) if any(greedy) and not self.all_greedy else None
        inv = [1.0 if g else 1.0 / t for g, t in zip(greedy, temperatures)]
        self.inv_temp: float | torch.Tensor = (
            inv[0] if len(set(inv)) == 1 else torch.tensor(inv, device=device).unsqueeze(-1))
        self.top_p = torch.tensor(top_ps, device=device).unsqueeze(-1) if any(p < 1 for p in top_ps) else None

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax(logits.float() * self.inv_temp, dim=-1)
        if self.all_greedy:
            tokens = logp.argmax(-1)
        else:
            probs = logp.exp()
            if self.top_p is not None:
                probs = _nucleus(probs, self.top_p)
            noise = torch.empty_like(probs).exponential_(generator=self.gen)
            for i, gen in self.own:  # one draw per token from the row's own stream: reproducible
                noise[i].exponential_(generator=gen)
            tokens = probs.div_(noise).argmax(-1)
            if self.greedy is not None:
                tokens = torch.where(self.greedy, logp.argmax(-1), tokens)
        return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero every token outside each row's smallest set whose mass reaches ``top_p`` (the top
    token always stays); not renormalised: the race above does not need it."""
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
    return torch.zeros_like(probs).scatter(-1, idx, torch.where(keep, sorted_p, torch.zeros_like(sorted_p)))
