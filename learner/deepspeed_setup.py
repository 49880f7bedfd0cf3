"""DeepSpeed bring-up for one learner process: distributed env, engine config, full weights.

On CPU the backend is gloo; on GPU nccl. World size 1 per learner actor here; multi-rank
learners set RANK/WORLD_SIZE from their placement group before calling ``init_engine``.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

from learner.config import LearnerConfig


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now ("" for every interface: a port other nodes connect to)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_distributed() -> None:
    import deepspeed

    defaults = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    for key, val in defaults.items():
        os.environ.setdefault(key, val)
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed("nccl" if torch.cuda.is_available() else "gloo")


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


def init_engine(model: torch.nn.Module, cfg: LearnerConfig, micro_batches: int):
    """Wrap ``model`` with a DeepSpeed engine and a torch AdamW (no FusedAdam build on CPU)."""
    import deepspeed

    init_distributed()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                            lr=cfg.lr, weight_decay=cfg.weight_decay)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(cfg, micro_batches))
    return engine


def full_state_dict(engine: Any) -> dict[str, torch.Tensor]:
    """Complete fp32 CPU weights, gathering ZeRO-3 partitions when needed."""
    module = engine.module
    if getattr(engine, "zero_optimization_stage", lambda: 0)() == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: v.detach().to("cpu", torch.float32).clone() for k, v in module.state_dict().items()}
    return {k: v.detach().to("cpu", torch.float32).clone() for k, v in module.state_dict().items()}
