"""Benchmark: the streaming tool-call parser, re-scanning (before) vs incremental (after).

The live gateway feeds its stream parser the whole decoded text after every token. Per chat
format, a long completion (prose, Qwen3's reasoning, a call whose arguments are a long code
string) is cut into 4-character "tokens" and fed token by token to ``RescanParser`` (the
whole-text re-scan the gateway used before, kept as the specification) and ``StreamParser``
(incremental), in the same process, the fastest of ``--repeat`` runs each; every delta of the
two is checked equal. Prints the parsers' cost per token at each length, side by side: the
re-scan's grows with the text, the incremental one's does not. The times include slicing each
prefix off the text (what the gateway's decode hands the parser), which both pay.

Then the decoding in front of the parser, per token of the same hermes completion tokenized by
a byte-level BPE tokenizer trained here: a full decode of the completion so far (the gateway
before) against ``rollout.chat.StreamDecoder`` (tokenizers' ``DecodeStream``), texts checked
equal after every token.

    .venv/bin/python bench/stream_parse.py --quick
    .venv/bin/python bench/stream_parse.py --tokens 1000 4000 16000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from envs.formats import FORMATS, ToolCall, get_format  # noqa: E402
from envs.formats.stream import RescanParser, StreamParser  # noqa: E402

CHARS_PER_TOKEN = 4
PROSE = "The capital of France is Paris, which I will check with a search before answering. "
CODE = "def area(r):\n    return {'circle': 3.14159 * r ** 2, 'note': \"r in metres\"}\n\n"


def completion(name: str, tokens: int) -> str:
    """About ``tokens`` tokens in ``name``'s syntax: a third prose (half of it reasoning for
    qwen3), two thirds the arguments of one call (Llama 3 JSON: the call alone)."""
    chars = tokens * CHARS_PER_TOKEN
    prose = (PROSE * (chars // 3 // len(PROSE) + 1))[: chars // 3]
    code = (CODE * (chars * 2 // 3 // len(CODE) + 1))[: chars * 2 // 3]
    call = ToolCall(name="python", arguments={"code": code})
    fmt = get_format(name)
    if name == "qwen3":
        return fmt.render(prose[: len(prose) // 2], [call], prose[len(prose) // 2:])
    return fmt.render(None if name == "llama3_json" else prose, [call])


def run(parser_cls: type, name: str, text: str) -> tuple[float, list]:
    """Seconds to feed ``text`` token by token (and finish), and the deltas."""
    parser, deltas = parser_cls(get_format(name)), []
    cuts = range(CHARS_PER_TOKEN, len(text), CHARS_PER_TOKEN)
    t0 = time.perf_counter()
    for i in cuts:
        deltas.append(parser.feed(text[:i]))
    deltas.append(parser.feed(text, final=True))
    return time.perf_counter() - t0, deltas


def tokenizer():
    """A byte-level BPE tokenizer (512 tokens) trained on the bench's own text, as transformers'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|im_end|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([completion("hermes", 500)] * 5, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


def decode_times(tok, n: int) -> tuple[int, float, float]:
    """Tokens, then seconds a token to decode an ``n``-token completion token by token, in full
    each time and with ``StreamDecoder``."""
    from rollout.chat import StreamDecoder, decode_action

    ids = tok(completion("hermes", n), add_special_tokens=False)["input_ids"]
    t0 = time.perf_counter()
    full = [decode_action(tok, ids[:i + 1]).rstrip("\ufffd") for i in range(len(ids))]
    t1 = time.perf_counter()
    decoder = StreamDecoder(tok)
    stepped = [decoder.push([t]) for t in ids]
    t2 = time.perf_counter()
    if stepped != full:
        raise SystemExit(f"{n} tokens: StreamDecoder's text differs from a full decode's")
    return len(ids), (t1 - t0) / len(ids), (t2 - t1) / len(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1000, 4000, 16000],
                    help="completion lengths, in 4-character tokens")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs per parser and length; the fastest counts (the machine is shared)")
    ap.add_argument("--quick", action="store_true", help="lengths 250 and 1000, one run (a smoke run)")
    args = ap.parse_args()
    lengths = [250, 1000] if args.quick else args.tokens
    print(f"{'format':<12} {'tokens':>7} {'re-scan ms/token':>17} {'incremental ms/token':>21} {'speed-up':>9}")
    worst = 0.0
    for name in sorted(FORMATS):
        for n in lengths:
            text = completion(name, n)
            tokens = len(text) // CHARS_PER_TOKEN
            repeat = 1 if args.quick else args.repeat
            before, want = min((run(RescanParser, name, text) for _ in range(repeat)), key=lambda r: r[0])
            after, got = min((run(StreamParser, name, text) for _ in range(repeat)), key=lambda r: r[0])
            if got != want:
                raise SystemExit(f"{name}, {n} tokens: the incremental deltas differ from the re-scan's")
            print(f"{name:<12} {tokens:>7} {before / tokens * 1e3:>17.4f} {after / tokens * 1e3:>21.4f} "
                  f"{before / after:>8.1f}x")
            if n == lengths[-1]:
                worst = max(worst, after / before)
    print(f"longest completions, incremental / re-scan time (worst format): {worst:.3f} "
          "(every delta equal to the re-scan's)")
    tok = tokenizer()
    print(f"\n{'decoding':<12} {'tokens':>7} {'full ms/token':>17} {'stepped ms/token':>21} {'speed-up':>9}")
    for n in lengths:
        tokens, full, stepped = decode_times(tok, n)
        print(f"{'hermes':<12} {tokens:>7} {full * 1e3:>17.4f} {stepped * 1e3:>21.4f} {full / stepped:>8.1f}x")


if __name__ == "__main__":
    main()
