"""Decoding steps with transformers' concatenating KV cache against the HF engine's growing one.

    .venv/bin/python bench/kv_cache.py [--quick] [--steps 48] [--repeats 3]

One decoding step of a batch (every row feeds one token, as the engine's ``_forward`` does: 4D
padding mask, explicit positions) on the demo policy's architecture (``TinyModelConfig``'s
defaults, random weights: time does not depend on them), for batches of several rows and
widths (the cache's columns: the longest row with its left padding). Each point runs both
caches alternately, ``--repeats`` times each, and keeps the best: on a shared machine the same
run swings by tens of percent from second to second. Prints milliseconds a step of CPU time
(this thread's; wall time follows it on an idle machine) for each cache and their ratio; the
logits of the two are checked to be identical.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402

from learner.config import TinyModelConfig  # noqa: E402
from rollout.engines.kv_cache import growing_cache  # noqa: E402


def tiny_model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    tiny = TinyModelConfig()
    cfg = LlamaConfig(vocab_size=tiny.vocab_size, hidden_size=tiny.hidden_size,
                      intermediate_size=tiny.intermediate_size, num_hidden_layers=tiny.num_layers,
                      num_attention_heads=tiny.num_heads, num_key_value_heads=tiny.num_heads,
                      max_position_embeddings=tiny.max_positions, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"  # what the engine's models load with
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def decode(model, rows: int, width: int, steps: int, growing: bool) -> tuple[float, torch.Tensor]:
    """CPU seconds per decoding step after a prefill of ``rows`` x ``width``, and the logits."""
    g = torch.Generator().manual_seed(rows * 10_000 + width)
    vocab = model.config.vocab_size
    ids, feed = torch.randint(0, vocab, (rows, width), generator=g), torch.randint(0, vocab, (steps, rows, 1), generator=g)
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1,
                    past_key_values=growing_cache(model.config) if growing else None)
        cache, mask, logits = out.past_key_values, torch.ones(rows, width, dtype=torch.bool), []
        start = time.thread_time()
        for s in range(steps):
            mask = torch.cat([mask, mask.new_ones((rows, 1))], dim=1)
            out = model(input_ids=feed[s], attention_mask=mask[:, None, None], use_cache=True,
                        position_ids=torch.full((rows, 1), width + s), past_key_values=cache)
            logits.append(out.logits[:, -1])
        return (time.thread_time() - start) / steps, torch.stack(logits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two points, 16 steps, one repeat")
    parser.add_argument("--steps", type=int, default=48, help="decoding steps a measurement (the demo's max_new_tokens)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the engine's share of a 2-core machine; one thread's CPU time
    points = [(8, 64), (32, 256)] if args.quick else [(r, w) for r in (8, 16, 32) for w in (64, 256, 512)]
    steps, repeats = (16, 1) if args.quick else (args.steps, args.repeats)
    model = tiny_model()
    decode(model, 4, 16, 4, growing=True)  # warm: first calls build kernels and caches
    print(f"decoding step, {model.num_parameters() / 1e6:.1f}M-parameter Llama, 1 thread, best of {repeats} "
          f"x {steps} steps, CPU ms a step")
    print(f"{'rows':>5} {'width':>6} {'concatenating':>14} {'growing':>9} {'speed-up':>9}")
    for rows, width in points:
        best = {True: float("inf"), False: float("inf")}
        for _ in range(repeats):
            logits = {}
            for growing in (False, True):
                seconds, logits[growing] = decode(model, rows, width, steps, growing)
                best[growing] = min(best[growing], seconds)
            assert torch.equal(logits[True], logits[False]), "the growing cache changed the logits"
        print(f"{rows:>5} {width:>6} {best[False] * 1e3:>12.2f}ms {best[True] * 1e3:>7.2f}ms "
              f"{best[False] / best[True]:>8.2f}x")


if __name__ == "__main__":
    main()
