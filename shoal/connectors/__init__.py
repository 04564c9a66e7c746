"""KV connectors: the contract (base), the registry and the built-in filesystem pool."""

from shoal.connectors.base import (ConnectorConfig, ConnectorContext, ConnectorError,
                                   KVCacheRegistration, LoadProgress,
                                   KvConnectorScheduler, KvConnectorWorker, RequestData,
                                   RequestView, SchedulerOutput)
from shoal.connectors.registry import register_connector, resolve_connector

__all__ = ["ConnectorConfig", "ConnectorContext", "ConnectorError", "KVCacheRegistration", "KvConnectorScheduler",
           "KvConnectorWorker", "LoadProgress", "RequestData", "RequestView", "SchedulerOutput",
           "register_connector", "resolve_connector"]
