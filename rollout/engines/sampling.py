"""Sampling the next token of every row of a decoding batch (the HF engine's sampler).

Settings are fixed for a batch's life, so what can be decided once (is any row greedy, does any
use top-p, one temperature for all) is decided when the sampler is built, not at every token.
Sampling uses the exponential race: ``argmax(p_i / E_i)`` with ``E_i ~ Exp(1)`` picks token
``i`` with probability ``p_i / sum(p)``, an exact categorical draw that costs one noise tensor
and an argmax, several times cheaper on CPU than ``torch.multinomial``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from rollout.engines.base import SamplingParams


class RowSampler:
    """``sampler(logits [B, V], outputs) -> (tokens [B], log-probs [B], alternatives)``.

    Each row's logits first take its ``logit_bias`` and its presence/frequency penalties
    (counted over ``outputs[i]``, the tokens that row sampled so far), as OpenAI and vLLM apply
    them; log-probs are under the tempered distribution of those logits (before top-p), what the
    learner's importance ratios compare with when nothing reshaped it. ``alternatives`` holds,
    per row, its ``top_logprobs`` most likely (token, log-prob) pairs (empty for rows that asked
    for none), or is None when no row asked."""

    def __init__(self, params: list[SamplingParams], generator: torch.Generator,
                 device: str | torch.device = "cpu",
                 row_generators: list[torch.Generator | None] | None = None) -> None:
        self.gen = generator
        self.own = [(i, g) for i, g in enumerate(row_generators or []) if g is not None]
        """Rows with a generator of their own (a seeded request): their noise comes from it."""
        temperatures, top_ps = [p.temperature for p in params], [p.top_p for p in params]
        greedy = [t <= 0 for t in temperatures]
        self.all_greedy = all(greedy)
        self.greedy = torch.tensor(greedy, device=device) if any(greedy) and not self.all_greedy else None
        inv = [1.0 if g else 1.0 / t for g, t in zip(greedy, temperatures)]
        self.inv_temp: float | torch.Tensor = (
            inv[0] if len(set(inv)) == 1 else torch.tensor(inv, device=device).unsqueeze(-1))
        self.top_p = torch.tensor(top_ps, device=device).unsqueeze(-1) if any(p < 1 for p in top_ps) else None
        self.biased = [(i, torch.tensor([t for t, _ in p.logit_bias], device=device),
                        torch.tensor([b for _, b in p.logit_bias], device=device))
                       for i, p in enumerate(params) if p.logit_bias]
        self.penalised = [(i, p.presence_penalty, p.frequency_penalty) for i, p in enumerate(params)
                          if p.presence_penalty or p.frequency_penalty]
        self.tops = [p.top_logprobs for p in params] if any(p.top_logprobs for p in params) else None

    def __call__(self, logits: torch.Tensor, outputs: Sequence[Sequence[int]] = ()
                 ) -> tuple[torch.Tensor, torch.Tensor, list[list[tuple[int, float]]] | None]:
        logits = self._reshape(logits.float(), outputs)
        logp = torch.log_softmax(logits * self.inv_temp, dim=-1)
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
        return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), self._alternatives(logp)

    @property
    def needs_outputs(self) -> bool:
        """Penalties count each row's sampled tokens: the caller must pass ``outputs``."""
        return bool(self.penalised)

    def _reshape(self, logits: torch.Tensor, outputs: Sequence[Sequence[int]]) -> torch.Tensor:
        if not self.biased and not self.penalised:
            return logits
        logits = logits.clone()
        for i, ids, bias in self.biased:
            logits[i].index_add_(0, ids, bias)
        for i, presence, frequency in self.penalised:
            if outputs[i]:
                counts = torch.bincount(torch.tensor(outputs[i], device=logits.device), minlength=logits.shape[-1])
                logits[i] -= frequency * counts + presence * (counts > 0)
        return logits

    def _alternatives(self, logp: torch.Tensor) -> list[list[tuple[int, float]]] | None:
        if self.tops is None:
            return None
        k = max(self.tops)
        vals, idx = logp.topk(k, dim=-1)
        return [list(zip(idx[i, :n].tolist(), vals[i, :n].tolist())) for i, n in enumerate(self.tops)]


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero every token outside each row's smallest set whose mass reaches ``top_p`` (the top
    token always stays); not renormalised: the race above does not need it."""
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
    return torch.zeros_like(probs).scatter(-1, idx, torch.where(keep, sorted_p, torch.zeros_like(sorted_p)))
