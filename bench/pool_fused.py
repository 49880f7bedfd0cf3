"""A fused step of several tenants' LoRA adapters against their steps one after another, on
one base model (the pool learner's core: ``learner.adapter_slots``, ``learner.pool_step``).

    .venv/bin/python bench/pool_fused.py [--model tiny|smollm2] [--tenants 4] [--rows 8]
                                         [--width 256] [--rank 16] [--repeats 5] [--threads 0] [--quick]

Each tenant has a slot (rank ``--rank`` on every linear layer, its own AdamW) and a mini-batch
of ``--rows`` rows of ``--width`` tokens (half of each row trained), one micro-batch. *Fused*:
one ``fused_steps`` call for all tenants (one base forward and backward over every tenant's
rows, each row through its own adapter, then each slot's optimizer step). *One by one*: the
same tenants' steps, one ``fused_steps`` call each. Both run on the same table, alternately,
``--repeats`` times after a warm-up pair; the ratio is one-by-one seconds over fused seconds
per pair, its median printed with the range (goal >= 1.3x). ``tenants.py --parts 3`` runs it
too. No Ray.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).parent)]

import torch  # noqa: E402

from learner.adapter_slots import SlotSettings, SlotTable  # noqa: E402
from learner.batching import TokenBatch  # noqa: E402
from learner.lora import linear_module_names  # noqa: E402
from learner.losses.config import PPOLossConfig  # noqa: E402
from learner.pool_step import TenantStep, fused_steps  # noqa: E402

GOAL = 1.3


def batch(seed: int, rows: int, width: int, vocab: int) -> TokenBatch:
    """Full rows of random tokens; the second half of each is its actions, one advantage a row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (rows, width), generator=g)
    mask = torch.zeros(rows, width - 1)
    mask[:, width // 2:] = 1.0
    adv = torch.randn(rows, 1, generator=g).expand(rows, width - 1) * mask
    turns = torch.where(mask > 0, torch.arange(rows)[:, None].expand(rows, width - 1), -1)
    return TokenBatch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=mask,
                      behaviour=torch.zeros(rows, width - 1), advantages=adv.clone(), turn_ids=turns)


def fused_vs_one_by_one(model: torch.nn.Module, pad_id: int, tenants: int, rows: int, width: int, rank: int,
                        repeats: int) -> dict[str, float]:
    """Seconds per fused step and per one-by-one round, and their ratios (median, min, max)."""
    targets = sorted({n.rsplit(".", 1)[-1] for n in linear_module_names(model) if "layers." in n})
    table = SlotTable(model, targets)
    vocab = model.get_input_embeddings().num_embeddings
    names = [f"t{i}" for i in range(tenants)]
    for i, name in enumerate(names):
        table.attach(name, SlotSettings(rank=rank, alpha=2.0 * rank, lr=1e-5, seed=i))
    steps = [TenantStep(name, batch(i, rows, width, vocab), PPOLossConfig(), rows) for i, name in enumerate(names)]

    def fused() -> float:
        t0 = time.perf_counter()
        fused_steps(table, steps, pad_id)
        return time.perf_counter() - t0

    def one_by_one() -> float:
        t0 = time.perf_counter()
        for step in steps:
            fused_steps(table, [step], pad_id)
        return time.perf_counter() - t0

    fused(), one_by_one()  # warm-up: allocator, first-call costs
    pairs = []
    for i in range(repeats):
        a, b = (fused(), one_by_one()) if i % 2 == 0 else tuple(reversed((one_by_one(), fused())))
        pairs.append((a, b))
        print(f"  [{i + 1}/{repeats}] fused {a:.2f} s, one by one {b:.2f} s: {b / a:.2f}x "
              f"(load {os.getloadavg()[0]:.2f})", flush=True)
    ratios = [b / a for a, b in pairs]
    return {"fused_s": statistics.median(a for a, _ in pairs), "one_by_one_s": statistics.median(b for _, b in pairs),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "adapter_params": float(table.slots[names[0]].num_parameters)}


def report(args: argparse.Namespace, model: torch.nn.Module, pad_id: int) -> dict[str, float]:
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    print(f"\n3. fused step: {args.tenants} tenants x {args.rows} rows x {args.width} tokens, rank {args.rank} "
          f"(load {os.getloadavg()[0]:.2f})", flush=True)
    r = fused_vs_one_by_one(model, pad_id, args.tenants, args.rows, args.width, args.rank, args.repeats)
    print(f"fused {r['fused_s']:.2f} s vs one by one {r['one_by_one_s']:.2f} s a round: {r['ratio']:.2f}x "
          f"(range {r['ratio_min']:.2f}-{r['ratio_max']:.2f}; goal >= {GOAL}x); "
          f"{r['adapter_params'] / 1e6:.2f} M adapter parameters a tenant", flush=True)
    return r


def load_model(name: str) -> tuple[torch.nn.Module, int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engines import policy_and_source  # bench/engines.py: the cached tiny policy or converted SmolLM2

    path, _ = policy_and_source(name, show_progress=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(path).pad_token_id or 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: one per core this process may use)")
    p.add_argument("--quick", action="store_true", help="2 tenants x 2 rows x 32 tokens, 2 repeats, 1 thread "
                   "(the tests)")
    args = p.parse_args()
    if args.quick:
        args.tenants, args.rows, args.width, args.repeats, args.threads = 2, 2, 32, 2, 1
    model, pad_id = load_model(args.model)
    report(args, model, pad_id)


if __name__ == "__main__":
    main()
