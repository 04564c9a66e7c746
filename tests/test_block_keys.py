"""Block keys: chained, namespaced, salted, deterministic across processes."""

from __future__ import annotations

import subprocess
import sys

import torch

from shoal.kv.block_keys import (extend_block_keys, make_namespace, request_seed, shard_key,
                              shard_namespace)

NS = make_namespace("model-x", torch.float32, 4, 1)


def keys(tokens, ns=NS, salt=None, block_size=4):
    out: list[bytes] = []
    extend_block_keys(out, tokens, block_size, request_seed(ns, salt))
    return out


def test_only_full_blocks_are_keyed_and_extension_is_incremental():
    tokens = list(range(11))
    assert len(keys(tokens)) == 2
    grown: list[bytes] = []
    seed = request_seed(NS, None)
    extend_block_keys(grown, tokens[:5], 4, seed)
    extend_block_keys(grown, tokens, 4, seed)
    assert grown == keys(tokens)


def test_keys_chain_on_the_whole_prefix():
    a = keys([1, 2, 3, 4, 5, 6, 7, 8])
    b = keys([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different history
    assert keys([1, 2, 3, 4, 5, 6, 7, 9])[0] == a[0]


def test_namespace_and_salt_separate_keys():
    tokens = list(range(8))
    base = keys(tokens)
    assert keys(tokens, salt="tenant-a") != base
    assert keys(tokens, salt="tenant-a") != keys(tokens, salt="tenant-b")
    for other in (make_namespace("model-y", torch.float32, 4, 1),
                  make_namespace("model-x", torch.float16, 4, 1),
                  make_namespace("model-x", torch.float32, 4, 2),
                  make_namespace("model-x", torch.float32, 4, 1, tp_size=2)):
        assert keys(tokens, ns=other) != base


def test_shard_keys_differ_per_shard_and_equal_the_key_with_one_shard():
    ns = make_namespace("model-x", torch.float32, 4, 1, tp_size=2)
    key = keys(list(range(8)), ns=ns)[0]
    assert shard_key(key, 0, 1) == key and shard_namespace(ns, 0, 1) == ns
    shards = {shard_key(key, r, 2) for r in range(2)} | {shard_key(key, r, 3) for r in range(3)}
    assert len(shards) == 5 and key not in shards
    assert shard_namespace(ns, 0, 2) != shard_namespace(ns, 1, 2) != ns


def test_keys_are_identical_in_another_process():
    code = ("import torch; from shoal.kv.block_keys import *; k=[]; "
            "extend_block_keys(k, list(range(40)), 4, request_seed(make_namespace("
            "'model-x', torch.float32, 4, 1), 'salt')); print(b''.join(k).hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""})
    assert out.stdout.strip() == b"".join(keys(list(range(40)), salt="salt")).hex()
