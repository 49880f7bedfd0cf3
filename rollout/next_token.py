"""Next-token log-probs and entropy of a batch, without the whole vocabulary's logits at once.

A learner step needs, per position, the log-prob of the token that follows (and for the entropy
bonus, the next-token distribution's entropy), never the logits themselves. Materialising them
costs ``positions x vocabulary`` floats several times over (the logits, their float copy, the
log-softmax, and what backward keeps): with SmolLM2's 49,152-word vocabulary, 8 rows of ~350
positions are 550 MB per copy, which is how a 2.2 GB model's learner reached 6.5 GB. Here the
model's backbone gives the last hidden states, and the output head runs over ``LOGIT_CHUNK``
positions at a time; in training each chunk is checkpointed, so backward recomputes its logits
instead of keeping them. The positions of a prefix every row shares (``rollout.shared_prefix``)
run the head once, not once per row.

Models whose logits are not just the head applied to the hidden states (soft-capping, scaled
logits), and heads ZeRO-3 partitions, take the whole-logits path: same values, more memory.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from rollout.shared_prefix import forward_shared

LOGIT_CHUNK = 512
"""Positions whose vocabulary-wide logits exist at once (512 x 49,152 floats: 100 MB)."""
PLAIN_HEADS = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""Model types whose logits are exactly ``lm_head(last hidden state)``."""


def split_head(model: Any) -> tuple[Any, torch.nn.Module] | None:
    """(backbone returning ``last_hidden_state``, output head) of a causal LM, a DeepSpeed
    engine or a PEFT model around one; None when the logits are more than the head's output,
    or ZeRO-3 holds the head partitioned."""
    inner = getattr(model, "module", model)  # a DeepSpeed engine's model
    if hasattr(inner, "get_base_model"):  # a PEFT model: the adapted model itself
        inner = inner.get_base_model()
    config = getattr(inner, "config", None)
    if getattr(config, "model_type", None) not in PLAIN_HEADS or not hasattr(inner, "get_decoder"):
        return None
    head = inner.get_output_embeddings()
    if head is None or hasattr(head.weight, "ds_id"):  # ZeRO-3 partitions parameters (ds_id set)
        return None
    return inner.get_decoder(), head


def head_logprobs(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, temperature: float,
                  entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``hidden`` [N, H] through ``head``: (log-probs [N, K] of ``targets`` [N, K] at each
    position, entropy [N] or None), ``LOGIT_CHUNK`` positions at a time."""
    logps = [hidden.new_zeros(0, targets.size(1), dtype=torch.float32)]  # rows whose suffix is all prefix: none
    ents = [hidden.new_zeros(0, dtype=torch.float32)]
    for lo in range(0, hidden.size(0), LOGIT_CHUNK):
        args = (hidden[lo:lo + LOGIT_CHUNK], head.weight, head.bias, targets[lo:lo + LOGIT_CHUNK], temperature, entropy)
        if torch.is_grad_enabled():  # backward recomputes the chunk's logits instead of keeping them
            lp, ent = checkpoint(_chunk, *args, use_reentrant=False)
        else:
            lp, ent = _chunk(*args)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps), torch.cat(ents) if entropy else None


def _chunk(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
           temperature: float, entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.nn.functional.linear(h, weight, bias).float() / temperature
    lse = torch.logsumexp(logits, -1, keepdim=True)
    logp = logits.gather(-1, targets) - lse
    if not entropy:
        return logp, logp.new_zeros(logp.size(0))
    return logp, (lse[:, 0] - (torch.softmax(logits, -1) * logits).sum(-1))


def next_token_logprobs(model: Any, ids: torch.Tensor, mask: torch.Tensor, shared: int, temperature: float = 1.0,
                        entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(``[B, L-1]`` log-prob of each row's token ``j + 1`` given its tokens up to ``j``,
    ``[B, L-1]`` entropy of that next-token distribution, or None unless ``entropy``), at
    ``temperature``, as the padded batch's logits give them; the first ``shared`` tokens run once."""
    parts = split_head(model)
    if parts is None:
        return _whole_logits(model, ids, mask, shared, temperature, entropy)
    backbone, head = parts
    fwd = forward_shared(backbone, ids, mask, shared, field="last_hidden_state")
    rows, width = ids.shape
    hidden = fwd.suffix[:, :-1]  # the last position has no next token
    lp, ent = head_logprobs(hidden.reshape(-1, hidden.size(-1)), head, ids[:, shared + 1:].reshape(-1, 1),
                            temperature, entropy)
    logp, ents = [lp.view(rows, hidden.size(1))], [ent.view(rows, hidden.size(1))] if entropy else []
    if fwd.prefix is not None:  # one row's positions, every row's next token
        plp, pent = head_logprobs(fwd.prefix[0], head, ids[:, 1:shared + 1].T, temperature, entropy)
        logp.insert(0, plp.T)
        if entropy:
            ents.insert(0, pent.expand(rows, -1))
    return torch.cat(logp, 1), torch.cat(ents, 1) if entropy else None


def _whole_logits(model: Any, ids: torch.Tensor, mask: torch.Tensor, shared: int, temperature: float,
                  entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    fwd = forward_shared(model, ids, mask, shared)
    logp_all = torch.log_softmax(fwd.suffix.float() / temperature, -1)
    if fwd.prefix is not None:  # its log-softmax once, the same for every row
        prefix = torch.log_softmax(fwd.prefix.float() / temperature, -1)
        logp_all = torch.cat([prefix.expand(ids.size(0), -1, -1), logp_all], dim=1)
    logp_all = logp_all[:, :-1]
    logp = logp_all.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1) if entropy else None
