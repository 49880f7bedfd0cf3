"""The live-traffic gateway: an OpenAI-compatible front for the run's policy that records every
conversation it serves as token-exact trajectories (request/response models, tool-call
mapping, the session recorder and client feedback). Sits at the rollout level: imports envs and
rollout, never rewards, replay, learner, cluster or services, and no Ray."""
