"""LoRA adapters on the HF engine: what loading one costs against loading the whole model, and
what serving several in one batch costs against serving the base, side by side in one run.

    .venv/bin/python bench/adapters.py [--quick] [--model tiny|smollm2] [--rank 16] [--rows 8]
                                       [--max-new-tokens 32] [--repeats 5] [--vllm]

One in-process HF engine on the policy (``--model tiny``: the tiny bench policy of
bench/serving.py; ``smollm2``: SmolLM2-135M-Instruct, ``make smollm2``); adapters made by the
learner's own code (``learner.lora.wrap`` on every projection, random B), handed over in memory:

1. **Load.** Seconds for ``update_adapter`` (a new version of one adapter) and for
   ``update_weights`` (the full state dict), idle engine, best of the repeats, with the bytes
   each carries and their ratios, handed over in memory (part 4 adds the transports).
2. **Load under traffic.** The same adapter updates while ``--rows`` requests of another
   adapter decode: their tokens/s with updates landing against without (the goal: no pause,
   so near 1), and the update's latency then.
3. **Mixed batches.** Decoding tokens/s of ``--rows`` rows on the base alone, on one adapter,
   and spread over four adapters, in one batch: what routing rows to adapters costs.
4. **Publish end to end.** What a LoRA run's publish costs with ``learner.lora.publish:
   adapter`` against ``merged``: the tensors copied out of the learner's peft model, the
   transport's publish (Ray's object store, a file in /dev/shm) and the engine's load, best of
   the repeats; with ``--vllm`` into a vLLM engine serving adapters too.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from rollout.cores import apply_thread_policy  # noqa: E402

apply_thread_policy()  # before torch loads OpenMP, as every TurnRL process does

import torch  # noqa: E402

from engines import policy_and_source, prompts_of  # noqa: E402  (bench/ is on sys.path)


def random_peft(policy: str, rank: int, seed: int) -> tuple[Any, Any]:
    """(peft model, its LoRAConfig): an adapter on every projection of ``policy``, alpha 2 *
    rank, B random so it changes the model."""
    from transformers import AutoModelForCausalLM

    from learner.config import LoRAConfig
    from learner.lora import wrap

    cfg = LoRAConfig(rank=rank, alpha=2 * rank)
    torch.manual_seed(seed)
    peft = wrap(AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32), cfg)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    return peft, cfg


def make_adapter(policy: str, rank: int, seed: int) -> tuple[dict[str, torch.Tensor], float]:
    """(adapter tensors under the base's module names, alpha / rank) of ``random_peft``."""
    from learner.lora import adapter_state

    peft, cfg = random_peft(policy, rank, seed)
    return adapter_state({k: v.detach().clone() for k, v in peft.state_dict().items()}), cfg.alpha / cfg.rank


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in state.values())


async def timed(coro: Any) -> float:
    t0 = time.perf_counter()
    await coro
    return time.perf_counter() - t0


async def decode(engine: Any, prompts: list[list[int]], adapters: list[str | None], max_new: int) -> float:
    """Generated tokens/s of one request per prompt, all at once."""
    from rollout.engines.base import SamplingParams

    t0 = time.perf_counter()
    out = await asyncio.gather(*[engine.generate(p, SamplingParams(temperature=0.7, max_new_tokens=max_new,
                                                                   seed=i, adapter=a))
                                 for i, (p, a) in enumerate(zip(prompts, adapters))])
    return sum(len(c.token_ids) for c in out) / (time.perf_counter() - t0)


async def run(args: argparse.Namespace) -> None:
    from rollout.config import HFEngineConfig
    from rollout.engines.hf import HFEngine
    from rollout.engines.transport import InMemoryWeights

    policy, source = policy_and_source(args.model, show_progress=False)
    engine = HFEngine(HFEngineConfig(max_batch=64, prefix_cache_mib=0), policy, seed=0)
    full = {k: v.clone() for k, v in engine.model.state_dict().items()}
    adapters = [make_adapter(policy, args.rank, seed) for seed in range(4)]
    names = [f"a{i}" for i in range(4)]
    for name, (state, scale) in zip(names, adapters):
        await engine.update_adapter(name, 1, InMemoryWeights(state), scale)
    version = 1

    async def adapter_update() -> float:
        nonlocal version
        version += 1
        return await timed(engine.update_adapter("a0", version, InMemoryWeights(adapters[0][0]), adapters[0][1]))

    load_a = min([await adapter_update() for _ in range(args.repeats)])
    load_w = min([await timed(engine.update_weights(engine.version + 1, InMemoryWeights(full)))
                  for _ in range(args.repeats)])
    a_bytes, w_bytes = nbytes(adapters[0][0]), nbytes(full)
    print(f"adapters on the HF engine: {args.model} policy, rank {args.rank} on every projection, "
          f"{args.rows} rows, <= {args.max_new_tokens} new tokens, CPU")
    print(f"1. load (idle engine, best of {args.repeats}): adapter {a_bytes / 1e6:.2f} MB in {load_a * 1e3:.1f} ms, "
          f"full weights {w_bytes / 1e6:.2f} MB in {load_w * 1e3:.1f} ms; bytes ratio {a_bytes / w_bytes:.4f}, "
          f"time ratio {load_a / load_w:.3f}")

    prompts = prompts_of(policy, source, args.rows)
    quiet = await decode(engine, prompts, ["a1"] * args.rows, args.max_new_tokens)
    traffic = asyncio.ensure_future(decode(engine, prompts, ["a1"] * args.rows, args.max_new_tokens))
    during = []
    while not traffic.done():
        during.append(await adapter_update())
    busy = await traffic
    print(f"2. under traffic: {len(during)} updates of a0 while {args.rows} a1 rows decode: "
          f"{busy:.0f} tok/s against {quiet:.0f} without (ratio {busy / quiet:.2f}); update latency "
          f"median {sorted(during)[len(during) // 2] * 1e3:.1f} ms")

    base = await decode(engine, prompts, [None] * args.rows, args.max_new_tokens)
    one = await decode(engine, prompts, ["a1"] * args.rows, args.max_new_tokens)
    mixed = await decode(engine, prompts, [names[i % 4] for i in range(args.rows)], args.max_new_tokens)
    print(f"3. one batch of {args.rows}: base {base:.0f} tok/s, one adapter {one:.0f} ({one / base:.2f} of base), "
          f"four adapters {mixed:.0f} ({mixed / base:.2f} of base)")
    await publish_section(engine, "HF engine", policy, args)
    await engine.close()
    if args.vllm:
        from rollout.config import VLLMEngineConfig
        from rollout.engines.vllm import VLLMEngine

        engine = VLLMEngine(VLLMEngineConfig(max_loras=1, max_lora_rank=args.rank, max_model_len=1024), policy, seed=0)
        await publish_section(engine, "vLLM engine", policy, args)
        await engine.close()


async def publish_section(engine: Any, label: str, policy: str, args: argparse.Namespace) -> None:
    """4. What a LoRA run's publish costs end to end, adapter alone against the merged weights:
    the learner's side (the tensors copied out of the peft model as ``LearnerWorker._publish``
    does, then the transport's publish) and the engine's load, per transport."""
    import tempfile

    import ray

    from learner.lora import adapter_state, is_adapter_tensor, merged_state
    from learner.weights import FilePublisher, ObjectStorePublisher

    peft, cfg = random_peft(policy, args.rank, 7)
    kinds = {
        "adapter": (lambda: adapter_state({k: v.detach().clone() for k, v in peft.state_dict().items()
                                           if is_adapter_tensor(k)}),
                    lambda v, h: engine.update_adapter("run", v, h, cfg.alpha / cfg.rank)),
        "merged": (lambda: merged_state({k: v.detach().clone() for k, v in peft.state_dict().items()}, cfg),
                   lambda v, h: engine.update_weights(v, h)),
    }
    if not ray.is_initialized():
        ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
    shm = tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    version = 10 ** 6  # above every version the sections before loaded
    print(f"4. publish end to end into the {label} (copy out of the learner's model + publish + load, "
          f"best of {args.repeats}):")
    for transport, publisher in (("ray object store", ObjectStorePublisher()), ("file (/dev/shm)", FilePublisher(shm))):
        best: dict[str, tuple[int, float]] = {}
        for kind, (extract, load) in kinds.items():
            times = []
            for _ in range(args.repeats):
                version += 1
                t0 = time.perf_counter()
                state = extract()
                await load(version, publisher.publish(version, state))
                times.append(time.perf_counter() - t0)
            best[kind] = nbytes(state), min(times)
        (a_bytes, a_s), (m_bytes, m_s) = best["adapter"], best["merged"]
        print(f"   {label} {transport}: adapter {a_bytes / 1e6:.2f} MB in {a_s * 1e3:.1f} ms, merged "
              f"{m_bytes / 1e6:.2f} MB in {m_s * 1e3:.1f} ms; publish time ratio {a_s / m_s:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4 rows, 12 new tokens, 3 repeats")
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--vllm", action="store_true", help="also part 4 into a vLLM engine serving adapters")
    args = p.parse_args()
    if args.quick:
        args.rows, args.max_new_tokens, args.repeats = 4, 12, 3
    torch.set_num_threads(2)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
