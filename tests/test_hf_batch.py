"""The HF engine's decode batch (``rollout/engines/hf_batch.py``) driven directly, on this
thread, without asyncio or the engine's front: greedy rows decode the tokens a plain
uncached forward picks, a row that joins mid-batch decodes as it would alone, an aborted
row leaves at the next step, and prompt scoring gives a full forward's log-probs."""

from __future__ import annotations

import pytest
import torch

from rollout.config import HFEngineConfig
from rollout.engines.base import SamplingParams
from rollout.engines.hf_batch import DecodeBatch, Row


class Hooks:
    """What the engine's front would do, recorded: tokens per row, finishes, aborts; rows
    handed over to join at the ``join_at``-th step boundary."""

    def __init__(self, join: list[Row] = (), join_at: int = 0, abort: Row | None = None) -> None:
        self.steps, self.join, self.join_at, self.abort = 0, list(join), join_at, abort
        self.finished: dict[str, str] = {}
        self.aborted_ids: list[str] = []

    def boundary(self) -> None:
        self.steps += 1
        if self.abort is not None and self.steps == 3:
            self.abort.aborted = True

    def emitted(self, row: Row, token: int, logprob: float, reason: str | None) -> None:
        if reason is not None:
            self.finished[row.request_id] = reason

    def aborted(self, row: Row) -> None:
        self.aborted_ids.append(row.request_id)

    def joining(self, running: int) -> list[Row]:
        if self.join and self.steps == self.join_at:
            rows, self.join = self.join, []
            return rows
        return []


@pytest.fixture(scope="module")
def batch(tiny_policy) -> DecodeBatch:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_policy[0], dtype=torch.float32).eval()
    # No end-of-sequence token: every row runs to max_new_tokens, so lengths are known.
    return DecodeBatch(model, HFEngineConfig(prefix_cache_mib=0), pad_id=0, eos_id=None, seed=0, stats={
        k: 0.0 for k in ("tokens", "batches", "rows", "decode_s", "joins", "forwards", "forward_rows",
                         "prefill_tokens", "weight_changes_mid_request")})


@torch.inference_mode()
def _greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs from full forwards over the whole sequence, no cache."""
    ids, logps = list(prompt), []
    for _ in range(n):
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
        ids.append(int(logp.argmax()))
        logps.append(float(logp.max()))
    return ids[len(prompt):], logps


def _row(rid: str, prompt: list[int], n: int) -> Row:
    return Row(rid, prompt, SamplingParams(temperature=0.0, max_new_tokens=n))


def test_greedy_rows_decode_what_a_plain_forward_picks(batch) -> None:
    rows = [_row("a", [5, 6, 7], 6), _row("b", [9, 10, 11, 12, 13, 14], 4)]
    hooks = Hooks()
    batch.run(rows, hooks)
    for row in rows:
        tokens, logps = _greedy(batch.model, row.prompt_ids, row.params.max_new_tokens)
        assert row.token_ids == tokens
        assert row.logprobs == pytest.approx(logps, abs=1e-4)
        assert row.spans == [(0, batch.version)]
    assert hooks.finished == {"a": "length", "b": "length"}
    assert hooks.steps == 6  # one boundary per step, until the longest row ends


def test_a_row_joining_mid_batch_decodes_as_alone(batch) -> None:
    late = _row("late", [20, 21, 22, 23], 5)
    first = _row("a", [5, 6, 7], 8)
    rows = [first]
    before = dict(batch.stats)
    batch.run(rows, Hooks(join=[late], join_at=2))
    assert rows == []  # the batch list holds the rows decoding: the joined one came and went
    assert late.token_ids == _greedy(batch.model, late.prompt_ids, 5)[0]
    assert first.token_ids == _greedy(batch.model, [5, 6, 7], 8)[0]
    assert batch.stats["joins"] == before["joins"] + 1
    assert batch.stats["rows"] == before["rows"] + 2 and batch.stats["tokens"] == before["tokens"] + 13


def test_an_aborted_row_leaves_at_the_next_step(batch) -> None:
    a, b = _row("a", [5, 6, 7], 8), _row("b", [8, 9], 8)
    hooks = Hooks(abort=a)
    batch.run([a, b], hooks)
    assert hooks.aborted_ids == ["a"] and len(a.token_ids) == 2  # sampled at boundaries 1 and 2
    assert "a" not in hooks.finished and hooks.finished["b"] == "length" and len(b.token_ids) == 8


def test_prompt_scores_are_a_full_forwards_log_probs(batch) -> None:
    class Item:
        adapter = None  # the base model's log-probs

        def __init__(self, ids: list[int], first: int) -> None:
            self.ids, self.first = ids, first

    items = [Item([5, 6, 7, 8, 9], 2), Item([11, 12, 13], 1)]
    got = batch.score(items)
    for item, (version, values) in zip(items, got):
        with torch.inference_mode():
            logp = torch.log_softmax(batch.model(torch.tensor([item.ids])).logits[0].float(), -1)
        want = [float(logp[p - 1, item.ids[p]]) for p in range(item.first, len(item.ids))]
        assert version == batch.version and values == pytest.approx(want, abs=1e-4)


def test_a_next_turn_after_a_new_version_continues_on_kv_up_to_stale_kv_versions_old(tiny_policy) -> None:
    """The episode's next turn reuses its first turn's KV although new weights landed (so its
    first token's log-prob is not a fresh forward's), prefilling only the new tokens; with
    ``stale_kv_versions`` 0 it re-prefills everything and matches the fresh forward; prompt
    scoring stays exact either way."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_policy[0], dtype=torch.float32).eval()
    stats = {k: 0.0 for k in ("tokens", "batches", "rows", "decode_s", "joins", "forwards", "forward_rows",
                              "prefill_tokens", "weight_changes_mid_request")}
    batch = DecodeBatch(model, HFEngineConfig(stale_kv_versions=2), pad_id=0, eos_id=None, seed=0, stats=stats)
    first = _row("t1", list(range(5, 45)), 4)
    batch.run([first], Hooks())
    gen = torch.Generator().manual_seed(1)
    batch.load({k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}, 1)
    prompt = first.prompt_ids + first.token_ids + [50, 51, 52]
    fresh = _greedy(model, prompt, 1)[1][0]

    before = stats["prefill_tokens"]
    stale = _row("t2", prompt, 1)
    batch.run([stale], Hooks())
    assert stats["prefill_tokens"] - before == 4  # the last sampled token and the observation
    assert stale.kv_version == 0 and stale.spans == [(0, 1)]
    assert batch.prefix.stats["prefix_stale_reused_tokens"] == len(prompt) - 4
    assert abs(stale.logprobs[0] - fresh) > 1e-3  # the old KV was used

    class Item:
        ids, first, adapter = prompt, len(prompt) - 3, None

    [(version, scores)] = batch.score([Item()])
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    assert version == 1 and scores == pytest.approx([float(logp[p - 1, prompt[p]]) for p in range(Item.first, len(prompt))], abs=1e-4)

    batch.prefix.max_age = 0  # now exact: the same turn prefills all and matches a fresh forward
    again = _row("t3", prompt, 1)
    batch.run([again], Hooks())
    assert again.kv_version == 1 and again.logprobs[0] == pytest.approx(fresh, abs=1e-4)
