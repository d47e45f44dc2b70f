"""Nearest-neighbour users over FM user embeddings, with FAISS.

Exact inner-product search (``IndexFlatIP``; the embeddings are L2-normalised, so this is cosine) up to
``exact_max`` users; above that an HNSW graph (M=32, efSearch=128), whose recall@k against exact search is
measured on a sample of queries and reported. Users with no history have no FM user embedding and get no
neighbours (their requests fall through to tier none).
"""
from __future__ import annotations

import logging
import time

import numpy as np

logger = logging.getLogger(__name__)
logging.getLogger("faiss.loader").setLevel(logging.WARNING)   # it logs each missing SIMD build at INFO


def _exact(vectors: np.ndarray):
    import faiss
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    return index


def knn(ids: np.ndarray, vectors: np.ndarray, k: int = 10, exact_max: int = 100_000, recall_sample: int = 1000,
        seed: int = 0) -> tuple[np.ndarray, np.ndarray, dict]:
    """The k nearest other users of every user.

    Args:
        ids: (N,) user ids.
        vectors: (N, d) float32, L2-normalised.
        k: neighbours per user (fewer when N <= k).
        exact_max: above this N, HNSW instead of exact search.

    Returns:
        (neighbour ids (N, k'), similarities (N, k') float32, stats: index kind, N, seconds, recall@k).
        Missing slots (N too small, or ANN returning fewer) hold id -1 and similarity 0.
    """
    import faiss
    t0 = time.perf_counter()
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    n = len(ids)
    kk = min(k, max(n - 1, 0))
    if kk == 0:
        return np.zeros((n, 0), np.int64), np.zeros((n, 0), np.float32), {"index": "none", "users": n}
    if n <= exact_max:
        index, kind = _exact(vectors), "exact"
    else:
        index = faiss.IndexHNSWFlat(vectors.shape[1], 32, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 64
        index.add(vectors)
        index.hnsw.efSearch = 128
        kind = "hnsw"
    sims, pos = index.search(vectors, kk + 1)
    nbr, sim = _drop_self(pos, sims, kk)
    stats = {"index": kind, "users": n, "k": kk, "seconds": round(time.perf_counter() - t0, 2)}
    if kind != "exact":
        rng = np.random.default_rng(seed)
        q = rng.choice(n, min(recall_sample, n), replace=False)
        _, exact_pos = _exact(vectors).search(vectors[q], kk + 1)
        ex, _ = _drop_self(exact_pos, np.zeros_like(exact_pos, dtype=np.float32), kk, rows=q)
        stats["recall_at_k"] = float(np.mean([len(set(a) & set(b)) / kk for a, b in zip(nbr[q], ex)]))
    logger.info("knn: %s", stats)
    ids = np.asarray(ids)
    out_ids = np.where(nbr >= 0, ids[np.maximum(nbr, 0)], -1)
    return out_ids, np.where(nbr >= 0, sim, 0.0).astype(np.float32), stats


def _drop_self(pos: np.ndarray, sims: np.ndarray, k: int, rows: np.ndarray | None = None):
    """Removes each query's own row from its result list (or the last entry if it is not there)."""
    rows = np.arange(len(pos)) if rows is None else rows
    is_self = pos == rows[:, None]
    drop = np.where(is_self.any(1), is_self.argmax(1), pos.shape[1] - 1)
    keep = np.ones_like(pos, dtype=bool)
    keep[np.arange(len(pos)), drop] = False
    return pos[keep].reshape(len(pos), -1)[:, :k], sims[keep].reshape(len(pos), -1)[:, :k]
