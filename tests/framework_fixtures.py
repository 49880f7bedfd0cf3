"""Shared by the agent-framework tests (tests/test_frameworks.py): a tiny Llama taught, in ~20 s
of SFT on the project's own token layout (``learner.sft.demo_rows``), to act as an
agent in the shapes the frameworks send, and one live gateway serving it over HTTP with an
in-process reward service and replay store, so a test can read what the run recorded and put
into replay.

Why a trained tiny model and not constrained decoding: the HF engine cannot constrain decoding,
and a random model never writes a tool call. Taught on a handful of conversations, the model
calls ``search`` after a question, answers ``Katu`` after the search result and, when the tools
offered include ``final_answer`` (smolagents' way to end a run), calls that instead. Its
temperature-0 choices are then deterministic, so every framework runs its loop to the end.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
from pathlib import Path
from typing import Any

import torch

from envs.base import Task
from gateway.config import LiveConfig
from gateway.server import LiveGateway
from learner.config import TinyModelConfig
from learner import sft
from learner.sft import demo_rows
from learner.tiny_policy import create_model, train_tokenizer

TOKEN = "tok-frameworks"
MODEL = "turnrl-policy"
RESULT = "Mobi Vogi was born in Katu."
"""What every framework's ``search`` tool returns."""
ANSWER = "Katu"
NAMES = ["Mobi Vogi", "Tala Renn", "Ossa Quin", "Peri Lund", "Vedor Haas", "Ima Sorel"]
SMOL_SYSTEM = "Use the tools, then answer in one word."
"""The system prompt the smolagents test gives its agent (its default is 1,500 tokens here)."""
SYSTEMS = [None, "Answer.", "You are a helpful assistant.", SMOL_SYSTEM]
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the documents.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
FINAL = {"type": "function", "function": {
    "name": "final_answer", "description": "Provides a final answer to the given problem.",
    "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}


def question(name: str) -> str:
    return f"In which city was {name} born?"


def call_text(name: str, arguments: dict[str, Any]) -> str:
    """A tool call as the model writes it (and as the chat template renders one back)."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


CALL_SEARCH = call_text("search", {"query": "birthplace"})
CALL_FINAL = call_text("final_answer", {"answer": ANSWER})


def conversations(rng: random.Random) -> list[tuple[list[dict[str, Any]], list[dict], list[dict]]]:
    """(opening messages, tools, demonstration) of every shape the model is taught; the call ids
    smolagents echoes back are drawn from ``rng``."""
    out = []
    for i, name in enumerate(NAMES):
        system = SYSTEMS[i % len(SYSTEMS)]
        opening = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": question(name)}]
        # a tool-role result, then a second question in the same conversation
        again = question(NAMES[(i + 1) % len(NAMES)])
        out.append((opening, [SEARCH], [
            {"role": "assistant", "content": CALL_SEARCH}, {"role": "tool", "content": RESULT},
            {"role": "assistant", "content": ANSWER}, {"role": "user", "content": again},
            {"role": "assistant", "content": CALL_SEARCH}, {"role": "tool", "content": RESULT},
            {"role": "assistant", "content": ANSWER}]))
        out.append((opening, [SEARCH, FINAL], [
            {"role": "assistant", "content": CALL_SEARCH}, {"role": "tool", "content": RESULT},
            {"role": "assistant", "content": CALL_FINAL}]))
        # smolagents sends its calls back as text, with the served call's id, and the results as
        # user messages
        first = [{"role": "system", "content": SMOL_SYSTEM}, {"role": "user", "content": f"New task:\n{question(name)}"}]
        sent = f"Calling tools:\n[{{'id': 'call_{rng.getrandbits(96):024x}', 'type': 'function', " \
               "'function': {'name': 'search', 'arguments': {'query': 'birthplace'}}}]"
        out.append((first, [SEARCH, FINAL], [{"role": "assistant", "content": CALL_SEARCH}]))
        out.append((first + [{"role": "assistant", "content": sent},
                             {"role": "user", "content": f"Observation:\n{RESULT}"}],
                    [SEARCH, FINAL], [{"role": "assistant", "content": CALL_FINAL}]))
    return out


def _rows(tok: Any, convs: list[tuple[list[dict[str, Any]], list[dict], list[dict]]]) -> list[tuple[list[int], list[int]]]:
    return [row for i, (opening, tools, demo) in enumerate(convs)
            for row in demo_rows(tok, Task(task_id=f"f{i}", messages=opening, tools=tools), demo)]


def build_agent_policy(out: Path, steps: int = 120) -> Path:
    """Tokenizer, tiny Llama and its SFT; returns the policy folder."""
    rng = random.Random(0)
    convs = conversations(rng)
    corpus = [json.dumps([opening, demo]) for opening, _, demo in convs] + [CALL_SEARCH, CALL_FINAL] * 20
    tok = train_tokenizer(corpus, vocab_size=1500, out_dir=out)
    cfg = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, max_positions=4096)
    model = create_model(cfg, tok, 0, out)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only wait on each other on 2 shared cores
    for _ in range(steps):
        # every shape each step, with call ids drawn anew (the model must not read them); SFT's
        # loss (shared prefixes run once), on the actions only
        loss = sft._batch_loss(model, _rows(tok, conversations(rng)), tok.pad_token_id, context_weight=0.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.set_num_threads(threads)
    model.eval()
    model.save_pretrained(out)
    return out


class ServedRun:
    """The gateway on its own event-loop thread (as in its Ray actor), with an in-process
    reward service and replay store behind it and its record file, reachable over HTTP."""

    def __init__(self, policy: str, record_path: Path, engine: str = "hf") -> None:
        from cluster.live import LocalLivePorts, local_reward_service
        from replay.config import ReplayConfig
        from replay.memory import InProcessReplayStore
        from rollout.config import HFEngineConfig, VLLMEngineConfig
        from rollout.engines import local_client

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.store = InProcessReplayStore(ReplayConfig(live_capacity_groups=64), batch_groups=1)
        self.ports = LocalLivePorts(local_reward_service(self.store), self.store)
        cfg = LiveConfig(enabled=True, tokens=[TOKEN], default_max_tokens=48, max_context_tokens=4096)
        self.record_path = record_path
        engine_cfg = HFEngineConfig() if engine == "hf" else VLLMEngineConfig(max_model_len=4096)
        self.gateway = LiveGateway(cfg, local_client(engine_cfg, policy), self.ports, run_id="frameworks",
                                   record_path=str(record_path))
        self.url = self.call(self.gateway.start())

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def records(self) -> list[dict[str, Any]]:
        """The run's record of every closed segment (live_sessions.jsonl)."""
        if not self.record_path.exists():
            return []
        return [json.loads(line) for line in self.record_path.read_text().splitlines()]

    def close(self) -> None:
        self.call(self.gateway.stop())
        self.call(self.ports.close())
        self.call(self.gateway.service.engine.engine.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
