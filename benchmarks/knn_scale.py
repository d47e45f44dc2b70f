"""FAISS neighbour search at a million users: recall@k against exact search vs build and query time, for the exact
index, HNSW (M, efSearch) and IVF-Flat (nlist, nprobe), on the same vectors in one run, to choose what the
``neighbours`` step uses above ``knn_exact_max`` users.

The vectors stand in for FM user embeddings (``FoundationModel.user_embedding``: 2 x d_model = 128 dims,
L2-normalised). Real ones are not isotropic noise: users cluster by what they watch. So each user is a Dirichlet
mixture of ``--topics`` topic centroids in a ``--latent``-dimensional space plus per-user noise, mapped into
``--dim`` dimensions by a random orthonormal map plus a little isotropic noise, then normalised. On isotropic
Gaussian vectors (no structure) every method's recall is lower; say so when quoting these figures.

Ground truth is exact inner-product search for ``--recall-queries`` random users; query time is measured on
``--time-queries`` users and scaled to all users (per-query cost does not depend on which users) and to the
active share of an hourly interval (``--active-share``: only users active in the interval are re-queried).

    .venv/bin/python benchmarks/knn_scale.py [--users 1000000 --threads 2]

Prints a table and saves benchmarks/results/knn_scale.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def vectors(n: int, dim: int, latent: int, topics: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centroids = rng.normal(size=(topics, latent)).astype(np.float32)
    basis, _ = np.linalg.qr(rng.normal(size=(dim, latent)))
    out = np.empty((n, dim), np.float32)
    for lo in range(0, n, 100_000):
        hi = min(n, lo + 100_000)
        mix = rng.dirichlet(np.full(topics, 0.2), hi - lo).astype(np.float32)
        z = mix @ centroids + 0.3 * rng.normal(size=(hi - lo, latent)).astype(np.float32)
        x = z @ basis.T.astype(np.float32) + 0.05 * rng.normal(size=(hi - lo, dim)).astype(np.float32)
        out[lo:hi] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(a) & set(b)) / truth.shape[1] for a, b in zip(found, truth)]))


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    import faiss
    ap = argparse.ArgumentParser()
    ap.add_argument("--users", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--latent", type=int, default=32)
    ap.add_argument("--topics", type=int, default=64)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--recall-queries", type=int, default=2000)
    ap.add_argument("--time-queries", type=int, default=20_000)
    ap.add_argument("--active-share", type=float, default=0.1)
    ap.add_argument("--hnsw-m", default="16,32")
    ap.add_argument("--ef-search", default="16,32,64,128")
    ap.add_argument("--nlist", default="1024,4096")
    ap.add_argument("--nprobe", default="4,8,16,32")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "knn_scale.json"))
    a = ap.parse_args()
    faiss.omp_set_num_threads(a.threads)
    n, k = a.users, a.k
    t = time.perf_counter()
    x = vectors(n, a.dim, a.latent, a.topics)
    gen_s = time.perf_counter() - t
    rng = np.random.default_rng(1)
    rq = rng.choice(n, a.recall_queries, replace=False)
    tq = rng.choice(n, min(a.time_queries, n), replace=False)
    rows = []

    def per_query(index, qs) -> float:
        t0 = time.perf_counter()
        index.search(x[qs], k + 1)
        return (time.perf_counter() - t0) / len(qs)

    def record(kind, params, build_s, index, extra=None):
        _, pos = index.search(x[rq], k + 1)
        found = [[p for p in row if p != q][:k] for row, q in zip(pos, rq)]
        q_s = per_query(index, tq)
        row = {"index": kind, **params, "build_s": round(build_s, 1), "recall_at_k": round(recall(np.array(found),
                                                                                                 truth), 4),
               "query_ms": round(1000 * q_s, 4), "query_all_s": round(q_s * n, 1),
               "query_active_s": round(q_s * n * a.active_share, 1), **(extra or {})}
        rows.append(row)
        print(json.dumps(row), flush=True)

    # Exact search: the ground truth, and its own cost.
    t = time.perf_counter()
    flat = faiss.IndexFlatIP(a.dim)
    flat.add(x)
    build = time.perf_counter() - t
    _, pos = flat.search(x[rq], k + 1)
    truth = np.array([[p for p in row if p != q][:k] for row, q in zip(pos, rq)])
    q_s = per_query(flat, tq[: max(200, len(tq) // 20)])
    rows.append({"index": "exact", "build_s": round(build, 1), "recall_at_k": 1.0, "query_ms": round(1000 * q_s, 4),
                 "query_all_s": round(q_s * n, 1), "query_active_s": round(q_s * n * a.active_share, 1)})
    print(json.dumps(rows[-1]), flush=True)
    del flat

    for m in [int(v) for v in a.hnsw_m.split(",") if v]:
        t = time.perf_counter()
        index = faiss.IndexHNSWFlat(a.dim, m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 64
        index.add(x)
        build = time.perf_counter() - t
        for ef in [int(v) for v in a.ef_search.split(",")]:
            index.hnsw.efSearch = ef
            record("hnsw", {"M": m, "efConstruction": 64, "efSearch": ef}, build, index,
                   {"index_bytes": int(faiss.serialize_index(index).nbytes) if ef == 16 else None})
        del index

    for nlist in [int(v) for v in a.nlist.split(",") if v]:
        t = time.perf_counter()
        quant = faiss.IndexFlatIP(a.dim)
        index = faiss.IndexIVFFlat(quant, a.dim, nlist, faiss.METRIC_INNER_PRODUCT)
        index.train(x[rng.choice(n, min(n, 64 * nlist), replace=False)])
        index.add(x)
        build = time.perf_counter() - t
        for nprobe in [int(v) for v in a.nprobe.split(",")]:
            index.nprobe = nprobe
            record("ivf_flat", {"nlist": nlist, "nprobe": nprobe}, build, index)
        del index, quant

    ok = [r for r in rows if r["recall_at_k"] >= 0.95 and r["index"] != "exact"]
    best = min(ok, key=lambda r: r["build_s"] + r["query_active_s"]) if ok else None
    res = {"users": n, "dim": a.dim, "k": k, "threads": a.threads, "vectors": {"latent": a.latent, "topics": a.topics,
                                                                               "generate_s": round(gen_s, 1)},
           "recall_queries": a.recall_queries, "time_queries": len(tq), "active_share": a.active_share,
           "rows": rows, "best_at_recall_0.95": best, "peak_rss_gib": round(rss_gib(), 2),
           "machine": {"python": platform.python_version(), "faiss": faiss.__version__, "cpus": faiss.omp_get_max_threads()}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"\n{'index':8s} {'params':34s} {'build s':>8s} {'recall':>7s} {'ms/query':>9s} {'all s':>8s} "
          f"{'active s':>8s}")
    for r in rows:
        p = {k_: v for k_, v in r.items() if k_ in ("M", "efSearch", "nlist", "nprobe")}
        print(f"{r['index']:8s} {json.dumps(p):34s} {r['build_s']:8.1f} {r['recall_at_k']:7.3f} {r['query_ms']:9.4f} "
              f"{r['query_all_s']:8.1f} {r['query_active_s']:8.1f}")
    print(f"best with recall@{k} >= 0.95 (build + active queries): {best}")
    print(f"saved {a.out}")


if __name__ == "__main__":
    main()
