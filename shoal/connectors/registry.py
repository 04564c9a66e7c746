"""Connectors by name, imported lazily at bring-up."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from shoal.connectors.base import ConnectorConfig, KvConnectorScheduler, KvConnectorWorker


@dataclass(frozen=True)
class ConnectorSpec:
    module: str  # importable in every rank process
    scheduler_class: str
    worker_class: str


_REGISTRY: dict[str, ConnectorSpec] = {}


def register_connector(name: str, module: str, scheduler_class: str, worker_class: str) -> None:
    """Make `ConnectorConfig(name=name)` resolve to module.scheduler_class / worker_class.
    Nothing is imported until a connector of that name is built."""
    existing = _REGISTRY.get(name)
    spec = ConnectorSpec(module, scheduler_class, worker_class)
    if existing is not None and existing != spec:
        raise ValueError(f"connector {name!r} is already registered as {existing}")
    _REGISTRY[name] = spec


def registered_names() -> list[str]:
    return sorted(_REGISTRY)


def resolve_connector(config: ConnectorConfig, attention_dp: bool = False
                      ) -> tuple[type[KvConnectorScheduler], type[KvConnectorWorker]]:
    """The two classes a config names; ValueError naming whatever is missing or wrong, or
    (with `attention_dp`, i.e. dp_size > 1) a class that does not opt in to ADP."""
    if config.name is not None:
        spec = _REGISTRY.get(config.name)
        if spec is None:
            raise ValueError(f"unknown connector name {config.name!r} "
                             f"(registered: {', '.join(registered_names()) or 'none'})")
    else:
        spec = ConnectorSpec(config.module, config.scheduler_class, config.worker_class)
    try:
        module = importlib.import_module(spec.module)
    except ImportError as e:
        raise ValueError(f"connector module {spec.module!r} cannot be imported: {e}") from e
    classes = []
    for attr, base in ((spec.scheduler_class, KvConnectorScheduler),
                       (spec.worker_class, KvConnectorWorker)):
        cls = getattr(module, attr, None)
        if cls is None:
            raise ValueError(f"connector module {spec.module!r} has no class {attr!r}")
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ValueError(f"{spec.module}.{attr} is not a subclass of {base.__name__}")
        if attention_dp and not cls.supports_attention_dp:
            raise ValueError(f"connector class {spec.module}.{attr} does not declare "
                             "supports_attention_dp = True (required with dp_size > 1)")
        classes.append(cls)
    return classes[0], classes[1]


register_connector("fs", "shoal.connectors.fs.connector", "FsPoolScheduler", "FsPoolWorker")
register_connector("redis", "shoal.connectors.redis.connector", "RedisPoolScheduler",
                   "RedisPoolWorker")
