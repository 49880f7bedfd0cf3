"""DeepSpeed bring-up for one learner rank: its device, the process group, the engine config,
full weights.

A rank's device is ``cuda`` (NCCL process group) or ``cpu`` (gloo). A learner of one rank
picks a free local port for its group; the ranks of a larger learner are told their rank and
rank 0's address (``DistSpec``) by whoever placed them (``cluster/learner_group.py``).
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable

import torch

from learner.config import LearnerConfig


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now ("" for every interface: a port other nodes connect to)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class DistSpec:
    """One rank's place in a multi-rank learner."""

    rank: int
    world_size: int
    master_addr: str
    """Rank 0's node address."""
    master_port: int
    """A port free on rank 0's node, for the process group's rendezvous."""


def resolve_device(cfg: LearnerConfig) -> torch.device:
    """``learner.device`` for this process: ``auto`` is cuda when a GPU is visible."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"learner.device=cuda but this learner rank sees no GPU (learner.num_gpus="
                           f"{cfg.num_gpus:g}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", 0)  # Ray shows a rank only its own GPU
    if torch.cuda.is_available():  # DeepSpeed picks its accelerator once, at import
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return torch.device("cpu")


def init_distributed(device: torch.device, dist: DistSpec | None = None) -> None:
    """Join the learner's process group (alone on a free port when ``dist`` is None)."""
    import deepspeed

    picked = dist is None and "MASTER_PORT" not in os.environ  # ours to pick again
    if dist is None:
        defaults = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                    "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
        for key, val in defaults.items():
            os.environ.setdefault(key, val)
    else:
        os.environ.update({"MASTER_ADDR": dist.master_addr, "MASTER_PORT": str(dist.master_port),
                           "RANK": str(dist.rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(dist.world_size)})
    if torch.distributed.is_initialized():
        return
    if device.type == "cpu" and os.environ["WORLD_SIZE"] == "1":
        _skip_shm_comm()
    for attempt in range(PORT_TRIES):
        try:
            deepspeed.init_distributed("nccl" if device.type == "cuda" else "gloo")
            return
        except torch.distributed.DistNetworkError as exc:
            # A port free when picked can be taken before the store binds it (another process
            # on a busy machine): a lone rank picks again; ranks told their port cannot.
            if not picked or "EADDRINUSE" not in str(exc) or attempt == PORT_TRIES - 1:
                raise
            os.environ["MASTER_PORT"] = str(free_port())


PORT_TRIES = 5
"""Ports a lone learner rank tries for its process group's store before giving up."""


def leave_distributed() -> None:
    """Destroy this process's process group through DeepSpeed, which then drops the groups it
    cached (a group of the destroyed world, kept, fails the next learner built in this
    process: "Group ... is not registered")."""
    from deepspeed.comm import comm  # the module: its ``cdb`` is current, the package's a copy

    if not torch.distributed.is_initialized():
        return
    if comm.cdb is None:
        torch.distributed.destroy_process_group()
    else:
        comm.destroy_process_group()


def _skip_shm_comm() -> None:
    """A lone CPU rank has no peer to share memory with, yet DeepSpeed would compile its
    shared-memory all-reduce (~40 s of g++ on a fresh machine, before the first step):
    marking the op incompatible makes its gloo backend go without it."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def control_group(timeout_s: float) -> Any:
    """A gloo group beside the training group for Python objects (a claimed batch, metrics):
    it waits as long as rank 0 may wait for a batch, and works whatever the device."""
    return torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def ds_config(cfg: LearnerConfig, micro_batches: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": micro_batches,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": cfg.dtype == "bfloat16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def init_engine(model: torch.nn.Module, cfg: LearnerConfig, micro_batches: int, device: torch.device,
                dist: DistSpec | None = None):
    """Wrap ``model`` with a DeepSpeed engine and a torch AdamW (no FusedAdam build on CPU);
    DeepSpeed moves the model to ``device``."""
    import deepspeed

    init_distributed(device, dist)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                            lr=cfg.lr, weight_decay=cfg.weight_decay)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(cfg, micro_batches))
    return engine


def full_state_dict(engine: Any, gather_to_all: bool = True,
                    only: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor] | None:
    """Complete fp32 CPU weights, gathering ZeRO-3 partitions when needed (a collective: every
    rank calls it). With ``gather_to_all`` False only rank 0 gets them; other ranks get None.
    ``only``: the names to take (a LoRA run's adapter), copied and gathered alone."""
    module = engine.module
    keep = gather_to_all or torch.distributed.get_rank() == 0
    wanted = only or (lambda _name: True)

    def copy() -> dict[str, torch.Tensor] | None:
        return ({k: v.detach().to("cpu", torch.float32).clone() for k, v in module.state_dict().items() if wanted(k)}
                if keep else None)

    if getattr(engine, "zero_optimization_stage", lambda: 0)() == 3:
        import deepspeed

        params = [p for name, p in module.named_parameters() if wanted(name)]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return copy()
    return copy()
