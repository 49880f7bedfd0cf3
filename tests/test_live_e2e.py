"""A real run serving live traffic, end to end: the official ``openai`` SDK drives a
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

from tests import constrained_checks

pytestmark = pytest.mark.slow

TOKEN = "live-e2e-token"


def _served(content: str | None, calls) -> dict:
    """What the client got for one turn: its content and its calls (name, arguments as sent:
    the JSON the model wrote, which may be malformed)."""
    return {"content": content or None, "calls": [(c.function.name, c.function.arguments) for c in calls or []]}


def _streamed_calls(chunks) -> list:
    """Tool calls assembled from streamed deltas, as the SDK's objects are read."""
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, {"name": "", "arguments": ""})
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
    return [openai.types.chat.ChatCompletionMessageToolCall(
        id=f"call_{i}", type="function", function={"name": c["name"], "arguments": c["arguments"]})
        for i, c in sorted(calls.items())]


def _agent_session(client: openai.OpenAI, task, sid: str, stream: bool) -> list[dict]:
    """Ask, run the tool call the model makes (a canned result), ask again; returns what each
    reply served (``_served``)."""
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
        second = _served("".join(c.choices[0].delta.content or "" for c in chunks), _streamed_calls(chunks))
    else:
        reply = client.chat.completions.create(**kwargs).choices[0].message
        second = _served(reply.content, reply.tool_calls)
    return [_served(msg.content, msg.tool_calls), second]


def _start_run(train, cfg) -> tuple[threading.Thread, dict, Path, str, float]:
    """Run ``cfg`` in a thread; returns it, its result holder, run dir, base URL and a deadline."""
    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.update(result=train(cfg, on_stage=lambda _: None)), daemon=True)
    runner.start()
    run_dir = Path(cfg.output_dir) / cfg.name
    deadline = time.time() + 600  # a vLLM engine took over 4 minutes to start on a busy 2-core machine
    while not (run_dir / "live.json").exists():
        assert runner.is_alive() and time.time() < deadline, "the run never served its endpoint"
        time.sleep(0.5)
    return runner, outcome, run_dir, json.loads((run_dir / "live.json").read_text())["base_url"], deadline


def test_openai_sdk_sessions_are_recorded_scored_and_trained(tiny_run_config, agent_policy, ray_cluster,
                                                            tmp_path) -> None:
    from transformers import AutoTokenizer

    from cluster.driver import train
    from gateway.toolcalls import split_action

    tokenizer = AutoTokenizer.from_pretrained(agent_policy[0])

    cfg = tiny_run_config(["policy.sft.steps=300", f"output_dir={tmp_path}", "name=live",
                           "live.enabled=true", f"live.tokens=[{TOKEN}]", "live.feedback_timeout_s=600",
                           "live.close_after_feedback_s=2",
                           "train.source=live", "train.steps=2", "learner.batch_groups=2",
                           "learner.num_cpus=0.5", "learner.checkpoint_every=0", "eval.num_tasks=0",
                           "rollout.group_size=2", "progress=none"])
    runner, outcome, run_dir, base, deadline = _start_run(train, cfg)
    live_file = run_dir / "live.json"
    client = openai.OpenAI(base_url=base, api_key=TOKEN, max_retries=0, timeout=120)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    tasks = agent_policy[1].tasks("train")
    sids = [f"agent-{i}" for i in range(4)]
    texts: dict[str, list[dict]] = {}
    with httpx.Client(timeout=60) as http:

        def session(i: int, sid: str) -> None:
            texts[sid] = _agent_session(client, tasks[i], sid, stream=bool(i % 2))
            fb = http.post(f"{base}/sessions/{sid}/feedback", headers=auth,
                           json={"outcome": float(i % 2), "turn_rewards": [0.1, float(i % 2)]})
            assert fb.status_code == 200 and fb.json()["turns"] == 2
            if i < 2:  # the other two never call /end, as the SDK's agents do not: closed 2 s after feedback
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
    # the two steps trained all four sessions, two each, and nothing else: the two closed by
    # close_after_feedback_s as the two closed by /end
    assert sorted(g.split(":")[1] for g in trained_ids) == sids
    assert {g.split(":")[2] for g in trained_ids} == {"0"} and [row["version"] for row in trained] == [1, 2]
    rows = [json.loads(line) for line in (run_dir / "live_sessions.jsonl").read_text().splitlines()]
    recorded = [r for r in rows if r["replay"] == "accepted"]
    assert sorted(r["trajectory"]["group_id"] for r in recorded) == sorted(trained_ids)
    # the one-request "still there?" sessions never got feedback: closed when the run stopped,
    # kept in the record, counted, not trained
    assert all(r["replay"] == "dropped_run_ended" and r["trajectory"]["live"]["session_id"].startswith("req-")
               for r in rows if r not in recorded) and len(rows) == len(recorded) + answered
    for row in recorded:
        traj = row["trajectory"]
        assert len(traj["turns"]) == 2  # both requests, one segment
        session = texts[traj["group_id"].split(":")[1]]
        for turn, served in zip(traj["turns"], session):
            assert len(turn["action_logprobs"]) == len(turn["action_ids"]) > 0
            # what the client got (content, and calls by name and arguments) is exactly what
            # the recorded tokens say, for tool-call turns as for plain answers
            text = tokenizer.decode(turn["action_ids"], skip_special_tokens=True)
            reply = split_action(text, "any", 0)
            assert (reply.content or None, reply.wire) == (served["content"], served["calls"])
            # the turn records the well-formed calls (a malformed one marks it invalid)
            assert [(c["name"], c["arguments"]) for c in turn["tool_calls"]] == [(c.name, c.arguments)
                                                                                 for c in reply.calls]
            assert turn["invalid_action"] == bool(reply.errors)
    # the agent called its tool: the token-exact check above covered a tool-call turn
    assert any(served[0]["calls"] for served in texts.values())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == [1, 2]
    assert [m["live/trained_sessions"] for m in metrics] == [2.0, 2.0]
    # scored: the clients' outcomes 0, 1, 0, 1 reached the learner (mean of the steps' means)
    assert sum(m["reward/outcome_mean"] for m in metrics) / 2 == pytest.approx(0.5)
    assert not Path(live_file).exists()  # the endpoint is gone with the run


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_mixed_batches_hold_one_live_session_and_one_rollout_group(tiny_run_config, agent_policy, ray_cluster,
                                                                    tmp_path, engine) -> None:
    # train.source: mixed, live_fraction 0.5 of 2 groups, learner.live_shortfall: wait (the
    # strict mix): every step trains exactly one served session and one group the rollout
    # workers generated (admission paces them by 1 a step). With the vLLM engine, one vLLM
    # engine serves both the rollout workers and the endpoint.
    from cluster.driver import train

    cfg = tiny_run_config(["policy.sft.steps=300", f"output_dir={tmp_path}", "name=mixed", "live.enabled=true",
                           f"rollout.engine.type={engine}", "learner.live_shortfall=wait",
                           "train.source=mixed", "train.live_fraction=0.5", "train.steps=2",
                           "learner.batch_groups=2", "learner.num_cpus=0.5", "learner.checkpoint_every=0",
                           "eval.num_tasks=0", "rollout.group_size=2", "progress=none"])
    runner, outcome, run_dir, base, deadline = _start_run(train, cfg)
    task = agent_policy[1].tasks("train")[0]
    # constrained decoding (vLLM) or its refusal (HF), and stop strings, on this run's endpoint;
    # sessions without feedback: recorded at the run's end, never trained
    served = constrained_checks.served_checks(base, engine, task.messages)
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
    from transformers import AutoTokenizer

    records = [json.loads(line) for line in (run_dir / "live_sessions.jsonl").read_text().splitlines()]
    constrained_checks.recorded_checks(records, served, AutoTokenizer.from_pretrained(agent_policy[0]), engine)


def test_mixed_training_goes_on_with_rollout_groups_while_no_traffic_comes(tiny_run_config, agent_policy,
                                                                          ray_cluster, tmp_path) -> None:
    # Live training never dies for want of traffic: train.source: mixed and nobody calls the
    # endpoint. By default (learner.live_shortfall: train_rollouts) each step trains its rollout share (1 group of
    # 2 rollouts) and says the live share was missing; the run ends normally, well inside a
    # claim timeout it used to die of.
    from cluster.driver import train

    cfg = tiny_run_config(["policy.sft.steps=300", f"output_dir={tmp_path}", "name=quiet", "live.enabled=true",
                           "train.source=mixed", "train.live_fraction=0.5", "train.steps=2",
                           "learner.claim_timeout_s=120", "learner.batch_groups=2", "learner.num_cpus=0.5",
                           "learner.checkpoint_every=0", "eval.num_tasks=0", "rollout.group_size=2", "progress=none"])
    result = train(cfg, on_stage=lambda _: None)
    assert result.steps == 2 and not result.interrupted
    trained = [json.loads(line)["group_ids"] for line in (result.run_dir / "trained_groups.jsonl").read_text().splitlines()]
    assert [len(ids) for ids in trained] == [1, 1] and not any(g.startswith("live:") for ids in trained for g in ids)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["live/trained_sessions"], r["live/sessions_missing"], r["samples"]) for r in rows] == [(0.0, 1.0, 2.0)] * 2

