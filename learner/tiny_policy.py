"""Create a tiny policy locally: a byte-level BPE tokenizer trained on the environment's text,
a chat template with the Hermes tool-call convention, and a random-init Llama or Qwen2 model.

No hub access: everything is built from the environment's own corpus and saved as a normal
Hugging Face folder that ``AutoTokenizer``/``AutoModelForCausalLM`` load back.
"""

from __future__ import annotations

from pathlib import Path

from learner.config import TinyModelConfig

IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

# Qwen2.5-style turns; tools are listed compactly as name(params) in the system turn, since
# a tiny model pays for every prompt token and gains nothing from the JSON schema's prose.
CHAT_TEMPLATE = """\
{%- if tools -%}
{%- set ns = namespace(text='\n<tools>') -%}
{%- for t in tools -%}
{%- set f = t.function if t.function is defined else t -%}
{%- set ns.text = ns.text ~ '\n' ~ f.name ~ '(' ~ ((f.parameters.properties if f.parameters is defined else {}) | list | join(', ')) ~ ')' -%}
{%- endfor -%}
{%- set tool_text = ns.text ~ '\n</tools>' -%}
{%- else -%}{%- set tool_text = '' -%}{%- endif -%}
{%- if messages[0].role != 'system' and tools -%}
<|im_start|>system
You may call tools.{{ tool_text }}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
<|im_start|>system
{{ m.content }}{{ tool_text }}<|im_end|>
{% elif m.role == 'assistant' -%}
<|im_start|>assistant
{{ m.content or '' }}
{%- for c in (m.tool_calls or []) -%}
{%- set f = c.function if c.function is defined else c -%}
<tool_call>{{ {'name': f.name, 'arguments': f.arguments} | tojson }}</tool_call>
{%- endfor -%}<|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}"""


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path, split_digits: bool = False):
    """Train a byte-level BPE on ``texts`` and save it as a fast HF tokenizer; with
    ``split_digits`` every digit is its own piece, never merged."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Every space and punctuation mark is its own piece, so a word gets the same tokens
    # wherever it stands (" Vedor" in a document, "Vedor" after a quote or a tag): a tiny
    # model then only has to learn to copy, not to map between spellings of the same name.
    pieces = [pre_tokenizers.Split(Regex(r"\s|[^\w\s]"), behavior="isolated")]
    if split_digits:
        pieces.append(pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*pieces, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, bos_token=None,
        additional_special_tokens=[IM_START],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def create_model(cfg: TinyModelConfig, tokenizer, seed: int, out_dir: Path):
    """A random-init causal LM of the configured family, saved next to the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    config = LlamaConfig(**common) if cfg.architecture == "llama" else Qwen2Config(**common)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    return model
