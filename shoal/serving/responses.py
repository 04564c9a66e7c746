"""Response bodies in OpenAI's shapes: whole responses and SSE chunks, for chat
(`chat.completion`, `chat.completion.chunk`) and legacy completions (`text_completion`),
with their logprobs (chat: `content` items with `top_logprobs`; legacy: tokens,
token_logprobs, top_logprobs, text_offset)."""

from __future__ import annotations

import time

from shoal.model.tokenizer import Tokenizer
from shoal.serving.generation import Choice, Delta


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

    def usage_chunk(self, usage) -> dict:
        return self._envelope(self.chunk_object, choices=[], usage=usage.body())

    def first_chunk(self, choice: Choice) -> dict | None:
        return None


class ChatFormat(ResponseFormat):
    chunk_object = "chat.completion.chunk"

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
        return self._envelope("chat.completion", choices=[{
            "index": c.index, "message": {"role": "assistant", "content": text},
            "logprobs": self._logprobs(c.logprobs), "finish_reason": c.finish_reason}
            for c, text in results], usage=usage.body(), system_fingerprint=None)

    def first_chunk(self, choice: Choice) -> dict:
        return self._envelope(self.chunk_object, choices=[{
            "index": choice.index, "delta": {"role": "assistant", "content": ""},
            "logprobs": None, "finish_reason": None}])

    def chunk(self, d: Delta) -> dict:
        delta = {"content": d.text} if d.text or d.finish_reason is None else {}
        return self._envelope(self.chunk_object, choices=[{
            "index": d.choice.index, "delta": delta,
            "logprobs": self._logprobs(d.logprobs) if d.logprobs else None,
            "finish_reason": d.finish_reason}])


class CompletionFormat(ResponseFormat):
    chunk_object = "text_completion"

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
        return self._envelope("text_completion", choices=[{
            "index": c.index, "text": text, "logprobs": self._logprobs(c, c.logprobs),
            "finish_reason": c.finish_reason} for c, text in results], usage=usage.body())

    def chunk(self, d: Delta) -> dict:
        return self._envelope(self.chunk_object, choices=[{
            "index": d.choice.index, "text": d.text,
            "logprobs": self._logprobs(d.choice, d.logprobs) if d.logprobs else None,
            "finish_reason": d.finish_reason}])
