"""Engine output -> OpenAI responses: whole completions, and streamed chunks.

Log-probs are the behaviour log-probs the engine recorded (under the tempered, top-p-cut
distribution that sampled each token), one entry per generated token except the end-of-turn
token that closes the message (OpenAI reports no entry for the stop sequence). ``top_logprobs``
is always empty: alternatives are not computed (the request model only accepts 0).

Streaming holds back text that may be the start of a ``<tool_call>`` block: content is sent as
it is decoded up to the first ``<tool_call>``; what follows is parsed when the choice finishes,
and the calls go out in one delta each, followed by any content after them. So the streamed
content adds up to the non-streamed message's content, and calls never leak into it as text.
"""

from __future__ import annotations

from typing import Any, Sequence

from gateway.openai_types import (
    ChatCompletion, Choice, ChoiceLogprobs, ChunkChoice, Delta, DeltaFunction, DeltaToolCall,
    OpenAIFinish, TokenLogprob, Usage,
)
from gateway.toolcalls import AssistantReply, split_action

_OPEN = "<tool_call>"


def openai_finish(engine_reason: str, reply: AssistantReply) -> OpenAIFinish:
    """``length`` when cut by the token limit or aborted (the text is unfinished either way),
    else ``tool_calls`` when the message calls tools, else ``stop``."""
    if engine_reason in ("length", "abort"):
        return "length"
    return "tool_calls" if reply.calls else "stop"


def token_logprobs(tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[float]) -> list[TokenLogprob]:
    """One entry per generated token, the closing end-of-turn token left out (it only ever
    comes last, so leaving it out wherever it is gives the same entries chunk by chunk)."""
    out = []
    for tid, lp in zip(token_ids, logprobs):
        if tid == tokenizer.eos_token_id:
            continue
        text = tokenizer.decode([tid])
        # A token holding part of a multi-byte character decodes to U+FFFD: its bytes are unknown.
        raw = None if "\ufffd" in text else list(text.encode("utf-8"))
        out.append(TokenLogprob(token=text, logprob=float(lp), bytes=raw, top_logprobs=[]))
    return out


def decode(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """Text of generated ids, special tokens (end-of-turn) dropped."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


def chat_completion(tokenizer: Any, completion_id: str, model: str, created: int, prompt_len: int,
                    completions: Sequence[Any], tools_enabled: bool,
                    logprobs: bool) -> tuple[ChatCompletion, list[AssistantReply]]:
    """The response to a non-streamed request, and each choice's reply (for the recorder).
    ``completions`` are engine completions (token_ids, logprobs, finish_reason, version_spans)."""
    choices, replies = [], []
    for i, comp in enumerate(completions):
        reply = split_action(decode(tokenizer, comp.token_ids), completion_id, i, tools_enabled)
        lps = ChoiceLogprobs(content=token_logprobs(tokenizer, comp.token_ids, comp.logprobs)) if logprobs else None
        choices.append(Choice(index=i, message=reply.message(), logprobs=lps,
                              finish_reason=openai_finish(comp.finish_reason, reply)))
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
                 logprobs: bool) -> None:
        self.tokenizer = tokenizer
        self.completion_id = completion_id
        self.index = index
        self.tools_enabled = tools_enabled
        self.logprobs = logprobs
        self.token_ids: list[int] = []
        self.token_logprobs: list[float] = []
        self._sent = 0  # characters of decoded text already sent as content
        self._held = False  # a <tool_call> began: content after it waits for the end
        self._started = False

    def push(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> list[ChunkChoice]:
        """New tokens -> zero or one chunk choice (the first carries ``role``)."""
        self.token_ids += token_ids
        self.token_logprobs += logprobs
        text = decode(self.tokenizer, self.token_ids)
        lps = self._logprobs(token_ids, logprobs) if self.logprobs else None
        content = "" if self._held else self._releasable(text)
        if not content and not lps and self._started:
            return []
        return [self._chunk(Delta(content=content or None), lps)]

    def finish(self, engine_reason: str) -> tuple[list[ChunkChoice], AssistantReply]:
        """The closing chunk choices (held content, tool calls, finish reason) and the reply."""
        text = decode(self.tokenizer, self.token_ids)
        reply = split_action(text, self.completion_id, self.index, self.tools_enabled)
        out: list[ChunkChoice] = []
        rest = (reply.content or "")[self._sent:]
        for k, (cid, call) in enumerate(zip(reply.ids, reply.message().tool_calls or [])):
            fn = DeltaFunction(name=call.function.name, arguments=call.function.arguments)
            out.append(self._chunk(Delta(tool_calls=[DeltaToolCall(index=k, id=cid, type="function", function=fn)])))
        if rest:
            out.append(self._chunk(Delta(content=rest)))
        out.append(self._chunk(Delta(), finish=openai_finish(engine_reason, reply)))
        return out, reply

    def _releasable(self, text: str) -> str:
        """Text that can go out now: up to a <tool_call> (holding back a partial tag at the end
        and an undecoded partial character)."""
        text = text.rstrip("\ufffd")
        if self.tools_enabled:
            cut = text.find(_OPEN, self._sent)
            if cut >= 0:
                self._held = True
                text = text[:cut]
            else:
                text = text[:len(text) - _partial_tag(text)]
        new, self._sent = text[self._sent:], max(self._sent, len(text))
        return new

    def _logprobs(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> ChoiceLogprobs | None:
        entries = token_logprobs(self.tokenizer, token_ids, logprobs)
        return ChoiceLogprobs(content=entries) if entries else None

    def _chunk(self, delta: Delta, lps: ChoiceLogprobs | None = None,
               finish: OpenAIFinish | None = None) -> ChunkChoice:
        if not self._started:
            delta.role, self._started = "assistant", True
            delta.content = delta.content or ("" if delta.tool_calls is None else None)
        return ChunkChoice(index=self.index, delta=delta, finish_reason=finish, logprobs=lps)


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of ``text`` that begins ``<tool_call>``."""
    return next((n for n in range(min(len(_OPEN) - 1, len(text)), 0, -1) if text.endswith(_OPEN[:n])), 0)
