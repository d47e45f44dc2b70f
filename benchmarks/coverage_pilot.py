"""The design pilot behind the evaluation's headline TTL and budget: how much of the pair-coverage ceiling an
idealised refresh reaches per FM inference, on a window of the log *before* t1 (no test-period data).

The idealised refresh: every ``--cadence`` hours, the pairs ranked in the last ``--recent-hours`` are ranked by the
time of their latest ranking (most recent first) and the top ``budget x rows per hour`` are embedded; a row is
covered when its pair was embedded at a refresh at or before it (visible at once) and within the pair TTL. The
real replay (``solaris evaluate``) then measures the same through the jobs, the store and the reader.

    .venv/bin/python benchmarks/coverage_pilot.py --data artifacts/eval/data-seq0.5 --from-hour 48 --to-hour 72

Prints a table and writes ``benchmarks/results/coverage_pilot.json``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from solaris_jobs.core import events as ev


def simulate(g: pd.DataFrame, key: np.ndarray, hour: np.ndarray, lo: int, hi: int, ttl: int, recent: int,
             budget: float, rows_per_hour: float) -> dict:
    computed: dict = {}
    covered = np.zeros(len(key), bool)
    ages, inferences = [], 0
    by_hour = {h: np.flatnonzero(hour == h) for h in range(lo, hi)}
    for T in range(lo - 24, hi):
        pool = g[(g.h >= T - recent) & (g.h < T)]
        last = pool.groupby("k").h.max()
        order = np.argsort(-last.to_numpy(), kind="stable")[: int(budget * rows_per_hour)]
        for k in last.index.to_numpy()[order]:
            computed[k] = T
        if T >= lo:
            inferences += len(order)
            idx = by_hour[T]
            when = np.array([computed.get(k, -10**6) for k in key[idx]])
            ok = T - when < ttl
            covered[idx] = ok
            ages += list(T - when[ok])
    return {"inferences": inferences, "covered": covered, "mean_age_h": float(np.mean(ages)) if ages else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--from-hour", type=int, default=48, help="first hour (from the log's first midnight) measured")
    ap.add_argument("--to-hour", type=int, default=72, help="end hour (exclusive); keep it before t1")
    ap.add_argument("--recent-hours", type=int, default=24)
    ap.add_argument("--ttls", default="4,8,24")
    ap.add_argument("--budgets", default="0.25,0.5,1")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "coverage_pilot.json"))
    a = ap.parse_args()
    df = ev.read_events(a.data).to_pandas()[["user_id", "item_id", "event_timestamp"]]
    t0 = df.event_timestamp.min().floor("D")
    df["h"] = ((df.event_timestamp - t0).dt.total_seconds() // 3600).astype(int)
    df["k"] = df.user_id.to_numpy() * 10_000_000 + df.item_id.to_numpy()
    g = df.groupby(["k", "h"]).size().rename("n").reset_index()
    first = df.groupby("k").h.min()
    key, hour = df.k.to_numpy(), df.h.to_numpy()
    ceiling = first.reindex(key).to_numpy() < hour
    win = (hour >= a.from_hour) & (hour < a.to_hour)
    rows_per_hour = win.sum() / (a.to_hour - a.from_hour)
    out = {"data": a.data, "hours": [a.from_hour, a.to_hour], "rows_per_hour": rows_per_hour,
           "ceiling": float(ceiling[win].mean()), "points": []}
    print(f"rows/hour {rows_per_hour:.0f}; pair ceiling (shown before the last refresh) {ceiling[win].mean():.3f}")
    print(f"{'ttl h':>5s} {'budget':>6s} {'FM/row':>6s} {'pair':>6s} {'of ceiling':>10s} {'mean age h':>10s}")
    for ttl in (int(x) for x in a.ttls.split(",")):
        for b in (float(x) for x in a.budgets.split(",")):
            r = simulate(g, key, hour, a.from_hour, a.to_hour, ttl, a.recent_hours, b, rows_per_hour)
            cov = float(r["covered"][win].mean())
            p = {"ttl_hours": ttl, "budget": b, "fm_per_row": r["inferences"] / win.sum(), "pair": cov,
                 "of_ceiling": cov / float(ceiling[win].mean()), "mean_age_h": r["mean_age_h"]}
            out["points"].append(p)
            print(f"{ttl:5d} {b:6.2f} {p['fm_per_row']:6.3f} {cov:6.3f} {p['of_ceiling']:10.3f} "
                  f"{p['mean_age_h'] or 0:10.2f}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
