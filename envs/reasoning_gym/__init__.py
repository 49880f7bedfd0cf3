"""reasoning-gym's procedural task families (``env.type: reasoning_gym``)."""

from envs.reasoning_gym.source import ReasoningGymTaskSource
