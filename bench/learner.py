"""Benchmark: one learner update against a plain PyTorch step, and what publishing weights costs.

The learner's update (``LearnerWorker._update``: advantages, token batch, DeepSpeed forward /
backward / step with the configured loss) and a plain PyTorch step (the same model init, the
same token batch and loss: forward, backward per micro-batch, clip, ``torch.optim.AdamW``) run
alternately in one process on the same batch of trajectories; the bench prints each one's
median and their ratio. Then the per-step cost of publishing the weights: gathering the state
dict, putting it into Ray's object store, writing a safetensors file.

    .venv/bin/python bench/learner.py --quick
    .venv/bin/python bench/learner.py --hidden 256 --layers 4 --groups 8
    python bench/learner.py --device cuda --dtype bfloat16 --no-publish   # a GPU without Ray
    .venv/bin/python bench/learner.py --memory [--quick]   # peak memory: chunked head, whole logits, checkpointed

On ``--device cuda`` both run on the GPU (each moves its micro-batches there, as the learner
does); with ``--dtype bfloat16`` the learner trains as DeepSpeed's bf16 does and the plain step
under ``torch.autocast`` with fp32 weights, PyTorch's usual mixed precision.

``--memory``: two learner updates of a SmolLM2-sized model (576 wide, 30 layers, a 49,152-word
head; 8 rows of ~300 positions), each variant in a process of its own: the sampled tokens'
log-probs through the output head in chunks (``rollout/next_token.py``, what the learner does),
through the whole vocabulary's logits (as before), and in chunks with every layer's activations
recomputed in the backward (``learner.gradient_checkpointing``). It prints each one's peak RSS (sampled
every 5 ms) against the ideal, weights + gradients + Adam's two moments (16 bytes a parameter),
and its step time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from rollout.cores import apply_thread_policy  # noqa: E402

apply_thread_policy()  # before torch loads OpenMP, as every TurnRL process does

import torch  # noqa: E402

from bench.tiny_llama import build_tiny_llama  # noqa: E402
from learner.batching import TokenBatch, build_token_batch  # noqa: E402
from learner.config import LearnerConfig  # noqa: E402
from learner.losses import LossInputs, policy_loss  # noqa: E402
from rollout.trajectory import Trajectory, Turn  # noqa: E402

CORPUS = ["Question: who wrote the report? <tool_call>search</tool_call> <answer>Ada</answer>",
          "The report was written by Ada Lovelace in 1843 for the Analytical Engine."] * 20


def trajectories(args: argparse.Namespace, vocab: int) -> list[Trajectory]:
    """``groups`` x ``group_size`` episodes of ``turns`` turns: random tokens of the demo's
    lengths, outcomes that differ within each group (so advantages are not all zero)."""
    gen = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(5, vocab, (n,), generator=gen).tolist()  # noqa: E731
    out = []
    for g in range(args.groups):
        for r in range(args.group_size):
            turns = [Turn(action_ids=rand(args.action_tokens), action_logprobs=[-1.5] * args.action_tokens,
                          policy_version=0, observation_ids=rand(args.obs_tokens) if t < args.turns - 1 else [])
                     for t in range(args.turns)]
            out.append(Trajectory(trajectory_id=f"{g}-{r}", task_id=f"t{g}", group_id=f"g{g}",
                                  prompt_ids=rand(args.prompt_tokens), turns=turns, outcome=float(r % 2)))
    return out


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued kernels: a step's time, not the time to queue them."""
    if device.type == "cuda":
        torch.cuda.synchronize()


class PlainStep:
    """The same update in plain PyTorch: no DeepSpeed, no learner bookkeeping."""

    def __init__(self, model_path: str, cfg: LearnerConfig, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        self.cfg, self.device = cfg, device
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).train()
        self.autocast = torch.autocast(device.type, torch.bfloat16, enabled=cfg.dtype == "bfloat16")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    def step(self, tb: TokenBatch) -> None:
        rows, tokens = tb.input_ids.size(0), max(tb.num_tokens, 1.0)
        for a in range(0, rows, self.cfg.micro_batch_size):
            mb = tb.rows(a, a + self.cfg.micro_batch_size).to(self.device)
            with self.autocast:
                logits = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, mb.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            inputs = LossInputs(logprobs=logp, old_logprobs=logp.detach(), behaviour_logprobs=mb.behaviour,
                                advantages=mb.advantages, mask=mb.loss_mask, turn_ids=mb.turn_ids)
            loss, _ = policy_loss(inputs, self.cfg.loss, None)
            (loss * mb.num_tokens / tokens).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        synchronize(self.device)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_update(model_path: str, trajs: list[Trajectory], cfg: LearnerConfig, repeats: int,
                 group_size: int) -> dict[str, float]:
    from learner.worker import LearnerWorker

    worker = LearnerWorker(cfg, model_path, tempfile.mkdtemp(), ports=None, group_size=group_size,
                           temperature=1.0)
    plain = PlainStep(model_path, cfg, worker.device)
    trajs_sorted, res, mask = worker.advantages(trajs)
    tb = build_token_batch(trajs_sorted, res.advantages, mask, worker.tokenizer.pad_token_id)
    learner_s, plain_s = [], []
    for i in range(repeats + 1):  # the first round warms both up and is not counted
        t_learner = timed(lambda: (worker._update(trajs), synchronize(worker.device)))
        t_plain = timed(lambda: plain.step(tb))
        if i:
            learner_s.append(t_learner)
            plain_s.append(t_plain)
    return {"learner_s": statistics.median(learner_s), "plain_s": statistics.median(plain_s),
            "rows": float(tb.input_ids.size(0)), "tokens": tb.num_tokens, "worker": worker}


def bench_publish(worker, repeats: int) -> list[tuple[str, float, int]]:
    """(what, median seconds, bytes) of each way a step's weights leave the learner."""
    import ray

    from learner.deepspeed_setup import full_state_dict
    from learner.weights import FilePublisher, ObjectStorePublisher

    state = full_state_dict(worker.ds_engine)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    files = FilePublisher(tempfile.mkdtemp())
    store = ObjectStorePublisher()
    rows = []
    for name, fn in [("gather state dict (fp32 CPU copy)", lambda: full_state_dict(worker.ds_engine)),
                     ("object store, torch tensors pickled", lambda: ray.put(full_state_dict(worker.ds_engine))),
                     ("object store publish (numpy buffers)", lambda: store.publish(1, full_state_dict(worker.ds_engine))),
                     ("file publish (safetensors)", lambda: files.publish(1, full_state_dict(worker.ds_engine)))]:
        fn()
        rows.append((name, statistics.median(timed(fn) for _ in range(repeats)), nbytes))
    # what every engine and reward scorer pays to fetch a version
    from rollout.engines.transport import ObjectStoreWeights

    pickled = ObjectStoreWeights([ray.put(full_state_dict(worker.ds_engine))])
    mapped = store.publish(1, full_state_dict(worker.ds_engine))
    for name, fn in [("reader load, torch tensors pickled", lambda: asyncio.run(pickled.load())),
                     ("reader load (numpy buffers, mapped)", lambda: asyncio.run(mapped.load()))]:
        fn()
        rows.append((name, statistics.median(timed(fn) for _ in range(repeats)), nbytes))
    ray.shutdown()
    return rows


PHASES = ("forward", "backward", "optimizer step")


def memory_child(args: argparse.Namespace) -> None:
    """One variant of ``--memory`` in this process: prints its numbers as one JSON line, the
    peak RSS of each phase of two updates (forward: the micro-step's log-probs and loss;
    backward; the optimizer step), sampled every 3 ms."""
    import json
    import threading

    import psutil

    from learner.worker import LearnerWorker
    from rollout import next_token

    if args.memory_child == "whole":
        next_token.PLAIN_HEADS = frozenset()  # every model takes the whole-logits path
    proc, phase, peaks, done = psutil.Process(), ["setup"], {}, threading.Event()

    def sample() -> None:
        while not done.wait(0.003):
            peaks[phase[0]] = max(peaks.get(phase[0], 0), proc.memory_info().rss)

    def marked(fn: Callable, name: str, after: str) -> Callable:
        def run(*a, **k):
            phase[0] = name
            out = fn(*a, **k)
            phase[0] = after
            return out
        return run

    with tempfile.TemporaryDirectory() as tmp:
        model, tok = build_tiny_llama(Path(tmp), CORPUS, vocab=args.vocab, hidden=args.hidden, layers=args.layers,
                                      max_positions=2048, model_vocab=args.model_vocab)
        params = sum(p.numel() for p in model.parameters())
        del model
        cfg = LearnerConfig(batch_groups=args.groups, micro_batch_size=args.micro_batch_size,
                            torch_threads=args.threads, zero_stage=args.zero_stage,
                            gradient_checkpointing=args.memory_child == "checkpointed")
        worker = LearnerWorker(cfg, tmp, tempfile.mkdtemp(), ports=None, group_size=args.group_size, temperature=1.0)
        worker._micro_step = marked(worker._micro_step, "forward", "other")
        worker.ds_engine.backward = marked(worker.ds_engine.backward, "backward", "other")
        worker.ds_engine.step = marked(worker.ds_engine.step, "optimizer step", "other")
        trajs = trajectories(args, len(tok))
        before = proc.memory_info().rss
        threading.Thread(target=sample, daemon=True).start()
        times = [timed(lambda: worker._update(trajs)) for _ in range(2)]
        done.set()
    print(json.dumps({"variant": args.memory_child, "params": params, "rss_before_gb": before / 1e9,
                      "peaks_gb": {k: peaks.get(k, 0) / 1e9 for k in PHASES}, "step_s": times[-1]}))


def bench_memory(args: argparse.Namespace) -> None:
    import json
    import subprocess

    shape = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--model-vocab", str(args.model_vocab),
             "--groups", str(args.groups), "--group-size", str(args.group_size), "--threads", str(args.threads),
             "--zero-stage", str(args.zero_stage), "--micro-batch-size", str(args.micro_batch_size)]
    rows = {}
    for variant in ("chunked", "whole", "checkpointed"):
        out = subprocess.run([sys.executable, __file__, "--memory-child", variant, *shape], capture_output=True,
                             text=True, check=True).stdout
        rows[variant] = json.loads(out.strip().splitlines()[-1])
    ideal = rows["chunked"]["params"] * 16 / 1e9
    print(f"model: {rows['chunked']['params'] / 1e6:.1f}M parameters, a {args.model_vocab}-word head; "
          f"{args.groups * args.group_size} rows; ZeRO {args.zero_stage}; {args.threads} threads")
    print(f"ideal (fp32 weights + gradients + Adam's two moments): {ideal:.2f} GB")
    print(f"{'':13s}" + "".join(f"{p + ' GB':>18s}" for p in PHASES) + f"{'peak / ideal':>14s}{'before GB':>11s}{'step s':>8s}")
    for name, r in rows.items():
        peak = max(r["peaks_gb"].values())
        print(f"{name:13s}" + "".join(f"{r['peaks_gb'][p]:>18.2f}" for p in PHASES)
              + f"{peak / ideal:>14.2f}{r['rss_before_gb']:>11.2f}{r['step_s']:>8.1f}")
    c, w, k = (rows[v]["peaks_gb"] for v in ("chunked", "whole", "checkpointed"))
    print(f"peak chunked/whole: {max(c.values()) / max(w.values()):.2f}x (forward {c['forward'] / w['forward']:.2f}x); "
          f"step time chunked/whole: {rows['chunked']['step_s'] / rows['whole']['step_s']:.2f}x")
    print(f"checkpointed/chunked: peak {max(k.values()) / max(c.values()):.2f}x (backward "
          f"{k['backward'] / c['backward']:.2f}x); step time {rows['checkpointed']['step_s'] / rows['chunked']['step_s']:.2f}x")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--groups", type=int, default=4, help="learner.batch_groups")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--action-tokens", type=int, default=24)
    p.add_argument("--obs-tokens", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--zero-stage", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--no-publish", action="store_true", help="skip the publish costs (they need Ray)")
    p.add_argument("--quick", action="store_true", help="a small model and batch, 3 repeats (seconds)")
    p.add_argument("--memory", action="store_true", help="peak memory of the chunked head against whole logits "
                   "and against gradient checkpointing")
    p.add_argument("--model-vocab", type=int, default=49152, help="--memory: the head's width (SmolLM2's)")
    p.add_argument("--memory-child", choices=["chunked", "whole", "checkpointed"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory and not args.quick:  # SmolLM2's size (untied head), 8 rows of ~300 positions
        args.hidden, args.layers, args.groups, args.group_size = 576, 30, 2, 4
    if args.quick:
        args.hidden, args.layers, args.groups, args.group_size, args.repeats = 64, 2, 2, 4, 3
        args.model_vocab = 8192
    torch.set_num_threads(args.threads)
    os.environ.setdefault("DS_BUILD_OPS", "0")
    if args.memory_child:
        return memory_child(args)
    if args.memory:
        return bench_memory(args)
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = build_tiny_llama(Path(tmp), CORPUS, vocab=args.vocab, hidden=args.hidden,
                                      layers=args.layers, max_positions=2048)
        params = sum(p.numel() for p in model.parameters())
        cfg = LearnerConfig(batch_groups=args.groups, micro_batch_size=args.micro_batch_size,
                            zero_stage=args.zero_stage, torch_threads=args.threads, device=args.device,
                            dtype=args.dtype, num_gpus=1.0 if args.device == "cuda" else 0.0)
        res = bench_update(tmp, trajectories(args, len(tok)), cfg, args.repeats, args.group_size)
        print(f"model: {params / 1e6:.2f}M parameters; batch: {res['rows']:.0f} rows, "
              f"{res['tokens']:.0f} trained tokens; ZeRO {args.zero_stage}, {args.threads} threads, "
              f"{args.device}, {args.dtype}")
        print(f"learner update (DeepSpeed, LearnerWorker._update): {res['learner_s'] * 1e3:8.1f} ms")
        print(f"plain PyTorch step (forward, loss, backward, AdamW): {res['plain_s'] * 1e3:8.1f} ms")
        print(f"ratio learner/plain: {res['learner_s'] / res['plain_s']:.2f}x (goal <= 1.3x)")
        for name, secs, nbytes in [] if args.no_publish else bench_publish(res["worker"], 4 * args.repeats):
            print(f"{name:38s} {secs * 1e3:8.2f} ms  {nbytes / 1e6:.2f} MB  {nbytes / secs / 1e9:6.2f} GB/s  "
                  f"{secs / res['learner_s'] * 100:5.1f}% of an update")


if __name__ == "__main__":
    main()
