"""The built-in Redis / Valkey / Redis Cluster pool connector ("redis";
`LLM(kv_pool="redis://host:port/db")`).

The pool of the fs connector over a network store (store.py: names, publish, checks,
what happens when the store is down), so that processes on many machines share one
pool. The same block keys, header and checksum as the fs pool; TP shards and ADP owners
share it as they share a directory. Options: those of every store (store/base.py:
load_mode, io_threads, max_read_gbps, host_tier_bytes), and

    url             redis://[[user]:password@]host[:port][/db], rediss:// (TLS), or a
                    comma-separated list of a Redis Cluster's nodes (target.py); required
    cluster         True: the one URL is a seed of a Redis Cluster (default: a list is one)
    key_prefix      prefix of every name Shoal writes (default "shoal:")
    ttl_seconds     optional expiry of every block, refreshed when it is loaded (default:
                    none; capacity is then the store's maxmemory with allkeys-lru)
    timeout_s       what one round trip may take, connecting included (default 2.0)
    tls_ca_file     rediss://: the CA certificate to verify the server with
    tls_verify      rediss://: verify the server's certificate (default True)

At bring-up each side pings the store: a wrong or missing password fails it with an
error that says so; a store that cannot be reached is logged and its blocks are misses
until it can be.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from shoal.connectors.base import ConnectorConfig
from shoal.connectors.redis.store import RedisStore, store_errors
from shoal.connectors.redis.target import RedisTarget, parse_target
from shoal.connectors.store.base import BlockStore, PoolOptions, parse_pool_options
from shoal.connectors.store.scheduler import StoreScheduler
from shoal.connectors.store.worker import StoreWorker

log = logging.getLogger(__name__)

OWN_OPTIONS = ("url", "cluster", "key_prefix", "ttl_seconds", "timeout_s", "tls_ca_file",
               "tls_verify")


@dataclass(frozen=True)
class RedisPoolOptions:
    target: RedisTarget
    prefix: str
    ttl_s: int | None
    timeout_s: float
    tls: dict[str, Any]  # the client's ssl_* arguments
    shared: PoolOptions


def redis_options(config: ConnectorConfig, device: str = "cpu") -> RedisPoolOptions:
    """Validate the redis options (ValueError naming the option); nothing is contacted."""
    opts = dict(config.options)
    shared = parse_pool_options("redis", opts, OWN_OPTIONS, device)
    url = opts.get("url")
    if not isinstance(url, str) or not url:
        raise ValueError("redis connector: options['url'] (redis://host:port/db) is required")
    cluster = opts.get("cluster", False)
    if not isinstance(cluster, bool):
        raise ValueError(f"redis connector: cluster must be a bool, got {cluster!r}")
    target = parse_target(url, cluster)
    prefix = opts.get("key_prefix", "shoal:")
    if not isinstance(prefix, str) or not prefix or any(c in prefix for c in "{} \r\n"):
        raise ValueError("redis connector: key_prefix must be a non-empty string without "
                         f"braces or whitespace, got {prefix!r}")
    ttl = opts.get("ttl_seconds")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl <= 0):
        raise ValueError(f"redis connector: ttl_seconds must be a positive integer, got {ttl!r}")
    timeout = opts.get("timeout_s", 2.0)
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout) or timeout <= 0):
        raise ValueError(f"redis connector: timeout_s must be a finite number > 0, got {timeout!r}")
    tls = {}
    if "tls_ca_file" in opts or "tls_verify" in opts:
        if not target.use_tls:
            raise ValueError("redis connector: tls_ca_file and tls_verify need a rediss:// url")
        verify = opts.get("tls_verify", True)
        if not isinstance(verify, bool):
            raise ValueError(f"redis connector: tls_verify must be a bool, got {verify!r}")
        tls["ssl_cert_reqs"] = "required" if verify else "none"
        if not verify:
            tls["ssl_check_hostname"] = False
        if opts.get("tls_ca_file") is not None:
            tls["ssl_ca_certs"] = str(opts["tls_ca_file"])
    return RedisPoolOptions(target, prefix, ttl, float(timeout), tls, shared)


def open_redis_pool(config: ConnectorConfig, device: str = "cpu") -> tuple[RedisStore, PoolOptions]:
    """The store the options name, pinged: ValueError if it refuses our credentials (a
    configuration error); a warning if it cannot be reached (misses until it can)."""
    import redis
    opts = redis_options(config, device)
    threads = opts.shared.io_threads
    store = RedisStore(opts.target, opts.prefix, opts.timeout_s, opts.ttl_s,
                       max_connections=2 * threads + 2, tls_options=opts.tls)
    try:
        store.ping()
    except redis.exceptions.AuthenticationError as e:
        store.close()
        raise ValueError(f"redis connector: {opts.target.display} refused the credentials "
                         f"(password from the url or SHOAL_REDIS_PASSWORD): {e}") from None
    except (redis.exceptions.ResponseError,) as e:
        store.close()
        raise ValueError(f"redis connector: {opts.target.display} refused the connection: "
                         f"{e}") from None
    except store_errors() as e:
        log.warning("redis pool %s cannot be reached (%s: %s): every block is a miss until "
                    "it can", opts.target.display, type(e).__name__, e)
    return store, opts.shared


class RedisPoolScheduler(StoreScheduler):
    @classmethod
    def open_store(cls, config: ConnectorConfig, device: str) -> tuple[BlockStore, PoolOptions]:
        return open_redis_pool(config, device)


class RedisPoolWorker(StoreWorker):
    @classmethod
    def open_store(cls, config: ConnectorConfig, device: str) -> tuple[BlockStore, PoolOptions]:
        return open_redis_pool(config, device)
