"""An OpenEnv environment written with openenv-core: guess the number.

``reset(seed=s)`` picks a secret from 1 to 20 with the seed; each ``step`` takes a ``guess`` and
answers "higher", "lower" or "correct" (reward 1.0, and the episode is done).
``python examples/envs/guess_server.py PORT`` serves it on 127.0.0.1:PORT, which is what
examples/envs/openenv.yaml has TurnRL start (``{port}``: a free port the run picks).
"""

from __future__ import annotations

import random
import sys
import uuid

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class GuessAction(Action):
    guess: int = Field(..., description="Your guess, an integer from 1 to 20")


class GuessObservation(Observation):
    feedback: str = Field(default="", description="higher, lower or correct")


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self.secret = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> GuessObservation:
        self.secret = random.Random(seed).randint(1, 20)
        self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
        return GuessObservation(feedback="I picked a number from 1 to 20. Guess it.", reward=0.0)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        if action.guess == self.secret:
            return GuessObservation(feedback="correct", reward=1.0, done=True)
        return GuessObservation(feedback="higher" if action.guess < self.secret else "lower", reward=0.0)

    @property
    def state(self) -> State:
        return self._state


def serve(environment: type[Environment], port: int) -> None:
    import uvicorn

    app = create_app(environment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=64)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    serve(GuessEnvironment, int(sys.argv[1]))
