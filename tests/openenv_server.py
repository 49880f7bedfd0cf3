"""examples/envs/guess_server.py's environment with two guesses that break the server on purpose,
for tests/test_envs_openenv.py: 0 makes its step hang, -1 kills the process.
``python tests/openenv_server.py PORT`` serves it on 127.0.0.1:PORT."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.envs.guess_server import GuessEnvironment, serve  # noqa: E402


class BreakableGuess(GuessEnvironment):
    def step(self, action, timeout_s=None, **kwargs):
        if action.guess == 0:
            time.sleep(3600)
        if action.guess == -1:
            os._exit(5)
        return super().step(action, timeout_s, **kwargs)


if __name__ == "__main__":
    serve(BreakableGuess, int(sys.argv[1]))
