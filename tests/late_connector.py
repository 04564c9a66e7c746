"""A test connector: an in-memory pool whose transfers finish N polls late.

Copies happen when a transfer *completes*, not when it starts, the way a DMA engine
would write late: if the engine freed or reused a block while its transfer was pending,
the wrong bytes would move and the outputs would differ from a run without a connector.
Every hook call is recorded, in order, for the hook-order tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shoal.connectors import KvConnectorScheduler, KvConnectorWorker

STORE: dict[bytes, torch.Tensor] = {}  # key -> block bytes, shared by both sides
CALLS: list[tuple[str, str]] = []  # (side, hook) in call order
PENDING: dict[str, set[int]] = {}  # rid -> block ids a pending transfer touches


def reset() -> None:
    STORE.clear()
    CALLS.clear()
    PENDING.clear()


@dataclass
class Meta:
    loads: list[tuple[str, int, bytes]] = field(default_factory=list)  # (rid, block_id, key)
    saves: list[tuple[str, int, bytes]] = field(default_factory=list)


class LateScheduler(KvConnectorScheduler):
    supports_attention_dp = True

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self._matched: dict[str, tuple[int, int]] = {}
        self._loads: list[tuple[str, int, bytes]] = []
        self._blocks: dict[str, list[int]] = {}
        self._checked: dict[str, int] = {}
        self._saved_any: set[str] = set()
        self._scheduled: set[bytes] = set()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        CALLS.append(("scheduler", "get_num_new_matched_tokens"))
        bs = self.ctx.block_size
        first, last = num_computed_tokens // bs, (len(request.prompt_token_ids) - 1) // bs
        n = 0
        while first + n < min(last, len(request.block_keys)) and request.block_keys[first + n] in STORE:
            n += 1
        if n:
            self._matched[request.request_id] = (first, n)
        return n * bs, n > 0

    def update_state_after_alloc(self, request, block_ids):
        CALLS.append(("scheduler", "update_state_after_alloc"))
        first, n = self._matched.pop(request.request_id, (0, 0))
        self._loads += [(request.request_id, block_ids[i], request.block_keys[i])
                        for i in range(first, first + n)]

    def build_connector_meta(self, scheduler_output):
        CALLS.append(("scheduler", "build_connector_meta"))
        meta = Meta(loads=self._loads)
        self._loads = []
        for rd in scheduler_output.new_requests:
            self._blocks[rd.request_id] = list(rd.new_block_ids)
            self._checked[rd.request_id] = 0
        for rd in scheduler_output.cached_requests:
            self._blocks[rd.request_id].extend(rd.new_block_ids)
        for rd in (*scheduler_output.new_requests, *scheduler_output.cached_requests):
            full = min((rd.computed_position + rd.num_scheduled_tokens) // self.ctx.block_size,
                       len(rd.block_keys))
            for i in range(self._checked[rd.request_id], full):
                key = rd.block_keys[i]
                if key not in STORE and key not in self._scheduled:
                    self._scheduled.add(key)
                    meta.saves.append((rd.request_id, self._blocks[rd.request_id][i], key))
                    self._saved_any.add(rd.request_id)
            self._checked[rd.request_id] = max(self._checked[rd.request_id], full)
        return meta

    def request_finished(self, request, block_ids):
        CALLS.append(("scheduler", "request_finished"))
        self._blocks.pop(request.request_id, None)
        return request.request_id in self._saved_any


class LateWorker(KvConnectorWorker):
    supports_attention_dp = True

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        delay = config.options.get("delay_polls", 3)  # or one per rank: [rank 0, rank 1, ...]
        self.delay = int(delay[ctx.rank] if isinstance(delay, list) else delay)
        self._loads: dict[str, list[list]] = {}  # rid -> [[polls_left, block_id, key], ...]
        self._saves: dict[str, list[list]] = {}

    def register_kv_caches(self, kv_caches):
        CALLS.append(("worker", "register_kv_caches"))
        self.kv = kv_caches.tensor

    def bind_connector_meta(self, meta):
        CALLS.append(("worker", "bind_connector_meta"))
        super().bind_connector_meta(meta)

    def clear_connector_meta(self):
        CALLS.append(("worker", "clear_connector_meta"))
        super().clear_connector_meta()

    def start_load_kv(self):
        CALLS.append(("worker", "start_load_kv"))
        for rid, block_id, key in self.get_connector_meta().loads:
            self._loads.setdefault(rid, []).append([self.delay, block_id, key])
            PENDING.setdefault(rid, set()).add(block_id)

    def wait_for_layer_load(self, layer_idx):
        CALLS.append(("worker", f"wait_for_layer_load:{layer_idx}"))

    def save_kv_layer(self, layer_idx):
        CALLS.append(("worker", f"save_kv_layer:{layer_idx}"))

    def wait_for_save(self):
        CALLS.append(("worker", "wait_for_save"))
        for rid, block_id, key in self.get_connector_meta().saves:
            self._saves.setdefault(rid, []).append([self.delay, block_id, key])
            PENDING.setdefault(rid, set()).add(block_id)

    def get_finished(self, saving_ids, loading_ids):
        CALLS.append(("worker", "get_finished"))
        for pending in (*self._loads.values(), *self._saves.values()):
            for t in pending:
                t[0] -= 1
        done_loading = {rid for rid in loading_ids if rid in self._loads
                        and all(t[0] <= 0 for t in self._loads[rid])}
        for rid in done_loading:
            for _, block_id, key in self._loads.pop(rid):
                self.kv[block_id].copy_(STORE[key])  # the late copy into KV
        # saves of running requests complete too (their copy happens now); a request is
        # reported only once it is finished (in saving_ids) and nothing of it is pending
        for rid, pending in list(self._saves.items()):
            for t in [t for t in pending if t[0] <= 0]:
                STORE[t[2]] = self.kv[t[1]].clone()  # the late copy out of KV
                pending.remove(t)
        done_saving = {rid for rid in saving_ids if not self._saves.get(rid)}
        for rid in done_saving:
            self._saves.pop(rid, None)
        for rid in done_loading | done_saving:
            if rid not in self._loads and not self._saves.get(rid):
                PENDING.pop(rid, None)
        return done_saving, done_loading

    def get_failed_loads(self):
        CALLS.append(("worker", "get_failed_loads"))
        return {}


class NoDpScheduler(LateScheduler):
    """Opts the worker side in only (for the ADP refusal test)."""

    supports_attention_dp = False


class NoDpWorker(LateWorker):
    """Opts the scheduler side in only (for the ADP refusal test)."""

    supports_attention_dp = False
