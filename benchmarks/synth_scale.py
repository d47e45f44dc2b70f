"""Synthetic generation at scale: wall time, rows, rows/s and peak memory (max RSS) per user count.

Each size runs in its own child process so that its peak memory is its own. Prints a table and saves JSON to
benchmarks/results/synth_scale.json.

    .venv/bin/python benchmarks/synth_scale.py --users 100000 1000000 --days 7
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, resource, sys, time
from solaris_jobs.data import synth
cfg = synth.SynthConfig(users=int(sys.argv[1]), items=int(sys.argv[2]), days=float(sys.argv[3]), seed=0,
                        chunk_users=int(sys.argv[5]))
t0 = time.perf_counter()
m = synth.generate(cfg, sys.argv[4])
print(json.dumps({"seconds": time.perf_counter() - t0, "rows": m["events"],
                  "pair_recurrence_24h": m["pair_recurrence_24h"], "positive_rate": m["positive_rate"],
                  "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--items", type=int, default=50_000)
    ap.add_argument("--days", type=float, default=7.0)
    ap.add_argument("--chunk-users", type=int, default=50_000)
    ap.add_argument("--out", default="benchmarks/results/synth_scale.json")
    args = ap.parse_args()
    results = []
    for n in args.users:
        tmp = Path(tempfile.mkdtemp(prefix="synth_bench_"))
        try:
            proc = subprocess.run([sys.executable, "-c", CHILD, str(n), str(args.items), str(args.days),
                                   str(tmp), str(args.chunk_users)], capture_output=True, text=True, check=True)
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r["disk_mb"] = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file()) / 2**20
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        r.update(users=n, items=args.items, days=args.days, chunk_users=args.chunk_users,
                 rows_per_s=r["rows"] / r["seconds"])
        results.append(r)
        print(f"users {n:>9,}  rows {r['rows']:>12,}  {r['seconds']:7.1f} s  {r['rows_per_s']:>10,.0f} rows/s  "
              f"peak RSS {r['max_rss_mb']:7.0f} MB  disk {r['disk_mb']:7.0f} MB  "
              f"recurrence {r['pair_recurrence_24h']:.3f}  CTR {r['positive_rate']:.3f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.platform(), "cpus": __import__("os").cpu_count(),
                               "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": results},
                              indent=2) + "\n")


if __name__ == "__main__":
    main()
