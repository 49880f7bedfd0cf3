"""verifiers environments (their classic API) as TurnRL task sources: ``source`` maps datasets,
rollouts and rubrics; ``client`` answers the environment's model calls with the policy."""
