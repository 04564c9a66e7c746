"""A fault-injection connector: the real `fs` pool, plus faults chosen in the options.

    options["fault"] = {
        "raise_in": hook name,     # raise InjectedFault from this hook (scheduler or worker)
        "block_in": hook name,     # ... or block in it until RELEASE is set (never, in a rank)
        "rank": r,                 # ... only on this rank (default: every rank)
        "after": n,                # ... after n calls of it went through (default 0)
        "load_polls": n | -1,      # loads start only after n completion polls (-1: never)
        "save_polls": n | -1,      # the same for saves ("rank" limits these too)
    }

A held transfer has not started: it moves nothing until released, so `abort` can drop it
(the fs worker cancels I/O that has not started and waits for I/O in progress).
`NoAbortFaultWorker` is the same worker without abort support.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import replace

from shoal.connectors.fs.connector import FsPoolMeta, FsPoolScheduler, FsPoolWorker
from shoal.connectors.store.load_queue import LoadQueue


class InjectedFault(RuntimeError):
    pass


RELEASE = threading.Event()  # lets a blocked hook return (a test's clean-up)


def _split(config):
    fault = dict(config.options.get("fault", {}))
    options = {k: v for k, v in config.options.items() if k != "fault"}
    return replace(config, options=options), fault


class _Faults:
    def __init__(self, fault: dict, rank: int):
        self.fault = fault
        self.rank = rank
        self.calls: dict[str, int] = {}

    def here(self) -> bool:
        return self.fault.get("rank", self.rank) == self.rank

    def holds(self, kind: str) -> bool:
        return self.fault.get(f"{kind}_polls") is not None and self.here()

    def hook(self, name: str) -> None:
        if name not in (self.fault.get("raise_in"), self.fault.get("block_in")) or not self.here():
            return
        n = self.calls[name] = self.calls.get(name, 0) + 1
        if n <= self.fault.get("after", 0):
            return
        if self.fault.get("block_in") == name:
            RELEASE.wait()
        else:
            raise InjectedFault(f"injected fault in {name}")


class _Faulty:
    """Takes options["fault"] out of the config before the fs class sees it."""

    def __init__(self, config, ctx):
        config, fault = _split(config)
        super().__init__(config, ctx)
        self.faults = _Faults(fault, ctx.rank)


class FaultScheduler(_Faulty, FsPoolScheduler):
    supports_attention_dp = True
    supports_partial_loads = False  # held loads are whole: they bypass the fs load queues

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.faults.hook("get_num_new_matched_tokens")
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, block_ids):
        self.faults.hook("update_state_after_alloc")
        super().update_state_after_alloc(request, block_ids)

    def build_connector_meta(self, scheduler_output):
        self.faults.hook("build_connector_meta")
        return super().build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        self.faults.hook("request_finished")
        return super().request_finished(request, block_ids)


class FaultWorker(_Faulty, FsPoolWorker):
    supports_attention_dp = True
    supports_partial_loads = False

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self._held: list[list] = []  # [polls_left, kind, transfer, placeholder future]

    def _hold(self, kind: str, transfers) -> None:
        polls = self.faults.fault.get(f"{kind}_polls")
        table = self._loads if kind == "load" else self._saves
        for t in transfers:
            placeholder = Future()  # pending: completion polls cannot report the request
            table.setdefault(t.request_id, []).append(placeholder)
            self._held.append([polls, kind, t, placeholder])

    def start_load_kv(self):
        self.faults.hook("start_load_kv")
        meta = self.get_connector_meta()
        if meta is not None and meta.loads and self.faults.holds("load"):
            self._hold("load", meta.loads)
            meta = FsPoolMeta(loads=[], saves=meta.saves)
            self.bind_connector_meta(meta)
        super().start_load_kv()

    def wait_for_layer_load(self, layer_idx):
        self.faults.hook("wait_for_layer_load")

    def save_kv_layer(self, layer_idx):
        self.faults.hook("save_kv_layer")

    def wait_for_save(self):
        self.faults.hook("wait_for_save")
        meta = self.get_connector_meta()
        if meta is not None and meta.saves and self.faults.holds("save"):
            self._hold("save", meta.saves)
            self.bind_connector_meta(FsPoolMeta(loads=meta.loads, saves=[]))
        super().wait_for_save()

    def get_finished(self, saving_ids, loading_ids):
        self.faults.hook("get_finished")
        for held in list(self._held):
            if held[0] < 0:
                continue  # stalled for good
            held[0] -= 1
            if held[0] < 0:
                self._release(held)
        return super().get_finished(saving_ids, loading_ids)

    def _release(self, held) -> None:
        """Start a held transfer for real (its placeholder is replaced by the I/O)."""
        self._held.remove(held)
        _, kind, t, placeholder = held
        table = self._loads if kind == "load" else self._saves
        table[t.request_id].remove(placeholder)
        if kind == "load":  # a queue of its own, its one unit taken as an I/O task takes it
            queue = LoadQueue([[t]], per_block=self._mover is None)
            table[t.request_id].append(self._io.submit(self._load_blocks, queue.pop(), queue))
        else:  # the late copy out of the KV, started as a step's saves are
            meta = self.get_connector_meta()
            self.bind_connector_meta(FsPoolMeta(saves=[t]))
            FsPoolWorker.wait_for_save(self)
            self.bind_connector_meta(meta)

    def abort(self, request_ids):
        self.faults.hook("abort")
        gone = set(request_ids)
        self._held = [h for h in self._held if h[2].request_id not in gone]
        super().abort(request_ids)


class NoAbortFaultWorker(FaultWorker):
    supports_abort = False
