"""Shared by the gateway tests: a tiny tokenizer with the project's chat template
(learner/tiny_policy.py), trained in about a second on a few gateway-flavoured sentences (no
model), and an engine completion as the recorder and response builders read it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from learner.tiny_policy import train_tokenizer

CORPUS = [
    "What is the capital of France? Let me search. Paris is the capital of France.",
    '<tool_call>{"name": "search", "arguments": {"query": "capital of France"}}</tool_call>',
    "The weather in Paris is sunny. Thanks! You are a helpful assistant.",
    "<answer>Paris</answer> search(query) lookup(name)",
]


def tiny_tokenizer(out_dir: Path):
    return train_tokenizer(CORPUS * 10, vocab_size=320, out_dir=out_dir)


TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"properties": {"query": {}}}}}]
CALL_TEXT = '<tool_call>{"name": "search", "arguments": {"query": "capital of France"}}</tool_call>'


@dataclass
class Sampled:
    """An engine completion's fields the gateway reads."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version_spans: list[tuple[int, int]]
