"""The import direction (DEVELOPERS.md) is checked by import-linter's contracts in
``.importlinter``: the checkout keeps them, and a copy with an upward import planted breaks them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")
PACKAGES = ("storage", "envs", "rollout", "gateway", "rewards", "replay", "learner", "cluster", "services")


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    """lint-imports over the packages under ``root`` (they come first on its path), no cache
    written into the checkout."""
    return subprocess.run([str(LINT), "--config", str(root / ".importlinter"), "--no-cache"],
                          cwd=root, capture_output=True, text=True, timeout=120)


def test_the_checkout_keeps_every_import_contract() -> None:
    run = lint(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Contracts: 3 kept, 0 broken." in run.stdout


def test_planted_upward_imports_break_the_contracts(tmp_path: Path) -> None:
    shutil.copy(ROOT / ".importlinter", tmp_path)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "static"))
    plants = {  # one upward import per contract
        "rewards/combine.py": "import replay.base",  # rewards sits below replay
        "replay/memory.py": "import gateway.sessions",  # only cluster/services wire in the live side
        "rollout/config.py": "import torch",  # config modules stay pydantic-only
    }
    for path, line in plants.items():
        (tmp_path / path).write_text((tmp_path / path).read_text() + f"\n{line}  # noqa\n")
    run = lint(tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Contracts: 0 kept, 3 broken." in run.stdout
    for importer, imported in (("rewards.combine", "replay.base"), ("replay.memory", "gateway.sessions"),
                               ("rollout.config", "torch")):
        assert f"{importer} -> {imported}" in run.stdout, run.stdout
