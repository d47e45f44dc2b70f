"""FM inference throughput in plain torch, the settings the refresh's embed step can take, side by side: the history
encoded once per pair (the job before #13) and once per user (``FoundationModel.forward(rows=...)``, the job now),
over torch threads, batch sizes (pairs per batch), ``torch.no_grad`` vs ``torch.inference_mode``, and
``torch.compile``. The FM has the production architecture (``FMConfig`` defaults: d_model 64, 2 layers, history
50, d_interaction 128) with random weights (speed does not depend on them) and the autoencoder's encoder after it,
as in the job. Inputs: ``--users`` users with full histories and ``--pairs-per-user`` target items each (the 100K
synthetic interval selects about 20 per user).

    .venv/bin/python benchmarks/fm_inference.py [--users 512 --pairs-per-user 20 --repeats 3]
    .venv/bin/python benchmarks/fm_inference.py --user-embedding     # the neighbours step's user embeddings

``--user-embedding`` instead times ``FoundationModel.user_embedding`` (the history encoder alone, what the
neighbours step runs for every user with history) over users per batch (``--user-batches``) and threads, the
vectors compared with the largest batch's; saved as benchmarks/results/fm_user_embedding.json. It chose
``PrecomputeConfig.user_batch_size``.

Prints a table and saves benchmarks/results/fm_inference.json. Each setting runs ``--repeats`` times; the best
is reported (the machine is shared and noisy), with every run's seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def inputs(users: int, per_user: int, n_items: int, history_len: int, seed: int = 0) -> dict:
    """Numpy model inputs for ``users`` x ``per_user`` pairs, sorted by user, and the history per distinct user."""
    from solaris_jobs.core.contract import N_GAP_BUCKETS
    rng = np.random.default_rng(seed)
    n = users * per_user
    hist = rng.integers(1, n_items, (users, history_len))
    return {
        "user": np.repeat(np.arange(1, users + 1), per_user), "item": rng.integers(1, n_items, n),
        "hist_item": hist, "hist_signal": rng.integers(1, 8, (users, history_len)),
        "hist_gap": rng.integers(1, N_GAP_BUCKETS, (users, history_len)),
        **{k: rng.integers(0, 50, n).astype(np.float32) for k in
           ["user_cnt", "user_known", "user_pos", "item_cnt", "item_known", "item_pos"]},
        "rows": np.repeat(np.arange(users), per_user),
    }


def make_batches(data: dict, batch: int, shared: bool = True, device="cpu") -> list:
    """The pairs of ``data`` in batches of about ``batch`` pairs (whole users, as the embed step makes them) as
    tensors on ``device``: with ``shared``, each user's history once and the rows index (``forward(rows=...)``),
    else each pair's history repeated (rows None)."""
    import torch

    from models import batch_to_tensors
    from solaris_jobs.pipeline.inference import user_batches
    per_user = np.bincount(data["rows"])
    starts = np.concatenate([[0], np.cumsum(per_user)])
    pair_keys = [k for k in data if k not in ("hist_item", "hist_signal", "hist_gap", "rows")]
    batches = []
    for sl in user_batches(per_user, batch):
        lo, hi = starts[sl.start], starts[sl.stop]
        b = {k: data[k][lo:hi] for k in pair_keys}
        rows = data["rows"][lo:hi] - sl.start
        hist = {k: data[k][sl] for k in ("hist_item", "hist_signal", "hist_gap")}
        if shared:
            batches.append((batch_to_tensors({**b, **hist}, device), torch.as_tensor(rows, device=device)))
        else:
            batches.append((batch_to_tensors({**b, **{k: v[rows] for k, v in hist.items()}}, device), None))
    return batches


def run_setting(fm, ae, data: dict, batch: int, mode: str, shared: bool) -> tuple[float, np.ndarray]:
    """Seconds for all pairs in batches of about ``batch`` pairs (whole users), and the codes."""
    import torch
    batches = make_batches(data, batch, shared)
    ctx = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    out = []
    t0 = time.perf_counter()
    with ctx():
        for tb, rows in batches:
            out.append(ae.encode(fm(tb, rows=rows)["h"]))
    seconds = time.perf_counter() - t0
    return seconds, torch.cat(out).numpy()


def user_embedding_sweep(args) -> None:
    """Users per second of ``FoundationModel.user_embedding`` by users per batch and threads (best of repeats)."""
    import torch

    from models import FMConfig, FoundationModel, batch_to_tensors
    torch.manual_seed(0)
    fm = FoundationModel(FMConfig(user_side={"n_ids": args.users + 1}, item_side={"n_ids": args.items})).eval()
    data = inputs(args.users, 1, args.items, fm.cfg.history_len)
    keys = ("user", "hist_item", "hist_signal", "hist_gap")
    rows, reference = [], None
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch in sorted(args.user_batches, reverse=True):
            parts = [batch_to_tensors({k: data[k][s: s + batch] for k in keys})
                     for s in range(0, args.users, batch)]
            runs = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                with torch.inference_mode():
                    vec = torch.cat([fm.user_embedding(b) for b in parts]).numpy()
                runs.append(round(time.perf_counter() - t0, 3))
            reference = vec if reference is None else reference
            diff = float(np.abs(vec - reference).max())
            row = {"threads": threads, "users_per_batch": batch, "seconds": min(runs), "runs": runs,
                   "users_per_s": round(args.users / min(runs), 1), "max_abs_difference": diff}
            rows.append(row)
            print(f"threads {threads} users per batch {batch:5d} {row['users_per_s']:9.0f} users/s (best of {runs} "
                  f"s; vectors within {diff:.1e} of the first setting's)", flush=True)
    out = Path(args.out).with_name("fm_user_embedding.json")
    out.write_text(json.dumps({"args": vars(args), "torch": torch.__version__, "cpus": os.cpu_count(),
                               "rows": rows, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                              indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=512)
    ap.add_argument("--pairs-per-user", type=int, default=20)
    ap.add_argument("--items", type=int, default=50_000)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="Also time torch.compile'd models (slow to compile).")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "fm_inference.json"))
    ap.add_argument("--user-embedding", action="store_true",
                    help="Time the user embedding (history encoder alone) over --user-batches instead.")
    ap.add_argument("--user-batches", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    args = ap.parse_args()
    if args.user_embedding:
        user_embedding_sweep(args)
        return
    import torch

    from models import AEConfig, Autoencoder, FMConfig, FoundationModel
    torch.manual_seed(0)
    fm = FoundationModel(FMConfig(user_side={"n_ids": args.users + 1}, item_side={"n_ids": args.items})).eval()
    ae = Autoencoder(AEConfig(d_in=fm.cfg.d_interaction)).eval()
    data = inputs(args.users, args.pairs_per_user, args.items, fm.cfg.history_len)
    n = len(data["item"])
    models = {"eager": (fm, ae)}
    if args.compile:
        models["compiled"] = (torch.compile(fm, dynamic=True), torch.compile(ae, dynamic=True))
    rows, reference = [], None
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, (f, a) in models.items():
            for batch in args.batches:
                for mode in ("no_grad", "inference_mode"):
                    for shared in (False, True):
                        runs, codes = [], None
                        for _ in range(args.repeats + (name == "compiled")):    # the first compiled run compiles
                            s, codes = run_setting(f, a, data, batch, mode, shared)
                            runs.append(round(s, 3))
                        runs = runs[1:] if name == "compiled" else runs
                        reference = codes if reference is None else reference
                        diff = float(np.abs(codes - reference).max())
                        row = {"threads": threads, "model": name, "batch_pairs": batch, "mode": mode,
                               "history": "once per user" if shared else "once per pair", "seconds": min(runs),
                               "runs": runs, "pairs_per_s": round(n / min(runs), 1),
                               "max_abs_code_difference": diff}
                        rows.append(row)
                        print(f"threads {threads} {name:8s} batch {batch:5d} {mode:14s} {row['history']:14s} "
                              f"{row['pairs_per_s']:10.0f} pairs/s  (best of {runs} s; codes within {diff:.1e})",
                              flush=True)
    best = {h: max((r for r in rows if r["history"] == h), key=lambda r: r["pairs_per_s"])
            for h in ("once per pair", "once per user")}
    ratio = best["once per user"]["pairs_per_s"] / best["once per pair"]["pairs_per_s"]
    print(f"best once per pair: {best['once per pair']['pairs_per_s']:.0f} pairs/s; best once per user: "
          f"{best['once per user']['pairs_per_s']:.0f} pairs/s ({ratio:.1f}x)")
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "args": vars(args), "pairs": n, "torch": torch.__version__, "cpus": os.cpu_count(),
        "machine": platform.machine(), "rows": rows, "best": best, "speedup": round(ratio, 2),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2) + "\n")


if __name__ == "__main__":
    main()
