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


def _agent_session(client: openai.OpenAI, task, sid: str, stream: bool) -> list[str]:
    """Ask, run the tool call the model makes (a canned result), ask again; returns the texts."""
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
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content or ""
    return [msg.content or "", text]


def test_openai_sdk_sessions_are_recorded_scored_and_trained(tiny_run_config, agent_policy, ray_cluster,
                                                            tmp_path) -> None:
    from cluster.driver import train

    cfg = tiny_run_config(["policy.sft.steps=300", f"output_dir={tmp_path}", "name=live",
                           "live.enabled=true", f"live.tokens=[{TOKEN}]", "live.feedback_timeout_s=600",
                           "train.source=live", "train.steps=2", "learner.batch_groups=2",
                           "learner.num_cpus=0.5", "learner.checkpoint_every=0", "eval.num_tasks=0",
                           "rollout.group_size=2", "progress=none"])
    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.update(result=train(cfg, on_stage=lambda _: None)), daemon=True)
    runner.start()
    run_dir = tmp_path / "live"
    live_file = run_dir / "live.json"
    deadline = time.time() + 240
    while not live_file.exists():
        assert runner.is_alive() and time.time() < deadline, "the run never served its endpoint"
        time.sleep(0.5)
    base = json.loads(live_file.read_text())["base_url"]
    client = openai.OpenAI(base_url=base, api_key=TOKEN, max_retries=0, timeout=120)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    tasks = agent_policy[1].tasks("train")
    sids = [f"agent-{i}" for i in range(4)]
    with httpx.Client(timeout=60) as http:
        for i, sid in enumerate(sids):
            _agent_session(client, tasks[i], sid, stream=bool(i % 2))
            fb = http.post(f"{base}/sessions/{sid}/feedback", headers=auth,
                           json={"outcome": float(i % 2), "turn_rewards": [0.1, float(i % 2)]})
            assert fb.status_code == 200 and fb.json()["turns"] == 2
            assert http.post(f"{base}/sessions/{sid}/end", headers=auth).json()["submitted"] is True
        # the endpoint keeps answering while the learner trains on those sessions
        answered = 0
        while runner.is_alive() and time.time() < deadline + 300:
            reply = client.chat.completions.create(model="turnrl-policy", max_tokens=8,
                                                   messages=[{"role": "user", "content": "still there?"}])
            answered += reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    runner.join(timeout=60)
    assert not runner.is_alive() and outcome["result"].steps == 2
    assert answered >= 1
    trained = [json.loads(line) for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()]
    trained_ids = {g for row in trained for g in row["groups"]}
    # every one of the four sessions was one stitched segment, and all four were trained on
    assert {g.split(":")[1] for g in trained_ids} == set(sids)
    assert len(trained_ids) == 4
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["version"] == 2 if "version" in metrics[-1] else metrics[-1]["step"] == 2
    assert not Path(live_file).exists()  # the endpoint is gone with the run
