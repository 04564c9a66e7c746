"""Calling a connector under the failure policy (SPEC 6; docs/connectors.md, "Deadlines,
cancellation and the failure policy"). Once the connector failed no hook is called (each
call answers a safe value); a hook that raises is fatal, and so is one the watchdog finds
still running after transfer_timeout_sec. Under TP scheduler-side hooks run on the lead
rank only, and every rank gets the answer together with the lead's failure."""

from __future__ import annotations

import logging
from typing import Any, Callable, TypeVar

from shoal.connectors.base import (ConnectorConfig, ConnectorContext, KVCacheRegistration,
                                   RequestView)
from shoal.connectors.registry import resolve_connector
from shoal.connectors.watchdog import HookWatchdog
from shoal.engine.peers import Agreement

log = logging.getLogger(__name__)

T = TypeVar("T")

_KEEP_ALIVE: list = []


def keep_alive(obj: Any) -> None:
    """Keep memory a copy may still touch after a fatal failure referenced for the life of
    the process: never freed or reused (a restart is required anyway)."""
    _KEEP_ALIVE.append(obj)


def is_kept_alive(obj: Any) -> bool:
    return any(o is obj for o in _KEEP_ALIVE)


class ConnectorCalls:
    """The connector's two sides, built from the config, and every call into them."""

    def __init__(self, config: ConnectorConfig, ctx: ConnectorContext,
                 registration: KVCacheRegistration, agreement: Agreement,
                 on_stuck: Callable[[str], None] | None = None):
        scheduler_cls, worker_cls = resolve_connector(config, attention_dp=ctx.num_owners > 1)
        self.config = config
        self.ctx = ctx
        self.agreement = agreement
        self.scheduler = scheduler_cls(config, ctx) if agreement.is_lead else None
        self.worker = worker_cls(config, ctx)
        # both sides take part in partial loads (SPEC 3.1), else loads are whole
        self.partial_loads = bool(scheduler_cls.supports_partial_loads
                                  and worker_cls.supports_partial_loads)
        self.worker.register_kv_caches(registration)
        self.failure: str | None = None  # the first fatal failure: the engine must stop
        # told (from the watchdog's thread) when a hook call blocks: the engine's owner fails
        # what waits on the stuck engine (LLM: its handles; a rank: the process)
        self.on_stuck = on_stuck
        self._watchdog = HookWatchdog(config.transfer_timeout_sec, self._hook_stuck)

    def fail(self, what: str, request_id: str | None = None) -> None:
        """Record a fatal failure (the first one counts); the engine stops at its next step."""
        if self.failure is None:
            about = f", request {request_id}" if request_id else ""
            self.failure = (f"KV connector failure (owner {self.ctx.owner_rank}, rank "
                            f"{self.ctx.rank}{about}): {what}. The engine must be restarted.")
            log.error("%s", self.failure)

    def ask(self, hook: str, call: Callable[[Any], T], safe: T, request_id: str | None = None) -> T:
        """A scheduler-side hook, asked on the lead rank; every rank gets its answer and its
        failure. `safe` is the answer once the connector failed."""
        answer = None
        if self.agreement.is_lead:
            answer = (self._guarded(hook, lambda: call(self.scheduler), safe, request_id),
                      self.failure)
        value, failure = self.agreement.share(answer)
        if failure is not None and self.failure is None:
            self.failure = failure
        return value

    def work(self, hook: str, call: Callable[[Any], T], safe: T = None) -> T:
        """A worker-side hook (on the thread that runs the forward)."""
        return self._guarded(f"worker {hook}", lambda: call(self.worker), safe)

    # the per-layer worker hooks, as the forward calls them (exceptions are fatal, as in `work`)
    def wait_for_layer_load(self, layer_idx: int) -> None:
        self.work("wait_for_layer_load", lambda w: w.wait_for_layer_load(layer_idx))

    def save_kv_layer(self, layer_idx: int) -> None:
        self.work("save_kv_layer", lambda w: w.save_kv_layer(layer_idx))

    def _guarded(self, hook: str, fn: Callable[[], T], safe: T, request_id: str | None = None) -> T:
        if self.failure is not None:
            return safe
        token = self._watchdog.enter(hook)
        try:
            return fn()
        except Exception as e:
            self.fail(f"{hook} raised {type(e).__name__}: {e}", request_id)
            return safe
        finally:
            self._watchdog.leave(token)

    def _hook_stuck(self, hook: str) -> None:
        self.fail(f"{hook} did not return within transfer_timeout_sec="
                  f"{self.config.transfer_timeout_sec:g} (a connector hook must not block)")
        if self.on_stuck is not None:
            self.on_stuck(self.failure)

    def stats(self) -> dict[str, float]:
        return {**(self.scheduler.stats() if self.scheduler else {}), **self.worker.stats()}

    def shutdown(self) -> None:
        self._watchdog.stop()
        if self.failure is not None:
            # a copy may still be running: keep the connector and its memory, wait for nothing
            keep_alive(self)
            return
        self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()


def request_view(req, ctx: ConnectorContext) -> RequestView:
    """What a connector sees of a request (`shoal.request.Request`): its full prompt
    blocks' keys, never its blocks or state."""
    num_full = req.num_prompt_tokens // ctx.block_size
    return RequestView(req.request_id, tuple(req.prompt_token_ids), req.cache_salt,
                       tuple(req.block_keys[:num_full]), ctx.owner_rank)
