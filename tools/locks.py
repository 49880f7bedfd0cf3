"""Which pins belong in which lock file, from the installed packages' own metadata.

    .venv/bin/python tools/locks.py    # prints each misplaced pin; exit 1 if any

- ``requirements.lock``: what the project needs to run (``make demo``, the images): exactly the
  closure of pyproject.toml's ``dependencies`` over the packages' declared requirements, extras
  and environment markers followed, plus ``setuptools`` (torch's JIT extensions import it at
  run time without declaring it).
- ``requirements-test.lock``: the rest (``make test``): the ``test`` extra's closure and the
  optional packages some tests exercise; nothing in both files.
- ``requirements-dense.lock``: sentence-transformers and its own closure, which ``make test``
  installs apart, into ``.venv/extras`` (the file says why); none of it in the other two.

A pin in the wrong file either makes the demo's install fetch what it never imports or leaves
a fresh demo without something it does import, so tests/test_locks.py runs this check.
"""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script too

from tools.install import pins as pin_lines  # noqa: E402
from tools.install import project_name as normalize  # noqa: E402

RUNTIME_EXTRAS = {"setuptools"}
"""Imported at run time (torch.utils.cpp_extension) though no dependency declares it."""


def pins(path: Path) -> dict[str, str]:
    """A lock file's pins, version by normalized name, read as the installer reads them."""
    return {normalize(pin): pin.split("==", 1)[1] for pin in pin_lines([path])}


def closure(requirements: Iterable[str]) -> set[str]:
    """Every installed distribution ``requirements`` need, transitively (names normalized).
    A requirement nothing installed satisfies raises, naming it."""
    seen: set[tuple[str, frozenset[str]]] = set()
    stack = [Requirement(r) for r in requirements]
    while stack:
        req = stack.pop()
        key = (normalize(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            raise LookupError(f"{req.name} is required ({req}) but not installed: build the "
                              "environment first (make test-venv)") from None
        environments = [{"extra": e} for e in req.extras] or [{"extra": ""}]
        for line in dist.requires or []:
            dep = Requirement(line)
            if dep.marker is None or any(dep.marker.evaluate(env) for env in environments):
                stack.append(dep)
    return {name for name, _ in seen}


def misplaced(root: Path = ROOT) -> list[str]:
    """One line per pin in the wrong lock file (or missing from both); empty when the split
    is right."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    runtime = pins(root / "requirements.lock")
    test = pins(root / "requirements-test.lock")
    needed = closure(project["dependencies"]) - {"turnrl"}
    problems = [f"{n}: the project needs it at run time; pin it in requirements.lock"
                for n in sorted(needed - runtime.keys())]
    problems += [f"{n}: nothing the project depends on needs it; move it to requirements-test.lock"
                 for n in sorted(runtime.keys() - needed - RUNTIME_EXTRAS)]
    problems += [f"{n}: pinned in both lock files; keep it in one" for n in sorted(runtime.keys() & test.keys())]
    dense = pins(root / "requirements-dense.lock") if (root / "requirements-dense.lock").exists() else {}
    problems += [f"{n}: requirements-dense.lock installs it apart (.venv/extras); pin it only there"
                 for n in sorted(dense.keys() & (runtime.keys() | test.keys()))]
    tests_need = closure(project["optional-dependencies"]["test"])
    problems += [f"{n}: the test extra needs it; pin it in requirements-test.lock"
                 for n in sorted(tests_need - runtime.keys() - test.keys())]
    return problems


def main() -> int:
    problems = misplaced()
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
