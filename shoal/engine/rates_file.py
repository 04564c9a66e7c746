"""The load planner's measured rates, kept between runs of the same model, device and
connector (a small JSON file each under `$SHOAL_CACHE/rates/`; the newest MAX_RATE_FILES)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path

from shoal.engine.load_split import MAX_SLOWDOWN, RATES, LoadPlanner
from shoal.model.presets import cache_dir

log = logging.getLogger(__name__)

MAX_RATE_FILES = 64  # the newest kept: one per pool directory, and temporary pools come and go
PREFILL_UNIT = "work"  # the prefill rate's unit in a rates file (files before it: tokens)
SECONDS = ("prefill_overhead_s", "prefill_launch_s")  # a planner's plain fields (at most 1 s)


def rates_path(config, ctx) -> Path:
    """Where the rates of engines of this model, device and connector (its options, the
    pool's directory among them; a ConnectorConfig and a ConnectorContext) are kept."""
    what = json.dumps([ctx.namespace, ctx.device, ctx.num_owners, config.name, config.module,
                       config.scheduler_class, config.worker_class,
                       sorted((k, repr(v)) for k, v in config.options.items())])
    return cache_dir() / "rates" / f"{hashlib.sha256(what.encode()).hexdigest()[:32]}.json"


def save_rates(planner: LoadPlanner, path: Path) -> None:
    """Keep the planner's measured rates for the next engine of the same model and pool."""
    rates = {name: getattr(planner, name).value for name in RATES}
    if all(v is None for v in rates.values()):
        return
    rates.update({name: getattr(planner, name) for name in SECONDS}, prefill_unit=PREFILL_UNIT)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(rates))
        os.replace(tmp, path)
        _prune(path.parent)
    except OSError as e:  # a cache that cannot be written costs a start-up, nothing more
        log.debug("rates not saved to %s: %s", path, e)


def restore_rates(planner: LoadPlanner, path: Path) -> None:
    """Start the planner from a previous engine's rates (none, or unreadable: measure anew)."""
    try:
        rates = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(rates, dict):
        return
    # a prefill rate (and its seconds) counted in another unit is measured anew, and so are
    # load rates from before a split's load stopped teaching them (its slowed rate)
    same_unit = rates.get("prefill_unit") == PREFILL_UNIT
    stale = {"prefill_tps"} if not same_unit else set()
    if "load_slowdown" not in rates:
        stale |= {"load_tps", "load_latency_s", "host_load_tps", "host_load_latency_s"}
    numbers = {name: value for name, value in rates.items()
               if isinstance(value, (int, float)) and not isinstance(value, bool)}
    for name in (n for n in RATES if n in numbers and n not in stale):
        value = numbers[name]
        if name.endswith("_slowdown"):  # a ratio: from 1 (none) to the most counted
            value = min(max(value, 1.0), MAX_SLOWDOWN) if math.isfinite(value) else 1.0
        getattr(planner, name).add(float(value))
    for name in (n for n in SECONDS if n in numbers and same_unit):
        setattr(planner, name, min(max(float(numbers[name]), 0.0), 1.0))


def _prune(folder: Path) -> None:
    """Keep the MAX_RATE_FILES newest rate files of `folder`."""
    files = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in files[MAX_RATE_FILES:]:
        old.unlink(missing_ok=True)
