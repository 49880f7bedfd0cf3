"""Every command README.md and docs/running.md show runs as written: each `make` target exists
(`make -n`), each script exists and defines every flag shown, and each `turnrl` command parses
with the CLI's own parser and its config loads with its overrides. `turnrl train ...
--print-config` runs for real, as a reader's first command would. (The quick benches run end
to end in tests/test_bench.py, the reference loop in tests/test_reference_loop.py.)"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/running.md")
PLACEHOLDER_CONFIG = "my.yaml"
"""The docs' name for "your config"; checked as configs/demo.yaml."""


def _commands(doc: str) -> list[list[str]]:
    """The commands of a doc's ```bash blocks and its inline `make ...` / `.venv/bin/...` spans,
    comments and leading environment assignments removed."""
    text = (ROOT / doc).read_text()
    lines = [line for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.splitlines()]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    lines += re.findall(r"`((?:make |\.venv/bin/)[^`]+)`", prose)
    out = []
    for line in lines:
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]
        if words:
            out.append(words)
    return out


ALL = [(doc, words) for doc in DOCS for words in _commands(doc)]


def test_the_docs_show_commands() -> None:
    shown = {doc for doc, _ in ALL}
    assert shown == set(DOCS)
    assert ["make", "demo"] in [w for _, w in ALL] and ["make", "test"] in [w for _, w in ALL]


@pytest.mark.parametrize("doc, words", ALL, ids=[" ".join(w)[:60] for _, w in ALL])
def test_command_is_runnable_as_written(doc: str, words: list[str]) -> None:
    program = words[0]
    if program == "make":
        proc = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"{doc}: {' '.join(words)}: {proc.stderr}"
    elif program == ".venv/bin/python":
        script = ROOT / words[1]
        assert script.is_file(), f"{doc}: {words[1]} does not exist"
        source = script.read_text()
        for flag in (w for w in words[2:] if w.startswith("--")):
            assert f'"{flag}"' in source, f"{doc}: {words[1]} defines no {flag}"
        for path in (w for w in words[2:] if w.endswith(".yaml")):
            assert (ROOT / path).is_file(), f"{doc}: {path} does not exist"
    elif program == ".venv/bin/turnrl":
        _check_turnrl(doc, words[1:])
    else:
        pytest.fail(f"{doc}: no check for a command starting {program!r}: add one here")


def _check_turnrl(doc: str, argv: list[str]) -> None:
    from cluster.cli import build_parser
    from cluster.config import load_config

    argv = ["configs/demo.yaml" if a == PLACEHOLDER_CONFIG else a for a in argv]
    if argv[0] == "eval":
        from cluster.eval_cli import build_parser as eval_parser

        args = eval_parser().parse_args(argv[1:])
    else:
        args = build_parser().parse_args(argv)
    assert args.config and (ROOT / args.config).is_file(), f"{doc}: {args.config} does not exist"
    load_config(ROOT / args.config, args.overrides)  # raises naming the key when one is wrong


def test_print_config_prints_the_resolved_config() -> None:
    proc = subprocess.run([str(ROOT / ".venv/bin/turnrl"), "train", "configs/demo.yaml", "--print-config",
                           "--set", "train.steps=100", "--set", "learner.lr=1e-4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert '"steps": 100' in proc.stdout and '"lr": 0.0001' in proc.stdout
    assert '"name": "demo"' in proc.stdout


def test_every_doc_the_readmes_point_to_exists() -> None:
    """The README's and the docs index's links and `docs/...` mentions name files that exist."""
    named = set()
    for doc in ("README.md", "docs/README.md"):
        text = (ROOT / doc).read_text()
        named |= {(ROOT / doc).parent / link for link in re.findall(r"\]\(([\w./-]+\.md)\)", text)}
        named |= {ROOT / path for path in re.findall(r"`((?:docs|examples)/[\w./-]+\.(?:md|py))`", text)}
    assert len(named) > 20
    assert [str(p.relative_to(ROOT)) for p in sorted(named) if not p.is_file()] == []
