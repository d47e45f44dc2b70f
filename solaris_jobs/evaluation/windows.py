"""The protocol's windows over what was served: the protocol of a data set, the served rows of a window of it, and
what they measure there: tier coverage (overall and per refresh interval), the pair-coverage ceiling, returning
users, and the FM compute per served row.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from solaris_jobs.core.contract import TIERS
from solaris_jobs.evaluation import metrics
from solaris_jobs.evaluation.config import EvalConfig
from solaris_jobs.evaluation.protocol import Protocol, by_days, by_quantiles


def protocol_of(cfg: EvalConfig, events: pa.Table) -> Protocol:
    """The protocol's dates for the log ``events``: synthetic traffic by days; MovieLens and a user's log at
    quantiles of its times (``cfg.split``), or a user's log at the dates given (``cfg.times``, checked against it)."""
    ts = event_us(events)
    if cfg.dataset == "path" and cfg.times:
        return given_times(cfg.times, ts)
    if cfg.dataset == "path":
        # Dates on whole days for a log of a month or more, else on whole hours.
        floor = "D" if ts.max() - ts.min() >= 30 * 86_400 * 10**6 else "h"
        try:
            return by_quantiles(ts, *cfg.split, floor=floor)
        except ValueError as e:
            raise ValueError(f"--split {cfg.split}: the log's quantiles give no room for every period ({e}); give "
                             f"--times t0,t1,t2,t3 or other --split quantiles") from e
    if cfg.dataset == "movielens":
        return by_quantiles(ts, *cfg.split)
    first = pd.Timestamp(int(ts.min()), unit="us", tz="UTC")
    return by_days(first, cfg.train_days, cfg.served_days, cfg.test_days, cfg.valid_hours, cfg.fm_valid_hours)


def given_times(times, ts_us: np.ndarray, valid_share: float = 0.5, fm_valid_share: float = 0.125) -> Protocol:
    """The protocol at the given ``(t0, t1, t2, t3)``, checked against the log's event times: in order, inside the
    log, and each of the training, served-training and test periods holding events. The validation slices are as
    ``by_quantiles`` makes them.

    Raises:
        ValueError: naming the date and what is wrong with it.
    """
    from solaris_jobs.core.events import to_utc
    if len(times) != 4:
        raise ValueError(f"--times: four dates t0,t1,t2,t3 are needed, got {len(times)}")
    names = ("t0", "t1", "t2", "t3")
    try:
        t = [to_utc(x) for x in times]
    except ValueError as e:
        raise ValueError(f"--times: {e}") from e
    for (a, x), (b, y) in zip(zip(names, t), zip(names[1:], t[1:])):
        if y <= x:
            raise ValueError(f"--times: {b} ({y.isoformat()}) is not after {a} ({x.isoformat()})")
    first, last = (pd.Timestamp(int(v), unit="us", tz="UTC") for v in (ts_us.min(), ts_us.max()))
    if t[0] > last or t[3] <= first:
        raise ValueError(f"--times: [{t[0].isoformat()}, {t[3].isoformat()}) does not overlap the log "
                         f"({first.isoformat()} .. {last.isoformat()})")
    for name, (a, b) in zip(("training [t0, t1)", "served-training [t1, t2)", "test [t2, t3)"),
                            zip(t, t[1:])):
        if not within(ts_us, a, b).any():
            raise ValueError(f"--times: the {name} period holds no event of the log ({first.isoformat()} .. "
                             f"{last.isoformat()})")
    return Protocol(t[0], t[1], t[2], t[3], (t[2] - (t[2] - t[1]) * valid_share).floor("h"),
                    (t[1] - (t[1] - t[0]) * fm_valid_share).floor("h"))


def event_us(table: pa.Table) -> np.ndarray:
    """A table's ``event_timestamp`` in microseconds."""
    return table.column("event_timestamp").cast(pa.int64()).to_numpy()


def within(ts_us: np.ndarray, start: pd.Timestamp, stop: pd.Timestamp) -> np.ndarray:
    """Which of the times (microseconds) lie in ``[start, stop)``."""
    return (ts_us >= start.value // 1000) & (ts_us < stop.value // 1000)


def ceiling_and_segments(events, protocol: Protocol, served: pa.Table, every: pd.Timedelta) -> dict:
    """Per served row: whether its pair was shown before the last refresh (the pair-coverage ceiling), whether its
    user was seen before t2 (returning).

    Args:
        events: the log (``EventTable``), read over ``[t0, t3)``.
        every: the refresh interval.
    """
    ev = events.table(protocol.t0, protocol.t3, ["user_id", "item_id", "event_timestamp"])
    u = ev.column("user_id").to_numpy()
    t = event_us(ev)
    su = served.column("user_id").to_numpy()
    st = event_us(served)
    ceiling = metrics.pair_ceiling(u, ev.column("item_id").to_numpy(), t, su, served.column("item_id").to_numpy(),
                                   st, protocol.t1.value // 1000, every.value // 1000)
    first_user = pd.Series(t).groupby(u).min()
    returning = first_user.reindex(su).to_numpy() < protocol.t2.value // 1000
    return {"ceiling": ceiling, "returning": returning}


def coverage(served: pa.Table, mask: np.ndarray, extra: dict, protocol: Protocol, every: pd.Timedelta) -> dict:
    """Tier shares (``online.coverage.tier_summary``: the refresh DAG's report uses the same), ages and the ceiling of
    the rows in ``mask``, overall and per refresh interval (``extra``: ``ceiling_and_segments``)."""
    from solaris_jobs.online.coverage import tier_summary
    tier = served.column("tier").to_numpy()[mask]
    age_s = served.column("age_s").to_numpy(zero_copy_only=False)[mask]
    n = int(mask.sum())
    if not n:
        return {"rows": 0}
    summary = tier_summary(tier, age_s)
    shares = summary["coverage"]
    ceil = extra["ceiling"][mask]
    ts = event_us(served)[mask]
    t1_us, step = protocol.t1.value // 1000, every.value // 1000
    slot = (ts - t1_us) // step
    per = []
    for s in np.unique(slot):
        m = slot == s
        per.append({"interval_start": pd.Timestamp(int(t1_us + s * step), unit="us", tz="UTC").isoformat(),
                    "rows": int(m.sum()), **tier_summary(tier[m], age_s[m])["coverage"]})
    # The target's measure: of the rows whose pair had been shown before the last refresh (what a refresh could have
    # embedded from the log), the share served from the pair tier.
    within_ceiling = float((tier[ceil] == 0).mean()) if ceil.any() else None
    return {"rows": n, "shares": shares, "any_tier": 1.0 - shares["none"], "ceiling": float(ceil.mean()),
            "pair_of_ceiling": within_ceiling, "age": summary["age_hours"], "per_interval": per,
            "returning_share": float(extra["returning"][mask].mean())}


def coverage_of_test(events, protocol: Protocol, served: pa.Table, every: pd.Timedelta) -> dict:
    """``coverage`` of the test rows ``[t2, t3)`` without its per-interval part (a curve's point)."""
    extra = ceiling_and_segments(events, protocol, served, every)
    cov = coverage(served, within(event_us(served), protocol.t2, protocol.t3), extra, protocol, every)
    cov.pop("per_interval", None)
    return cov


def fm_per_row(rec: dict, served: pa.Table, protocol: Protocol, derived_out: Path | None) -> dict:
    """FM inferences per served candidate row over the test: pairs embedded by the refreshes whose cutoffs lie in
    [t2, t3), over the rows served in [t2, t3) (running the FM on every served row = 1.0)."""
    rows = int(within(event_us(served), protocol.t2, protocol.t3).sum())
    cut = lambda r: pd.Timestamp(r["cutoff"])
    refreshes = [r for r in rec["refreshes"] if protocol.t2 <= cut(r) < protocol.t3]
    if derived_out is None:
        pairs = sum(r["pairs_embedded"] for r in refreshes)
    else:
        from solaris_jobs.core import offline as off
        pairs = sum((off.read_stats(str(derived_out / "offline"), "pair_embeddings", cut(r)) or {}).get(
            "pairs", 0) for r in refreshes)
    # The neighbour tier's FM user embeddings (history only, no target) are counted apart: every user with history,
    # every refresh (the same for every budget).
    users = sum(r.get("users_embedded", 0) for r in refreshes)
    return {"fm_inferences": int(pairs), "served_rows": rows, "per_row": pairs / rows if rows else None,
            "user_embeddings": int(users), "user_embeddings_per_row": users / rows if rows else None,
            "total_per_row": (pairs + users) / rows if rows else None}


def tier_shares(tier: np.ndarray) -> dict:
    """The share of each tier among the rows served ``tier``."""
    return {name: float((tier == k).mean()) if len(tier) else None for k, name in enumerate(TIERS)}
