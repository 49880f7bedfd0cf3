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
    finally:
        asyncio.run(client.engine.close())
    assert [g.trajectory_id for g in got] == [t.trajectory_id for t in trajs]
    diffs = []
    for g, w, traj in zip(got, want, trajs):
        assert len(g.values) == len(traj.turns) and g.version == 0
        assert g.values == pytest.approx(w.values, abs=TOLERANCE)
        assert g.ig == pytest.approx(w.ig, abs=TOLERANCE)
        diffs += [abs(a - b) for a, b in zip(g.values, w.values)]
    print(f"{kind}: max |engine - model copy| over {len(diffs)} boundary values = {max(diffs):.2e}")
