"""The public entry point: `LLM(...)`, `generate`, `chat`, `stats`, `shutdown`."""

from __future__ import annotations

import numbers
import os
import sys
from dataclasses import replace
from typing import Sequence

from shoal.config import EngineConfig
from shoal.connectors.base import ConnectorConfig, ConnectorError
from shoal.driver import Driver, EngineLike, RequestHandle
from shoal.engine.engine import Engine
from shoal.request import NewRequest, RequestOutput
from shoal.sampling import SamplingParams

Prompt = str | Sequence[int]  # text, or token ids used as they are


def pool_connector(kv_pool) -> ConnectorConfig:
    """What `kv_pool=` stands for: a redis:// or rediss:// URL (or a comma-separated list
    of a Redis Cluster's nodes), the built-in redis connector on it; anything else, the
    built-in fs connector on that directory."""
    if not isinstance(kv_pool, (str, os.PathLike)) or not str(kv_pool):
        raise ValueError(f"kv_pool must be a directory path or a redis:// URL, got {kv_pool!r}")
    if isinstance(kv_pool, str) and kv_pool.startswith(("redis://", "rediss://")):
        return ConnectorConfig(name="redis", options={"url": kv_pool})
    return ConnectorConfig(name="fs", options={"root": str(kv_pool)})


class LLM:
    """An inference engine. Keyword arguments are those of `EngineConfig`; `kv_pool=DIR` is
    shorthand for `kv_connector=ConnectorConfig(name="fs", options={"root": DIR})`, and
    `kv_pool="redis://..."` for `ConnectorConfig(name="redis", options={"url": ...})`."""

    def __init__(self, model: str = "smollm2", *, kv_pool: str | None = None, **config):
        if kv_pool is not None and config.get("kv_connector") is not None:
            raise ValueError("give kv_pool or kv_connector, not both")
        if kv_pool is not None:
            config["kv_connector"] = pool_connector(kv_pool)
        self.config = EngineConfig(model=model, **config)  # unknown keywords: TypeError
        if self.config.tp_size > 1 or self.config.dp_size > 1 or self.config.engine_process:
            from shoal.parallel.fleet import Fleet
            self._engine: EngineLike | None = Fleet(self.config)
        else:  # a connector hook that never returns fails the handles instead of hanging
            self._engine = Engine(self.config, on_stuck=lambda message: self._driver.abandon(
                ConnectorError(message)))
        self.tokenizer = self._engine.tokenizer
        self._driver = Driver(self._engine, self._complete)

    @property
    def engine(self):
        """The engine (one rank) or the fleet of rank processes (tp_size or dp_size > 1, or
        engine_process)."""
        if self._engine is None:
            raise RuntimeError("this LLM has been shut down")
        return self._engine

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 cache_salt: str | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order."""
        if _is_one_prompt(prompts):
            prompts = [prompts]
        elif not isinstance(prompts, (list, tuple)):
            raise TypeError("prompts must be a str, a sequence of token ids, or a list of "
                            f"those, got {type(prompts).__name__}")
        params = _per_prompt(sampling, len(prompts))
        handles = self._submit([(p, sp, None) for p, sp in zip(prompts, params)], cache_salt,
                               streams=False)
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(handles), desc="requests", file=sys.stderr, unit="req")
        try:
            outs = []
            for h in handles:
                outs.append(h.result())
                if bar is not None:
                    bar.update(1)
            return outs
        finally:
            if bar is not None:
                bar.close()

    def submit(self, prompt: Prompt, sampling: SamplingParams | None = None,
               request_id: str | None = None, *, cache_salt: str | None = None) -> RequestHandle:
        """Start one request and return at once; the engine runs it in the background.
        The handle has request_id, cancel(), result(timeout=None) and stream()."""
        return self._submit([(prompt, sampling or SamplingParams(), request_id)], cache_salt)[0]

    def _submit(self, items, cache_salt: str | None, streams: bool = True) -> list[RequestHandle]:
        """(prompt, sampling, request_id) items, added to the engine in one go; all are
        validated first (TypeError/ValueError naming the field: nothing is added then)."""
        engine = self.engine  # raises once shut down
        requests = []
        for prompt, sp, rid in items:
            text = prompt if isinstance(prompt, str) else None
            ids = self.tokenizer.encode(prompt) if text is not None else prompt
            new = NewRequest(ids, sp, rid, text, cache_salt)
            new.check_vocab(engine.info.vocab_size)
            if sp is not None and sp.structured_output is not None and not self.tokenizer.is_available:
                raise ValueError("SamplingParams.structured_output needs the model's tokenizer "
                                 "(this checkpoint has none)")
            requests.append(new)
        return self._driver.submit(requests, streams)

    def chat(self, messages_list: Sequence[dict] | Sequence[Sequence[dict]],
             sampling: SamplingParams | Sequence[SamplingParams] | None = None, *,
             cache_salt: str | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Like generate, for conversations (lists of {"role", "content"}) through the model's
        chat template; one conversation or a list of them."""
        if not isinstance(messages_list, (list, tuple)):
            raise TypeError("chat takes a conversation (a list of messages) or a list of "
                            f"conversations, got {type(messages_list).__name__}")
        if messages_list and isinstance(messages_list[0], dict):
            messages_list = [messages_list]
        for messages in messages_list:
            _check_messages(messages)
        ids = [self.tokenizer.apply_chat_template(list(m)) for m in messages_list]
        return self.generate(ids, sampling, cache_salt=cache_salt, use_tqdm=use_tqdm)

    def stats(self) -> dict:
        """Counters summed over ranks, plus "per_rank": one dict of the same keys per rank."""
        s = self._call(lambda engine: engine.stats())
        return s if "per_rank" in s else {**s, "per_rank": [dict(s)]}

    def check_integrity(self) -> None:
        """Block accounting holds on every rank (AssertionError naming what broke)."""
        self._call(lambda engine: engine.check_integrity())

    def shutdown(self) -> None:
        """Cancel what is still running, drain pending KV saves (each gets at most the
        connector's control_grace_sec), stop. Raises the connector's error if that fails."""
        if self._engine is not None:
            self._engine = None
            self._driver.stop()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _call(self, fn):
        """fn(engine) where the engine runs (the driver thread, once it started)."""
        self.engine  # noqa: B018 -- raises once shut down
        return self._driver.call(fn)

    def _complete(self, out: RequestOutput) -> RequestOutput:
        """The engine's output with its text decoded (when a tokenizer exists)."""
        text = self.tokenizer.decode(out.token_ids) if self.tokenizer.is_available else ""
        return replace(out, text=text)


def _is_one_prompt(prompts) -> bool:
    """Text, or token ids (a 1-D array, or a list/tuple starting with an int)."""
    if isinstance(prompts, str) or getattr(prompts, "ndim", None) == 1:
        return True
    return (isinstance(prompts, (list, tuple)) and len(prompts) > 0
            and isinstance(prompts[0], numbers.Integral))


def _check_messages(messages) -> None:
    """A conversation: a list of {"role": str, "content": str} (TypeError naming the problem)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError(f"a conversation must be a non-empty list of messages, got {messages!r:.60}")
    for i, m in enumerate(messages):
        if (not isinstance(m, dict) or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)):
            raise TypeError(f"message {i} must be a dict with str 'role' and 'content', "
                            f"got {m!r:.60}")


def _per_prompt(sampling, n: int) -> list[SamplingParams]:
    if sampling is None:
        return [SamplingParams()] * n
    if isinstance(sampling, SamplingParams):
        return [sampling] * n
    if not isinstance(sampling, (list, tuple)):
        raise TypeError(f"sampling must be a SamplingParams or a list of them, got "
                        f"{type(sampling).__name__}")
    if len(sampling) != n:
        raise ValueError(f"sampling: got {len(sampling)} SamplingParams for {n} prompts")
    return list(sampling)
