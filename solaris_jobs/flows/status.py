"""``solaris status``: the last intervals and what each step left of them, the coverage the interval's requests
met, how fresh the online store is and what it holds, and (given one) the serving client's metrics: what an
operator checks first, from the offline store and the online store alone (no Airflow needed).
"""
from __future__ import annotations

import pandas as pd

from solaris_jobs.core import offline as off
from solaris_jobs.core.contract import TIERS
from solaris_jobs.core.settings import Settings
from solaris_jobs.flows.refresh_steps import STEP_OUTPUT, store, wall_clock
from solaris_jobs.flows.run_summary import step_summary


def status(s: Settings, last: int = 10, now=None, metrics: str | None = None, scan_limit: int = 1_000_000) -> dict:
    """The newest ``last`` intervals (any step done, or materialized), newest first: per step ``done`` or
    ``missing`` with its headline numbers, the report's coverage per tier, the lease holder if a run holds the
    interval now; the online store's newest materialized interval, its age and keys per view; the serving
    client's metrics from ``metrics`` (a Prometheus text file or http(s) endpoint)."""
    from solaris_jobs.online import lease
    from solaris_jobs.online.materialize import materialized_intervals
    from solaris_jobs.online.store_stats import keys_per_view, serving_metrics
    from solaris_jobs.core.events import to_utc
    if last < 1:
        raise ValueError(f"--last {last}: show at least 1 interval")
    now = to_utc(now) if now is not None else wall_clock()
    cfg = store(s)
    done = materialized_intervals(cfg)
    complete = {step: set(off.list_intervals(s.offline, ds, last=last)) for step, ds in STEP_OUTPUT.items()}
    ends = sorted(set(done).union(*complete.values()), reverse=True)[:last]
    intervals = []
    for end in ends:
        row = {"interval_end": end.isoformat(), "steps": {}}
        for step, ds in STEP_OUTPUT.items():
            stats = off.read_stats(s.offline, ds, end) if end in complete[step] else None
            row["steps"][step] = ({"state": "done", **_numbers(step, stats)} if stats is not None
                                  else {"state": "missing"})
        report = off.read_report(s.offline, end)
        start = (done.get(end) or {}).get("interval_start") or (report or {}).get("interval_start")
        if start:
            row["interval_start"] = start
        row["steps"]["report"] = ({"state": "done", **_numbers("report", report)} if report
                                  else {"state": "missing"})
        row["steps"]["materialize"] = ({"state": "done", **_numbers("materialize", done[end])} if end in done
                                       else {"state": "missing"})
        row["complete"] = all(v["state"] == "done" for k, v in row["steps"].items() if k != "report")
        row["lease"] = lease.holder(cfg, end)
        intervals.append(row)
    newest = max(done) if done else None
    out = {"offline": s.offline, "store": cfg.describe(), "now": now.isoformat(), "intervals": intervals,
           "online": {"latest_materialized_end": newest.isoformat() if newest is not None else None,
                      "age_hours": round((now - newest).total_seconds() / 3600, 2) if newest is not None else None,
                      "materialized_intervals": len(done), "keys": keys_per_view(cfg, scan_limit)}}
    if metrics:
        out["serving"] = serving_metrics(metrics)
    return out


def _numbers(step: str, stats: dict) -> dict:
    return {k: v for k, v in step_summary(step, stats).items() if k not in ("step", "interval_start", "interval_end")}


COLUMNS = (("select", "pairs_selected", "selected"), ("embed", "pairs", "embedded"),
           ("aggregate", "users", "agg users"), ("neighbours", "users_with_history", "nbr users"))


def format_status(st: dict) -> str:
    """The status as a terminal table and a few lines."""
    head = ["interval end", *(c[2] for c in COLUMNS), "materialized", *(f"cov {t}" for t in TIERS), "lease"]
    rows = []
    for r in st["intervals"]:
        cells = [r["interval_end"]]
        for step, key, _ in COLUMNS:
            v = r["steps"][step]
            cells.append(str(v.get(key, "-")) if v["state"] == "done" else "MISSING")
        m = r["steps"]["materialize"]
        cells.append(str(m.get("pair_embeddings_written", "yes")) if m["state"] == "done" else "MISSING")
        rep = r["steps"]["report"]
        for t in TIERS:
            v = rep.get(f"coverage_{t}") if rep["state"] == "done" else None
            cells.append("-" if v is None else f"{v:.1%}")
        cells.append(r["lease"] or "")
        rows.append(cells)
    widths = [max(len(x) for x in col) for col in zip(head, *rows)] if rows else [len(h) for h in head]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    lines = [f"offline: {st['offline']}   online store: {st['store']}   now: {st['now']}", "",
             fmt(head), *(fmt(r) for r in rows)]
    if not rows:
        lines.append("(no interval has been refreshed yet)")
    o = st["online"]
    lines += ["", f"online store: newest materialized interval {o['latest_materialized_end'] or 'none'}"
              + (f" ({o['age_hours']} h ago)" if o["age_hours"] is not None else "")
              + f", {o['materialized_intervals']} intervals recorded",
              "keys per view: " + (", ".join(f"{k} {v:,}" for k, v in o["keys"].items())
                                   if o["keys"].get("counted", True) is True
                                   else f"not counted (more than {o['keys']['scan_limit']:,} keys; --scan-limit)")]
    if "serving" in st:
        lines += ["", "serving client:"] + [f"  {k} {v:g}" for k, v in st["serving"].items()]
    return "\n".join(lines)
