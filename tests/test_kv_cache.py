"""The HF engine's growing KV cache (rollout/engines/kv_cache.py) on a real tiny Llama: it
decodes to exactly the logits of transformers' own cache, hands out views that later steps
never change, takes tensors the engine assigns (joins, trims) and moves its buffer only a few
times over a long decode."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from rollout.engines.kv_cache import GrowingLayer, growing_cache

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
