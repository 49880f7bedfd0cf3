"""Benchmark: IGPO scoring, batched vs one forward per turn, against generation time.

Builds a tiny random-init Llama over a byte-level BPE tokenizer (``bench/tiny_llama.py``, shared
with tests/test_ig.py), rolls out N trajectories of T turns through the HF engine (sampled
actions, one session per trajectory; random-token tool observations of realistic lengths), then
scores every turn boundary, in the same process, with:

- the engine that sampled them (``rewards.ig.scorer: engine``, ``EngineIGScorer``): its prefix
  cache still holds each context, so a boundary costs its answer template; and again after a
  weights update, when nothing is reused (the cost when the learner published in between);
- the model-copy scorer (``IGScorer.score``): shared-prefix and per-row batched passes;
- ``IGScorer.score_per_turn``: one plain forward per boundary, the reference every line is
  checked against and timed against.

With ``--model smollm2`` the model is SmolLM2-135M-Instruct (the offline wheel, converted
once as runs convert it) instead: what IG costs at the size the credit matrix trains
(docs/results/credit.md), one learner step's trajectories at a time.

    .venv/bin/python bench/ig.py --quick
    .venv/bin/python bench/ig.py --trajectories 32 --turns 4 --hidden 256 --layers 4
    .venv/bin/python bench/ig.py --model smollm2 --quick --repeat 1
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.tiny_llama import build_tiny_llama  # noqa: E402
from rewards.config import IGConfig  # noqa: E402
from rewards.ig_engine import EngineIGScorer  # noqa: E402
from rewards.ig_scorer import IGScorer  # noqa: E402
from rollout.config import HFEngineConfig  # noqa: E402
from rollout.engines import local_client  # noqa: E402
from rollout.engines.base import SamplingParams  # noqa: E402
from rollout.engines.transport import InMemoryWeights  # noqa: E402
from rollout.trajectory import Trajectory, Turn  # noqa: E402

CORPUS = [
    "Question: what is the capital of France? Answer: Paris.",
    '<tool_call>{"name": "search", "arguments": {"query": "capital of France"}}</tool_call>',
    "<tool_response>Paris is the capital and largest city of France.</tool_response>",
    "<answer>Paris</answer> The answer is Paris. Berlin is the capital of Germany.",
    "Madrid is the capital of Spain. Rome is the capital of Italy. Lisbon is in Portugal.",
]
GOLDS = ["Paris", "Berlin", "Madrid", "Rome", "capital of Italy"]


def build_tiny(path: Path, hidden: int, layers: int, vocab: int, model_vocab: int = 0) -> tuple:
    """The tiny model and tokenizer over ``CORPUS``.

    ``model_vocab`` > tokenizer size pads the embedding/lm_head with never-used rows, so the
    head costs what a real model's does (the logits saving of the scorer shows up).
    """
    return build_tiny_llama(
        path, CORPUS * 10, vocab=vocab, hidden=hidden, layers=layers, max_positions=4096,
        model_vocab=model_vocab,
    )


def load_smollm2() -> tuple:
    """SmolLM2-135M-Instruct in fp32 (as the credit matrix trains it), its folder and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.config import PolicyConfig
    from learner.pretrained import convert

    path = str(convert("smollm2", PolicyConfig().models_dir))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return path, model.eval(), AutoTokenizer.from_pretrained(path)


def rollout(client, tok, args) -> tuple[list[Trajectory], float]:
    """N trajectories x T turns sampled by the HF engine (what rollout workers call: one
    session per trajectory, all trajectories' turns concurrent); returns them and the seconds
    spent generating. Observations are random tokens of realistic lengths."""
    rng = random.Random(0)
    vocab = list(range(2, len(tok)))  # skip <pad>, <eos>
    prompts = [[rng.choice(vocab) for _ in range(rng.randint(*args.prompt_len))]
               for _ in range(args.trajectories)]
    contexts = [list(p) for p in prompts]
    turns: list[list[Turn]] = [[] for _ in prompts]
    gen_s = 0.0
    for t in range(args.turns):
        params = SamplingParams(temperature=1.0, max_new_tokens=rng.randint(*args.action_len))
        start = time.perf_counter()
        outs = asyncio.run(_turn(client, contexts, params))
        gen_s += time.perf_counter() - start
        last = t == args.turns - 1
        for i, out in enumerate(outs):
            obs = [] if last else [rng.choice(vocab) for _ in range(rng.randint(*args.obs_len))]
            turns[i].append(Turn(action_ids=out.token_ids, action_logprobs=out.logprobs,
                                 policy_version=out.version, observation_ids=obs))
            contexts[i] += out.token_ids + obs
    trajs = [
        Trajectory(trajectory_id=f"b{i}", task_id=f"t{i}", group_id=f"g{i // 8}",
                   prompt_ids=prompts[i], turns=turns[i], gold_answers=[GOLDS[i % len(GOLDS)]])
        for i in range(args.trajectories)
    ]
    return trajs, gen_s


async def _turn(client, contexts: list[list[int]], params: SamplingParams) -> list:
    return await asyncio.gather(*[client.generate(c, params, session_id=f"b{i}") for i, c in enumerate(contexts)])


def work(scorer: IGScorer, trajs: list[Trajectory]) -> tuple[float, float]:
    """Per-turn / shared-prefix ratios of the work each path must do: tokens through the
    model (linear layers) and causal (query, key) pairs (attention). A speedup past these
    needs a faster kernel, not batching: it bounds what sharing the prefix can buy."""
    tokens = {"turn": 0, "shared": 0}
    pairs = {"turn": 0, "shared": 0}
    for item in scorer.shared_items(trajs):
        m = len(item.template.ids)
        for n in item.lengths:  # per-turn: one forward over context b + template
            tokens["turn"] += n + m
            pairs["turn"] += (n + m) * (n + m + 1) // 2
        ctx = len(item.context)  # shared: the longest context once, then every template copy
        tokens["shared"] += ctx + m * len(item.lengths)
        pairs["shared"] += ctx * (ctx + 1) // 2 + sum(m * n + m * (m + 1) // 2 for n in item.lengths)
    return tokens["turn"] / tokens["shared"], pairs["turn"] / pairs["shared"]


async def _after_update(client, model, engine: EngineIGScorer, trajs: list[Trajectory]) -> list:
    """Engine IG right after a weights update (the same weights as a new version): nothing
    the engine held is reused. The update itself is timed too (an idle engine: ~ms)."""
    await client.update_weights(client.version + 1, InMemoryWeights(model.state_dict()))
    return await engine.score(trajs)


def timed(fn, *a, repeat: int = 1, **kw) -> tuple[object, float]:
    """Result and the best wall time of ``repeat`` runs (the min resists noisy neighbours)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn(*a, **kw)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return out, best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="16 trajectories, shorter turns")
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny",
                   help="smollm2: the real model (--hidden, --layers and the vocab flags do not apply)")
    p.add_argument("--trajectories", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1000, help="BPE vocab (capped by the corpus)")
    p.add_argument("--model-vocab", type=int, default=0,
                   help="pad the model's vocab (e.g. 151936) to price a real-size lm_head")
    p.add_argument("--token-budget", type=int, default=IGConfig().token_budget)
    p.add_argument("--repeat", type=int, default=3, help="IG timings: best of N runs")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    args.prompt_len, args.action_len, args.obs_len = (96, 192), (32, 96), (64, 256)
    if args.quick:
        args.trajectories = min(args.trajectories, 16)
        args.prompt_len, args.action_len, args.obs_len = (48, 96), (16, 48), (32, 128)
    if args.model == "smollm2":
        path, model, tok = load_smollm2()
        client = local_client(HFEngineConfig(device=args.device), path, seed=0)
        label = "SmolLM2-135M-Instruct"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            model, tok = build_tiny(Path(tmp), args.hidden, args.layers, args.vocab, args.model_vocab)
            client = local_client(HFEngineConfig(device=args.device), tmp, seed=0)
        label = f"hidden{args.hidden}x{args.layers}L"
    model.to(args.device)
    trajs, gen_s = rollout(client, tok, args)
    cfg = IGConfig(token_budget=args.token_budget)
    shared = IGScorer(model, tok, cfg)
    per_row = IGScorer(model, tok, cfg.model_copy(update={"share_prefix": False}))
    engine = EngineIGScorer(client, tok, cfg)
    shared.score(trajs[:2])  # warm-up (allocator, kernels)
    per_row.score(trajs[:2])
    res_shared, shared_s = timed(shared.score, trajs, repeat=args.repeat)
    res_rows, rows_s = timed(per_row.score, trajs, repeat=args.repeat)
    res_ref, ref_s = timed(per_row.score_per_turn, trajs, repeat=args.repeat)
    # The engine that sampled the trajectories still holds their contexts' KV (same weights
    # version): each boundary costs a prefill of its answer template only. Then the same after
    # a weights update (an async run's learner published meanwhile): nothing is reused.
    res_warm, warm_s = timed(lambda: asyncio.run(engine.score(trajs)), repeat=args.repeat)
    res_cold, cold_s = timed(lambda: asyncio.run(_after_update(client, model, engine, trajs)), repeat=args.repeat)
    err = max(
        abs(a - b)
        for res in (res_shared, res_rows, res_warm, res_cold)
        for x, y in zip(res, res_ref)
        for a, b in zip(x.values, y.values)
    )
    n_batches = (
        len(shared.shared_batches(shared.shared_items(trajs))),
        len(per_row.batches(per_row.rows(trajs))),
    )
    tokens = sum(len(t.token_ids()) for t in trajs)
    print(f"device={args.device} model={label} "
          f"vocab={model.config.vocab_size} (tokenizer {len(tok)}) "
          f"threads={torch.get_num_threads()}")
    print(f"trajectories={len(trajs)} turns={args.turns} tokens={tokens} "
          f"boundaries={len(per_row.rows(trajs))} budget={args.token_budget} "
          f"batches shared/per-row={n_batches[0]}/{n_batches[1]}")
    print(f"generate (HF engine)         {gen_s:8.3f} s")
    for name, secs in (("ig engine, KV kept", warm_s), ("ig engine, new weights", cold_s),
                       ("ig model copy, shared", shared_s), ("ig model copy, per-row", rows_s),
                       ("ig per-turn (ref)", ref_s)):
        print(f"{name:<27} {secs:8.3f} s  ({secs / gen_s:6.1%} of generate, "
              f"{ref_s / secs:5.2f}x vs per-turn)")
    print(f"max |v - v_ref| = {err:.2e}")
    for name, secs in (("engine, KV kept", warm_s), ("model copy, shared", shared_s)):
        met = ref_s / secs >= 5 and secs / gen_s <= 0.10
        print(f"goal (>= 5x per-turn, <= 10% of generate) with the {name}: {'met' if met else 'not met'}")
    tok_ratio, pair_ratio = work(shared, trajs)
    print(f"work per-turn / shared: {tok_ratio:.2f}x tokens, {pair_ratio:.2f}x attention pairs "
          "(what sharing the prefix saves; a speedup beyond it needs faster kernels)")
    asyncio.run(client.engine.close())

if __name__ == "__main__":
    main()
