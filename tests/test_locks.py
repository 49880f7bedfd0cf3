"""The lock files' split (tools/locks.py): requirements.lock holds exactly what the project
runs on, requirements-test.lock the rest, checked against the installed packages' metadata."""

from __future__ import annotations

from pathlib import Path

from tools.locks import closure, misplaced


def test_the_lock_files_split_as_the_project_declares() -> None:
    assert misplaced() == []


def test_closure_follows_extras_and_markers() -> None:
    plain, default = closure(["ray"]), closure(["ray[default]"])
    assert {"ray", "click", "msgpack"} <= plain and "aiohttp" not in plain
    assert {"aiohttp", "prometheus-client", "py-spy"} <= default  # ray's "default" extra
    assert "colorama" not in closure(["tqdm"])  # tqdm wants it only on Windows


def _project(root: Path, runtime: list[str], test: list[str]) -> Path:
    (root / "pyproject.toml").write_text(
        '[project]\nname = "x"\ndependencies = ["pyyaml", "tqdm"]\n'
        '[project.optional-dependencies]\ntest = ["pytest"]\n')
    (root / "requirements.lock").write_text("".join(f"{p}==1\n" for p in runtime))
    (root / "requirements-test.lock").write_text("# test\n" + "".join(f"{p}==1\n" for p in test))
    return root


def test_each_misplaced_pin_is_named_with_its_fix(tmp_path) -> None:
    root = _project(tmp_path, runtime=["tqdm", "pytest", "setuptools"],
                    test=["tqdm", "iniconfig", "packaging", "Pygments"])
    assert misplaced(root) == [
        "pyyaml: the project needs it at run time; pin it in requirements.lock",
        "pytest: nothing the project depends on needs it; move it to requirements-test.lock",
        "tqdm: pinned in both lock files; keep it in one",
        "pluggy: the test extra needs it; pin it in requirements-test.lock",
    ]
    fixed = _project(tmp_path, runtime=["PyYAML", "tqdm"],
                     test=["pytest", "iniconfig", "packaging", "pluggy", "pygments"])
    assert misplaced(fixed) == []
