"""SFT warm-start step: the padded batch against shared prefix + length cuts, side by side.

    .venv/bin/python bench/sft.py [--quick] [--config configs/demo.yaml] [--steps 60] [--rounds 3] [--set k=v ...]

Builds the config's tokenizer, a random-init model and its demonstrations exactly as the warm
start does, then alternates rounds of ``--steps`` optimizer steps (forward, backward, clip,
AdamW) on the same seeded batches with two losses:

- padded: every row of a batch right-padded to the longest, one forward (SFT before
  2026-11-26);
- shared: ``learner.sft._batch_loss`` -- the prefix all rows share runs once
  (``rollout.shared_prefix``) and the length-sorted rows run in passes cut where they pad
  least (``learner.batching.padding_cuts``).

Prints each one's steps/s, the tokens a step holds (real, and padded to each batch's longest),
their ratio, and both losses of the first step (same weights, same batch: equal but for float
rounding).
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from rollout.cores import apply_thread_policy  # noqa: E402

apply_thread_policy()  # before torch loads OpenMP, as every TurnRL process does

import torch  # noqa: E402

from learner.sft import _batch_loss, target_weights  # noqa: E402
from rollout.shared_prefix import pad_rows  # noqa: E402

Row = tuple[list[int], list[int]]


def padded_loss(model, batch: list[Row], pad: int, context_weight: float) -> torch.Tensor:
    """The weighted mean next-token NLL of the whole batch padded to its longest row."""
    ids, mask = pad_rows([r[0] for r in batch], pad)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1),
                                            reduction="none").view(ids.size(0), -1)
    weight = target_weights(batch, ids.size(1), context_weight)
    return (nll * weight).sum() / weight.sum()


def setup(args: argparse.Namespace):
    """(model, pad id, demonstration rows, SFT config) as the warm start builds them."""
    from cluster.config import load_config
    from envs.registry import make_task_source
    from learner.bootstrap import _corpus, demo_env_config
    from learner.sft import demo_rows, demonstrations
    from learner.tiny_policy import create_model, train_tokenizer

    cfg = load_config(args.config, args.overrides)
    policy = cfg.policy
    source = make_task_source(cfg.env)
    demo_cfg = demo_env_config(policy, cfg.env)
    demo_source = make_task_source(demo_cfg) if demo_cfg is not None else source
    out = Path(tempfile.mkdtemp(prefix="bench-sft-"))
    texts = _corpus(source) + (_corpus(demo_source) if demo_source is not source else [])
    tok = train_tokenizer(texts, policy.tiny.vocab_size, out, policy.tiny.split_digits)
    model = create_model(policy.tiny, tok, policy.sft.seed, out).train()
    data = [demo_rows(tok, t, d, cfg.rollout.history_turns) for t, d in demonstrations(demo_source, policy.sft)]
    return model, tok.pad_token_id, data, policy.sft


def timed_round(model, opt, batches: list[list[Row]], loss_fn, pad: int, weight: float) -> tuple[float, list[float]]:
    start, losses = time.perf_counter(), []
    for batch in batches:
        loss = loss_fn(model, batch, pad, weight)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return time.perf_counter() - start, losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"))
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each loss, alternated")
    ap.add_argument("--quick", action="store_true", help="one round of 6 steps (a smoke run)")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    if args.quick:
        args.steps, args.rounds = 6, 1
    model, pad, data, sft = setup(args)
    rng = random.Random(sft.seed)
    batches = [[row for rows in rng.sample(data, min(sft.batch_size, len(data))) for row in rows]
               for _ in range(args.steps)]
    real = sum(len(r[0]) for b in batches for r in b) / len(batches)
    padded_tokens = sum(len(b) * max(len(r[0]) for r in b) for b in batches) / len(batches)
    losses = {"padded": padded_loss, "shared": _batch_loss}
    # Two copies from one init, each with its own optimizer: both take the same steps.
    runs = {name: (m := copy.deepcopy(model), torch.optim.AdamW(m.parameters(), lr=sft.lr)) for name in losses}
    seconds = {name: 0.0 for name in losses}
    first: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, fn in losses.items():
            m, opt = runs[name]
            dt, seen = timed_round(m, opt, batches, fn, pad, sft.context_loss_weight)
            seconds[name] += dt
            first.setdefault(name, seen[0])  # the first step: both copies still the same weights
    steps = args.steps * args.rounds
    rate = {name: steps / s for name, s in seconds.items()}
    print(f"{len(data)} demonstrations, batch {sft.batch_size}; {real:.0f} real tokens a step, "
          f"{padded_tokens:.0f} padded; {steps} steps of each, alternated in {args.rounds} rounds")
    print(f"padded batch            {rate['padded']:6.2f} steps/s")
    print(f"shared prefix + cuts    {rate['shared']:6.2f} steps/s")
    print(f"ratio {rate['shared'] / rate['padded']:.2f}x | first step's loss: padded {first['padded']:.6f}, "
          f"shared {first['shared']:.6f} (same weights, same batch)")


if __name__ == "__main__":
    main()
