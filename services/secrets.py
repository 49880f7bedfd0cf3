"""The secrets of a submitted run: kept out of everything people see, handed to the job alone.

A RunConfig's ``SecretStr`` fields (today ``live.tokens``) dump as ``**********`` in JSON mode,
which is what ``run.yaml``, ``config.json``, logs and API answers show. The real values go to
``secrets.json`` in the run directory, created with mode 0600 (the directory is 0700) and read
only by the job's entrypoint (``services.job``), which puts them back into the config in its own
process. Nothing else (Ray's job environment, the command line, the dashboard) carries them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel, SecretStr

SECRETS_FILE = "secrets.json"


def _reveal(value: Any) -> tuple[bool, Any]:
    """(holds a secret, the value with every SecretStr revealed) for a field value."""
    if isinstance(value, SecretStr):
        return True, value.get_secret_value()
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, SecretStr) for v in value):
        return True, [v.get_secret_value() for v in value]
    return False, value


def secret_fields(model: BaseModel, loc: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(key path by alias, real value) for every field of ``model`` (nested sections included)
    that holds a ``SecretStr`` or a list of them."""
    for name, info in type(model).model_fields.items():
        here, value = (*loc, info.alias or name), getattr(model, name)
        secret, real = _reveal(value)
        if secret:
            yield here, real
        elif isinstance(value, BaseModel):
            yield from secret_fields(value, here)
        elif isinstance(value, (list, tuple, dict)):
            items = value.values() if isinstance(value, dict) else value
            if any(isinstance(v, SecretStr) or (isinstance(v, BaseModel) and any(True for _ in secret_fields(v)))
                   for v in items):
                # --set addresses sections by key only: a secret inside a list or map of sections
                # could not be put back, and the job would run with the masked form
                raise TypeError(f"{'.'.join(here)}: secrets inside a list or map of sections are not supported")


def write_secrets(run_dir: Path, cfg: BaseModel) -> Path | None:
    """``<run_dir>/secrets.json`` (0600 from its creation) with every secret of ``cfg``; None
    when it has none."""
    values = {".".join(loc): real for loc, real in secret_fields(cfg)}
    if not values:
        return None
    path = run_dir / SECRETS_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others, not even briefly
    with os.fdopen(fd, "w") as fh:
        json.dump(values, fh)
    return path


def secret_overrides(config_path: Path) -> list[str]:
    """``key=value`` overrides (values as JSON, which YAML reads) from the secrets file beside
    ``config_path``; none when there is no such file."""
    try:
        values = json.loads((config_path.parent / SECRETS_FILE).read_text())
    except FileNotFoundError:
        return []
    return [f"{key}={json.dumps(value, ensure_ascii=False)}" for key, value in values.items()]
