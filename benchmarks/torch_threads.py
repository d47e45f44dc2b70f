"""FM training throughput by torch thread count, alone and beside another CPU job: what to give each process on a
shared host (the evaluation's seeds, an FM search, the test suite, a training task beside a Spark executor).

Each case runs FM training steps (the product's ``training.build_fm`` and ``fit``'s step: forward, loss, backward,
AdamW; batch 256) in fresh processes and reports rows/s per process and in all:

- ``alone``: one process at 1 thread, then at ``--threads`` (the cores, torch's default);
- ``side_by_side_1``: ``--threads`` processes at 1 thread each, at once;
- ``beside_a_job``: one process at ``--threads`` while another trains at 1 thread (a default-threaded job sharing the
  host with anything else CPU-bound).

    .venv/bin/python benchmarks/torch_threads.py --data /path/to/a/synthetic/log      # or --users N to draw one

Saves benchmarks/results/torch_threads.json. Run it on a quiet host: it measures contention, so anything else
running changes its figures.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def one(data: str, family: str, threads: int, steps: int, warmup: int = 5) -> dict:
    """Train steps of one FM in this process at ``threads`` threads: rows/s over ``steps`` after ``warmup``."""
    import torch
    torch.set_num_threads(threads)
    from solaris_jobs.learning import training
    from solaris_jobs.learning.training import TrainConfig, batch_to_tensors
    ds = training.load_dataset(data, 50)
    cfg = TrainConfig(lr=4e-3, weight_decay=1e-2)
    model = training.build_fm(ds, cfg, family=family, target_user=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    model.train()
    t0 = None
    for k, b in enumerate(ds.train.batches(cfg.batch_size, shuffle_seed=0)):
        if k == warmup:
            t0 = time.perf_counter()
        if k == warmup + steps:
            break
        tb = batch_to_tensors(b, "cpu")
        out = model(tb)
        loss = model.loss(out, tb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    secs = time.perf_counter() - t0
    return {"family": family, "threads": threads, "steps": steps, "seconds": round(secs, 2),
            "rows_per_s": round(steps * cfg.batch_size / secs, 1)}


def run(data: str, jobs: list[tuple[str, int]], steps: int, measured: int | None = None) -> list[dict]:
    """``jobs`` (family, threads) as processes started at once; each one's figures. ``measured``: only the first
    ``measured`` jobs are measured; the others (10x the steps) are the load beside them, stopped when they end."""
    measured = len(jobs) if measured is None else measured
    procs = [subprocess.Popen([sys.executable, __file__, "--one", data, fam, str(t),
                               str(steps if i < measured else 10 * steps)],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": str(t)})
             for i, (fam, t) in enumerate(jobs)]
    out = []
    try:
        for p in procs[:measured]:
            stdout, _ = p.communicate()
            if p.returncode:
                raise RuntimeError(f"a training process exited {p.returncode}")
            out.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="a data set in the event-log contract (default: draw a synthetic one, --users)")
    ap.add_argument("--users", type=int, default=2000)
    ap.add_argument("--families", nargs="+", default=["transformer", "gru4rec"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/torch_threads.json"))
    ap.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], a.one[1], int(a.one[2]), int(a.one[3]))), flush=True)
        return
    data = a.data
    if data is None:
        from solaris_jobs.data import synth
        data = str(Path(tempfile.mkdtemp(prefix="solaris-threads-")) / "synth")
        synth.generate(synth.SynthConfig(users=a.users, seed=0), data)
    res = {"data": data, "cpu_count": os.cpu_count(), "threads": a.threads, "steps": a.steps, "cases": {}}
    for fam in a.families:
        cases = {"alone_1": run(data, [(fam, 1)], a.steps),
                 f"alone_{a.threads}": run(data, [(fam, a.threads)], a.steps),
                 "side_by_side_1": run(data, [(fam, 1)] * a.threads, a.steps),
                 "beside_a_job": run(data, [(fam, a.threads), (fam, 1)], a.steps, measured=1)}
        res["cases"][fam] = {k: {"per_process_rows_per_s": [r["rows_per_s"] for r in v],
                                 "total_rows_per_s": round(sum(r["rows_per_s"] for r in v), 1)}
                             for k, v in cases.items()}
        for k, v in res["cases"][fam].items():
            print(f"{fam} {k}: {v['per_process_rows_per_s']} rows/s per process, {v['total_rows_per_s']} in all",
                  flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"saved {a.out}")


if __name__ == "__main__":
    main()
