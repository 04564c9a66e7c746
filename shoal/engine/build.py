"""Bring-up of one rank's engine: model and its shard, KV cache sizing, the block-key
namespace, and the connector's transfers. What it discovers comes back as `EngineInfo`."""

from __future__ import annotations

import atexit
import gc
import hashlib
import logging
import sys
from dataclasses import dataclass, replace
from typing import Callable

import torch

from shoal.config import EngineConfig
from shoal.connectors.base import ConnectorContext, KVCacheRegistration
from shoal.engine.peers import Peers
from shoal.engine.transfers import KVTransfers
from shoal.kv.block_keys import make_namespace
from shoal.kv.kv_cache import KVCache, KVCacheLayout
from shoal.kv.kv_cache_manager import KVCacheManager
from shoal.model.attention_backend import default_backend
from shoal.model.llama import LlamaModel
from shoal.model.rope import rope_inv_freq
from shoal.model.loader import load_model_source
from shoal.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineInfo:
    """What bring-up discovered."""

    num_kv_blocks: int
    block_nbytes: int
    max_model_len: int
    namespace: str  # hex of the block-key namespace
    vocab_size: int  # prompt token ids must be in [0, vocab_size)


@dataclass
class EngineParts:
    """Everything an engine is made of, built and wired."""

    model: LlamaModel
    tokenizer: Tokenizer
    kv_cache: KVCache
    kv_manager: KVCacheManager
    transfers: KVTransfers | None  # None without a connector
    eos_token_ids: frozenset[int]
    info: EngineInfo


GPU_GIL_SWITCH_SECONDS = 100e-6


def hand_over_the_gil_often() -> None:
    """A GPU engine's host threads (the forward thread of the overlap loop, the pool's I/O
    threads) each hold the GIL briefly between waits that release it; with Python's default
    5 ms switch interval one that wants the GIL back after a wait (a step's tokens arrived,
    a copy ended) can wait up to 5 ms behind a thread running Python, which would be most
    of a decode step. A process running a GPU engine is a server: set for the process."""
    if sys.getswitchinterval() > GPU_GIL_SWITCH_SECONDS:
        sys.setswitchinterval(GPU_GIL_SWITCH_SECONDS)


def freeze_what_was_built() -> None:
    """Collect, then move every object alive now (the model, torch's and the other
    libraries' modules: hundreds of thousands) out of the cyclic collector's reach: the
    collections a step's short-lived objects set off would otherwise scan them all (two
    such passes took 0.46 s of a 0.67 s batch of 256 on a 2-core machine). Unfrozen at
    exit (below), so the interpreter's last collection still finalizes them: Triton's
    bindings report objects left alive then as leaks."""
    gc.collect()
    gc.freeze()


atexit.register(gc.unfreeze)  # a no-op when nothing was frozen


def collect_what_was_shut_down() -> None:
    """After an engine shut down and was let go, when a reference cycle still holds it: its
    objects were frozen with the rest at its bring-up, out of the cyclic collector's reach,
    so the cycle would keep its weights and KV memory for the life of the process (on a
    GPU, each engine a process builds after another would add its own until one no longer
    fits). Collect once with everything thawed (~0.2-0.5 s); freeze the survivors (other
    engines, the libraries) again. An engine no cycle holds is freed when let go."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def _allocate(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Uninitialised storage on `device` for each parameter and buffer on the meta device
    (the weights are loaded next). As Module.to_empty, without its empty_like, whose meta
    implementation loads about half a second of torch's Python into every process."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                module._parameters[name] = torch.nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
    return model


def build_engine_parts(config: EngineConfig, peers: Peers,
                       on_stuck: Callable[[str], None] | None = None) -> EngineParts:
    device = torch.device(config.device)
    if device.type == "cuda":
        hand_over_the_gil_often()
    dtype = config.torch_dtype
    source = load_model_source(config.model)
    cfg = source.config
    tokenizer = Tokenizer(source.tokenizer_dir, source.gguf_file, source.checksum)
    with torch.device("meta"):
        model = LlamaModel(cfg, peers.shard, default_backend(device))
    model = _allocate(model.to_dtype(dtype), device)  # storage allocated once, in its dtype
    model.tie_weights_if_needed()
    model.inv_freq = rope_inv_freq(cfg).to(device)  # float32 whatever the dtype (as transformers)
    model.load_hf_state_dict(source.weights)
    model.eval()
    del source.weights

    parts, heads, dim = cfg.kv_token_shape(peers.shard.attention_size)
    probe = KVCacheLayout(1, cfg.num_layers, config.block_size, heads, dim, dtype, parts)
    num_blocks = config.num_kv_blocks or max(
        int(config.kv_cache_gb * (1 << 30)) // probe.block_nbytes, 1)
    layout = replace(probe, num_blocks=num_blocks)
    kv_cache = KVCache(layout, device)
    identity = hashlib.blake2b((cfg.to_json() + source.checksum).encode(),
                               digest_size=16).hexdigest()
    # TP ranks share block keys (each stores its shard under a shard key); the ADP owner is
    # never part of a key: owners share the pool
    topo = peers.topology
    namespace = make_namespace(identity, dtype, config.block_size, layout.layout_version,
                               tp_size=topo.num_shards)
    max_model_len = min(config.max_model_len or cfg.max_position_embeddings,
                        cfg.max_position_embeddings)
    info = EngineInfo(num_blocks, layout.block_nbytes, max_model_len, namespace.hex(),
                      cfg.vocab_size)
    kv_manager = KVCacheManager(num_blocks, config.block_size, namespace,
                                config.enable_prefix_caching)
    transfers = None
    if config.kv_connector is not None:
        ctx = ConnectorContext(rank=topo.rank, world_size=topo.world_size,
                               owner_rank=topo.owner_rank, num_owners=topo.num_owners,
                               shard_rank=topo.shard_rank, num_shards=topo.num_shards,
                               block_size=config.block_size, namespace=namespace.hex(),
                               device=str(device), block_nbytes=layout.block_nbytes)
        transfers = KVTransfers(config.kv_connector, ctx, KVCacheRegistration(kv_cache.tensor, layout),
                                kv_manager.pool, peers.agreement, config.max_num_tokens,
                                on_stuck, model.attention_weight())
    log.info("engine ready: %d KV blocks of %d tokens (%.1f MiB), max_model_len %d",
             num_blocks, config.block_size, num_blocks * layout.block_nbytes / 2**20,
             max_model_len)
    return EngineParts(model, tokenizer, kv_cache, kv_manager, transfers,
                       frozenset(cfg.eos_token_ids), info)
