"""The live gateway over real HTTP on loopback, driven by the official ``openai`` SDK: a tiny
warm-started agent calls the search tool, gets the tool's result back in the next request, and
answers; the recorder must hold exactly the tokens the engine saw and sampled."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest

from gateway.config import LiveConfig
from gateway.server import LiveGateway
from rollout import chat
from rollout.config import HFEngineConfig
from rollout.engines import local_client
from tests.gateway_fixtures import random_policy  # noqa: F401 - a fixture

TOKEN = "tok-live-test"


class Served:
    """A gateway on its own event loop thread (as in its Ray actor), reachable over HTTP."""

    def __init__(self, cfg: LiveConfig, policy: str, ports=None, early_judge: bool = False, engine=None,
                 chat_format: str = "hermes") -> None:
        """``engine``: the engine client (default: an HF engine in this process)."""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.ports = ports
        self.gateway = LiveGateway(cfg, engine or local_client(HFEngineConfig(), policy), ports, run_id="t1",
                                   early_judge=early_judge, chat_format=chat_format)
        self.url = self.call(self.gateway.start())

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def close(self) -> None:
        self.call(self.gateway.stop())
        if self.ports is not None:
            self.call(self.ports.close())  # the reward service's tasks live on this loop
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture()
def served(agent_policy):
    s = Served(LiveConfig(enabled=True, tokens=[TOKEN], default_max_tokens=48), agent_policy[0])
    yield s
    s.close()


def _sdk(served: Served, token: str = TOKEN) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url, api_key=token, max_retries=0)


def test_tool_call_then_tool_result_is_one_token_exact_trajectory(served, agent_policy) -> None:
    client, task = _sdk(served), agent_policy[1].tasks("train")[0]
    headers = {"X-Session-Id": "conv-1"}
    first = client.chat.completions.create(model="turnrl-policy", messages=task.messages, tools=task.tools,
                                           temperature=0, logprobs=True, extra_headers=headers)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "search"
    messages = [*task.messages, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "Mobi Vogi was born in Katu."}]
    stream = client.chat.completions.create(model="turnrl-policy", messages=messages, tools=task.tools,
                                            temperature=0, stream=True, extra_headers=headers,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0

    seg = served.gateway.service.recorder.segments("conv-1")
    assert len(seg) == 1  # stitched: one trajectory of two turns
    traj = seg[0].trajectory
    assert len(traj.turns) == 2 and served.gateway.stats()["recorder"]["stitched"] == 1
    # behaviour log-probs the client saw are the recorded ones (the closing end-of-turn has no entry)
    sent = [e.logprob for e in first.choices[0].logprobs.content]
    assert sent == pytest.approx(traj.turns[0].action_logprobs[:len(sent)], abs=1e-6)
    assert first.usage.completion_tokens == len(traj.turns[0].action_ids)
    tok = served.gateway.service.engine.tokenizer
    assert tok.decode(traj.turns[1].action_ids, skip_special_tokens=True) == text
    # the tool result reached the model as template tokens appended after the first action
    assert "Katu" in tok.decode(traj.turns[0].observation_ids)
    assert traj.prompt_ids == chat.prompt_ids(tok, task.messages, task.tools)


def test_models_auth_and_unsupported_parameters(served) -> None:
    client = _sdk(served)
    listed = client.models.list()
    assert [m.id for m in listed.data] == ["turnrl-policy"] and listed.data[0].version == 0
    with pytest.raises(openai.AuthenticationError):
        _sdk(served, token="wrong").models.list()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="turnrl-policy", messages=[{"role": "user", "content": "hi"}],
                                       response_format={"type": "json_object"})
    assert err.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="turnrl-policy", messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"frobnicate": 1})
    assert err.value.body["param"] == "frobnicate" and "unknown parameter" in err.value.body["message"]
    assert served.gateway.stats()["recorder"]["requests"] == 0  # nothing bad was recorded


def test_feedback_is_validated_against_the_session(served) -> None:
    client = _sdk(served)
    client.chat.completions.create(model="turnrl-policy", messages=[{"role": "user", "content": "hi"}],
                                   max_tokens=4, user="u-7")
    headers = {"Authorization": f"Bearer {TOKEN}"}
    base = served.url
    with httpx.Client(timeout=30) as http:
        missing = http.post(f"{base}/sessions/nobody/feedback", json={"outcome": 1.0}, headers=headers)
        assert missing.status_code == 404
        bad = http.post(f"{base}/sessions/u-7/feedback", json={"outcome": 1.0, "turn_rewards": {"3": 0.5}},
                        headers=headers)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "turn_rewards.3"
        assert "out of range" in bad.json()["error"]["message"]
        wrong = http.post(f"{base}/sessions/u-7/feedback", json={"outcome": "great"}, headers=headers)
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "outcome"
        traj = served.gateway.service.recorder.segments("u-7")[0].trajectory
        assert traj.outcome is None and not traj.live.feedback  # nothing applied
        ok = http.post(f"{base}/sessions/u-7/feedback", json={"outcome": 0.5, "turn_rewards": [0.25]},
                       headers=headers)
        assert ok.status_code == 200 and ok.json()["turns"] == 1
        assert traj.outcome == 0.5 and traj.turns[0].rewards["env"] == 0.25
        # no replay here (a run that trains on rollouts only): the recording is not trained on
        assert http.post(f"{base}/sessions/u-7/end", headers=headers).json()["submitted"] is True
        served.call(served.gateway.drain())
        metrics = http.get(f"{base[:-3]}/metrics").text
    # (the exposition format lists labels alphabetically)
    assert 'turnrl_gateway_episodes_total{result="not_trained",run="t1"} 1.0' in metrics
    assert 'turnrl_gateway_feedback_total{result="invalid",run="t1"} 3.0' in metrics  # 404 + two 400s
    assert 'turnrl_gateway_requests_total{route="/v1/sessions/{session_id}/feedback",run="t1",status="400"} 2.0' \
        in metrics
    assert 'turnrl_gateway_requests_total{route="/v1/chat/completions",run="t1",status="200"} 1.0' in metrics
    assert "turnrl_gateway_request_latency_seconds_bucket" in metrics


def _one_session(url: str, sid: str) -> httpx.Response:
    """A one-request session with feedback and end; returns the chat response."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    reply = httpx.post(f"{url}/chat/completions", headers={**auth, "X-Session-Id": sid}, timeout=60,
                       json={"model": "turnrl-policy", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
    if reply.status_code == 200:
        assert httpx.post(f"{url}/sessions/{sid}/feedback", headers=auth, json={"outcome": 1.0}).status_code == 200
        assert httpx.post(f"{url}/sessions/{sid}/end", headers=auth).status_code == 200
    return reply


@pytest.mark.parametrize("when_full", ["shed", "reject"])
def test_a_full_live_budget_sheds_recordings_or_answers_429(agent_policy, when_full) -> None:
    # Serving never blocks on a full replay: a real reward service and in-process replay with
    # room for one live group.
    from cluster.live import LocalLivePorts, local_reward_service
    from replay.config import ReplayConfig
    from replay.memory import InProcessReplayStore

    store = InProcessReplayStore(ReplayConfig(live_capacity_groups=1), batch_groups=1)
    cfg = LiveConfig(enabled=True, tokens=[TOKEN], when_full=when_full, retry_after_s=7)
    served = Served(cfg, agent_policy[0], LocalLivePorts(local_reward_service(store), store))
    try:
        assert _one_session(served.url, "s1").status_code == 200
        served.call(served.gateway.drain())
        assert store.stats().live_held == 1 and store.live_room() == 0
        second = _one_session(served.url, "s2")
        served.call(served.gateway.drain())
        episodes = served.gateway.stats()["episodes"]
        if when_full == "shed":  # served all the same; the recording is refused and counted
            assert second.status_code == 200 and second.json()["choices"][0]["message"]["role"] == "assistant"
            assert (episodes["recorded"], episodes["shed"]) == (1, 1)
            assert store.stats().refused == {"live_full": 1}
        else:  # refused before any engine work, with the wait the operator configured
            assert second.status_code == 429 and second.headers["retry-after"] == "7"
            assert second.json()["error"]["type"] and "full" in second.json()["error"]["message"]
            assert (episodes["recorded"], episodes["shed"]) == (1, 0) and store.stats().refused == {}
        # the learner takes the live group: room again, and the next session is recorded
        claim = store.claim(1, live=(1, 1))
        store.ack(claim.claim_id, 1)
        assert _one_session(served.url, "s3").status_code == 200
        served.call(served.gateway.drain())
        assert served.gateway.stats()["episodes"]["recorded"] == 2
    finally:
        served.close()


class RecordingJudge:
    """The rule-based format judge, keeping every prompt it was shown."""

    def __init__(self) -> None:
        self.prompts: list[str] = []

    def __call__(self, prompts: list[str]) -> list[str]:
        from rewards.judge import format_judge

        self.prompts += prompts
        return [format_judge(p) for p in prompts]


def test_hindsight_judge_scores_each_turn_when_its_next_state_arrives(agent_policy) -> None:
    # With rewards.prm a hindsight judge, turn t of a live session is judged
    # when the request carrying its tool result arrives (not at the session's close), from a
    # prompt that shows that result; at the close only the last turn is left to judge.
    import time

    from cluster.live import LocalLivePorts, local_reward_service
    from replay.config import ReplayConfig
    from replay.memory import InProcessReplayStore
    from rewards.config import JudgeConfig, RewardsConfig
    from rewards.judge import JudgeWorker
    from rewards.service import LocalJudge

    policy, source = agent_policy
    judge = RecordingJudge()
    cfg = JudgeConfig(backend="callable", function="rewards.judge:format_judge", hindsight=True)
    store = InProcessReplayStore(ReplayConfig(), batch_groups=1)
    reward = local_reward_service(store, RewardsConfig(prm=cfg), [LocalJudge(JudgeWorker(cfg, policy, judge))])
    served = Served(LiveConfig(enabled=True, tokens=[TOKEN], default_max_tokens=48), policy,
                    LocalLivePorts(reward, store), early_judge=True)
    try:
        client, task = _sdk(served), source.tasks("train")[0]
        headers = {"X-Session-Id": "hs-1"}
        first = client.chat.completions.create(model="turnrl-policy", messages=task.messages, tools=task.tools,
                                               temperature=0, extra_headers=headers).choices[0].message
        assert first.tool_calls and reward.stats()["judge_turns"] == 0  # nothing followed turn 0 yet
        messages = [*task.messages, first.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "Mobi Vogi was born in Katu."}]
        client.chat.completions.create(model="turnrl-policy", messages=messages, tools=task.tools,
                                       temperature=0, extra_headers=headers)
        deadline = time.time() + 30
        while reward.stats()["judge_early_turns"] < 1:  # judged in the background, session still open
            assert time.time() < deadline, reward.stats()
            time.sleep(0.05)
        assert len(judge.prompts) == 1 and "### What followed step 1" in judge.prompts[0]
        assert "Katu" in judge.prompts[0].split("### What followed step 1")[1]
        auth = {"Authorization": f"Bearer {TOKEN}"}
        httpx.post(f"{served.url}/sessions/hs-1/feedback", headers=auth, json={"outcome": 1.0})
        httpx.post(f"{served.url}/sessions/hs-1/end", headers=auth)
        served.call(served.gateway.drain())
        # the close judged only turn 1 (the last: nothing followed it)
        assert reward.stats()["judge_turns"] == 2 and len(judge.prompts) == 2
        assert "### What followed" not in judge.prompts[1]
        traj = store.claim(1, live=(1, 1)).groups[0].trajectories[0]
        assert set(traj.live.prejudged) == {0}
        assert traj.turns[0].rewards["prm"] == 1.0  # a well-formed tool call (format judge: 10/10)
        assert traj.turns[1].rewards["prm"] is not None
    finally:
        served.close()


def test_an_unknown_model_is_a_404_and_a_seed_samples_the_same_reply_again(random_policy) -> None:
    # Nothing accepted is ignored. ``model`` must be the served one (OpenAI's
    # 404 model_not_found otherwise, which the SDK raises as NotFoundError); ``seed`` makes
    # the sample repeat, streamed or not, and another seed samples another reply.
    served = Served(LiveConfig(enabled=True, tokens=[TOKEN], default_max_tokens=16), random_policy)
    try:
        client = _sdk(served)
        hello = [{"role": "user", "content": "hello"}]
        with pytest.raises(openai.NotFoundError) as err:
            client.chat.completions.create(model="gpt-4o", messages=hello)
        assert (err.value.code, err.value.param, err.value.type) == ("model_not_found", "model", "invalid_request_error")
        assert "turnrl-policy" in err.value.message

        def tokens(seed: int, stream: bool = False) -> list[str]:
            kwargs = dict(model="turnrl-policy", messages=hello, temperature=1.0, max_tokens=16, seed=seed,
                          logprobs=True)
            if stream:
                chunks = client.chat.completions.create(stream=True, **kwargs)
                return [t.token for c in chunks if c.choices and c.choices[0].logprobs
                        for t in c.choices[0].logprobs.content]
            return [t.token for t in client.chat.completions.create(**kwargs).choices[0].logprobs.content]

        first = tokens(11)
        assert len(first) > 1 and tokens(11) == first and tokens(11, stream=True) == first
        assert tokens(12) != first
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="turnrl-policy", messages=hello, seed=-1)
        assert err.value.param == "seed"
    finally:
        served.close()
