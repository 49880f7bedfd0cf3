"""A batch run as shared prefix + suffixes gives the padded batch's losses and gradients."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from learner.sft import _batch_loss
from rollout import next_token
from rollout.next_token import next_token_logprobs
from rollout.shared_prefix import MIN_SHARED, forward_shared, pad_rows, shared_length

PAD = 0


@pytest.fixture()
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
                      pad_token_id=PAD)
    return LlamaForCausalLM(cfg).train()


def _rows(shared: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 96) for _ in range(shared)]
    return [prefix + [rng.randrange(1, 96) for _ in range(n - shared)] for n in lengths]


def _plain_nll(model, rows: list[list[int]]) -> torch.Tensor:
    """The padded batch's next-token NLL, 0 past each row's end: what SFT computed before."""
    width = max(map(len, rows))
    ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
    att = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1),
                                            reduction="none").view(len(rows), width - 1)
    return nll * att[:, 1:]


def _grads(model, loss: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def _shared(rows: list[list[int]], cap: int | None = None) -> int:
    return shared_length(*pad_rows(rows, PAD), cap=cap)


def test_shared_length_is_the_common_prefix_within_bounds() -> None:
    rows = _rows(30, [40, 35, 50])
    assert _shared(rows) == 30
    assert _shared(rows, cap=20) == 20
    assert _shared([rows[0], rows[0][:31]]) == 30  # the shorter row keeps one token after it
    assert _shared(_rows(MIN_SHARED - 1, [30, 30])) == 0  # too short to be worth a pass
    assert _shared(rows[:1]) == 0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [512, 7])
def test_logprobs_entropy_and_gradients_match_the_padded_batch(model, temperature, chunk, monkeypatch) -> None:
    # The head runs ``chunk`` positions at a time (7: many chunks, one splitting the shared
    # prefix's); values and gradients are the whole padded batch's log-softmax's.
    monkeypatch.setattr(next_token, "LOGIT_CHUNK", chunk)
    rows = _rows(24, [60, 31, 45, 25])
    ids, mask = pad_rows(rows, PAD)
    shared = shared_length(ids, mask)
    assert shared == 24
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1] / temperature
    plain_all = torch.log_softmax(logits, -1)
    plain = plain_all.gather(-1, ids[:, 1:, None])[..., 0]
    plain_ent = -(plain_all.exp() * plain_all).sum(-1)
    fast, fast_ent = next_token_logprobs(model, ids, mask, shared, temperature, entropy=True)
    real = mask[:, 1:].bool()  # past a row's end both are a pad's log-prob, unused
    assert fast.shape == plain.shape and fast_ent.shape == plain_ent.shape
    assert torch.allclose(fast[real], plain[real], atol=1e-5)
    assert torch.allclose(fast_ent[real], plain_ent[real], atol=1e-5)
    unshared, none = next_token_logprobs(model, ids, mask, 0, temperature)
    assert none is None and torch.allclose(unshared[real], plain[real], atol=1e-5)
    weight = torch.rand(plain.shape) * mask[:, 1:]
    for want, got in zip(_grads(model, (plain * weight).sum() + (plain_ent * weight).sum()),
                         _grads(model, (fast * weight).sum() + (fast_ent * weight).sum())):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


def test_identical_rows_share_all_but_their_last_token(model) -> None:
    # A group whose samples came out the same (a collapsed policy's): the prefix is every
    # token but the last, the suffix pass has no next token of its own to score
    rows = _rows(30, [30, 30])
    rows[1] = list(rows[0])
    ids, mask = pad_rows(rows, PAD)
    assert shared_length(ids, mask) == 29
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    plain = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    fast, ent = next_token_logprobs(model, ids, mask, 29, 1.0, entropy=True)
    assert fast.shape == ent.shape == (2, 29) and torch.allclose(fast, plain, atol=1e-5)
    grads = _grads(model, fast.sum())
    assert all(torch.isfinite(g).all() for g in grads)


def test_a_model_whose_logits_are_more_than_its_head_takes_the_whole_logits(model, monkeypatch) -> None:
    # Only model types whose logits are the head's output run the head in chunks; others
    # (soft-capped or scaled logits) get the same values through the model's own logits.
    rows = _rows(24, [40, 30])
    ids, mask = pad_rows(rows, PAD)
    chunked = next_token_logprobs(model, ids, mask, 24, 1.0, entropy=True)
    assert next_token.split_head(model) is not None
    monkeypatch.setattr(next_token, "PLAIN_HEADS", frozenset())
    assert next_token.split_head(model) is None
    whole = next_token_logprobs(model, ids, mask, 24, 1.0, entropy=True)
    real = mask[:, 1:].bool()
    assert all(torch.allclose(a[real], b[real], atol=1e-5) for a, b in zip(chunked, whole))


def test_prefix_states_are_the_rows_own(model) -> None:
    rows = _rows(20, [30, 26])
    ids, mask = pad_rows(rows, PAD)
    fwd = forward_shared(model.base_model, ids, mask, 20, field="last_hidden_state")
    whole = model.base_model(input_ids=torch.tensor([rows[0]])).last_hidden_state
    assert fwd.start == 20 and fwd.prefix.shape == (1, 20, 32) and fwd.suffix.shape == (2, 10, 32)
    assert torch.allclose(fwd.prefix[0], whole[0, :20], atol=1e-5)
    assert torch.allclose(fwd.suffix[0], whole[0, 20:], atol=1e-5)


def test_sft_batch_loss_equals_the_plain_weighted_mean(model) -> None:
    """SFT's loss (prefix once, rows in two length-sorted passes) is the padded batch's."""
    rows = _rows(24, [70, 30, 64, 33, 28, 66])
    rng = random.Random(1)
    batch = [(r, [int(j >= 24 and rng.random() < 0.5) for j in range(len(r))]) for r in rows]
    weight = torch.zeros(len(rows), max(map(len, rows)) - 1)
    for i, (r, mask) in enumerate(batch):
        weight[i, : len(r) - 1] = torch.tensor([1.0 if m else 0.25 for m in mask[1:]])
    plain = (_plain_nll(model, rows) * weight).sum() / weight.sum()
    fast = _batch_loss(model, batch, PAD, context_weight=0.25)
    assert fast.item() == pytest.approx(plain.item(), abs=1e-6)
    for want, got in zip(_grads(model, plain), _grads(model, fast)):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-4)
