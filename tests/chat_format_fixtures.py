"""Tiny tokenizers carrying each model family's published chat template (tests/data/chat_templates)
and its special tokens, trained in well under a second on a few sentences (no model, no
download). Import ``family_tokenizer`` to use them."""

from __future__ import annotations

from pathlib import Path

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"

# family -> (template file, chat format, special tokens, eos, bos, added non-special tokens)
FAMILIES = {
    "qwen2_5": ("qwen2_5.jinja", "hermes", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", None,
                ["<tool_call>", "</tool_call>"]),
    "qwen3": ("qwen3.jinja", "qwen3", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", None,
              ["<think>", "</think>", "<tool_call>", "</tool_call>"]),
    "llama3_1": ("llama3_1_json.jinja", "llama3_json",
                 ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                  "<|python_tag|>"], "<|eot_id|>", "<|begin_of_text|>", []),
    "mistral": ("mistral.jinja", "mistral",
                ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                 "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], "</s>", "<s>", []),
    "smollm2": ("smollm2.jinja", "hermes", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", None, []),
}

CORPUS = [
    'What is the capital of France? Let me search. Paris is the capital of France. Thanks!',
    '{"name": "search", "arguments": {"query": "capital of France"}} {"type": "function"}',
    '{"name": "lookup", "parameters": {"id": 3, "city": "Paris"}} You are a helpful assistant.',
    "# Tools You may call one or more functions <tools> </tools> tool_response ipython output",
]


def family_tokenizer(family: str):
    """A fast tokenizer with ``family``'s template, special tokens, eos and bos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template, _, specials, eos, bos, added = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 5, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos,
                                   additional_special_tokens=[s for s in specials if s not in (eos, bos)])
    if added:
        fast.add_tokens(added)  # Qwen's <think>/<tool_call> are added tokens, not special ones
    fast.chat_template = (TEMPLATES / template).read_text()
    return fast


def family_format(family: str) -> str:
    return FAMILIES[family][1]
