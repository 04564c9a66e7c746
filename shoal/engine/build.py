"""Bring-up of one rank's engine: model and its shard, KV cache sizing, the block-key
namespace, and the connector's transfers. What it discovers comes back as `EngineInfo`."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch

from shoal.config import EngineConfig
from shoal.connectors.base import ConnectorContext, KVCacheRegistration
from shoal.engine.peers import Peers
from shoal.engine.transfers import KVTransfers
from shoal.kv.block_keys import make_namespace
from shoal.kv.kv_cache import KVCache, KVCacheLayout
from shoal.kv.kv_cache_manager import KVCacheManager
from shoal.model.llama import LlamaModel, build_model
from shoal.model.loader import load_model_source
from shoal.model.tokenizer import Tokenizer
from shoal.util import hand_over_the_gil_often

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


def build_engine_parts(config: EngineConfig, peers: Peers,
                       on_stuck: Callable[[str], None] | None = None) -> EngineParts:
    device = torch.device(config.device)
    if device.type == "cuda":
        hand_over_the_gil_often()
    dtype = config.torch_dtype
    source = load_model_source(config.model)
    cfg = source.config
    tokenizer = Tokenizer(source.tokenizer_dir, source.gguf_file, source.checksum)
    model = build_model(source, peers.shard, device, dtype)

    parts, heads, dim = cfg.kv_token_shape(peers.shard.attention_size)
    probe = KVCacheLayout(1, cfg.num_layers, config.block_size, heads, dim, dtype, parts)
    num_blocks = config.num_kv_blocks or max(
        int(config.kv_cache_gb * (1 << 30)) // probe.block_nbytes, 1)
    layout = replace(probe, num_blocks=num_blocks)
    kv_cache = KVCache(layout, device)
    identity = hashlib.blake2b((cfg.to_json() + source.checksum).encode(),
                               digest_size=16).hexdigest()
    # no ADP owner in a key (owners share the pool); TP ranks store shards under shard keys
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
        # the engine's place among its peers (Topology's fields are the context's)
        ctx = ConnectorContext(**asdict(topo), block_size=config.block_size,
                               namespace=namespace.hex(), device=str(device),
                               block_nbytes=layout.block_nbytes)
        transfers = KVTransfers(config.kv_connector, ctx, KVCacheRegistration(kv_cache.tensor, layout),
                                kv_manager.pool, peers.agreement, config.max_num_tokens,
                                on_stuck, model.attention_weight())
    log.info("engine ready: %d KV blocks of %d tokens (%.1f MiB), max_model_len %d", num_blocks,
             config.block_size, num_blocks * layout.block_nbytes / 2**20, max_model_len)
    return EngineParts(model, tokenizer, kv_cache, kv_manager, transfers,
                       frozenset(cfg.eos_token_ids), info)
