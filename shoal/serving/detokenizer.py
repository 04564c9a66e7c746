"""A choice's text as its tokens arrive: incremental detokenization and stop strings.

Decoding token by token would split multi-byte characters (a byte-level BPE token may hold
half of one) and lose the spaces some tokenizers add only between tokens, so the text is
decoded over a short sliding window (as vLLM does):

    ids        ... | prefix_offset ........ read_offset | new token(s)
    text out       |-- already released --|              |-- released once whole --|

A delta ending in U+FFFD (an incomplete character) waits for the next token. Stop strings
are searched in the decoded text; the match and everything after it are dropped, and the
last len(longest stop) - 1 characters are held back until no stop string can begin there.
"""

from __future__ import annotations

from shoal.model.tokenizer import Tokenizer

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first output (leading spaces)


class TextStream:
    """Text of one choice. Feed tokens with `add`; `take` returns what may be sent now;
    `finish` what is left once the request ended."""

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int], stop: list[str]):
        self._tok = tokenizer if tokenizer is not None and tokenizer.is_available else None
        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._num_context = len(self._ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._searched = 0  # text before this index cannot start a match any more
        self.text = ""  # decoded so far (stop string and what follows removed)
        self.num_released = 0  # characters of `text` handed out by take/finish
        self.num_tokens = 0  # tokens that count for this choice (up to a stop string)
        self.stopped = False  # a stop string matched: later tokens are ignored

    @property
    def token_ids(self) -> list[int]:
        return self._ids[self._num_context:]

    def add(self, token_id: int) -> None:
        if self.stopped:
            return
        self._ids.append(token_id)
        self.num_tokens += 1
        if self._tok is None:
            return
        self.text += self._next_delta()
        if self._stop:
            self._find_stop()

    def take(self) -> str:
        """Text that no later token can change or remove."""
        end = len(self.text) if self.stopped else max(len(self.text) - self._hold, self.num_released)
        delta, self.num_released = self.text[self.num_released:end], end
        return delta

    def finish(self) -> str:
        """The rest of the text once the request ended (the whole decode is the reference:
        trailing bytes that never formed a character are decoded as the full text has them)."""
        if self._tok is not None and not self.stopped:
            full = self._tok.decode(self.token_ids)
            if full.startswith(self.text):
                self.text = full
        delta, self.num_released = self.text[self.num_released:], len(self.text)
        return delta

    def _next_delta(self) -> str:
        decode = self._tok.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset])
        full = decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return full[len(prefix):]
        return ""

    def _find_stop(self) -> None:
        hits = [i for i in (self.text.find(s, self._searched) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
        else:
            self._searched = max(len(self.text) - self._hold, 0)
