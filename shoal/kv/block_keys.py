"""Content identity of KV blocks: chained hashes seeded by a namespace.

    namespace = H(model identity, kv dtype, block size, KV layout version, TP size)
    seed      = H(namespace || cache_salt)
    key_0     = H(seed    || tokens of block 0)
    key_i     = H(key_i-1 || tokens of block i)

Same key, same bytes. Every TP rank computes the same keys and stores its shard under
`shard_key` (pool keys include the shard); keys never include the ADP rank (owners share
the pool). hashlib only: Python's `hash()` is salted per process. docs/design.md, "Blocks
and prefix reuse"; docs/connectors.md, "Under tensor parallelism".
"""

from __future__ import annotations

import hashlib
import struct

import torch


def _h(*parts: bytes) -> bytes:
    return hashlib.sha256(b"".join(parts)).digest()


def make_namespace(model_identity: str, kv_dtype: torch.dtype, block_size: int,
                   layout_version: int, tp_size: int = 1) -> bytes:
    text = (f"shoal-kv|model={model_identity}|dtype={str(kv_dtype)}|block_size={block_size}"
            f"|layout={layout_version}|tp={tp_size}")
    return _h(text.encode())


def shard_namespace(namespace: bytes, tp_rank: int, tp_size: int) -> bytes:
    """The namespace of one TP shard's KV (the namespace itself when there is one shard),
    derived as a shard's pool key is."""
    return shard_key(namespace, tp_rank, tp_size)


def shard_key(key: bytes, tp_rank: int, tp_size: int) -> bytes:
    """The pool key of shard `tp_rank` of a block (the block key itself with one shard)."""
    return key if tp_size == 1 else _h(key, f"|shard={tp_rank}/{tp_size}".encode())


def request_seed(namespace: bytes, cache_salt: str | None) -> bytes:
    return _h(namespace, b"" if cache_salt is None else b"salt:" + cache_salt.encode())


def extend_block_keys(keys: list[bytes], token_ids: list[int], block_size: int,
                      seed: bytes) -> None:
    """Append the keys of every full block of `token_ids` not yet keyed in `keys`."""
    for i in range(len(keys), len(token_ids) // block_size):
        prev = keys[i - 1] if i else seed
        block = token_ids[i * block_size:(i + 1) * block_size]
        keys.append(_h(prev, struct.pack(f"<{block_size}i", *block)))
