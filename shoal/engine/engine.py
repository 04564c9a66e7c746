"""One rank's engine: model, KV cache, scheduler, runner and executor, built from a config."""

from __future__ import annotations

import hashlib
import itertools
import logging
from dataclasses import dataclass

import torch

from shoal.kv.block_keys import make_namespace
from shoal.config import EngineConfig
from shoal.connectors.base import ConnectorContext, ConnectorError, KVCacheRegistration
from shoal.engine.transfers import KEEP_ALIVE, ConnectorManager
from shoal.engine.executor import Executor
from shoal.kv.kv_cache import KVCache, KVCacheLayout
from shoal.kv.kv_cache_manager import KVCacheManager
from shoal.model.llama import LlamaModel, Shard, rope_inv_freq
from shoal.model.loader import load_model_source
from shoal.engine.model_runner import ModelRunner
from shoal.parallel.comm import SINGLE, Comm, ParallelInfo
from shoal.request import Request
from shoal.sampling import SamplingParams
from shoal.engine.scheduler import Scheduler
from shoal.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

STAT_KEYS = (
    "iterations", "forward_passes", "forward_passes_skipped", "control_collectives",
    "pool_lookups", "pool_hit_blocks", "pool_miss_blocks", "connector_tokens_loaded",
    "bytes_loaded", "bytes_saved", "load_seconds", "save_seconds", "corrupt_blocks",
    "load_failures_recomputed", "deadline_expiries", "cancellations",
    "preemptions", "local_prefix_hit_tokens", "prompt_tokens", "generated_tokens",
    "missing_blocks", "save_failures", "blocks_loaded", "blocks_saved", "load_gbps", "save_gbps",
    "kv_blocks_used", "control_seconds", "forward_seconds", "transfers_aborted",
)


@dataclass(frozen=True)
class EngineInfo:
    """What bring-up discovered."""

    num_kv_blocks: int
    block_nbytes: int
    max_model_len: int
    namespace: str  # hex of the block-key namespace


class Engine:
    def __init__(self, config: EngineConfig, info: ParallelInfo = SINGLE, comm: Comm | None = None,
                 fleet_sync=None):
        self.config = config
        self.comm = comm or Comm(info)
        self.device = torch.device(config.device)
        source = load_model_source(config.model)
        self.model_config = source.config
        self.tokenizer = Tokenizer(source.tokenizer_dir, source.gguf_file, source.checksum)
        dtype = config.torch_dtype
        if info.mode == "tp":
            shard = Shard(info.rank, info.tp_size, self.comm.all_reduce_)
        elif info.mode == "adp":
            shard = Shard(info.rank, info.dp_size, self.comm.all_reduce_, self.comm.all_gather_)
        else:
            shard = Shard()
        with torch.device("meta"):
            model = LlamaModel(source.config, shard)
        model = model.to_empty(device=self.device)
        model.tie_weights_if_needed()
        model.inv_freq.copy_(rope_inv_freq(source.config))
        model.load_hf_state_dict(source.weights)
        self.model = model.to(dtype).eval()
        del source.weights

        cfg = source.config
        num_kv_heads = cfg.num_kv_heads // shard.attention_size
        probe = KVCacheLayout(1, cfg.num_layers, config.block_size, num_kv_heads, cfg.head_dim,
                              dtype)
        num_blocks = config.num_kv_blocks or max(
            int(config.kv_cache_gb * (1 << 30)) // probe.block_nbytes, 1)
        layout = KVCacheLayout(num_blocks, cfg.num_layers, config.block_size, num_kv_heads,
                               cfg.head_dim, dtype)
        self.kv_cache = KVCache(layout, self.device)
        identity = hashlib.blake2b((cfg.to_json() + source.checksum).encode(),
                                   digest_size=16).hexdigest()
        # TP ranks share block keys (each stores its shard under a shard key); the ADP owner
        # is never part of a key: owners share the pool
        namespace = make_namespace(identity, dtype, config.block_size, layout.layout_version,
                                   tp_size=shard.size if shard.shards_attention else 1)
        max_model_len = min(config.max_model_len or cfg.max_position_embeddings,
                            cfg.max_position_embeddings)
        self.info = EngineInfo(num_blocks, layout.block_nbytes, max_model_len, namespace.hex())
        self.kv_manager = KVCacheManager(num_blocks, config.block_size, namespace,
                                         config.enable_prefix_caching)
        self.connector = None
        if config.kv_connector is not None:
            self.connector = self._make_connector(config, info, namespace, layout)
        self.scheduler = Scheduler(self.kv_manager, config.max_num_tokens, config.max_batch_size,
                                   max_model_len, self.connector)
        self.executor = Executor(self.scheduler, ModelRunner(self.model, self.kv_cache, self.device),
                                 config.overlap_scheduler, self.connector, fleet_sync)
        self.eos_token_ids = frozenset(cfg.eos_token_ids)
        self._ids = itertools.count()
        self._live: dict[str, Request] = {}  # request id -> request, until it is returned
        self._rejected: list[Request] = []
        self._counts = dict.fromkeys(("prompt_tokens", "generated_tokens",
                                      "local_prefix_hit_tokens"), 0)
        log.info("engine ready: %d KV blocks of %d tokens (%.1f MiB), max_model_len %d",
                 num_blocks, config.block_size, num_blocks * layout.block_nbytes / 2**20,
                 max_model_len)

    def _make_connector(self, config: EngineConfig, info: ParallelInfo, namespace: bytes,
                        layout: KVCacheLayout) -> ConnectorManager:
        """ADP: every owner its own scheduler side and worker over one shared pool. TP: the
        scheduler side on rank 0, a worker per rank (shoal.parallel.agreement)."""
        ctx = ConnectorContext(rank=info.rank, world_size=info.world_size,
                               owner_rank=info.rank if info.mode == "adp" else 0,
                               num_owners=info.dp_size, shard_rank=info.rank if info.mode == "tp" else 0,
                               num_shards=info.tp_size,
                               block_size=config.block_size, namespace=namespace.hex(),
                               device=str(self.device))
        registration = KVCacheRegistration(self.kv_cache.tensor, layout)
        if info.mode == "tp":
            from shoal.parallel.agreement import TpConnectorManager
            return TpConnectorManager(config.kv_connector, ctx, registration,
                                      self.kv_manager.pool, self.comm)
        return ConnectorManager(config.kv_connector, ctx, registration, self.kv_manager.pool)

    def add_request(self, prompt_token_ids: list[int], sampling: SamplingParams,
                    request_id: str | None = None, prompt: str | None = None,
                    cache_salt: str | None = None) -> Request:
        stop = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else self.eos_token_ids)
        req = Request(request_id or f"req-{next(self._ids)}", list(prompt_token_ids), sampling,
                      frozenset(stop), cache_salt=cache_salt, prompt=prompt)
        if req.request_id in self._live:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        error = self.scheduler.add(req)
        if error is not None:
            self.scheduler.finish(req, "error", error)
            self._rejected.append(req)
        self._live[req.request_id] = req
        return req

    def cancel(self, request_id: str) -> None:
        """End a request as "cancelled" (no-op if unknown or already ended). With a pending
        transfer it ends once that drains, within control_grace_sec."""
        req = self._live.get(request_id)
        if req is not None and not req.is_finished:
            if self.executor.cancel(req):
                self._rejected.append(req)  # returned by the next step
        elif self.connector is not None:  # ended; a save of it may still be pending
            self.connector.shorten_deadline(request_id)

    @property
    def has_work(self) -> bool:
        return self.executor.has_work or bool(self._rejected)

    @property
    def failure(self) -> str | None:
        """Why the engine stopped for good (a fatal connector failure), or None."""
        return None if self.connector is None else self.connector.failure

    def step(self) -> list[Request]:
        """One executor step; returns the requests that ended (rejected ones included).
        Raises ConnectorError once the connector failed (and on every later call); under
        ADP the step's all-gather raises it on every owner instead."""
        voted = self.executor.fleet_sync is not None
        if self.failure is not None and not voted:
            raise ConnectorError(self.failure)
        finished, self._rejected = self._rejected, []
        finished += self.executor.step().finished
        if self.failure is not None and not voted:
            raise ConnectorError(self.failure)
        for req in finished:
            self._live.pop(req.request_id, None)
            self._counts["prompt_tokens"] += req.num_prompt_tokens
            self._counts["generated_tokens"] += len(req.output_token_ids)
            self._counts["local_prefix_hit_tokens"] += req.num_local_prefix_tokens or 0
        return finished

    def stats(self) -> dict:
        s = dict.fromkeys(STAT_KEYS, 0)
        s.update(self._counts)
        s["iterations"] = self.executor.num_iterations
        s["forward_passes"] = self.executor.num_forward_passes
        s["forward_passes_skipped"] = s["iterations"] - s["forward_passes"]
        s["preemptions"] = self.scheduler.num_preemptions
        s["cancellations"] = self.scheduler.num_cancellations
        s["control_collectives"] = self.comm.num_control_collectives
        s["control_seconds"] = self.comm.control_seconds
        s["forward_seconds"] = self.executor.forward_seconds
        s["kv_blocks_used"] = sum(b.ref_count > 0 for b in self.kv_manager.pool.blocks)
        if self.connector is not None:
            s.update(self.connector.stats())
        for kind, moved in (("load", "bytes_loaded"), ("save", "bytes_saved")):
            secs = s[f"{kind}_seconds"]  # summed over I/O threads
            s[f"{kind}_gbps"] = s[moved] / secs / 1e9 if secs else 0.0
        return s

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def live_requests(self) -> dict[str, Request]:
        """Requests added and not yet returned by step(), by id."""
        return self._live

    def begin_drain(self) -> None:
        """Cancel every live request; every pending transfer gets at most control_grace_sec."""
        for rid in list(self._live):
            self.cancel(rid)
        if self.connector is not None:
            self.connector.shorten_all_deadlines()

    def drain(self) -> list[Request]:
        """begin_drain, then step until nothing is pending. Returns the requests that ended
        (none after a fatal failure: nothing is waited for then)."""
        if self.failure is not None:
            return []
        self.begin_drain()
        ended = []
        while self.has_work:
            ended += self.step()
        return ended

    def shutdown(self) -> None:
        """Drain, then stop. After a fatal failure nothing is waited for and the KV memory
        stays referenced for the life of the process (a copy may still write it)."""
        if self.failure is None:
            self.drain()
        if self.failure is not None:
            KEEP_ALIVE.append(self.kv_cache)
        self.executor.shutdown(wait=self.failure is None)
        if self.connector is not None:
            self.connector.shutdown()
