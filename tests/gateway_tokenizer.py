"""A tiny tokenizer with the project's chat template (learner/tiny_policy.py), trained in about a
second on a few gateway-flavoured sentences: for the gateway's token-level tests, no model."""

from __future__ import annotations

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
