"""A real run serving live traffic (issue 16, item 7): the official ``openai`` SDK drives a
multi-turn tool-calling agent against the run's endpoint (real HTTP, real Ray, engine actor,
reward actor, replay, DeepSpeed learner on the tiny policy); feedback is posted; the run's own
records must show those sessions recorded token-exactly, scored, and trained on, while the
endpoint kept answering."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

TOKEN = "live-e2e-token"


def _agent_session(client: openai.OpenAI, task, sid: str, stream: bool) -> list[str | None]:
    """Ask, run the tool call the model makes (a canned result), ask again; returns each
    reply's text when it was a plain answer (None for a tool call: its text was parsed)."""
    headers = {"X-Session-Id": sid}
    first = client.chat.completions.create(model="turnrl-policy", messages=task.messages, tools=task.tools,
                                           temperature=0.7, max_tokens=48, extra_headers=headers)
    msg = first.choices[0].message
    messages = [*task.messages, msg.model_dump(exclude_none=True)]
    for call in msg.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"{call.function.arguments} -> Katu"})
    if not msg.tool_calls:
        messages.append({"role": "user", "content": "Please search first."})
    kwargs = dict(model="turnrl-policy", messages=messages, tools=task.tools, temperature=0.7, max_tokens=48,
                  extra_headers=headers)
    if stream:
        chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        called = any(c.choices[0].delta.tool_calls for c in chunks)
    else:
        second = client.chat.completions.create(**kwargs).choices[0].message
        text, called = second.content or "", bool(second.tool_calls)
    return [None if msg.tool_calls else msg.content or "", None if called else text]


def _start_run(train, cfg) -> tuple[threading.Thread, dict, Path, str, float]:
    """Run ``cfg`` in a thread; returns it, its result holder, run dir, base URL and a deadline."""
    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.update(result=train(cfg, on_stage=lambda _: None)), daemon=True)
    runner.start()
    run_dir = Path(cfg.output_dir) / cfg.name
    deadline = time.time() + 240
    while not (run_dir / "live.json").exists():
        assert runner.is_alive() and time.time() < deadline, "the run never served its endpoint"
        time.sleep(0.5)
    return runner, outcome, run_dir, json.loads((run_dir / "live.json").read_text())["base_url"], deadline


def test_openai_sdk_sessions_are_recorded_scored_and_trained(tiny_run_config, agent_policy, ray_cluster,
                                                            tmp_path) -> None:
    from transformers import AutoTokenizer

    from cluster.driver import train

    tokenizer = AutoTokenizer.from_pretrained(agent_policy[0])

    cfg = tiny_run_config(["policy.sft.steps=300", f"output_dir={tmp_path}", "name=live",
                           "live.enabled=true", f"live.tokens=[{TOKEN}]", "live.feedback_timeout_s=600",
                           "train.source=live", "train.steps=2", "learner.batch_groups=2",
                           "learner.num_cpus=0.5", "learner.checkpoint_every=0", "eval.num_tasks=0",
                           "rollout.group_size=2", "progress=none"])
    runner, outcome, run_dir, base, deadline = _start_run(train, cfg)
    live_file = run_dir / "live.json"
    client = openai.OpenAI(base_url=base, api_key=TOKEN, max_retries=0, timeout=120)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    tasks = agent_policy[1].tasks("train")
    sids = [f"agent-{i}" for i in range(4)]
    texts: dict[str, list[str | None]] = {}
    with httpx.Client(timeout=60) as http:

        def session(i: int, sid: str) -> None:
            texts[sid] = _agent_session(client, tasks[i], sid, stream=bool(i % 2))
            fb = http.post(f"{base}/sessions/{sid}/feedback", headers=auth,
                           json={"outcome": float(i % 2), "turn_rewards": [0.1, float(i % 2)]})
            assert fb.status_code == 200 and fb.json()["turns"] == 2
            assert http.post(f"{base}/sessions/{sid}/end", headers=auth).json()["submitted"] is True

        for i, sid in enumerate(sids[:2]):
            session(i, sid)
        # Two sessions make the first step's batch; the run cannot end before the other two
        # arrive, so the endpoint must keep answering while the learner trains and until the
        # engines serve the version it published.
        answered, served_versions = 0, []
        while not served_versions or served_versions[-1] < 1:
            reply = client.chat.completions.create(model="turnrl-policy", max_tokens=8,
                                                   messages=[{"role": "user", "content": "still there?"}])
            answered += reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
            served_versions.append(http.get(f"{base}/models", headers=auth).json()["data"][0]["version"])
            assert runner.is_alive() and time.time() < deadline + 300, "the engines never served a trained version"
        for i, sid in enumerate(sids[2:], start=2):
            session(i, sid)
    runner.join(timeout=60)
    assert not runner.is_alive() and outcome["result"].steps == 2
    assert answered >= 1
    # /v1/models reports what the engines serve: the learner's published versions reach them
    assert served_versions == sorted(served_versions) and served_versions[-1] >= 1
    trained = [json.loads(line) for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()]
    trained_ids = [g for row in trained for g in row["group_ids"]]
    # group ids are live:<session>:<segment>:<nonce>; each session was one stitched segment, and
    # the two steps trained all four sessions, two each, and nothing else
    assert sorted(g.split(":")[1] for g in trained_ids) == sids
    assert {g.split(":")[2] for g in trained_ids} == {"0"} and [row["version"] for row in trained] == [1, 2]
    recorded = [json.loads(line) for line in (run_dir / "live_sessions.jsonl").read_text().splitlines()]
    assert sorted(r["trajectory"]["group_id"] for r in recorded) == sorted(trained_ids)
    for row in recorded:
        traj = row["trajectory"]
        assert row["replay"] == "accepted" and len(traj["turns"]) == 2  # both requests, one segment
        session = texts[traj["group_id"].split(":")[1]]
        for turn, served in zip(traj["turns"], session):
            assert len(turn["action_logprobs"]) == len(turn["action_ids"]) > 0
            if served is not None:  # a plain answer: the served text is the sampled tokens' text
                assert tokenizer.decode(turn["action_ids"], skip_special_tokens=True).strip() == served.strip()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == [1, 2]
    assert [m["live/trained_sessions"] for m in metrics] == [2.0, 2.0]
    # scored: the clients' outcomes 0, 1, 0, 1 reached the learner (mean of the steps' means)
    assert sum(m["reward/outcome_mean"] for m in metrics) / 2 == pytest.approx(0.5)
    assert not Path(live_file).exists()  # the endpoint is gone with the run


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_mixed_batches_hold_one_live_session_and_one_rollout_group(tiny_run_config, agent_policy, ray_cluster,
                                                                    tmp_path, engine) -> None:
    # train.source: mixed, live_fraction 0.5 of 2 groups: every step trains exactly one served
    # session and one group the rollout workers generated (admission paces them by 1 a step).
    # With the vLLM engine, one vLLM engine serves both the rollout workers and the endpoint.
    from cluster.driver import train

    cfg = tiny_run_config(["policy.sft.steps=300", f"output_dir={tmp_path}", "name=mixed", "live.enabled=true",
                           f"rollout.engine.type={engine}",
                           "train.source=mixed", "train.live_fraction=0.5", "train.steps=2",
                           "learner.batch_groups=2", "learner.num_cpus=0.5", "learner.checkpoint_every=0",
                           "eval.num_tasks=0", "rollout.group_size=2", "progress=none"])
    runner, outcome, run_dir, base, deadline = _start_run(train, cfg)
    task = agent_policy[1].tasks("train")[0]
    with httpx.Client(timeout=60) as http:
        for sid in ("m-0", "m-1"):
            reply = http.post(f"{base}/chat/completions", headers={"X-Session-Id": sid},
                              json={"model": "turnrl-policy", "messages": task.messages, "max_tokens": 24})
            assert reply.status_code == 200
            assert http.post(f"{base}/sessions/{sid}/feedback", json={"outcome": 1.0}).status_code == 200
            assert http.post(f"{base}/sessions/{sid}/end").status_code == 200
    runner.join(timeout=300)
    assert not runner.is_alive() and outcome["result"].steps == 2
    trained = [json.loads(line)["group_ids"] for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()]
    assert [sorted(g.startswith("live:") for g in ids) for ids in trained] == [[False, True], [False, True]]
    assert sorted(g.split(":")[1] for ids in trained for g in ids if g.startswith("live:")) == ["m-0", "m-1"]
    # one published version per step
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2]
