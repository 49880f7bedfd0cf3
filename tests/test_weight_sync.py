"""The weight sync (``learner.weights.WeightSync``): the one owner that pushes each new version
to every model scorer and engine and only then acknowledges the batch to replay, so replay
never admits groups for a version no engine serves; a restarted engine catches up from it
before it serves; removed polling settings fail naming themselves.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from replay.config import ReplayConfig
from replay.host import ReplayHost
from rollout.engines.base import SamplingParams
from rollout.engines.transport import InMemoryWeights
from tests.redis_fixture import make_group


def _perturbed(model, scale: float) -> dict:
    """The model's weights plus a constant: a version the engine visibly loads."""
    return {k: v.detach().clone() + scale for k, v in model.state_dict().items()}


class RecordingAck:
    """The replay host's ``ack`` as the sync's port, recording what every engine and scorer
    served at the moment of each acknowledgement (the order under test)."""

    def __init__(self, host: ReplayHost, engines: list, scorers: list) -> None:
        self.host, self.engines, self.scorers = host, engines, scorers
        self.seen: list[tuple[int, list[int], list[int]]] = []

    async def ack(self, claim_id: str, version: int, commit: bool) -> None:
        self.seen.append((version, [e.version for e in self.engines],
                          [max(s.stats()["ig_held_versions"]) for s in self.scorers]))
        self.host.ack(claim_id, version, commit)


def test_the_sync_pushes_to_scorers_and_engines_before_it_acks(tiny_policy, tiny_run_config, tmp_path) -> None:
    from learner.weights import WeightSync
    from rewards.config import IGConfig, RewardsConfig
    from rewards.scorer import ModelScorer
    from rollout.engines import local_client

    policy, _ = tiny_policy
    cfg = tiny_run_config()
    engine = local_client(cfg.rollout.engine, policy)
    scorer = ModelScorer(RewardsConfig(ig=IGConfig(keep_versions=2)), policy)
    host = ReplayHost(ReplayConfig(eta=0), 1, str(tmp_path), "sync")
    replay = RecordingAck(host, [engine], [scorer])

    class ScorerTarget:  # the scorer's own method, awaited as an actor call would be
        async def update_weights(self, version, handle):
            return scorer.update_weights(version, handle)

    sync = WeightSync([engine], [ScorerTarget()], replay)
    model = engine.engine.model
    v1, v2 = InMemoryWeights(_perturbed(model, 0.01)), InMemoryWeights(_perturbed(model, 0.02))

    async def steps() -> list[int]:
        served = []
        for version, handle, gid in ((1, v1, "a"), (2, v2, "b")):
            assert host.reserve(1) == 1
            host.put(make_group(gid, version - 1))
            claim = host.claim(1)
            assert host.reserve(1) == 0  # (eta + version + 1) * B groups: none more until the ack
            served.append(await sync.publish(version, handle, (claim.claim_id, False)))
        served.append(await sync.publish(1, v1))  # a republish of an older version: nothing moves
        return served

    assert asyncio.run(steps()) == [1, 2, 2]
    # At each ack the engine and the scorer served the acknowledged version already.
    assert replay.seen == [(1, [1], [1]), (2, [2], [2])]
    assert host.stats().version == 2 and engine.version == 2
    assert scorer.stats()["ig_held_versions"] == [1, 2]
    assert sync.latest()[0] == 2 and sync.stats()["acks"] == 2 and sync.stats()["pushes"] == 2
    loaded = engine.engine.model.state_dict()
    assert all(float((loaded[k] - v2.state[k]).abs().max()) == 0.0 for k in v2.state)


def test_a_restarted_engine_catches_up_before_it_serves(tiny_policy, tiny_run_config) -> None:
    import torch

    from learner.weights import WeightSync
    from rollout.engines.server import EngineServer

    policy, _ = tiny_policy
    cfg = tiny_run_config()
    sync = WeightSync([])

    class Source:  # the sync as a restarted engine finds it (rollout.ports.WeightSyncSource)
        async def versions(self):
            return [(None, *sync.latest())]

    server = EngineServer(cfg.rollout.engine, policy, 0, Source(), restarted_by_ray=True)
    state = _perturbed(server.engine.model, 0.01)
    threads = torch.get_num_threads()  # the restart takes the engine's threads for this process
    try:
        done = asyncio.run(_publish_then_generate(sync, server, state))
    finally:
        torch.set_num_threads(threads)
    assert done.version_spans == [(0, 3)]  # its first request already ran on the newest version
    assert server.version() == 3


async def _publish_then_generate(sync, server, state):
    await sync.publish(3, InMemoryWeights(state))  # published while the engine was down
    return await server.generate([1, 2, 3], SamplingParams(max_new_tokens=4, seed=0), "first")


@pytest.mark.parametrize("override, key", [
    ("rollout.wave_hold_s=30", "rollout.wave_hold_s"),
    ("rollout.engine.weight_poll_s=0.2", "rollout.engine.weight_poll_s"),
    ("rewards.service.weight_poll_s=0.5", "rewards.service.weight_poll_s"),
])
def test_a_config_naming_a_removed_polling_setting_says_it_is_gone_and_why(override: str, key: str) -> None:
    from cluster.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=rf"{key} was removed: .*no longer .*weight sync .* pushes"):
        load_config(None, [override])


@pytest.mark.slow
def test_replay_admits_for_a_version_only_once_every_engine_serves_it(ray_cluster, tiny_policy, tiny_run_config,
                                                                      tmp_path) -> None:
    """Real actors: two engines, the replay host, the weight sync, the learner's ports. One
    engine is kept from loading (``weight_update: between_batches`` with a paused request):
    the other serves the new version, but replay's version and admission stay where they were
    until the held engine serves it too; then the ack widens admission by one batch."""
    ray = ray_cluster
    from cluster.weight_sync import ActorReplayAck, ActorWeightTarget
    from learner.ports import ActorLearnerPorts
    from learner.weights import WeightSync
    from replay.host import ACTOR_THREADS
    from rollout.engines.server import EngineServer

    policy, _ = tiny_policy
    cfg = tiny_run_config(["rollout.engine.weight_update=between_batches"])
    replay = ray.remote(ReplayHost).options(num_cpus=0, max_concurrency=ACTOR_THREADS).remote(
        ReplayConfig(eta=0), 1, str(tmp_path), "order")
    engines = [ray.remote(EngineServer).options(num_cpus=0, max_concurrency=64).remote(cfg.rollout.engine, policy, i)
               for i in range(2)]
    sync = ray.remote(WeightSync).options(num_cpus=0).remote(
        [ActorWeightTarget(e, True) for e in engines], [], ActorReplayAck(replay))
    ports = ActorLearnerPorts(replay, sync)
    try:
        assert ray.get(replay.reserve.remote(1)) == 1
        ray.get(replay.put.remote(make_group("g")))
        claim = ray.get(replay.claim.remote(1))
        # Engine 0 mid-request, paused: between batches it cannot load until the request ends.
        # Seeded and hot, the request samples the same 300 tokens every time (asserted below).
        params = SamplingParams(temperature=5.0, max_new_tokens=300, seed=7)
        chunks = engines[0].stream.options(num_returns="streaming").remote([1, 2, 3], params, "held")
        ray.get(next(chunks))
        ray.get(engines[0].pause.remote())
        from transformers import AutoModelForCausalLM

        ports.publish(1, _perturbed(AutoModelForCausalLM.from_pretrained(policy), 0.01), (claim.claim_id, False))
        deadline = time.monotonic() + 60  # engine 1 loads at once; how long that takes depends on load
        while ray.get(engines[1].version.remote()) != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ray.get([e.version.remote() for e in engines]) == [0, 1]  # one serves it, one cannot yet
        assert ray.get(replay.stats.remote()).version == 0  # so no ack, and no group admitted for it
        assert ray.get(replay.reserve.remote(5)) == 0
        ray.get(engines[0].resume.remote())
        ports.settle()  # the push ends once engine 0 loads; then the ack
        assert ray.get([e.version.remote() for e in engines]) == [1, 1]
        assert ray.get(replay.stats.remote()).version == 1
        assert ray.get(replay.reserve.remote(5)) == 1  # (eta + 1 + 1) * 1 - 1 accepted: one more
        held = [ray.get(ref) for ref in chunks]
        assert held[-1].finish_reason == "length" and {c.version for c in held} == {0}
        assert ray.get(sync.stats.remote())["acks"] == 1
    finally:
        for actor in (*engines, sync, replay):
            ray.kill(actor)


def test_one_rule_says_whether_weights_fit_a_model() -> None:
    from rollout.engines.transport import check_fits

    want = {"embed.weight": (8, 4), "lm_head.weight": (8, 4), "norm.weight": (4,)}
    check_fits(want, {"embed.weight": (8, 4), "norm.weight": (4,)}, 1, True, "m")  # a tied head may be left out
    with pytest.raises(ValueError, match=r"weights v2 do not fit m: missing=\['lm_head.weight'\] unexpected=\[\] "
                                         r"wrong_shape=\[\]"):
        check_fits(want, {"embed.weight": (8, 4), "norm.weight": (4,)}, 2, False, "m")
    with pytest.raises(ValueError, match=r"missing=\[\] unexpected=\['extra'\] wrong_shape=\['norm.weight'\]"):
        check_fits(want, {**want, "norm.weight": (5,), "extra": (1,)}, 3, True, "m")
