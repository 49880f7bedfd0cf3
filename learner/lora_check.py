"""The driver's early check of a LoRA run's ``learner.lora.target_modules`` against its policy,
in a child process: building the model's skeleton imports torch and transformers (~170 MB),
which a driver that never trains would otherwise hold for the whole run.

``python -m learner.lora_check <policy folder> <target> ...`` exits 2 with the reason on stderr
when a target names no linear layer of the policy (``learner.lora.check_policy``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from learner.config import LoRAConfig

REFUSED = 2


def check_policy(path: str | Path, cfg: LoRAConfig) -> None:
    """Raise ``ValueError`` (naming the field and the policy's layers) when a target of
    ``cfg`` matches no linear module of the policy at ``path``. No time limit: on a busy core
    importing torch alone can take minutes (a bench saw more than 300 s)."""
    root = str(Path(__file__).resolve().parents[1])  # where ``learner`` imports from
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "learner.lora_check", str(path), *cfg.target_modules],
                          capture_output=True, text=True, env=env)
    reason = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    if proc.returncode == REFUSED:
        raise ValueError(reason)
    if proc.returncode != 0:
        raise RuntimeError(f"checking learner.lora.target_modules against {path} failed: {reason}")


def main(argv: list[str]) -> int:
    from learner.lora import check_policy as check_here

    if len(argv) < 2:
        print("usage: python -m learner.lora_check <policy folder> <target> ...", file=sys.stderr)
        return 1
    try:
        check_here(argv[0], LoRAConfig(target_modules=argv[1:]))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
