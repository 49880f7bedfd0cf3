"""Reading task files: JSONL, a JSON or YAML list, or parquet, one record per task.

Every record comes with a ``where`` ("file.jsonl:12", "file.parquet row 3") so a loader can name
the exact record and field of a problem. Parquet needs ``pyarrow``, imported only for parquet.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def read_records(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(where, record)`` with ``where`` like ``file.jsonl:12`` for error messages."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"task file {path} does not exist")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from exc
        for row, record in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path} row {row}", record
        return
    if path.suffix in (".json", ".yaml", ".yml"):
        records = _document(path)
        if not isinstance(records, list):
            raise ValueError(f"{path}: expected a list of records")
        for row, record in enumerate(records):
            yield _as_record(f"{path} record {row}", record)
        return
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
            yield _as_record(where, record)


def _document(path: Path) -> Any:
    if path.suffix == ".json":
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ValueError(f"{path}{line}: not valid YAML ({getattr(exc, 'problem', None) or exc})") from None


def _as_record(where: str, record: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return where, record
