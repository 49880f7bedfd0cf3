"""Engine throughput and weight updates: the HF engine, the vLLM engine and plain
``model.generate``, side by side in one run.

    .venv/bin/python bench/engines.py [--quick] [--model tiny|smollm2] [--batch B] [--requests R]
                                      [--max-new-tokens T] [--no-vllm] [--device cuda] [--no-updates]
                                      [--updates-on hf|vllm ...]

Same model on every side (``--model tiny``: the tiny warm-started policy of bench/serving.py;
``--model smollm2``: SmolLM2-135M-Instruct converted from its package, learner/pretrained.py),
the same search-QA prompts, the same sampling (temperature 0.7, top-p 1, at most T new tokens, stopping at end-of-turn):

1. **Equal batch.** B prompts at once: one ``model.generate`` call on the left-padded batch,
   against B concurrent requests to each engine. Prints generated tokens/s of each and the
   ratios (goal: the HF engine at least matches ``generate``).
2. **Concurrent load.** R requests arriving together, as a server sees them: a plain server
   answers each with its own ``model.generate`` call, one after another; the HF engine batches
   whatever is waiting (up to ``max_batch``), vLLM schedules continuously. Prints tokens/s,
   p50/p99 request latency and the throughput ratios (goal: the engines beat it).
3. **Per-token overhead.** The HF engine's wall time per generated token at batch B minus that
   of ``model.generate`` at the same batch: the Python the engine adds per token.
4. **Weight updates.** Latency of ``update_weights`` into each engine per transport (in memory,
   Ray object store, safetensors file in /dev/shm, bucketed gloo broadcast from another
   process), with the bytes moved and GB/s; each engine keeps serving in between. Beside each,
   the ratio to a plain in-memory copy of the same bytes (``copy_`` into tensors allocated
   beforehand, best of the repeats): the physical reference on this CPU, what no transport can
   beat. On a GPU machine a plain NCCL broadcast of the same bytes would be the other
   reference: this CPU has none, so it is not printed.

Tokens are counted as generated (rows that stop early stop counting), so both sides are
charged for the padding rows they carry. ``--device cuda`` puts ``generate``'s model and the HF
engine on the GPU (vLLM picks its own device); ``--no-updates`` leaves part 4 out (it needs Ray);
``--updates-on hf`` measures it on the HF engine alone (tests/test_bench.py runs the harness
so, at half its cost: tests/test_engine_service.py checks every transport into vLLM itself).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from rollout.cores import apply_thread_policy  # noqa: E402

apply_thread_policy()  # before torch loads OpenMP, as every TurnRL process does

import torch  # noqa: E402

from serving import build_policy  # noqa: E402  (bench/ is on sys.path as the script's folder)

TEMPERATURE = 0.7


def prompts_of(policy: str, source: Any, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from rollout import chat

    tok = AutoTokenizer.from_pretrained(policy)
    tasks = source.tasks("train")
    return [chat.prompt_ids(tok, tasks[i % len(tasks)].messages, tasks[i % len(tasks)].tools) for i in range(n)]


def generate_batch(model: Any, tok: Any, batch: list[list[int]], max_new: int) -> int:
    """One ``model.generate`` call on ``batch`` (left-padded); returns tokens generated."""
    pad = tok.pad_token_id or 0
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=model.device)
    att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new, do_sample=True,
                             temperature=TEMPERATURE, top_p=1.0, top_k=0, pad_token_id=pad,
                             eos_token_id=tok.eos_token_id)
    new = out[:, width:]
    done = (new == tok.eos_token_id).int()
    # a row counts its tokens up to and including its end-of-turn; padding after it does not
    ended = done.cumsum(-1) - done > 0
    return int((~ended).sum())


async def engine_requests(client: Any, prompts: list[list[int]], max_new: int) -> tuple[int, list[float]]:
    """All ``prompts`` as concurrent requests; returns (tokens generated, per-request latency)."""
    from rollout.engines.base import SamplingParams

    params = SamplingParams(temperature=TEMPERATURE, top_p=1.0, max_new_tokens=max_new)

    async def one(p: list[int]) -> tuple[int, float]:
        t0 = time.perf_counter()
        done = await client.generate(p, params)
        return len(done.token_ids), time.perf_counter() - t0

    results = await asyncio.gather(*[one(p) for p in prompts])
    return sum(n for n, _ in results), [s for _, s in results]


def plain_server(model: Any, tok: Any, prompts: list[list[int]], max_new: int) -> tuple[int, list[float]]:
    """One ``model.generate`` per request, in arrival order (all arrived at t0)."""
    t0, tokens, latency = time.perf_counter(), 0, []
    for p in prompts:
        tokens += generate_batch(model, tok, [p], max_new)
        latency.append(time.perf_counter() - t0)
    return tokens, latency


def timed(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def engine_config(kind: str, max_batch: int, device: str = "cpu") -> Any:
    from rollout.config import HFEngineConfig, VLLMEngineConfig

    if kind == "hf":
        return HFEngineConfig(max_batch=max_batch, torch_threads=2, device=device)
    return VLLMEngineConfig(max_num_seqs=max_batch, torch_threads=2, max_model_len=2048)


def policy_and_source(model: str, show_progress: bool = True) -> tuple[str, Any]:
    """The policy folder and the search-QA task source the prompts come from."""
    if model == "tiny":
        return build_policy(show_progress=show_progress)
    from envs.config import SearchQAConfig
    from envs.registry import make_task_source
    from learner.config import PolicyConfig
    from learner.pretrained import convert

    return str(convert(model, PolicyConfig().models_dir)), make_task_source(SearchQAConfig())


def memory_copy_s(state: dict[str, torch.Tensor], repeats: int) -> float:
    """Best seconds to copy every tensor of ``state`` into tensors allocated beforehand."""
    dst = {k: torch.empty_like(v) for k, v in state.items()}

    def once() -> float:
        t0 = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v)
        return time.perf_counter() - t0

    return min(once() for _ in range(max(repeats, 3)))


def run_transports(client: Any, policy: str, repeats: int) -> list[tuple[str, int, float]]:
    """Weight-update latency into ``client``'s engine per transport: (transport, bytes, best
    seconds); first ("memory copy") the plain copy of the same bytes."""
    import multiprocessing
    import tempfile

    import ray

    from learner.deepspeed_setup import free_port
    from rollout.engines.transport import (BroadcastWeights, FileWeightsWriter, InMemoryWeights,
                                           ObjectStoreWeights, plan_buckets)

    torch.set_num_threads(2)
    from transformers import AutoModelForCausalLM

    state = {k: v.detach().clone() for k, v in AutoModelForCausalLM.from_pretrained(policy).state_dict().items()
             if k != "lm_head.weight"}  # tied: the head travels as the embedding
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
    shm = tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    version = 0

    def timed_update(make_handle: Any) -> float:
        nonlocal version
        version += 1
        t0 = time.perf_counter()
        asyncio.run(client.update_weights(version, make_handle(version)))
        return time.perf_counter() - t0

    out = [("memory copy", nbytes, memory_copy_s(state, repeats)),
           ("memory", nbytes, min(timed_update(lambda v: InMemoryWeights(state)) for _ in range(repeats))),
           ("ray object store", nbytes, min(timed_update(lambda v: ObjectStoreWeights.put(state))
                                          for _ in range(repeats)))]
    writer = FileWeightsWriter(shm)
    out.append(("file (/dev/shm)", nbytes, min(timed_update(lambda v: writer.publish(v, state)) for _ in range(repeats))))
    layout = plan_buckets(state, bucket_bytes=64 << 20)
    init = {"host": "127.0.0.1", "port": free_port(), "world_size": 2, "backend": "gloo", "rank": 1}
    sender = multiprocessing.get_context("spawn").Process(target=broadcast_sender, args=(init, state, layout, repeats))
    sender.start()
    asyncio.run(client.server.join_weight_group(init))
    out.append(("gloo broadcast", nbytes, min(timed_update(lambda v: BroadcastWeights(layout)) for _ in range(repeats))))
    sender.join()
    ray.shutdown()
    return out


def broadcast_sender(init: dict, state: dict, layout: list, times: int) -> None:
    """The learner's side of the broadcast: send ``state`` ``times`` times (the engine receives
    each when its update starts)."""
    from rollout.engines.transport import BroadcastGroup

    group = BroadcastGroup(init, rank=0)
    for _ in range(times):
        group.send(state, layout)


def run_side(side: str, model_name: str, policy: str, batch: int, requests: int, max_new: int,
             repeats: int, device: str = "cpu", updates: bool = True) -> dict[str, Any]:
    """Everything measured of one side, in this (fresh) process: per phase ("batch", "load")
    the (tokens, seconds, request latencies) of its best repeat, and for an engine its weight
    updates ("updates"). Each side gets a process of its own because torch's OpenMP workers
    spin for a while after a call: a second thread calling torch in the same process (the
    engine's decode thread after ``generate`` on the main one) would share its cores with them.
    Within a side every call comes from one thread (and one engine start serves all phases)."""
    torch.set_num_threads(2)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.engines import local_client

    _, source = policy_and_source(model_name, show_progress=False)
    prompts = prompts_of(policy, source, max(batch, requests))
    tok = AutoTokenizer.from_pretrained(policy)
    if side == "generate":
        model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).to(device).eval()
        generate_batch(model, tok, prompts[:2], 4)  # warm up
        phases = {"batch": lambda: (generate_batch(model, tok, prompts[:batch], max_new), []),
                  "load": lambda: plain_server(model, tok, prompts[:requests], max_new)}
    else:
        client = local_client(engine_config(side, batch, device), policy)
        asyncio.run(engine_requests(client, prompts[:2], 4))  # warm up
        phases = {"batch": lambda: asyncio.run(engine_requests(client, prompts[:batch], max_new)),
                  "load": lambda: asyncio.run(engine_requests(client, prompts[:requests], max_new))}
    out: dict[str, Any] = {}
    for phase, reps in (("batch", repeats), ("load", 1)):
        runs = [timed(phases[phase]) for _ in range(reps)]
        (tokens, latency), seconds = max(runs, key=lambda r: r[0][0] / r[1])
        out[phase] = (tokens, seconds, latency)
    if side != "generate":
        if updates:
            out["updates"] = run_transports(client, policy, repeats)
        asyncio.run(client.engine.close())
    return out


def _child(conn: Any, fn: Any, args: tuple) -> None:
    conn.send(fn(*args))
    conn.close()


def in_fresh_process(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a new spawned, non-daemonic process (vLLM starts processes of its own,
    which a pool's daemonic workers may not), returning its result."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, fn, args))
    proc.start()
    send.close()  # the child holds the only sending end: if it dies, recv() ends instead of waiting forever
    try:
        out = recv.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"{fn.__name__}{args[:1]} died without a result (exit code {proc.exitcode})") from None
    proc.join()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="batch 8, 16 requests, 24 new tokens, 3 repeats")
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny",
                   help="the tiny bench policy, or SmolLM2-135M-Instruct (converted once: make smollm2)")
    p.add_argument("--batch", type=int, default=16, help="B, the equal-batch size")
    p.add_argument("--requests", type=int, default=64, help="R, requests arriving together")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3, help="equal-batch runs per side (best kept)")
    p.add_argument("--no-vllm", action="store_true", help="leave the vLLM engine out (not installed)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where generate and the HF engine run")
    p.add_argument("--no-updates", action="store_true", help="leave the weight updates out (they need Ray)")
    p.add_argument("--updates-on", nargs="+", choices=["hf", "vllm"], default=["hf", "vllm"],
                   help="the engines whose weight updates part 4 measures")
    args = p.parse_args()
    if args.quick:
        args.batch, args.requests, args.max_new_tokens, args.repeats = 8, 16, 24, 3
    policy, _ = policy_and_source(args.model)
    engines = ["hf"] if args.no_vllm else ["hf", "vllm"]
    res, updates = {}, {}
    for side in ("generate", *engines):
        out = in_fresh_process(run_side, side, args.model, policy, args.batch, args.requests, args.max_new_tokens,
                               args.repeats, args.device, not args.no_updates and side in args.updates_on)
        res |= {(side, phase): out[phase] for phase in ("batch", "load")}
        if "updates" in out:
            updates[side] = out["updates"]
    report(args, res, updates, engines)


def report(args: Any, res: dict, updates: dict, engines: list[str]) -> None:
    tps = {key: tokens / seconds for key, (tokens, seconds, _) in res.items()}
    q = lambda xs, k: statistics.quantiles(xs, n=100)[k - 1] if len(xs) > 1 else xs[0]  # noqa: E731
    name = {"generate": "model.generate", "hf": "HF engine", "vllm": "vLLM engine"}
    print(f"\nengines: {args.model} policy, temperature {TEMPERATURE}, <= {args.max_new_tokens} new tokens, 2 torch "
          f"threads, each side in its own process, on {args.device}")
    print(f"1. equal batch of {args.batch}: " + ", ".join(f"{name[s]} {tps[s, 'batch']:.0f} tok/s"
                                                          for s in ("generate", *engines)))
    for s in engines:
        print(f"   ratio {name[s]}/generate {tps[s, 'batch'] / tps['generate', 'batch']:.2f}"
              + (" (goal >= 1.00)" if s == "hf" else ""))
    print(f"2. {args.requests} concurrent requests (generate: one call per request, in turn):")
    for s in ("generate", *engines):
        lat = res[s, "load"][2]
        print(f"   {name[s]}: {tps[s, 'load']:.0f} tok/s, p50 {q(lat, 50):.2f} s, p99 {q(lat, 99):.2f} s"
              + ("" if s == "generate" else f", throughput ratio to generate {tps[s, 'load'] / tps['generate', 'load']:.2f}"
                 " (goal > 1)"))
    per = {side: 1e3 / tps[side, "batch"] for side in ("hf", "generate")}
    print(f"3. per-token overhead at batch {args.batch}: HF engine {per['hf']:.3f} ms/token, generate "
          f"{per['generate']:.3f} ms/token, the engine adds {per['hf'] - per['generate']:+.3f} ms/token")
    if not updates:
        return
    print("4. weight update latency (best of the repeats; bytes of the tied-once state dict; x copy: "
          "seconds over a plain in-memory copy of the same bytes):")
    for kind in updates:
        copy_s = updates[kind][0][2]
        for transport, nbytes, seconds in updates[kind]:
            print(f"   {name[kind]:<11} {transport:<17} {nbytes / 1e6:7.2f} MB  {seconds * 1e3:8.1f} ms  "
                  f"{nbytes / seconds / 1e9:6.3f} GB/s  x copy {seconds / copy_s:7.1f}")
    print("   NCCL broadcast of the same bytes (physical reference): not measured, no GPU on this machine")


if __name__ == "__main__":
    main()
