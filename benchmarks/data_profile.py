"""`solaris data profile` at 10M events: wall time and peak memory of profiling a synthetic log (the ad-like
generator's defaults, ``--users`` over ``--days``), against the target of at most 5 minutes on this machine.

    .venv/bin/python benchmarks/data_profile.py [--users 21500 --days 5]

The log is generated once under ``--work`` (reused when there); the profile runs in a child process so that its
peak memory (RSS, sampled every 0.2 s) is its own. No stock tool computes these figures, so none is timed beside
it. Saves benchmarks/results/data_profile.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from precompute_jobs import PeakRSS  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "data_profile.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=21_500)
    ap.add_argument("--days", type=float, default=5.0)
    ap.add_argument("--work", default="artifacts/bench-profile")
    args = ap.parse_args()
    from solaris_jobs.data import synth
    data = Path(args.work) / f"data_{args.users}_{args.days:g}d"
    if not (data / "manifest.json").exists():
        t0 = time.perf_counter()
        synth.generate(synth.SynthConfig(users=args.users, days=args.days, seed=0), data)
        print(f"generated {data} in {time.perf_counter() - t0:.0f} s", flush=True)
    events = json.loads((data / "manifest.json").read_text())["events"]
    cmd = [str(Path(sys.executable).parent / "solaris"), "data", "profile", str(data), "--json"]
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(res.stderr[-3000:])
    prof = json.loads(res.stdout)
    out = {"events": events, "users": args.users, "days": args.days, "seconds": round(wall, 1),
           "peak_rss_mb": round(mem.peak / 2**20), "target_seconds": 300, "met": wall <= 300,
           "machine": f"{os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "profile": prof}
    OUT.write_text(json.dumps(out, indent=2) + "\n")
    print(f"{events:,} events profiled in {wall:.1f} s, peak {out['peak_rss_mb']} MB (target 300 s: "
          f"{'met' if out['met'] else 'missed'}); saved {OUT}")
    print("\n".join(prof["verdict"]))


if __name__ == "__main__":
    main()
