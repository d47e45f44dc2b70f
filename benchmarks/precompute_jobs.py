"""The precompute jobs in sequence on one interval: seconds per job, pairs considered / excluded / selected,
FM pairs/s (of the step, and of the model alone inside the executors), and the peak memory of the whole process
tree (driver JVM, Python driver and workers), sampled every 0.2 s. Beside it, the same FM + autoencoder over the
same selected pairs in a plain torch loop on one process (no Spark), with the history encoded once per pair (the
job before #13) and once per user (the job now), to show what the Spark job adds or saves.

    .venv/bin/python benchmarks/precompute_jobs.py --data artifacts/demo-movielens/data \
        --models artifacts/demo-movielens/models/seed0 \
        --end 1998-03-01T00:00:00Z --active-hours 168 --lookback-days 0 --name movielens

Saves benchmarks/results/precompute_<name>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class PeakRSS:
    """Samples the RSS of this process and all its descendants."""

    def __init__(self, interval: float = 0.2):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    def _sample(self):
        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for p in [me, *me.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            time.sleep(self.interval)

    def __enter__(self):
        self.peak = 0
        self._stop.clear()
        self._t = threading.Thread(target=self._sample, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def torch_reference(data: str, models: str, pairs: pd.DataFrame, end: pd.Timestamp, history_len: int,
                    batch_size: int) -> dict:
    """The FM + autoencoder over the same pairs in plain torch, two ways: ``per_pair`` encodes the history once per
    pair (the job before #13), ``shared`` once per user (``FoundationModel.forward(rows=...)``, what the job does
    now); with the largest difference between the two codes."""
    import torch

    from models import batch_to_tensors, load_checkpoint
    from solaris_jobs.core import events as ev
    from solaris_jobs.core.model_inputs import EventIndex, Examples
    from solaris_jobs.pipeline.inference import user_batches
    t0 = time.perf_counter()
    table = ev.read_events(data, end=end)
    index = EventIndex(table)
    t_index = time.perf_counter() - t0
    fm, _ = load_checkpoint(Path(models) / "fm.pt", kind="fm")
    ae, _ = load_checkpoint(Path(models) / "ae.pt", kind="ae")
    pairs = pairs.sort_values(["user_id", "item_id"]).reset_index(drop=True)
    n = len(pairs)
    ex = Examples(index, pairs["user_id"].to_numpy(), pairs["item_id"].to_numpy(), np.full(n, end.value // 1000),
                  np.full(n, -1.0, np.float32), np.zeros(n, np.float32), history_len)
    out = {"pairs": n, "read_and_index_seconds": round(t_index, 2), "torch_threads": torch.get_num_threads()}
    codes = {}
    with torch.inference_mode():
        parts, t_pair = [], 0.0
        for b in ex.batches(batch_size):                     # only the model calls are timed, both ways
            tb = batch_to_tensors(b)
            t1 = time.perf_counter()
            parts.append(ae.encode(fm(tb)["h"]).numpy())
            t_pair += time.perf_counter() - t1
        codes["per_pair"] = np.concatenate(parts) if parts else np.zeros((0, 1))
        users, first, n_pairs = np.unique(ex.users, return_index=True, return_counts=True)
        parts, t_shared = [], 0.0
        for sl in user_batches(n_pairs, batch_size):
            lo, hi = first[sl.start], first[sl.stop - 1] + n_pairs[sl.stop - 1]
            b = ex.batch(np.arange(lo, hi))
            hist = index.history(users[sl], np.full(sl.stop - sl.start, end.value // 1000), history_len)
            rows = torch.as_tensor(np.repeat(np.arange(sl.stop - sl.start), n_pairs[sl]))
            tb = batch_to_tensors({**b, **hist})
            t1 = time.perf_counter()
            parts.append(ae.encode(fm(tb, rows=rows)["h"]).numpy())
            t_shared += time.perf_counter() - t1
        codes["shared"] = np.concatenate(parts) if parts else np.zeros((0, 1))
    for name, sec in (("per_pair", t_pair), ("shared", t_shared)):
        out[name] = {"fm_seconds": round(sec, 2), "fm_pairs_per_s": round(n / sec, 1) if sec else None}
    out["max_abs_code_difference"] = float(np.abs(codes["per_pair"] - codes["shared"]).max()) if n else 0.0
    # Kept for the figures of earlier runs: the FM as the job ran it before (history per pair).
    out["fm_seconds"], out["fm_pairs_per_s"] = out["per_pair"]["fm_seconds"], out["per_pair"]["fm_pairs_per_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--models", required=True)
    ap.add_argument("--end", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--active-hours", type=float, default=24)
    ap.add_argument("--lookback-days", type=float, default=30)
    ap.add_argument("--candidates", type=int, default=200)
    ap.add_argument("--history-len", type=int, default=None, help="default: the FM's")
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--intervals", type=int, default=1, help="Consecutive hourly intervals ending at --end.")
    args = ap.parse_args()
    from solaris_jobs.core import offline as off
    from solaris_jobs.core.settings import Settings, apply_flags
    from solaris_jobs.pipeline import jobs
    offline = tempfile.mkdtemp(prefix="solaris_bench_offline_")
    s = apply_flags(Settings(data=args.data, offline=offline, models=args.models, spark_master=args.master), {
        "precompute.active_hours": args.active_hours, "precompute.lookback_days": args.lookback_days,
        "precompute.history_len": args.history_len, "precompute.batch_size": args.batch_size,
        "precompute.simulator.n_candidates": args.candidates})
    end = pd.Timestamp(args.end)
    results = []
    with PeakRSS() as mem:
        spark = jobs.session(s, "bench")
        for k in reversed(range(args.intervals)):
            e = end - pd.Timedelta(hours=k)
            row = {"interval_end": e.isoformat()}
            for step in jobs.SPARK_STEPS:
                with PeakRSS() as step_mem:
                    row[step] = jobs.run(spark, s, e - pd.Timedelta(hours=1), e, (step,))[step]
                row[step]["peak_rss_mb"] = round(step_mem.peak / 2**20)
            results.append(row)
            sel, emb = row["select"], row["embed"]
            print(f"{e.isoformat()}: users {sel['users']}, pairs considered {sel['pairs_considered']}, excluded "
                  f"{sel['pairs_excluded']}, selected {sel['pairs_selected']}; seconds select {sel['seconds']}, "
                  f"embed {emb['seconds']} ({emb['pairs_per_s']} pairs/s), aggregate {row['aggregate']['seconds']}, "
                  f"neighbours {row['neighbours']['seconds']}; peak RSS per step (MB) "
                  f"{[row[st]['peak_rss_mb'] for st in jobs.SPARK_STEPS]}", flush=True)
        selected = off.read_interval(spark, offline, "selection", end).where("selected") \
            .select("user_id", "item_id").toPandas()
        spark.stop()
    from solaris_jobs.pipeline import model_refs
    L = model_refs.resolve(args.models, ("fm",), args.history_len).history_len
    ref = torch_reference(args.data, args.models, selected, end, L, args.batch_size)
    emb = results[-1]["embed"]
    print(f"plain torch loop, same {ref['pairs']} pairs ({ref['torch_threads']} threads): read+index "
          f"{ref['read_and_index_seconds']} s; FM+AE with the history per pair {ref['per_pair']['fm_seconds']} s = "
          f"{ref['per_pair']['fm_pairs_per_s']} pairs/s, once per user {ref['shared']['fm_seconds']} s = "
          f"{ref['shared']['fm_pairs_per_s']} pairs/s (codes differ by at most {ref['max_abs_code_difference']:.2g}); "
          f"in the job's executors the model took {emb['model_seconds']} s of task time = "
          f"{emb['model_pairs_per_s']} pairs/s, the step {emb['seconds']} s", flush=True)
    print(f"peak RSS of the process tree over the run: {mem.peak / 2**20:.0f} MB")
    out = Path(__file__).parent / "results" / f"precompute_{args.name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "cpus": os.cpu_count(), "intervals": results,
                               "torch_reference": ref, "peak_rss_mb": round(mem.peak / 2**20),
                               "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2,
                              default=str) + "\n")


if __name__ == "__main__":
    main()
