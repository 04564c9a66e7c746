"""The KV connector contract (SPEC 3): what a connector sees, and the two roles it plays.

One scheduler-side object per owner decides what moves; one worker-side object per rank
moves the bytes. Metadata flows scheduler -> worker once per step. The engine's
KVTransfers (shoal.engine.transfers) is the only caller of either side.
"""

from __future__ import annotations

import abc
import math
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

LOAD_FAILURE_POLICIES = ("recompute", "fail")
# a worker that cannot tell when its transfers move: the engine's pause between polls
IDLE_PAUSE_SECONDS = 0.0005


class ConnectorError(RuntimeError):
    """A connector failed in a way the engine cannot undo: the fleet must be restarted."""


@dataclass(frozen=True)
class ConnectorConfig:
    """Which connector, with what options. Either a registered `name`, or `module` plus both
    class names (the module is imported in every rank process)."""

    name: str | None = None
    module: str | None = None
    scheduler_class: str | None = None
    worker_class: str | None = None
    options: dict[str, Any] = field(default_factory=dict)  # connector-specific settings
    transfer_timeout_sec: float = 600.0  # a pending load or save must finish within this
    control_grace_sec: float = 60.0  # what a cancel or shutdown still waits for a transfer
    load_failure_policy: str = "recompute"  # "recompute" from the first bad block, or "fail"
    # compute a hit's front while its back loads (SPEC 3.1), where the connector supports
    # partial loads; False: every matched block is loaded before the request computes
    compute_while_loading: bool = True

    def __post_init__(self) -> None:
        by_module = (self.module, self.scheduler_class, self.worker_class)
        if self.name is not None and any(by_module):
            raise ValueError("ConnectorConfig: give either name or module + scheduler_class + "
                             f"worker_class, not both (name={self.name!r}, module={self.module!r})")
        if self.name is None and not all(by_module):
            raise ValueError("ConnectorConfig: give a registered name, or module, scheduler_class "
                             f"and worker_class together (got module={self.module!r}, "
                             f"scheduler_class={self.scheduler_class!r}, "
                             f"worker_class={self.worker_class!r})")
        for fname in ("transfer_timeout_sec", "control_grace_sec"):
            v = getattr(self, fname)
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                    or v <= 0):
                raise ValueError(f"ConnectorConfig.{fname} must be a finite number > 0, got {v!r}")
        if self.load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(f"ConnectorConfig.load_failure_policy must be one of "
                             f"{LOAD_FAILURE_POLICIES}, got {self.load_failure_policy!r}")
        if not isinstance(self.compute_while_loading, bool):
            raise ValueError("ConnectorConfig.compute_while_loading must be a bool, got "
                             f"{self.compute_while_loading!r}")
        if not isinstance(self.options, dict):
            raise ValueError(f"ConnectorConfig.options must be a dict, got {type(self.options).__name__}")


@dataclass(frozen=True)
class ConnectorContext:
    """Where a connector object runs."""

    rank: int  # this process's rank in the group
    world_size: int
    owner_rank: int  # the ADP owner whose requests this object serves (0 without ADP)
    num_owners: int  # ADP owners sharing the pool, each with its own requests (1 without ADP)
    shard_rank: int  # TP: which shard of every block this rank holds (0 without TP)
    num_shards: int  # TP: shards each block is split into, one per rank (1 without TP)
    block_size: int  # token slots per block
    namespace: str  # hex of the block-key namespace (model, dtype, block size, layout, TP size)
    device: str  # where the KV cache lives
    block_nbytes: int = 0  # bytes of one block's KV on this rank (0: not known)


@dataclass(frozen=True)
class RequestView:
    """A read-only view of one request."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    cache_salt: str | None
    block_keys: tuple[bytes, ...]  # engine keys of the full prompt blocks
    owner_rank: int


@dataclass(frozen=True)
class RequestData:
    """One request's part of a step."""

    request_id: str
    new_token_ids: tuple[int, ...]  # known ids of the positions scheduled this step
    new_block_ids: tuple[int, ...]  # blocks added since the last report (all, when new)
    computed_position: int  # tokens with KV before this step
    num_scheduled_tokens: int  # positions computed this step (0: e.g. waiting for a load)
    block_keys: tuple[bytes, ...]  # engine keys of the full prompt blocks


@dataclass(frozen=True)
class SchedulerOutput:
    """What one owner's step does, as its connector sees it. Padding never appears."""

    new_requests: tuple[RequestData, ...]  # first report of a request (or after preemption)
    cached_requests: tuple[RequestData, ...]  # requests reported before
    owner_rank: int  # whose local block ids these are (never part of a content key)


@dataclass(frozen=True)
class LoadProgress:
    """How far a partial load (one that lands its last block first) has come. Block indices
    are positions in the request (block i holds tokens [i * block_size, (i + 1) * block_size)).

        blocks     c ........ writes_from ..... landed_from ........ e
                   |- dropped: the engine -|- queued or -|- landed (or failed:
                      computes them           copying      get_failed_loads) -|
    """

    writes_from: int  # no copy of the load writes a block below this index any more
    landed_from: int  # every block of the load at or above this index has landed
    # when (time.monotonic() on this host) the worker saw the load's first block and its
    # latest block land; None: not known (the engine takes its polls' times, which a
    # forward running meanwhile delays); not part of equality
    first_landed_at: float | None = field(default=None, compare=False)
    last_landed_at: float | None = field(default=None, compare=False)
    # when the worker began the load (an I/O thread took its first unit; a store serving
    # loads in turn begins a load queued behind others later than it was asked)
    started_at: float | None = field(default=None, compare=False)


@dataclass(frozen=True)
class KVCacheRegistration:
    """What register_kv_caches receives: the KV tensor and how to read it."""

    tensor: Any  # torch.Tensor [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    layout: Any  # shoal.kv.kv_cache.KVCacheLayout


class KvConnectorScheduler(abc.ABC):
    """Scheduler side: decides what moves. One per owner."""

    supports_attention_dp: ClassVar[bool] = False
    # plans each load last block first and takes `drop_loads` (the worker side must
    # report `get_load_progress` too): the engine then computes a hit's front while its
    # back loads (SPEC 3.1)
    supports_partial_loads: ClassVar[bool] = False

    def __init__(self, config: ConnectorConfig, ctx: ConnectorContext):
        self.config = config
        self.ctx = ctx

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: RequestView,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Prompt tokens beyond `num_computed_tokens` the pool can supply, and whether the load
        is async. No side effects; never covers the last prompt token; (0, True) is an error."""

    @abc.abstractmethod
    def update_state_after_alloc(self, request: RequestView, block_ids: list[int]) -> None:
        """Blocks were allocated for an admitted request (all of its blocks, in order)."""

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """This step's plan (loads and saves). Called every step, also when empty."""

    @abc.abstractmethod
    def request_finished(self, request: RequestView, block_ids: list[int]) -> bool:
        """Once per request, before its blocks are freed. True = an async save still reads them;
        the engine keeps them pinned until the worker reports the save finished."""

    def drop_loads(self, request: RequestView, num_blocks: int) -> None:
        """Only with supports_partial_loads: the engine computes the request's first
        `num_blocks` blocks itself. Drop the blocks of its load below that index that no copy
        has started on (in the next plan); blocks already being copied still land. Called
        after update_state_after_alloc, any number of times, with growing num_blocks."""
        raise NotImplementedError(f"{type(self).__name__} does not support partial loads")

    def get_num_matched_host_tokens(self, request: RequestView) -> int:
        """Of the tokens the last get_num_new_matched_tokens offered `request`, how many the
        worker side probably holds in host memory (they load faster than the store's): the
        engine weighs the two load rates by it when it splits a hit (SPEC 3.1). A guess,
        never a promise; 0 (the default): none, or not known."""
        return 0

    def stats(self) -> dict[str, float]:
        """Counters this side keeps (e.g. pool_lookups); summed into LLM.stats()."""
        return {}

    def shutdown(self) -> None:
        pass


class KvConnectorWorker(abc.ABC):
    """Worker side: moves the bytes. One per rank."""

    supports_attention_dp: ClassVar[bool] = False
    supports_abort: ClassVar[bool] = False
    supports_partial_loads: ClassVar[bool] = False  # reports get_load_progress

    def __init__(self, config: ConnectorConfig, ctx: ConnectorContext):
        self.config = config
        self.ctx = ctx
        self._meta: Any = None

    @abc.abstractmethod
    def register_kv_caches(self, kv_caches: KVCacheRegistration) -> None:
        """Once, before the first step."""

    def bind_connector_meta(self, meta: Any) -> None:
        self._meta = meta

    def get_connector_meta(self) -> Any:
        return self._meta

    def clear_connector_meta(self) -> None:
        self._meta = None

    @abc.abstractmethod
    def start_load_kv(self) -> None:
        """Start this step's loads (a sync load is complete when this returns)."""

    @abc.abstractmethod
    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Before layer `layer_idx` reads its KV."""

    @abc.abstractmethod
    def save_kv_layer(self, layer_idx: int) -> None:
        """After layer `layer_idx` wrote its KV."""

    @abc.abstractmethod
    def wait_for_save(self) -> None:
        """End of the forward: this step's saves are enqueued or done."""

    @abc.abstractmethod
    def get_finished(self, saving_ids: list[str],
                     loading_ids: list[str]) -> tuple[set[str], set[str]]:
        """Cheap, non-blocking poll over the still-pending ids: (finished_saving,
        finished_loading). Report an id only once every copy touching its blocks is done."""

    def get_failed_loads(self) -> dict[str, int]:
        """Finished loads that produced nothing usable: request id -> index (in the request's
        blocks) of the first block that must be recomputed. Each failure is reported once."""
        return {}

    def get_load_progress(self, loading_ids: list[str]) -> dict[str, LoadProgress]:
        """Only with supports_partial_loads: cheap, non-blocking; the progress of each of
        these still-pending loads (also of one reported finished by this poll's
        get_finished: its final progress). A load that is not known is left out."""
        raise NotImplementedError(f"{type(self).__name__} does not support partial loads")

    def wait_for_transfers(self, timeout: float) -> None:
        """Block until a transfer may have moved on (a block landed, a load or a save
        ended) or `timeout` seconds passed; the engine calls it between steps that have
        nothing to compute and only wait for transfers, so it polls when something changed
        rather than on a timer. May return early. The default pauses IDLE_PAUSE_SECONDS (at
        most `timeout`): override it where the worker can tell when a transfer moves."""
        time.sleep(min(timeout, IDLE_PAUSE_SECONDS))

    def abort(self, request_ids: list[str]) -> None:
        """Only with supports_abort: give up these requests' pending transfers (their deadline
        passed). When it returns no copy touches their blocks any more, and get_finished /
        get_failed_loads never report them."""
        raise NotImplementedError(f"{type(self).__name__} does not support abort")

    def stats(self) -> dict[str, float]:
        """Counters this side keeps (e.g. bytes_loaded); summed into LLM.stats()."""
        return {}

    def shutdown(self) -> None:
        pass
