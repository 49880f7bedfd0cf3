"""The entrypoint of a run the service submits: ``python -m services.job <run dir>/run.yaml [--resume]``.

It is ``turnrl train`` with the run's secrets put back: ``run.yaml`` holds the masked form
(``**********``) and ``secrets.json`` beside it the real values (``services.secrets``), applied
here as config overrides in this process, so they appear on no command line and in no
environment, file or log but that 0600 file.
"""

from __future__ import annotations

import sys
from pathlib import Path

from services.secrets import secret_overrides


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0].startswith("-"):
        print("usage: python -m services.job <run.yaml> [turnrl train options]", file=sys.stderr)
        return 2
    from cluster.cli import main as cli_main

    sets = [part for item in secret_overrides(Path(args[0])) for part in ("--set", item)]
    return cli_main(["train", *args, *sets])


if __name__ == "__main__":
    sys.exit(main())
