"""Shared by the gateway tests: a tiny tokenizer with the project's chat template
(learner/tiny_policy.py), trained in about a second on a few gateway-flavoured sentences (no
model), and an engine completion as the recorder and response builders read it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from learner.tiny_policy import train_tokenizer

CORPUS = [
    "What is the capital of France? Let me search. Paris is the capital of France.",
    '<tool_call>{"name": "search", "arguments": {"query": "capital of France"}}</tool_call>',
    "The weather in Paris is sunny. Thanks! You are a helpful assistant.",
    "<answer>Paris</answer> search(query) lookup(name)",
]


def tiny_tokenizer(out_dir: Path):
    return train_tokenizer(CORPUS * 10, vocab_size=320, out_dir=out_dir)


@pytest.fixture(scope="module")
def random_policy(tmp_path_factory) -> str:
    """A random-init tiny Llama with the project's chat template, built in a second or two:
    for gateway tests where what the model says does not matter (import it to use it)."""
    from learner.config import TinyModelConfig
    from learner.tiny_policy import create_model

    out = tmp_path_factory.mktemp("random-policy")
    tok = tiny_tokenizer(out)
    create_model(TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok, 0, out)
    return str(out)


TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"properties": {"query": {}}}}}]
CALL_TEXT = '<tool_call>{"name": "search", "arguments": {"query": "capital of France"}}</tool_call>'


@dataclass
class Sampled:
    """An engine completion's fields the gateway reads."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version_spans: list[tuple[int, int]]
    adapter: str | None = None
    top: list[list[tuple[int, float]]] = field(default_factory=list)
