"""The public entry point: `LLM(...)`, `generate`, `chat`, `stats`, `shutdown`."""

from __future__ import annotations

import os
import sys
from typing import Sequence

from shoal.config import EngineConfig
from shoal.connectors.base import ConnectorConfig, ConnectorError
from shoal.engine.engine import Engine
from shoal.serving.driver import Driver, RequestHandle
from shoal.request import Request, RequestOutput
from shoal.sampling import SamplingParams

Prompt = str | Sequence[int]  # text, or token ids used as they are


def pool_connector(kv_pool) -> ConnectorConfig:
    """What `kv_pool=DIR` stands for: the built-in fs connector on that directory."""
    if not isinstance(kv_pool, (str, os.PathLike)) or not str(kv_pool):
        raise ValueError(f"kv_pool must be a directory path, got {kv_pool!r}")
    return ConnectorConfig(name="fs", options={"root": str(kv_pool)})


class LLM:
    """An inference engine. Keyword arguments are those of `EngineConfig`; `kv_pool=DIR` is
    shorthand for `kv_connector=ConnectorConfig(name="fs", options={"root": DIR})`."""

    def __init__(self, model: str = "smollm2", *, kv_pool: str | None = None,
                 kv_connector=None, dp_size: int = 1, tp_size: int = 1, block_size: int = 16,
                 max_batch_size: int = 64, max_num_tokens: int = 2048,
                 num_kv_blocks: int | None = None, kv_cache_gb: float = 1.0,
                 max_model_len: int | None = None, overlap_scheduler: bool = True,
                 enable_prefix_caching: bool = True, device: str = "cpu",
                 dtype: str = "float32"):
        if kv_pool is not None and kv_connector is not None:
            raise ValueError("give kv_pool or kv_connector, not both")
        if kv_pool is not None:
            kv_connector = pool_connector(kv_pool)
        self.config = EngineConfig(
            model=model, block_size=block_size, max_batch_size=max_batch_size,
            max_num_tokens=max_num_tokens, num_kv_blocks=num_kv_blocks, kv_cache_gb=kv_cache_gb,
            max_model_len=max_model_len, overlap_scheduler=overlap_scheduler,
            enable_prefix_caching=enable_prefix_caching, device=device, dtype=dtype,
            dp_size=dp_size, tp_size=tp_size, kv_connector=kv_connector)
        if self.config.tp_size > 1 or self.config.dp_size > 1:
            from shoal.parallel.fleet import Fleet
            self._engine: Engine | Fleet | None = Fleet(self.config)
        else:
            self._engine = Engine(self.config)
        self.tokenizer = self._engine.tokenizer
        self._driver = Driver(self._engine, self._output)
        connector = getattr(self._engine, "connector", None)  # one rank: in this process
        if connector is not None:  # a hook that never returns fails the handles, not hangs
            driver = self._driver
            connector.on_stuck = lambda message: driver.abandon(ConnectorError(message))

    @property
    def engine(self):
        """The engine (one rank) or the fleet of rank processes (tp_size > 1)."""
        if self._engine is None:
            raise RuntimeError("this LLM has been shut down")
        return self._engine

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 cache_salt: str | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = _per_prompt(sampling, len(prompts))
        handles = self._submit([(p, sp, None) for p, sp in zip(prompts, params)], cache_salt)
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
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        return self._submit([(prompt, sampling or SamplingParams(), request_id)], cache_salt)[0]

    def _submit(self, items, cache_salt: str | None) -> list[RequestHandle]:
        """(prompt, sampling, request_id) items, added to the engine in one go."""
        self.engine  # noqa: B018 -- raises once shut down
        adds = []
        for prompt, sp, rid in items:
            if isinstance(prompt, str):
                ids, text = self.tokenizer.encode(prompt), prompt
            else:
                ids, text = list(prompt), None
            adds.append(lambda engine, ids=ids, sp=sp, rid=rid, text=text: engine.add_request(
                ids, sp, request_id=rid, prompt=text, cache_salt=cache_salt))
        return self._driver.submit(adds)

    def chat(self, messages_list: Sequence[dict] | Sequence[Sequence[dict]],
             sampling: SamplingParams | Sequence[SamplingParams] | None = None, *,
             cache_salt: str | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Like generate, for conversations (lists of {"role", "content"}) through the model's
        chat template; one conversation or a list of them."""
        if messages_list and isinstance(messages_list[0], dict):
            messages_list = [messages_list]
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
            engine, self._engine = self._engine, None
            self._driver.stop()
            del engine

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _call(self, fn):
        """fn(engine) where the engine runs (the driver thread, once it started)."""
        self.engine  # noqa: B018 -- raises once shut down
        return self._driver.call(fn)

    def _output(self, req: Request) -> RequestOutput:
        return to_output(req, self.tokenizer)


def to_output(req: Request, tokenizer) -> RequestOutput:
    """The user-facing result of a finished request (text decoded when a tokenizer exists)."""
    return RequestOutput(
        request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
        text=tokenizer.decode(req.output_token_ids) if tokenizer.is_available else "",
        token_ids=list(req.output_token_ids), finish_reason=req.finish_reason, error=req.error,
        metrics=req.metrics, num_local_prefix_tokens=req.num_local_prefix_tokens or 0,
        num_connector_tokens=req.num_connector_tokens)


def _per_prompt(sampling, n: int) -> list[SamplingParams]:
    if sampling is None:
        return [SamplingParams()] * n
    if isinstance(sampling, SamplingParams):
        return [sampling] * n
    sampling = list(sampling)
    if len(sampling) != n:
        raise ValueError(f"sampling: got {len(sampling)} SamplingParams for {n} prompts")
    return sampling
