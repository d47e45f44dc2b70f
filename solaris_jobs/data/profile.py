"""What an event log offers SOLARIS, before an hours-long evaluation (``solaris data profile PATH``).

SOLARIS pays where the pairs a ranker scores come back: a pair ranked before a refresh can be embedded by it and
served until its TTL. The profile measures that on the log itself, with no model:

- **pair-coverage ceiling** at a cadence, a TTL and a pool window: the share of rows whose pair was ranked in the
  window before some refresh that is still fresh at the row (refreshes every ``cadence`` from the log's first
  hour; a refresh at R embeds the pairs ranked in ``[R - window, R)`` and serves them until ``R + ttl``). No
  selection can serve more rows from the pair tier. Rows of the log's first ``window`` are left out (nothing
  before them);
- **the FM budget that ceiling takes**: the distinct pairs ranked in each refresh's window, summed over the
  refreshes, per row logged in their intervals (1.0 = as many FM inferences as served rows; the evaluated default
  budget is 0.5);
- **24 h pair recurrence**: rows whose pair was ranked for the user in an earlier request of the previous 24 h;
- **gaps between a user's requests** (a request: a ``request_id``, else a distinct time), **next-day return**
  (of the users active on a day, the share active the next day), **labels** (labelled share, positive rate);
- a **verdict** in plain words from fixed thresholds (``VERDICT_RULES``), and rows set aside by the event contract.

All of it is columnar numpy over one read of the log (``user_id``, ``item_id``, ``event_timestamp``, ``label``,
``request_id``); ``benchmarks/data_profile.py`` times it at 10M events.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa

from solaris_jobs.core import events as ev

COLUMNS = ["user_id", "item_id", "event_timestamp", "label", "request_id"]
US = 1_000_000

# Thresholds of the verdict, fixed before any log was profiled with them (their reasons beside each).
VERDICT_RULES = {
    "ceiling_low": 0.10,        # below: the pair tier serves almost nothing (MovieLens: a film is rated once)
    "ceiling_high": 0.40,       # above: the pair tier can carry the transfer (synthetic ad-like traffic: ~0.8)
    "budget_over": 0.5,         # FM inferences per row the ceiling takes, above the evaluated budget
    "positives_low": 0.01,      # under 1% positives: BCE gaps are small and intervals wide
    "labelled_low": 0.5,        # most rows without a label: little to train or test on
    "return_low": 0.2,          # few users back the next day: per-user state is rarely reused
    "events_small": 200_000,    # a small log: the evaluation's intervals will be wide
}


def _duration_us(text: str, name: str) -> int:
    try:
        d = pd.Timedelta(text)
    except ValueError as e:
        raise ValueError(f"{name}: not a duration: {text!r} (e.g. 1h, 30min, 24h)") from e
    if d < pd.Timedelta(seconds=1) or d % pd.Timedelta(seconds=1):
        raise ValueError(f"{name}: must be a positive number of whole seconds, got {text!r}")
    return int(d.value // 1000)


def _pair_ids(u: np.ndarray, i: np.ndarray) -> np.ndarray:
    """A dense id per (user, item) pair."""
    return pd.MultiIndex.from_arrays([u, i]).factorize()[0].astype(np.int64)


def ceiling_and_budget(u: np.ndarray, i: np.ndarray, t_us: np.ndarray, cadence_us: int, ttl_us: int,
                       window_us: int) -> dict:
    """The pair-coverage ceiling (module docstring) and the FM pairs per row it takes, over rows at least
    ``window_us`` after the log's first refresh slot.

    Args:
        u, i, t_us: the rows (any order), times in microseconds.
    """
    n = len(t_us)
    if n == 0:
        return {"rows_counted": 0, "ceiling": None, "pairs_per_row": None, "refreshes": 0}
    origin = int(t_us.min()) // cadence_us * cadence_us          # refreshes at origin + k * cadence
    pid = _pair_ids(u, i)
    order = np.lexsort((t_us, pid))
    p, t = pid[order], t_us[order]
    t_s = t // US                                                 # seconds: a key per pair that stays in int64
    span_s = int(t_s.max() - t_s.min()) + 2
    key = p * span_s + (t_s - t_s.min())
    # The last refresh at or before each row, and the first one still fresh at the row (age < ttl).
    last_r = origin + (t - origin) // cadence_us * cadence_us
    first_fresh = np.maximum(origin + ((t - ttl_us - origin) // cadence_us + 1) * cadence_us, origin)
    # The pair's latest showing strictly before the last refresh (seconds: a showing in the refresh's own second
    # counts after it, since refreshes fall on whole seconds).
    r_s = last_r // US
    j = np.searchsorted(key, p * span_s + (r_s - t_s.min()), side="left") - 1
    ok = j >= 0
    jj = np.where(ok, j, 0)
    ok &= p[jj] == p
    covered = ok & (t[jj] >= first_fresh - window_us) & (last_r > origin)
    counted = t >= origin + window_us
    # Per refresh R, the distinct pairs ranked in [R - window, R): a showing at t is its pair's latest before R for
    # R in (t, t_next]; it counts there while R <= t + window.
    same_next = np.concatenate([p[1:] == p[:-1], [False]])
    t_next = np.where(same_next, np.concatenate([t[1:], [np.iinfo(np.int64).max // 4]]), np.iinfo(np.int64).max // 4)
    upto = np.minimum(t_next, t + window_us)
    k_from = (t - origin) // cadence_us + 1                        # first refresh index after t
    k_to = np.maximum((upto - origin) // cadence_us + 1, k_from)   # first index past min(t_next, t + window)
    n_ref = int((t.max() - origin) // cadence_us) + 1
    diff = np.zeros(n_ref + 2, np.int64)
    np.add.at(diff, np.minimum(k_from, n_ref + 1), 1)
    np.add.at(diff, np.minimum(k_to, n_ref + 1), -1)
    pool = np.cumsum(diff)[:n_ref]                                # pairs in each refresh's window (index k: R_k)
    rows_per = np.bincount((t - origin) // cadence_us, minlength=n_ref)[:n_ref]
    # Every refresh from the window on costs its pool, whether or not rows follow it in its own interval (a pair it
    # embeds may serve rows of the next intervals, within the TTL): FM inferences over the rows of those intervals.
    steady = np.arange(n_ref) * cadence_us >= window_us
    rows = int(rows_per[steady].sum())
    return {"rows_counted": int(counted.sum()),
            "ceiling": float(covered[counted].mean()) if counted.any() else None,
            "pairs_per_row": float(pool[steady].sum() / rows) if rows else None,
            "refreshes": int(steady.sum())}


def request_gaps(u: np.ndarray, t_us: np.ndarray, request_id: np.ndarray | None) -> dict:
    """Gaps between a user's consecutive requests (a request id, else a distinct time)."""
    if request_id is not None:
        first = pd.DataFrame({"u": u, "r": request_id, "t": t_us}).groupby(["u", "r"], sort=False)["t"].min()
        uu, tt = first.index.get_level_values(0).to_numpy(), first.to_numpy()
    else:
        uniq = pd.DataFrame({"u": u, "t": t_us}).drop_duplicates()
        uu, tt = uniq["u"].to_numpy(), uniq["t"].to_numpy()
    order = np.lexsort((tt, uu))
    uu, tt = uu[order], tt[order]
    same = uu[1:] == uu[:-1]
    gaps = np.diff(tt)[same] / 60e6                                # minutes
    if not len(gaps):
        return {"requests": int(len(tt)), "gaps": 0, "median_minutes": None, "within_10min": None,
                "within_1h": None, "within_24h": None}
    return {"requests": int(len(tt)), "gaps": int(len(gaps)), "median_minutes": float(np.median(gaps)),
            "within_10min": float((gaps <= 10).mean()), "within_1h": float((gaps <= 60).mean()),
            "within_24h": float((gaps <= 24 * 60).mean())}


def next_day_return(u: np.ndarray, t_us: np.ndarray) -> float | None:
    """Of the users active on a (UTC) day that has a next day in the log, the share active on the next day."""
    day = t_us // (86_400 * US)
    active = pd.DataFrame({"u": u, "d": day}).drop_duplicates()
    last = day.max()
    base = active[active["d"] < last]
    if base.empty:
        return None
    nxt = pd.MultiIndex.from_arrays([active["u"], active["d"] - 1])
    back = pd.MultiIndex.from_arrays([base["u"], base["d"]]).isin(nxt)
    return float(back.mean())


def profile(root, cadence: str = "1h", ttl: str = "24h", window: str = "24h") -> dict:
    """The profile of the log under ``root`` (module docstring); raises ``DataContractError`` without a log."""
    from solaris_jobs.data.synth import pair_recurrence
    cad, ttl_us, win = _duration_us(cadence, "--cadence"), _duration_us(ttl, "--ttl"), _duration_us(window,
                                                                                                    "--window")
    if ttl_us < cad or win < cad:
        raise ValueError(f"--ttl ({ttl}) and --window ({window}) must be at least the cadence ({cadence}): a refresh's "
                         f"pairs must live until the next one")
    table = ev.read_events(root, columns=COLUMNS)
    bad, reasons = ev.bad_event_rows(table)
    if bad.any():
        table = table.filter(pa.array(~bad))
    n = table.num_rows
    out = {"root": str(root), "events": n + int(bad.sum()), "set_aside": {k: v for k, v in reasons.items() if v},
           "settings": {"cadence": cadence, "ttl": ttl, "window": window}}
    if n == 0:
        out["verdict"] = ["the log holds no usable event"]
        return out
    u = table.column("user_id").to_numpy()
    i = table.column("item_id").to_numpy()
    t = table.column("event_timestamp").cast(pa.int64()).to_numpy()
    label = table.column("label").to_numpy(zero_copy_only=False)
    rid = table.column("request_id")
    rid = rid.to_numpy(zero_copy_only=False) if rid.null_count == 0 else None
    known = ~pd.isna(label)
    rec, rows = pair_recurrence(table.select(["user_id", "item_id", "event_timestamp"]))
    out.update({
        "users": int(len(np.unique(u))), "items": int(len(np.unique(i))),
        "first": pd.Timestamp(int(t.min()), unit="us", tz="UTC").isoformat(),
        "last": pd.Timestamp(int(t.max()), unit="us", tz="UTC").isoformat(),
        "days": round((int(t.max()) - int(t.min())) / (86_400 * US), 2),
        "labelled_share": float(known.mean()),
        "positive_rate": float(np.asarray(label[known], np.float64).mean()) if known.any() else None,
        "pair_recurrence_24h": rec / rows,
        "pair_ceiling": ceiling_and_budget(u, i, t, cad, ttl_us, win),
        "request_gaps": request_gaps(u, t, rid),
        "next_day_return": next_day_return(u, t)})
    out["verdict"] = verdict(out)
    return out


def verdict(p: dict) -> list[str]:
    """Plain words from ``VERDICT_RULES``: what the log offers SOLARIS and what to expect of an evaluation."""
    R, s = VERDICT_RULES, p["settings"]
    c, budget = p["pair_ceiling"]["ceiling"], p["pair_ceiling"]["pairs_per_row"]
    out = []
    if c is None:
        out.append(f"the log is shorter than the pool window ({s['window']}): no pair ceiling")
    elif c < R["ceiling_low"]:
        out.append(f"pairs rarely recur: at most {c:.0%} of rows could be served a precomputed pair (cadence "
                   f"{s['cadence']}, TTL {s['ttl']}): the pair tier cannot help here; distillation (KD) or an FM "
                   f"run online fit this log better")
    elif c < R["ceiling_high"]:
        out.append(f"pairs recur for some rows: at most {c:.0%} of rows could be served a precomputed pair; the "
                   f"fallback tiers decide most rows")
    else:
        out.append(f"pairs recur: up to {c:.0%} of rows could be served a precomputed pair at cadence "
                   f"{s['cadence']} and TTL {s['ttl']}: what SOLARIS is for")
    if c is not None and c >= R["ceiling_low"] and budget is not None and budget > R["budget_over"]:
        out.append(f"embedding every pair ranked in the last {s['window']} takes {budget:.2f} FM inferences per "
                   f"served row at each refresh: a budget of {R['budget_over']} (the evaluated default) reaches "
                   f"part of the ceiling")
    pos, lab = p.get("positive_rate"), p.get("labelled_share", 0.0)
    if lab < R["labelled_low"]:
        out.append(f"only {lab:.0%} of rows carry a label: little to train and test on")
    if pos is not None and pos < R["positives_low"]:
        out.append(f"few positives ({pos:.2%} of labelled rows): BCE differences will be small and intervals wide")
    ret = p.get("next_day_return")
    if ret is not None and ret < R["return_low"]:
        out.append(f"few users come back the next day ({ret:.0%}): per-user state is rarely reused")
    if p["events"] < R["events_small"]:
        out.append(f"a small log ({p['events']:,} events): expect wide intervals")
    return out


def _pct(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1%}"


def format_profile(p: dict) -> str:
    """The profile as a short text table and the verdict."""
    if "users" not in p:
        return "\n".join([f"{p['root']}: {p['events']:,} events", *p["verdict"]])
    c, g, s = p["pair_ceiling"], p["request_gaps"], p["settings"]
    pos = "-" if p["positive_rate"] is None else f"{p['positive_rate']:.2%}"
    lines = [
        f"{p['root']}: {p['events']:,} events, {p['users']:,} users, {p['items']:,} items over {p['days']} days "
        f"({p['first']} .. {p['last']})",
        f"  set aside by the event contract: {p['set_aside'] or 'none'}",
        f"  pair-coverage ceiling (cadence {s['cadence']}, TTL {s['ttl']}, pool window {s['window']}): "
        f"{_pct(c['ceiling'])} of {c['rows_counted']:,} rows",
        f"  FM pairs per served row to reach it: "
        f"{'-' if c['pairs_per_row'] is None else format(c['pairs_per_row'], '.2f')} (over {c['refreshes']} refreshes)",
        f"  24 h pair recurrence: {_pct(p['pair_recurrence_24h'])}",
        f"  requests: {g['requests']:,}; gap to the user's next request: median "
        f"{'-' if g['median_minutes'] is None else format(g['median_minutes'], '.0f')} min, within 10 min "
        f"{_pct(g['within_10min'])}, 1 h {_pct(g['within_1h'])}, 24 h {_pct(g['within_24h'])}",
        f"  next-day return: {_pct(p['next_day_return'])}; labelled: {_pct(p['labelled_share'])}; positives: {pos}",
        "verdict:"] + [f"  - {v}" for v in p["verdict"]]
    return "\n".join(lines)
