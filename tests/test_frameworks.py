"""The agent frameworks people use, driving the live endpoint over real HTTP: the OpenAI Agents
SDK (chat-completions mode), LangGraph with langchain-openai, smolagents, pydantic-ai and
litellm's ``openai/`` passthrough. Each runs tool-calling sessions to the end against one served
tiny agent (tests/framework_fixtures.py); the run's own records (its live_sessions.jsonl) must
show every session token-exact -- each recorded action decodes to what the framework was served
and acted on, tool-call turns included -- and accepted into replay, where the learner's claim takes it.
A framework whose package is not installed is skipped, saying so. What a framework sends by
default that the HF engine cannot honour is a 400 naming the parameter, seen through the
framework."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from rollout.trajectory import Trajectory
from tests.framework_fixtures import ANSWER, CALL_FINAL, CALL_SEARCH, MODEL, NAMES, RESULT, SEARCH, SMOL_SYSTEM, \
    TOKEN, ServedRun, build_agent_policy, question

pytestmark = pytest.mark.slow
SEARCH_DOC = """Search the documents.

    Args:
        query: what to look for.
    """


def _needs(module: str):
    return pytest.importorskip(module, reason=f"{module} is not installed (requirements-test.lock pins it)")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("framework-agent")
    served = ServedRun(str(build_agent_policy(out)), out / "live_sessions.jsonl")
    yield served
    served.close()


class Searches:
    """The ``search`` tool every framework is given; keeps the queries it was called with."""

    def __init__(self) -> None:
        self.queries: list[str] = []

    def __call__(self, query: str) -> str:
        self.queries.append(query)
        return RESULT


def _tool(searches: Searches):
    def search(query: str) -> str:
        return searches(query)

    search.__doc__ = SEARCH_DOC
    return search


def _close(run: ServedRun, sid: str) -> list[Trajectory]:
    """Feedback and end over HTTP (as a client would), then the session's records: every
    segment accepted into replay."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.post(f"{run.url}/sessions/{sid}/feedback", json={"outcome": 1.0}, headers=auth).status_code == 200
    assert httpx.post(f"{run.url}/sessions/{sid}/end", headers=auth).status_code == 200
    run.call(run.gateway.drain())
    records = [r for r in run.records() if r["trajectory"]["live"]["session_id"] == sid]
    assert records and all(r["replay"] == "accepted" for r in records)
    return [Trajectory.model_validate(r["trajectory"]) for r in records]


def _trained(run: ServedRun, trajs: list[Trajectory]) -> None:
    """The learner's claim takes exactly these sessions' segments from replay (live groups,
    apart from rollouts) with the client's outcome, and its acknowledgement counts them trained."""
    before = run.store.stats().live_trained
    claim = run.store.claim(len(trajs), live=(len(trajs), len(trajs)))
    got = [t for g in claim.groups for t in g.trajectories]
    assert sorted(t.trajectory_id for t in got) == sorted(t.trajectory_id for t in trajs)
    assert all(t.outcome == 1.0 for t in got)
    run.store.ack(claim.claim_id, 1)
    assert run.store.stats().live_trained == before + len(trajs) and run.store.stats().live_held == 0


def _actions(run: ServedRun, traj: Trajectory) -> list[str]:
    """Each recorded turn's sampled tokens as text (the closing end-of-turn dropped)."""
    tok = run.gateway.service.engine.tokenizer
    eos = tok.eos_token_id
    out = []
    for turn in traj.turns:
        ids = list(turn.action_ids)
        assert ids[-1] == eos  # every turn ended by the model, none cut by max_tokens
        out.append(tok.decode(ids[:-1]))
    return out


def _stitched(run: ServedRun, sid: str, actions: list[str]) -> Trajectory:
    """A session whose client sent back what it was served: one segment, the tool result
    appended in token space after the sampled call."""
    [traj] = _close(run, sid)
    assert _actions(run, traj) == actions
    tok = run.gateway.service.engine.tokenizer
    assert RESULT in tok.decode(traj.turns[0].observation_ids)
    return traj


def test_openai_agents_sdk_runs_tools_plain_and_streamed(run) -> None:
    agents = _needs("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    searches = Searches()

    def agent(sid: str, strict: bool = False):
        client = AsyncOpenAI(base_url=run.url, api_key=TOKEN, max_retries=0, default_headers={"X-Session-Id": sid})
        model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
        return agents.Agent(name="a", instructions="Answer.", model=model,
                            model_settings=agents.ModelSettings(temperature=0.0),
                            tools=[agents.function_tool(_tool(searches), name_override="search", strict_mode=strict)])

    # its default: strict tool schemas, which need constrained decoding -> a 400 naming it
    import openai
    with pytest.raises(openai.BadRequestError) as err:
        agents.Runner.run_sync(agent("agents-strict", strict=True), question(NAMES[1]))
    assert err.value.body["param"] == "tools.0.function.strict"

    assert agents.Runner.run_sync(agent("agents-1"), question(NAMES[1])).final_output == ANSWER

    async def streamed() -> str:
        result = agents.Runner.run_streamed(agent("agents-2"), question(NAMES[1]))
        async for _ in result.stream_events():
            pass
        return result.final_output

    assert asyncio.run(streamed()) == ANSWER
    assert searches.queries == ["birthplace", "birthplace"]
    _trained(run, [_stitched(run, sid, [CALL_SEARCH, ANSWER]) for sid in ("agents-1", "agents-2")])


def test_openai_agents_sdk_on_its_default_responses_model(run) -> None:
    """The SDK's default model speaks the Responses API (``POST /v1/responses``): the whole
    conversation as input items each turn, the call's output as a ``function_call_output``
    item. Its default strict tool schemas need constrained decoding: on the HF engine a 400
    naming ``tools.0.strict`` (the vLLM engine runs them: the next test)."""
    agents = _needs("agents")
    import openai
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    searches = Searches()

    def agent(sid: str, strict: bool):
        client = AsyncOpenAI(base_url=run.url, api_key=TOKEN, max_retries=0, default_headers={"X-Session-Id": sid})
        return agents.Agent(name="a", instructions="Answer.", model=agents.OpenAIResponsesModel(MODEL, client),
                            model_settings=agents.ModelSettings(temperature=0.0),
                            tools=[agents.function_tool(_tool(searches), name_override="search", strict_mode=strict)])

    with pytest.raises(openai.BadRequestError) as err:
        agents.Runner.run_sync(agent("responses-strict", strict=True), question(NAMES[2]))
    assert err.value.body["param"] == "tools.0.strict"
    assert agents.Runner.run_sync(agent("responses-1", strict=False), question(NAMES[2])).final_output == ANSWER

    async def streamed() -> str:
        result = agents.Runner.run_streamed(agent("responses-2", strict=False), question(NAMES[2]))
        async for _ in result.stream_events():
            pass
        return result.final_output

    assert asyncio.run(streamed()) == ANSWER and searches.queries == ["birthplace", "birthplace"]
    _trained(run, [_stitched(run, sid, [CALL_SEARCH, ANSWER]) for sid in ("responses-1", "responses-2")])


def test_openai_agents_sdk_defaults_untouched_on_the_vllm_engine(tmp_path_factory) -> None:
    """As a user runs the SDK's quick start: ``set_default_openai_client`` with our base URL and
    key, a model name, ``function_tool`` as it comes (strict schemas) and the default Responses
    model; on the vLLM engine the strict schema is constrained decoding, so it just works, and
    the session (keyed by the client's header) is recorded token-exact and trained."""
    agents = _needs("agents")
    _needs("vllm")
    from openai import AsyncOpenAI

    out = tmp_path_factory.mktemp("framework-agent-vllm")
    served = ServedRun(str(build_agent_policy(out)), out / "live_sessions.jsonl", engine="vllm")
    try:
        agents.set_tracing_disabled(True)
        agents.set_default_openai_client(AsyncOpenAI(base_url=served.url, api_key=TOKEN,
                                                     default_headers={"X-Session-Id": "quickstart"}))
        searches = Searches()
        agent = agents.Agent(name="Assistant", instructions="Answer.", model=MODEL,
                             tools=[agents.function_tool(_tool(searches), name_override="search")],
                             model_settings=agents.ModelSettings(temperature=0.0))
        assert agents.Runner.run_sync(agent, question(NAMES[3])).final_output == ANSWER
        assert searches.queries == ["birthplace"]
        traj = _stitched(served, "quickstart", [CALL_SEARCH, ANSWER])
        assert traj.live.constrained == {0: "strict_tools", 1: "strict_tools"}
        _trained(served, [traj])
    finally:
        agents.set_default_openai_client(AsyncOpenAI(api_key="unset"))
        served.close()


def test_langgraph_react_agent_and_streamed_tool_call_chunks(run) -> None:
    _needs("langgraph")
    _needs("langchain_openai")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    searches = Searches()
    search = tool(_tool(searches), description="Search the documents.")

    def llm(sid: str) -> ChatOpenAI:
        return ChatOpenAI(model=MODEL, base_url=run.url, api_key=TOKEN, temperature=0, max_retries=0,
                          default_headers={"X-Session-Id": sid})

    import warnings
    with warnings.catch_warnings():  # create_react_agent moved to langchain.agents; still LangGraph's
        warnings.simplefilter("ignore")
        agent = create_react_agent(llm("lg-1"), [search])
    out = agent.invoke({"messages": [("user", question(NAMES[2]))]})
    assert out["messages"][-1].content == ANSWER
    # the conversation goes on: a second question in the same session
    out = agent.invoke({"messages": [*out["messages"], ("user", question(NAMES[3]))]})
    assert out["messages"][-1].content == ANSWER and searches.queries == ["birthplace"] * 2
    first = _stitched(run, "lg-1", [CALL_SEARCH, ANSWER, CALL_SEARCH, ANSWER])

    chunks = list(llm("lg-2").bind_tools([search]).stream([("user", question(NAMES[2]))]))
    parts = [c for chunk in chunks for c in chunk.tool_call_chunks]
    assert parts[0]["name"] == "search" and parts[0]["id"].startswith("call_")
    assert "".join(p["args"] or "" for p in parts) == '{"query": "birthplace"}'
    [traj] = _close(run, "lg-2")
    assert _actions(run, traj) == [CALL_SEARCH]
    _trained(run, [first, traj])


def test_smolagents_tool_calling_agent_ends_with_final_answer(run) -> None:
    smolagents = _needs("smolagents")
    searches = Searches()
    search = smolagents.tool(_tool(searches))

    def agent(sid: str, **model_kwargs):
        model = smolagents.OpenAIServerModel(model_id=MODEL, api_base=run.url, api_key=TOKEN, temperature=0,
                                             client_kwargs={"default_headers": {"X-Session-Id": sid}, "max_retries": 0},
                                             **model_kwargs)
        agent = smolagents.ToolCallingAgent(tools=[search], model=model, max_steps=3, verbosity_level=0)
        agent.prompt_templates["system_prompt"] = SMOL_SYSTEM  # its own is 1,500 tokens of examples
        return agent

    # its default tool_choice "required" needs constrained decoding, which the HF engine does
    # not do: smolagents surfaces the 400 naming the parameter
    with pytest.raises(Exception, match="tool_choice"):
        agent("smol-default").run(question(NAMES[0]))

    # its default stop strings ("Observation:", "Calling tools:", several tokens each) are taken
    result = agent("smol-1", tool_choice="auto").run(question(NAMES[0]))
    # smolagents sends its calls back as text and the results as user messages: the history is
    # not what was served, so each request is a segment of its own, each token-exact
    first, second = _close(run, "smol-1")
    assert result == ANSWER and searches.queries == ["birthplace"]
    assert (_actions(run, first), _actions(run, second)) == ([CALL_SEARCH], [CALL_FINAL])
    assert first.live.segment == 0 and second.live.segment == 1
    assert run.gateway.stats()["recorder"]["history_rewritten"] >= 1
    _trained(run, [first, second])


def test_pydantic_ai_agent_plain_and_streamed(run) -> None:
    _needs("pydantic_ai")
    from openai import AsyncOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.exceptions import ModelHTTPError
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.profiles.openai import OpenAIModelProfile
    from pydantic_ai.providers.openai import OpenAIProvider

    searches = Searches()

    def agent(sid: str, strict: bool = False) -> Agent:
        client = AsyncOpenAI(base_url=run.url, api_key=TOKEN, max_retries=0, default_headers={"X-Session-Id": sid})
        profile = None if strict else OpenAIModelProfile(openai_supports_strict_tool_definition=False)
        model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client), profile=profile)
        return Agent(model, tools=[_tool(searches)], model_settings={"temperature": 0.0})

    with pytest.raises(ModelHTTPError) as err:  # its default for this schema: strict
        agent("pyd-strict", strict=True).run_sync(question(NAMES[4]))
    assert err.value.status_code == 400 and "tools.0.function.strict" in str(err.value.body)

    assert agent("pyd-1").run_sync(question(NAMES[4])).output == ANSWER

    async def streamed() -> str:
        async with agent("pyd-2").run_stream(question(NAMES[4])) as result:
            return await result.get_output()

    assert asyncio.run(streamed()) == ANSWER and searches.queries == ["birthplace"] * 2
    _trained(run, [_stitched(run, sid, [CALL_SEARCH, ANSWER]) for sid in ("pyd-1", "pyd-2")])


def test_litellm_openai_passthrough_with_a_streamed_answer(run) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list
    litellm = _needs("litellm")
    kw = dict(model=f"openai/{MODEL}", api_base=run.url, api_key=TOKEN, tools=[SEARCH], temperature=0,
              extra_headers={"X-Session-Id": "litellm-1"})
    messages = [{"role": "user", "content": question(NAMES[5])}]
    first = litellm.completion(messages=messages, **kw)
    [call] = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "search"
    # litellm's own pattern: its message object goes back as it came (provider_specific_fields too)
    messages += [first.choices[0].message,
                 {"role": "tool", "tool_call_id": call.id, "content": Searches()(**json.loads(call.function.arguments))}]
    stream = litellm.completion(messages=messages, stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == ANSWER
    _trained(run, [_stitched(run, "litellm-1", [CALL_SEARCH, ANSWER])])


def test_autogen_assistant_agent_on_its_defaults(run) -> None:
    """AutoGen AgentChat's ``AssistantAgent`` with ``OpenAIChatCompletionClient`` as its quick
    start sets it up (``model_info`` is what it asks of any model not OpenAI's own). It names
    every message's sender (``messages[].name``) and, by default, ends a run with the tool's
    result rather than asking the model again: a second run in the same agent sends the whole
    history back, and the session goes on in token space."""
    _needs("autogen_agentchat")
    from autogen_agentchat.agents import AssistantAgent
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    searches = Searches()
    client = OpenAIChatCompletionClient(
        model=MODEL, base_url=run.url, api_key=TOKEN, temperature=0, max_retries=0,
        default_headers={"X-Session-Id": "autogen-1"},
        model_info={"vision": False, "function_calling": True, "json_output": False, "family": "unknown",
                    "structured_output": False})
    agent = AssistantAgent("assistant", model_client=client, tools=[_tool(searches)], system_message="Answer.")

    async def two_runs() -> list[str]:
        first = await agent.run(task=question(NAMES[0]))
        second = await agent.run(task=question(NAMES[1]))
        await client.close()
        return [first.messages[-1].content, second.messages[-1].content]

    assert asyncio.run(two_runs()) == [RESULT, RESULT] and searches.queries == ["birthplace"] * 2
    _trained(run, [_stitched(run, "autogen-1", [CALL_SEARCH, CALL_SEARCH])])


def test_llamaindex_function_agent_and_chat_with_tools_on_their_defaults(run) -> None:
    """LlamaIndex's ``OpenAILike`` (the class its docs give for OpenAI-compatible servers):
    ``FunctionAgent`` as its quick start runs it, streamed, and ``chat_with_tools`` used
    directly, whose default ``allow_parallel_tool_calls=False`` sends ``parallel_tool_calls:
    false`` -- the reply then ends where its first call closes."""
    _needs("llama_index.llms.openai_like")
    from llama_index.core.agent.workflow import FunctionAgent
    from llama_index.core.llms import ChatMessage
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.openai_like import OpenAILike

    searches = Searches()
    search = FunctionTool.from_defaults(_tool(searches))

    def llm(sid: str) -> OpenAILike:
        return OpenAILike(model=MODEL, api_base=run.url, api_key=TOKEN, is_chat_model=True,
                          is_function_calling_model=True, temperature=0, max_retries=0,
                          default_headers={"X-Session-Id": sid})

    async def quick_start() -> str:
        agent = FunctionAgent(tools=[search], llm=llm("llama-1"), system_prompt="Answer.")
        return str(await agent.run(question(NAMES[4])))

    assert asyncio.run(quick_start()).strip() == ANSWER

    model = llm("llama-2")
    history = [ChatMessage(role="user", content=question(NAMES[5]))]
    reply = model.chat_with_tools([search], chat_history=history)
    [call] = model.get_tool_calls_from_response(reply)
    assert call.tool_name == "search"
    history += [reply.message, ChatMessage(role="tool", content=searches(**call.tool_kwargs),
                                           additional_kwargs={"tool_call_id": call.tool_id})]
    assert model.chat_with_tools([search], chat_history=history).message.content == ANSWER
    assert searches.queries == ["birthplace"] * 2
    first = _stitched(run, "llama-1", [CALL_SEARCH, ANSWER])
    [second] = _close(run, "llama-2")
    assert second.live.ended_early == {0: "first_tool_call"}  # cut after the call: no end-of-turn
    tok = run.gateway.service.engine.tokenizer
    assert tok.decode(list(second.turns[0].action_ids)) == CALL_SEARCH
    _trained(run, [first, second])


def test_haystack_agent_with_openai_chat_generator(run) -> None:
    """Haystack's ``Agent`` around ``OpenAIChatGenerator`` pointed at the endpoint
    (``api_base_url``), a tool made from a function, as its agent tutorial builds them."""
    _needs("haystack")
    from haystack.components.agents import Agent
    from haystack.components.generators.chat import OpenAIChatGenerator
    from haystack.dataclasses import ChatMessage
    from haystack.tools import create_tool_from_function
    from haystack.utils import Secret

    searches = Searches()
    generator = OpenAIChatGenerator(model=MODEL, api_base_url=run.url, api_key=Secret.from_token(TOKEN),
                                    generation_kwargs={"temperature": 0}, max_retries=0,
                                    http_client_kwargs={"headers": {"X-Session-Id": "haystack-1"}})
    agent = Agent(chat_generator=generator, tools=[create_tool_from_function(_tool(searches))], system_prompt="Answer.")
    result = agent.run(messages=[ChatMessage.from_user(question(NAMES[0]))])
    assert result["last_message"].text == ANSWER and searches.queries == ["birthplace"]
    _trained(run, [_stitched(run, "haystack-1", [CALL_SEARCH, ANSWER])])


def test_agno_agent_on_chat_completions_and_on_responses(run) -> None:
    """Agno's ``Agent`` with ``OpenAILike`` (chat completions) and with ``OpenResponses`` (its
    model for servers of the Responses API), each as its docs configure an OpenAI-compatible
    server: base URL, key, model id."""
    _needs("agno")
    from agno.agent import Agent
    from agno.models.openai.like import OpenAILike
    from agno.models.openai.open_responses import OpenResponses

    searches = Searches()
    headers = lambda sid: {"X-Session-Id": sid}  # noqa: E731
    models = {"agno-chat": OpenAILike(id=MODEL, base_url=run.url, api_key=TOKEN, temperature=0, max_retries=0,
                                      default_headers=headers("agno-chat")),
              "agno-responses": OpenResponses(id=MODEL, base_url=run.url, api_key=TOKEN, temperature=0,
                                              max_retries=0, default_headers=headers("agno-responses"))}
    for sid, model in models.items():
        agent = Agent(model=model, tools=[_tool(searches)], instructions="Answer.", telemetry=False)
        assert agent.run(question(NAMES[1])).content == ANSWER, sid
    assert searches.queries == ["birthplace"] * 2
    _trained(run, [_stitched(run, sid, [CALL_SEARCH, ANSWER]) for sid in models])


NODE_DIR = Path(__file__).parent / "node"


@pytest.fixture(scope="module")
def node_openai() -> list[str]:
    """``node tests/node/agent.mjs``, its pinned ``openai`` package installed by ``npm ci``
    (package-lock.json) when missing; skipped, saying why, where node or the registry is not there."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed (apt-get install nodejs npm)")
    if not (NODE_DIR / "node_modules" / "openai").exists():
        done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            pytest.skip(f"npm ci could not install the openai package: {done.stderr.strip()[-300:]}")
    return ["node", str(NODE_DIR / "agent.mjs")]


def test_the_openai_npm_package_from_node(run, node_openai) -> None:
    """Another language's client: the openai npm package's chat completions (plain and streamed)
    and Responses API (chained, plain and streamed), from Node, as its README uses them."""
    done = subprocess.run([*node_openai, run.url, TOKEN, question(NAMES[2]), RESULT], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    served = json.loads(done.stdout)
    for sid, got in served.items():
        assert got["calls"] == [["search", '{"query": "birthplace"}']] and got["answer"] == ANSWER, sid
    assert served["node-chat"]["finish"] == "tool_calls" and served["node-chat-stream"]["completion_tokens"] > 0
    assert served["node-responses-stream"]["status"] == "completed"
    assert served["node-responses-stream"]["final"] == ANSWER
    _trained(run, [_stitched(run, sid, [CALL_SEARCH, ANSWER]) for sid in served])


def test_what_frameworks_send_is_taken_only_where_it_changes_nothing() -> None:
    from gateway.errors import InvalidRequest
    from gateway.openai_types import parse_chat_request

    user = [{"role": "user", "content": "hi"}]
    harmless = {"metadata": {"run": "x"}, "store": False, "response_format": {"type": "text"},
                "stream": True, "stream_options": {"include_usage": True}, "tool_choice": "auto"}
    echoed = {"role": "assistant", "content": None, "provider_specific_fields": {"refusal": None}}
    assert parse_chat_request({"messages": [*user, echoed, *user], **harmless}).metadata == {"run": "x"}
    with pytest.raises(InvalidRequest) as err:
        parse_chat_request({"messages": user, "store": True})
    assert err.value.param == "store" and err.value.status == 400


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}}, "response_format"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [SEARCH], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [SEARCH], "tool_choice": {"type": "function", "function": {"name": "search"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {**SEARCH["function"], "strict": True}}]}, "tools.0.function.strict"),
])
def test_the_hf_engine_refuses_what_needs_constrained_decoding_naming_it(run, extra, param) -> None:
    # over HTTP, through the served HF engine: a 400 naming the parameter and the engine that does it
    body = {"model": MODEL, "messages": [{"role": "user", "content": question(NAMES[0])}], **extra}
    reply = httpx.post(f"{run.url}/chat/completions", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    error = reply.json()["error"]
    assert (reply.status_code, error["param"]) == (400, param)
    assert "constrained decoding" in error["message"] and "rollout.engine.type: vllm" in error["message"]
