"""What the refresh's Spark steps share: the interval, the clock their outputs are stamped with, publication, the
caches a step holds, and the models an interval's steps use."""
from __future__ import annotations

import functools
import logging
from dataclasses import replace
from typing import Callable

import pandas as pd

from solaris_jobs.core import offline as off
from solaris_jobs.core.events import to_utc
from solaris_jobs.core.settings import PrecomputeConfig, Settings
from solaris_jobs.pipeline import model_refs

logger = logging.getLogger(__name__)

Clock = Callable[[], pd.Timestamp]


def wall_clock() -> pd.Timestamp:
    return pd.Timestamp.now(tz="UTC")


def interval(start, end) -> tuple[pd.Timestamp, pd.Timestamp]:
    """The interval as UTC timestamps (naive times are UTC).

    Raises:
        ValueError: ``end`` is not after ``start``.
    """
    start, end = to_utc(start), to_utc(end)
    if end <= start:
        raise ValueError(f"interval end {end.isoformat()} is not after its start {start.isoformat()}")
    return start, end


def publish(staged: off.Staged, stats: dict, clock: Clock | None) -> str:
    """Publishes a staged output with its stats and ``written_at``, both at the clock's now."""
    now = (clock or wall_clock)()
    return staged.publish({**stats, "written_at": now.isoformat()}, published_at=now)


def models_of_interval(s: Settings, end: pd.Timestamp) -> model_refs.ModelSet:
    """The FM and autoencoder ``embed`` used for this interval (its stats), else those of ``settings.models``."""
    stats = off.read_stats(s.offline, "pair_embeddings", end) or {}
    if "models" in stats:
        return model_refs.ModelSet.from_dict(stats["models"])
    return model_refs.of_settings(s, ("fm", "ae"))


def with_history_len(s: Settings, models: model_refs.ModelSet) -> PrecomputeConfig:
    """The precompute settings with the FM's history length (checked against the configured one)."""
    return replace(s.precompute, history_len=models.check_history_len(s.precompute.history_len))


def releases_caches(step):
    """Gives the step a ``cache(df)`` that caches a DataFrame and unpersists it when the step returns or fails: a
    long-lived Spark (a Spark Connect server the tasks share) would otherwise keep a failed task's caches."""
    @functools.wraps(step)
    def run(spark, s: Settings, start, end, **kw) -> dict:
        held = []

        def cache(df):
            held.append(df.cache())
            return held[-1]
        try:
            return step(spark, s, start, end, cache=cache, **kw)
        finally:
            for df in held:
                try:
                    df.unpersist()
                except Exception:          # the session is gone: nothing is held any more
                    logger.debug("unpersist failed", exc_info=True)
    return run
