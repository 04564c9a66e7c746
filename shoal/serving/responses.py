"""Response bodies in OpenAI's shapes: whole responses and SSE chunks, for chat
(`chat.completion`, `chat.completion.chunk`) and legacy completions (`text_completion`),
with their logprobs (chat: `content` items with `top_logprobs`; legacy: tokens,
token_logprobs, top_logprobs, text_offset)."""

from __future__ import annotations

import time

from shoal.model.tokenizer import Tokenizer
from shoal.serving.generation import Choice, Delta
from shoal.serving.tools import ToolStream, ToolUse


class ResponseFormat:
    chunk_object = ""  # a stream chunk's "object"

    def __init__(self, model_name: str, tokenizer: Tokenizer, rid: str, logprobs: bool):
        self.model_name, self.tokenizer = model_name, tokenizer
        self.rid, self.want_logprobs = rid, logprobs
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # choice index -> text offset so far (legacy)

    def _envelope(self, obj: str, **fields) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created,
                "model": self.model_name, **fields}

    def token_text(self, token_id: int) -> str:
        """A token's text decoded alone (logprobs); "" without a tokenizer."""
        return self.tokenizer.decode([token_id]) if self.tokenizer.is_available else ""

    def prompt_logprobs(self, choice: Choice, k: int | None) -> list | None:
        """vLLM's prompt_logprobs of a choice's prompt: None first, then per token
        {"<id>": {"logprob", "rank", "decoded_token"}} for it and the top k."""
        lps = choice.output.prompt_logprobs if choice.output is not None else None
        if k is None or lps is None:
            return None
        out = [None]
        for token_id, lp in zip(choice.prompt_ids[1:], lps[1:]):
            entry = {str(token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                     "decoded_token": self.token_text(token_id)}}
            for rank, (i, v) in enumerate(lp.top[:k], 1):
                entry.setdefault(str(i), {"logprob": v, "rank": rank,
                                          "decoded_token": self.token_text(i)})
            out.append(entry)
        return out

    def usage_chunk(self, usage) -> dict:
        return self._envelope(self.chunk_object, choices=[], usage=usage.body())

    def first_chunk(self, choice: Choice) -> dict | None:
        return None


class ChatFormat(ResponseFormat):
    """`tools` (a request with tools it may call): calls found in the text become
    `tool_calls` (finish_reason "tool_calls"); streamed, they come in the last delta."""

    chunk_object = "chat.completion.chunk"

    def __init__(self, model_name: str, tokenizer: Tokenizer, rid: str, logprobs: bool,
                 tools: ToolUse | None = None, prompt_logprobs: int | None = None):
        super().__init__(model_name, tokenizer, rid, logprobs)
        self.tools = tools
        self.num_prompt_logprobs = prompt_logprobs
        self._streams: dict[int, ToolStream] = {}

    def _logprobs(self, entries) -> dict | None:
        if not self.want_logprobs:
            return None
        def item(token_id, logprob):
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**item(t, lp.logprob),
                             "top_logprobs": [item(i, v) for i, v in lp.top]}
                            for t, lp in entries]}

    def response(self, results: list[tuple[Choice, str]], usage) -> dict:
        choices = []
        for c, text in results:
            message = {"role": "assistant", "content": text}
            calls = []
            if self.tools is not None:
                message["content"], calls = self.tools.parse(text)
                if calls:
                    message["tool_calls"] = calls
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._logprobs(c.logprobs),
                            "finish_reason": _finish(c.finish_reason, calls)})
        extra = {}
        if self.num_prompt_logprobs is not None and results:  # one prompt: at the top (vLLM's)
            extra["prompt_logprobs"] = self.prompt_logprobs(results[0][0], self.num_prompt_logprobs)
        return self._envelope("chat.completion", choices=choices, usage=usage.body(),
                              system_fingerprint=None, **extra)

    def first_chunk(self, choice: Choice) -> dict:
        return self._envelope(self.chunk_object, choices=[{
            "index": choice.index, "delta": {"role": "assistant", "content": ""},
            "logprobs": None, "finish_reason": None}])

    def chunk(self, d: Delta) -> dict | None:
        """The chunk of a delta (None: nothing to send yet)."""
        text, calls = d.text, []
        if self.tools is not None:
            stream = self._streams.setdefault(d.choice.index, self.tools.stream())
            text = stream.feed(text)
            if d.finish_reason is not None:
                rest, calls = stream.finish()
                text += rest
        if self.tools is not None and not text and d.finish_reason is None and not d.logprobs:
            return None  # held back: a call may be starting
        delta = {"content": text} if text or d.finish_reason is None else {}
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        return self._envelope(self.chunk_object, choices=[{
            "index": d.choice.index, "delta": delta,
            "logprobs": self._logprobs(d.logprobs) if d.logprobs else None,
            "finish_reason": _finish(d.finish_reason, calls)}])


def _finish(reason: str | None, calls: list) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when an answer that ended by itself called."""
    return "tool_calls" if calls and reason == "stop" else reason


class CompletionFormat(ResponseFormat):
    """`echo`: the prompts' texts (by prompt index), put before each answer, with their
    tokens' logprobs when logprobs are asked (the first token has none)."""

    chunk_object = "text_completion"

    def __init__(self, model_name: str, tokenizer: Tokenizer, rid: str, logprobs: bool,
                 num_logprobs: int | None = None, echo: list[str] | None = None,
                 prompt_logprobs: int | None = None):
        super().__init__(model_name, tokenizer, rid, logprobs)
        self.num_logprobs, self.echo = num_logprobs, echo
        self.num_prompt_logprobs = prompt_logprobs

    def _echoed(self, choice: Choice) -> dict | None:
        """The legacy logprobs of the choice's prompt tokens (echo with logprobs)."""
        lps = choice.output.prompt_logprobs if choice.output is not None else None
        if lps is None:
            return None
        tokens = [self.token_text(t) for t in choice.prompt_ids]
        offsets, offset = [], 0
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        self._offsets[choice.index] = offset
        return {"tokens": tokens,
                "token_logprobs": [None] + [lp.logprob for lp in lps[1:]],
                "top_logprobs": [None] + [{self.token_text(i): v for i, v in
                                           lp.top[:self.num_logprobs]} for lp in lps[1:]],
                "text_offset": offsets}

    def _logprobs(self, choice: Choice, entries) -> dict | None:
        if not self.want_logprobs:
            return None
        tokens = [self.token_text(t) for t, _ in entries]
        offset = self._offsets.get(choice.index, 0)
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        self._offsets[choice.index] = offset
        return {"tokens": tokens, "token_logprobs": [lp.logprob for _, lp in entries],
                "top_logprobs": [{self.token_text(i): v for i, v in lp.top} for _, lp in entries],
                "text_offset": offsets}

    def response(self, results: list[tuple[Choice, str]], usage) -> dict:
        choices = []
        for c, text in results:
            logprobs = None
            if self.want_logprobs:
                head = self._echoed(c) if self.echo is not None else None
                logprobs = self._logprobs(c, c.logprobs)
                if head is not None:
                    logprobs = {k: head[k] + logprobs[k] for k in logprobs}
            if self.echo is not None:
                text = self.echo[c.prompt_index] + text
            body = {"index": c.index, "text": text, "logprobs": logprobs,
                    "finish_reason": c.finish_reason}
            if self.num_prompt_logprobs is not None:
                body["prompt_logprobs"] = self.prompt_logprobs(c, self.num_prompt_logprobs)
            choices.append(body)
        return self._envelope("text_completion", choices=choices, usage=usage.body())

    def first_chunk(self, choice: Choice) -> dict | None:
        """With echo, the prompt's text comes first."""
        if self.echo is None:
            return None
        return self._envelope(self.chunk_object, choices=[{
            "index": choice.index, "text": self.echo[choice.prompt_index], "logprobs": None,
            "finish_reason": None}])

    def chunk(self, d: Delta) -> dict:
        return self._envelope(self.chunk_object, choices=[{
            "index": d.choice.index, "text": d.text,
            "logprobs": self._logprobs(d.choice, d.logprobs) if d.logprobs else None,
            "finish_reason": d.finish_reason}])
