"""Engine output -> OpenAI responses: whole completions, and streamed chunks.

Log-probs are the behaviour log-probs the engine recorded (under the distribution that sampled
each token: tempered, biased and penalised as the request asked), one entry per generated token
except the end-of-turn token that closes the message (OpenAI reports no entry for the stop
sequence); ``top_logprobs`` are the engine's alternatives under that same distribution.

Streaming parses incrementally in the policy's chat format (``envs.formats.StreamParser``):
content and ``reasoning_content`` go out as they are decoded; each tool call starts with a
delta carrying its index, id and name once the name is written, then its ``arguments`` in
fragments as the model writes them, as OpenAI streams calls. Text that could still turn out to
be a call tag is held back, so calls never leak into the content, and the deltas of a choice
add up to exactly the non-streamed message (same content, reasoning, ids, names, arguments).

``stop`` strings: a reply ends before the first one written (``cut_at_stop``, the one place
that rule lives); ``StopWatch`` finds the token that completes it while the engine samples, and
a stream holds back text that could still become one.
"""

from __future__ import annotations

from typing import Any, Sequence

from envs.formats import DEFAULT_FORMAT, ChatFormat, StreamDelta, StreamParser, get_format
from envs.formats.base import partial_suffix
from gateway.openai_types import (
    ChatCompletion, Choice, ChoiceLogprobs, ChunkChoice, Delta, DeltaFunction, DeltaToolCall,
    OpenAIFinish, TokenLogprob, TopLogprob, Usage,
)
from gateway.toolcalls import AssistantReply, split_action, tool_call_id
from rollout.chat import StreamDecoder, decode_action


def openai_finish(engine_reason: str, reply: AssistantReply, named_tool: bool = False) -> OpenAIFinish:
    """``length`` when cut by the token limit or aborted (the text is unfinished either way),
    else ``tool_calls`` when the message calls tools, else ``stop``. A call the request named
    (``tool_choice`` a function) finishes ``stop``, as OpenAI's does."""
    if engine_reason in ("length", "abort"):
        return "length"
    return "tool_calls" if reply.wire and not named_tool else "stop"


def token_logprobs(tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[float],
                   top: Sequence[Sequence[tuple[int, float]]] = ()) -> list[TokenLogprob]:
    """One entry per generated token, the closing end-of-turn token left out (it only ever
    comes last, so leaving it out wherever it is gives the same entries chunk by chunk); with
    ``top`` (the engine's alternatives per token), each entry's ``top_logprobs``."""
    out = []
    for k, (tid, lp) in enumerate(zip(token_ids, logprobs)):
        if tid == tokenizer.eos_token_id:
            continue
        text, raw = _token_text(tokenizer, tid)
        alts = [TopLogprob(token=t, logprob=float(v), bytes=b)
                for t, b, v in ((*_token_text(tokenizer, a), v) for a, v in top[k])] if k < len(top) else []
        out.append(TokenLogprob(token=text, logprob=float(lp), bytes=raw, top_logprobs=alts))
    return out


def _token_text(tokenizer: Any, tid: int) -> tuple[str, list[int] | None]:
    text = tokenizer.decode([tid])
    # A token holding part of a multi-byte character decodes to U+FFFD: its bytes are unknown.
    return text, None if "\ufffd" in text else list(text.encode("utf-8"))


def decode(tokenizer: Any, token_ids: Sequence[int], chat_format: str | ChatFormat = DEFAULT_FORMAT) -> str:
    """Text of generated ids, special tokens (end-of-turn) dropped but the format's own."""
    return decode_action(tokenizer, list(token_ids), chat_format)


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``text`` before the first place a stop string begins (OpenAI leaves the stop string out
    of the reply), and whether one was written. The one place the ``stop`` rule lives."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


class StopWatch:
    """Ends a choice where a stop string is first written, in the decoded text, whatever tokens
    wrote it: fed the tokens as they are sampled, it says how many to keep (through the token
    that completes the stop string). The engine request is then aborted; the tokens it sampled
    after that one are dropped, so the reply and the recording end at the same token."""

    def __init__(self, tokenizer: Any, stops: Sequence[str], chat_format: str | ChatFormat = DEFAULT_FORMAT) -> None:
        self.tokenizer, self.stops, self.format = tokenizer, list(stops), get_format(chat_format)
        # A stop string of L characters lies within the last 4L + 8 tokens that wrote it (a token
        # adds at least one character, except special tokens and parts of one character).
        self.window = 4 * max(len(s) for s in self.stops) + 8
        self.ids: list[int] = []

    def feed(self, token_ids: Sequence[int]) -> int | None:
        """None while no stop string is written, else how many of ``token_ids`` to keep."""
        for k, tid in enumerate(token_ids):
            self.ids.append(tid)
            if cut_at_stop(decode(self.tokenizer, self.ids[-self.window:], self.format), self.stops)[1]:
                return k + 1
        return None


class FirstCallWatch:
    """Ends a choice once its first tool call is complete (``parallel_tool_calls: false``): fed
    the tokens as they are sampled, it says how many to keep (through the token that closes the
    call block); the engine request is then aborted, so no second call is ever sampled."""

    def __init__(self, tokenizer: Any, chat_format: str | ChatFormat = DEFAULT_FORMAT) -> None:
        self.format = get_format(chat_format)
        self.decoder = StreamDecoder(tokenizer, self.format)

    def feed(self, token_ids: Sequence[int]) -> int | None:
        """None while no call is complete, else how many of ``token_ids`` to keep."""
        for k, tid in enumerate(token_ids):
            text = self.decoder.push([tid])
            if any(draft.closed for draft in self.format.scan(text, final=False).calls):
                return k + 1
        return None


def _reply(tokenizer: Any, token_ids: Sequence[int], completion_id: str, index: int, tools_enabled: bool,
           chat_format: str | ChatFormat, stops: Sequence[str]) -> AssistantReply:
    """One choice's reply: its text up to any stop string, split; ``text`` keeps all it wrote."""
    full = decode(tokenizer, token_ids, chat_format)
    reply = split_action(cut_at_stop(full, stops)[0], completion_id, index, tools_enabled, chat_format)
    reply.text = full
    return reply


def chat_completion(tokenizer: Any, completion_id: str, model: str, created: int, prompt_len: int,
                    completions: Sequence[Any], tools_enabled: bool, logprobs: bool,
                    chat_format: str | ChatFormat = DEFAULT_FORMAT,
                    stops: Sequence[str] = (), named_tool: bool = False) -> tuple[ChatCompletion, list[AssistantReply]]:
    """The response to a non-streamed request, and each choice's reply (for the recorder).
    ``completions`` are engine completions (token_ids, logprobs, finish_reason, version_spans)."""
    choices, replies = [], []
    for i, comp in enumerate(completions):
        reply = _reply(tokenizer, comp.token_ids, completion_id, i, tools_enabled, chat_format, stops)
        lps = ChoiceLogprobs(content=token_logprobs(tokenizer, comp.token_ids, comp.logprobs, comp.top)) \
            if logprobs else None
        choices.append(Choice(index=i, message=reply.message(), logprobs=lps,
                              finish_reason=openai_finish(comp.finish_reason, reply, named_tool)))
        replies.append(reply)
    generated = sum(len(c.token_ids) for c in completions)
    response = ChatCompletion(
        id=completion_id, created=created, model=model, choices=choices,
        usage=Usage(prompt_tokens=prompt_len, completion_tokens=generated, total_tokens=prompt_len + generated),
        system_fingerprint=f"turnrl-v{completions[0].version_spans[0][1]}",
    )
    return response, replies


class ChoiceStream:
    """Turns one choice's streamed tokens into chunk choices."""

    def __init__(self, tokenizer: Any, completion_id: str, index: int, tools_enabled: bool,
                 logprobs: bool, chat_format: str | ChatFormat = DEFAULT_FORMAT, stops: Sequence[str] = (),
                 named_tool: bool = False) -> None:
        self.named_tool = named_tool
        self.tokenizer = tokenizer
        self.stops = list(stops)
        """Stop strings: text that could still become one is held back, and none goes out."""
        self.completion_id = completion_id
        self.index = index
        self.tools_enabled = tools_enabled
        self.logprobs = logprobs
        self.format = get_format(chat_format)
        self.parser = StreamParser(self.format, tools_enabled)
        self.token_ids: list[int] = []
        self.token_logprobs: list[float] = []
        self.decoder = StreamDecoder(tokenizer, self.format)
        """The text so far, a token's worth of decoding a token."""
        self._started = False

    def push(self, token_ids: Sequence[int], logprobs: Sequence[float],
             top: Sequence[Sequence[tuple[int, float]]] = ()) -> list[ChunkChoice]:
        """New tokens -> the chunk choices they decide (none while text is held back)."""
        self.token_ids += token_ids
        self.token_logprobs += logprobs
        text, stopped = cut_at_stop(self.decoder.push(list(token_ids)), self.stops)
        if not stopped and self.stops:
            text = text[:len(text) - max(partial_suffix(text, s) for s in self.stops)]
        deltas = self._deltas(self.parser.feed(text))
        lps = self._logprobs(token_ids, logprobs, top) if self.logprobs else None
        if not deltas and not lps:
            return []
        return self._chunks(deltas or [Delta()], lps)

    def finish(self, engine_reason: str) -> tuple[list[ChunkChoice], AssistantReply]:
        """The closing chunk choices (what was held back, the finish reason) and the reply."""
        reply = _reply(self.tokenizer, self.token_ids, self.completion_id, self.index, self.tools_enabled,
                       self.format, self.stops)
        rest = self._deltas(self.parser.feed(cut_at_stop(reply.text, self.stops)[0], final=True))
        out = self._chunks(rest) if rest else []
        out += self._chunks([Delta()])
        out[-1].finish_reason = openai_finish(engine_reason, reply, self.named_tool)
        return out, reply

    def _deltas(self, parsed: StreamDelta) -> list[Delta]:
        """The chunks' deltas, as OpenAI streams them: text (content, reasoning) in one, then per
        call its start (index, id, type, name, ``arguments: ""``) in one and each fragment of its
        arguments in one."""
        out = []
        if parsed.content or parsed.reasoning:
            out.append(Delta(content=parsed.content or None, reasoning_content=parsed.reasoning or None))
        for c in parsed.calls:
            if c.name is not None:  # the call's first delta
                call_id = tool_call_id(self.completion_id, self.index, c.index)
                out.append(Delta(tool_calls=[DeltaToolCall(index=c.index, id=call_id, type="function",
                                                           function=DeltaFunction(name=c.name, arguments=""))]))
            if c.arguments:
                out.append(Delta(tool_calls=[DeltaToolCall(index=c.index, function=DeltaFunction(arguments=c.arguments))]))
        return out

    def _logprobs(self, token_ids: Sequence[int], logprobs: Sequence[float],
                  top: Sequence[Sequence[tuple[int, float]]]) -> ChoiceLogprobs | None:
        entries = token_logprobs(self.tokenizer, token_ids, logprobs, top)
        return ChoiceLogprobs(content=entries) if entries else None

    def _chunks(self, deltas: list[Delta], lps: ChoiceLogprobs | None = None) -> list[ChunkChoice]:
        """Chunk choices of ``deltas`` (the log-probs on the first). The stream opens as OpenAI's
        does: a text reply with ``{"role": "assistant", "content": ""}`` on a chunk of its own, a
        reply that begins with a call with ``role`` and ``content: null`` on the call's first delta."""
        out = []
        if not self._started:
            self._started = True
            if deltas[0].tool_calls is not None:
                deltas[0].role = "assistant"
            else:
                out.append(ChunkChoice(index=self.index, delta=Delta(role="assistant", content="")))
        out += [ChunkChoice(index=self.index, delta=d, logprobs=lps if k == 0 else None) for k, d in enumerate(deltas)]
        return out
