"""IG read from the engines (``rewards.ig_engine``): gold-answer log-probs as prompt log-probs of
the serving engine, vLLM's included, equal the model-copy scorer's values on the same weights.

Same tiny random Llama and trajectories as tests/test_ig.py; the reference is
``IGScorer.score_per_turn`` (one plain transformers forward per boundary)."""

from __future__ import annotations

import asyncio

import pytest

from bench.tiny_llama import build_tiny_llama
from rewards.config import IGConfig
from rewards.ig_engine import EngineIGScorer
from rewards.ig_scorer import IGScorer
from rollout.config import HFEngineConfig, VLLMEngineConfig
from rollout.engines import local_client
from tests.test_ig import SENTENCES, mixed_trajs

# fp32 on both sides; vLLM's CPU kernels (its own attention, packed GEMMs) sum in another order
# than transformers' SDPA. Measured max difference: 0 (HF engine), 5.7e-6 (vLLM).
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_llama_ig")
    # hidden 128 over 4 heads: vLLM's CPU attention needs a head size of at least 32
    build_tiny_llama(path, SENTENCES * 5, vocab=400, hidden=128, layers=2, max_positions=512,
                     initializer_range=0.2)
    return str(path)


@pytest.mark.parametrize("kind", ["hf", "vllm"])
def test_engine_ig_equals_the_model_copy_scorer(tiny_path, kind) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_path)
    model = LlamaForCausalLM.from_pretrained(tiny_path, attn_implementation="sdpa")
    cfg = IGConfig(mode="log_prob_diff")
    trajs = mixed_trajs(tok)
    want = IGScorer(model, tok, cfg).score_per_turn(trajs)
    engine_cfg = HFEngineConfig() if kind == "hf" else VLLMEngineConfig(max_model_len=512)
    client = local_client(engine_cfg, tiny_path)
    try:
        got = asyncio.run(EngineIGScorer(client, tok, cfg).score(trajs))
        stats = client.engine.stats()
    finally:
        asyncio.run(client.engine.close())
    if kind == "hf":  # later boundaries reused the contexts earlier ones computed (16-token blocks)
        assert stats["prefix_hits"] > 0
        assert 0 < stats["prefix_reused_tokens"] < sum(len(t.token_ids()) for t in trajs)
    assert [g.trajectory_id for g in got] == [t.trajectory_id for t in trajs]
    diffs = []
    for g, w, traj in zip(got, want, trajs):
        assert len(g.values) == len(traj.turns) and g.version == 0
        assert g.values == pytest.approx(w.values, abs=TOLERANCE)
        assert g.ig == pytest.approx(w.ig, abs=TOLERANCE)
        diffs += [abs(a - b) for a, b in zip(g.values, w.values)]
    print(f"{kind}: max |engine - model copy| over {len(diffs)} boundary values = {max(diffs):.2e}")


def test_the_reward_service_writes_engine_ig_into_the_turns(tiny_path) -> None:
    """The scorer port a run uses for ``rewards.ig.scorer: engine``: IG_t lands in turns
    0..T-2 with the engine's version, equal to the model-copy scorer's IG."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from rewards.config import RewardsConfig
    from rewards.ig_engine import EngineScorerPort
    from rewards.service import RewardService
    from rollout.trajectory import Group

    tok = AutoTokenizer.from_pretrained(tiny_path)
    cfg = RewardsConfig(ig=IGConfig(scorer="engine"))
    trajs = [t for t in mixed_trajs(tok) if t.turns]
    want = IGScorer(LlamaForCausalLM.from_pretrained(tiny_path), tok, cfg.ig).score_per_turn(trajs)
    client = local_client(VLLMEngineConfig(max_model_len=512), tiny_path)
    try:
        service = RewardService(cfg, None, [EngineScorerPort(EngineIGScorer(client, tok, cfg.ig))])
        group = asyncio.run(service.score_group(Group(group_id="g", task_id="t", trajectories=trajs)))
    finally:
        asyncio.run(client.engine.close())
    for traj, w in zip(group.trajectories, want):
        got = [turn.rewards["ig"] for turn in traj.turns[:-1]]
        assert got == pytest.approx(w.ig, abs=TOLERANCE)
        assert all(turn.reward_versions["ig"] == 0 for turn in traj.turns[:-1])
        assert "ig" not in traj.turns[-1].rewards  # the final turn's reward is the outcome


@pytest.mark.slow
def test_a_run_scores_ig_on_its_vllm_engines(tiny_run_config, tiny_policy, ray_cluster, tmp_path) -> None:
    """``rewards.ig.scorer: engine`` in a real run: no model scorer is started, the reward
    service reads gold log-probs from the run's vLLM engine, and IGPO trains on them."""
    import json

    from cluster.driver import train

    cfg = tiny_run_config([
        f"output_dir={tmp_path}", "name=ig-engine", "train.steps=2", "rollout.group_size=2",
        "learner.batch_groups=2", "rollout.groups_in_flight=2", "rollout.max_new_tokens=32", "eval.num_tasks=0",
        "progress=none", "rollout.engine.type=vllm", "rewards.ig={scorer: engine}", "learner.estimator.type=igpo"])
    result = train(cfg, on_stage=lambda s: None)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert result.steps == 2 and [r["version"] for r in rows] == [1, 2]
    assert all(r["samples"] == 4 for r in rows)
