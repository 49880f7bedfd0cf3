"""The HF engine's growing KV cache (rollout/engines/kv_cache.py) on a real tiny Llama: it
decodes to exactly the logits of transformers' own cache, hands out views that later steps
never change, takes tensors assigned from outside, moves its buffer only a few times over a
long decode, and the engine's row surgery (rows joining, leaving, copied) copies it once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

from rollout.engines.kv_cache import GrowingLayer, append_rows, growing_cache, select_rows

ROWS, PROMPT, STEPS = 3, 20, 150


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512)
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg).eval()


def _decode(model, cache, ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Prefill ``ids``, then feed ``tokens[s]`` at step s; every step's logits."""
    rows, width = ids.shape
    with torch.inference_mode():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, [out.logits[:, -1]]
        for s in range(tokens.shape[0]):
            pos = torch.full((rows, 1), width + s)
            out = model(input_ids=tokens[s], position_ids=pos, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    return torch.stack(logits)


def test_decoding_gives_exactly_the_logits_of_transformers_cache(model) -> None:
    g = torch.Generator().manual_seed(1)
    ids, tokens = torch.randint(0, 300, (ROWS, PROMPT), generator=g), torch.randint(0, 300, (STEPS, ROWS, 1), generator=g)
    cache = growing_cache(model.config)
    assert all(type(layer) is GrowingLayer for layer in cache.layers)
    grown = _decode(model, cache, ids, tokens)
    plain = _decode(model, None, ids, tokens)
    assert torch.equal(grown, plain)
    assert cache.get_seq_length() == PROMPT + STEPS
    assert cache.layers[0].keys.shape == (ROWS, 2, PROMPT + STEPS, 16)


def test_views_stay_as_handed_out_and_the_buffer_moves_a_few_times() -> None:
    layer, seen, buffers = GrowingLayer(), [], set()
    for step in range(300):
        new = torch.full((2, 1, 1, 4), float(step))
        keys, _ = layer.update(new, -new)
        seen.append(keys)
        buffers.add(keys.untyped_storage().data_ptr())
    for step, keys in enumerate(seen):  # each view: exactly the columns written up to its step
        assert torch.equal(keys[0, 0, :, 0], torch.arange(step + 1, dtype=torch.float32))
    assert torch.equal(layer.values[1, 0, :, 0], -torch.arange(300, dtype=torch.float32))
    assert len(buffers) <= 6  # 1 + 64 columns, then half again each time: 65, 97, 145, 217, 325


def test_a_tensor_assigned_from_outside_is_the_cache_and_grows_on() -> None:
    """What the engine's row surgery does: select rows, trim left columns, assign; the next
    update appends after what was assigned."""
    layer = GrowingLayer()
    layer.update(torch.arange(24.0).reshape(3, 1, 2, 4), torch.zeros(3, 1, 2, 4))
    layer.batch_select_indices(torch.tensor([2, 0]))
    layer.keys, layer.values = layer.keys[:, :, 1:], layer.values[:, :, 1:]
    assert layer.get_seq_length() == 1
    keys, values = layer.update(torch.full((2, 1, 1, 4), 99.0), torch.ones(2, 1, 1, 4))
    assert keys.shape == (2, 1, 2, 4) and values.shape == (2, 1, 2, 4)
    assert keys[:, 0, 0, 0].tolist() == [20.0, 4.0] and keys[:, 0, 1, 0].tolist() == [99.0, 99.0]
    assert values[:, 0, :, 0].tolist() == [[0.0, 1.0], [0.0, 1.0]]


def _prefilled(model, rows: int, width: int, seed: int):
    ids = torch.randint(0, 300, (rows, width), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        return model(input_ids=ids, past_key_values=growing_cache(model.config), use_cache=True).past_key_values


def _buffers(cache) -> set[int]:
    return {layer._key_buf.untyped_storage().data_ptr() for layer in cache.layers}


def test_appended_rows_are_the_padded_stack_in_one_roomy_buffer(model) -> None:
    """``append_rows`` gives what padding the narrower cache on the left with zeros and
    stacking gives, and the next step writes into that buffer (no second copy)."""
    top, bottom = _prefilled(model, 2, 7, 0), _prefilled(model, 3, 12, 1)
    want = [(torch.cat([F.pad(a.keys, (0, 0, 5, 0)), b.keys]), torch.cat([F.pad(a.values, (0, 0, 5, 0)), b.values]))
            for a, b in zip(top.layers, bottom.layers)]
    append_rows(top, bottom)
    for layer, (keys, values) in zip(top.layers, want):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    held = _buffers(top)
    for layer in top.layers:
        layer.update(torch.ones(5, 2, 1, 16), torch.ones(5, 2, 1, 16))
    assert _buffers(top) == held and top.get_seq_length() == 13


def test_selected_rows_keep_their_values_and_the_room(model) -> None:
    """``select_rows`` with a repeated row and dropped left columns: the same values as
    indexing, and the next step writes into the selected buffer."""
    cache = _prefilled(model, 3, 10, 2)
    want = [(layer.keys[[2, 0, 0], :, 4:], layer.values[[2, 0, 0], :, 4:]) for layer in cache.layers]
    select_rows(cache, torch.tensor([2, 0, 0]), drop_left=4)
    for layer, (keys, values) in zip(cache.layers, want):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    held = _buffers(cache)
    for layer in cache.layers:
        keys, _ = layer.update(torch.full((3, 2, 1, 16), 7.0), torch.zeros(3, 2, 1, 16))
        assert keys.shape == (3, 2, 7, 16) and bool((keys[:, :, -1] == 7.0).all())
    assert _buffers(cache) == held
