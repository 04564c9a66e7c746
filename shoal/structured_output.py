"""Structured output: a request's text must match a JSON schema, any JSON object, a regex,
one of a list of strings, or a grammar (Lark; GBNF is converted). Built on llguidance
(chosen over xgrammar and outlines-core by measurement, docs/serving.md): one matcher per
request follows its tokens; for each sample it fills the request's row of a token
bitmask (a bit per vocabulary entry) on the host, ahead of the sample on a worker thread
(`Grammars.prepare`), and the sampler applies the bitmask to
the logits on their device. The mask is computed from tokens the host already has, so it
adds no device sync of its own; the matcher takes each sampled token once it is read.

A grammar never makes a request fail: when no token is allowed (a dead end, or the grammar
is complete and the end-of-sequence token is the only way on), the request's first stop
token is drawn, which ends it ("stop").
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheel of torch comes without Triton: the torch ops run
    triton = None

log = logging.getLogger(__name__)

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_MASK_THREADS = 8  # the executor that fills many requests' masks at once


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match: exactly one of the fields. `json_schema`: a schema (a
    dict, or its JSON text); `json_object`: any JSON object; `regex`; `choice`: exactly one
    of the strings; `grammar`: a Lark grammar (llguidance's dialect) or GBNF (converted)."""

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json_schema, dict):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not all(
                    isinstance(c, str) for c in self.choice) or not self.choice:
                raise ValueError("StructuredOutput.choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json_schema", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"StructuredOutput.{name} must be a str, got {type(value).__name__}")
        if not isinstance(self.json_object, bool):
            raise TypeError(f"StructuredOutput.json_object must be a bool, got {self.json_object!r}")
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("StructuredOutput takes exactly one of json_schema, json_object, "
                             f"regex, choice, grammar (got {', '.join(given) or 'none'})")
        error = _llguidance().LLMatcher.validate_grammar(self.grammar_text())
        if error:
            raise ValueError(f"StructuredOutput.{given[0]} is not valid: {error.strip()}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def grammar_text(self) -> str:
        """The llguidance grammar (ValueError for JSON that is not a schema object)."""
        llg = _llguidance()
        if self.json_schema is not None or self.json_object:
            schema = self.json_schema if self.json_schema is not None else '{"type": "object"}'
            try:
                return llg.LLMatcher.grammar_from_json_schema(schema)
            except ValueError as e:
                raise ValueError(f"StructuredOutput.json_schema is not a JSON object: {e}") from None
        if self.regex is not None:
            return llg.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:  # JSON string literals are Lark string literals
            return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(
                json.dumps(c, ensure_ascii=False) for c in self.choice))
        from llguidance.gbnf_to_lark import any_to_lark
        return llg.LLMatcher.grammar_from_lark(any_to_lark(self.grammar))


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # a dependency of shoal: only a broken install lacks it
        raise ValueError(f"structured output needs the llguidance package ({e})") from None
    return llguidance


class Grammars:
    """The matchers of the requests that asked for structured output, on one engine (each
    TP rank runs its own and they agree: the same tokens in the same order). `tokenizer`:
    a callable returning the model's Hugging Face tokenizer (called at the first use)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer = None
        self._executor = None
        self._matchers: dict[str, object] = {}
        self.num_words = (vocab_size + 31) // 32
        # the last sample's rows: (request ids, their tokens on their way to the host)
        self._unread: tuple[list[str], object] | None = None
        self._ahead: tuple[list[str], Future] | None = None  # (request ids, `prepare`'s masks)
        self._thread: ThreadPoolExecutor | None = None
        self._dropped: list[str] = []  # requests forgotten while the worker was filling

    def _matcher(self, request_id: str, spec: StructuredOutput):
        m = self._matchers.get(request_id)
        if m is None:
            llg = _llguidance()
            if self._tokenizer is None:
                import llguidance.hf
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer(), n_vocab=self.vocab_size,
                    eos_token=self._eos[0] if self._eos else None)
                self._executor = llg.LLExecutor(min(MAX_MASK_THREADS, os.cpu_count() or 1))
            m = self._matchers[request_id] = llg.LLMatcher(self._tokenizer, spec.grammar_text(),
                                                           log_level=0)
        return m

    def bitmask(self, rows) -> torch.Tensor:
        """[len(rows), num_words] int32 on the host: bit t of a row set where token t may
        come next for that request (`rows`: requests with `sampling.structured_output`)."""
        mask = torch.zeros(len(rows), self.num_words, dtype=torch.int32,
                           pin_memory=torch.cuda.is_available())
        matchers = [(self._matcher(r.request_id, r.sampling.structured_output), i)
                    for i, r in enumerate(rows)]
        self._executor.unsafe_compute_mask_ptr(matchers, mask.data_ptr(), self.num_words * 4,
                                               len(rows))
        return mask

    def advance(self, request_ids: list[str], tokens: list[int]) -> None:
        """Each request's matcher takes its sampled token (on the executor's threads, off
        the GIL: the thread that launches the next forward is not held up meanwhile)."""
        taking = [(rid, m, token) for rid, token in zip(request_ids, tokens)
                  if (m := self._matchers.get(rid)) is not None and not m.is_stopped()]
        if not taking:
            return
        taken = self._executor.consume_token_par([(m, token) for _, m, token in taking])
        for (rid, m, token), ok in zip(taking, taken):
            if not ok and token not in self._eos:  # (a dead end's forced stop ends it anyway)
                log.warning("structured output of %s: token %d refused (%s); it ends at its "
                            "next token", rid, token, m.get_error())

    def forget(self, request_id: str) -> None:
        """Drop a request's matcher: now, or once the worker that may be using it is done
        (never waited for here: a request ends while its last masks are being filled)."""
        self._dropped.append(request_id)
        if self._ahead is None or self._ahead[1].done():
            self._drop()

    def _drop(self) -> None:
        for request_id in self._dropped:
            self._matchers.pop(request_id, None)
        self._dropped.clear()

    # -- the next sample's masks, filled ahead on a worker thread --------------------------

    def prepare(self, rows, tokens) -> None:
        """Start the masks of `rows` (requests just sampled; `tokens`: their tokens, a
        `shoal.util.HostCopy` on its way from the device) for the next sample on a worker
        thread: the wait for the copy is the worker's, then the matchers take the tokens and
        the rows' masks are filled. So they are computed while the host launches the next
        forward and the device runs it, not in series with it."""
        self._wait()
        self._unread = ([r.request_id for r in rows], tokens)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="shoal-grammar")
        self._ahead = ([r.request_id for r in rows], self._thread.submit(self._fill, rows))

    def masks(self, rows) -> torch.Tensor:
        """The rows' masks (`bitmask`): those `prepare` filled ahead, the rest (requests
        that were not in the last sample) filled here."""
        ahead_ids = self._ahead[0] if self._ahead is not None else []
        ahead = self._wait()
        if ahead_ids == [r.request_id for r in rows]:  # a decode batch in steady state
            return ahead
        at = {rid: i for i, rid in enumerate(ahead_ids)}
        kept = [j for j, r in enumerate(rows) if r.request_id in at]
        if not kept:
            return self._fill(rows)
        out = torch.empty(len(rows), ahead.shape[1], dtype=ahead.dtype,
                          pin_memory=ahead.is_pinned())
        out[kept] = ahead[[at[rows[j].request_id] for j in kept]]
        new = [j for j, r in enumerate(rows) if r.request_id not in at]
        if new:  # (their matchers have taken no token since: nothing to read back)
            out[new] = self._fill([rows[j] for j in new])
        return out

    def _fill(self, rows) -> torch.Tensor:
        if self._unread is not None:  # the matchers take the last sample's tokens first
            (request_ids, tokens), self._unread = self._unread, None
            self.advance(request_ids, tokens.tolist())
        return self.bitmask(rows)

    def _wait(self) -> torch.Tensor | None:
        ahead, self._ahead = self._ahead, None
        try:
            return None if ahead is None else ahead[1].result()
        finally:
            self._drop()


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, vocab] bool from an [R, words] int32 bitmask (on the bitmask's device)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = torch.ones_like(shifts) << shifts  # made on the device (no host copy); 1 << 31 wraps
    return (bitmask[:, :, None] & bits != 0).flatten(1)[:, :vocab_size]


def mask_logits_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor,
                 stops: torch.Tensor, kernel: bool | None = None) -> None:
    """In place, for each r: every token row `rows[r]` of `logits` [N, vocab] may not take
    (bit clear in `bitmask[r]`) goes to -inf; if none is left above -inf, its stop token
    `stops[r]` gets 0, so it is drawn (the request ends). All on the logits' device; on a
    GPU one kernel launch (the same in torch ops is ~15). `kernel`: the Triton kernel
    (default: on a GPU) or torch ops (its reference; on CPU tensors the kernel runs
    through Triton's interpreter)."""
    if kernel is None:
        kernel = logits.is_cuda and triton is not None
    if kernel:
        vocab = logits.shape[1]
        _mask_kernel[(rows.numel(),)](logits, logits.stride(0), rows, bitmask,
                                      bitmask.stride(0), stops, vocab,
                                      BLOCK=min(4096, triton.next_power_of_2(vocab)))
        return
    sub = logits.index_select(0, rows)
    sub = torch.where(allowed_tokens(bitmask, logits.shape[1]), sub, float("-inf"))
    dead = torch.isinf(sub.max(dim=1).values)
    at = (torch.arange(rows.numel(), device=logits.device), stops)
    sub.index_put_(at, torch.where(dead, 0.0, sub[at]))
    logits.index_copy_(0, rows, sub)


if triton is not None:
    @triton.jit
    def _mask_kernel(logits_ptr, stride, rows_ptr, mask_ptr, mask_stride, stops_ptr, vocab,
                     BLOCK: tl.constexpr):
        r = tl.program_id(0)
        row = logits_ptr + tl.load(rows_ptr + r).to(tl.int64) * stride
        words = mask_ptr + r.to(tl.int64) * mask_stride
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, vocab, BLOCK):
            v = start + tl.arange(0, BLOCK)
            inside = v < vocab
            word = tl.load(words + v // 32, mask=inside, other=0)
            x = tl.load(row + v, mask=inside, other=float("-inf"))
            x = tl.where((word >> (v % 32)) & 1 != 0, x, float("-inf"))
            tl.store(row + v, x, mask=inside)
            best = tl.maximum(best, x.to(tl.float32))
        stop = tl.load(stops_ptr + r)
        tl.store(row + stop, 0.0, mask=tl.max(best, axis=0) == float("-inf"))
