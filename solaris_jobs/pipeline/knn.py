"""Nearest-neighbour users over FM user embeddings, with FAISS.

Exact inner-product search (``IndexFlatIP``; the embeddings are L2-normalised, so this is cosine) up to
``exact_max`` users; above that an HNSW graph (``knn_hnsw_m`` links, ``knn_ef_search``; chosen by recall@10 vs time
at a million users in ``benchmarks/knn_scale.py``), whose recall@k against exact search is measured on a sample of
queries and reported. ``build_index`` / ``search`` / ``serialize`` let the ``neighbours`` step keep an index across
intervals and query only the users whose history changed (``knn_requery = active``). Users with no history have no FM user embedding and get no
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


def build_index(vectors: np.ndarray, exact_max: int = 100_000, hnsw_m: int = 32, ef_construction: int = 64):
    """A FAISS inner-product index over ``vectors`` (N, d) float32: exact up to ``exact_max`` rows, else HNSW with
    ``hnsw_m`` links per node. Returns (index, kind)."""
    import faiss
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if len(vectors) <= exact_max:
        return _exact(vectors), "exact"
    index = faiss.IndexHNSWFlat(vectors.shape[1], hnsw_m, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = ef_construction
    index.add(vectors)
    return index, "hnsw"


def search(index, queries: np.ndarray, own: np.ndarray, k: int, ef_search: int = 128):
    """The k best rows of ``index`` for each query, without the query's own row.

    Args:
        queries: (Q, d) float32, L2-normalised.
        own: (Q,) each query's row in the index, -1 for a query that is not in it (then its k best are kept).

    Returns:
        (rows (Q, k) int64, similarities (Q, k) float32); a missing slot is row -1, similarity 0.
    """
    import faiss
    if isinstance(index, faiss.IndexHNSW):
        index.hnsw.efSearch = max(ef_search, k + 1)
    if len(queries) == 0:
        return np.zeros((0, k), np.int64), np.zeros((0, k), np.float32)
    sims, pos = index.search(np.ascontiguousarray(queries, dtype=np.float32), k + 1)
    nbr, sim = _drop_self(pos, sims, k, rows=np.asarray(own, np.int64))
    return nbr, np.where(nbr >= 0, sim, 0.0).astype(np.float32)


def recall_at_k(index, vectors: np.ndarray, found: np.ndarray, rows: np.ndarray, k: int) -> float:
    """recall@k of ``found`` (the rows ``rows`` of ``vectors`` queried against ``index``) against exact search."""
    _, exact_pos = _exact(np.ascontiguousarray(vectors, dtype=np.float32)).search(vectors[rows], k + 1)
    ex, _ = _drop_self(exact_pos, np.zeros_like(exact_pos, dtype=np.float32), k, rows=rows)
    return float(np.mean([len(set(a[a >= 0]) & set(b)) / k for a, b in zip(found, ex)]))


def serialize(index) -> np.ndarray:
    """The index as a uint8 array (a buffer: written as is, no copy)."""
    import faiss
    return faiss.serialize_index(index)


def deserialize(data: bytes):
    import faiss
    return faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))


def knn(ids: np.ndarray, vectors: np.ndarray, k: int = 10, exact_max: int = 100_000, recall_sample: int = 1000,
        seed: int = 0, hnsw_m: int = 32, ef_search: int = 128) -> tuple[np.ndarray, np.ndarray, dict]:
    """The k nearest other users of every user.

    Args:
        ids: (N,) user ids.
        vectors: (N, d) float32, L2-normalised.
        k: neighbours per user (fewer when N <= k).
        exact_max: above this N, HNSW (``hnsw_m``, ``ef_search``) instead of exact search.

    Returns:
        (neighbour ids (N, k'), similarities (N, k') float32, stats: index kind, N, seconds, recall@k).
        Missing slots (N too small, or ANN returning fewer) hold id -1 and similarity 0.
    """
    t0 = time.perf_counter()
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    n = len(ids)
    kk = min(k, max(n - 1, 0))
    if kk == 0:
        return np.zeros((n, 0), np.int64), np.zeros((n, 0), np.float32), {"index": "none", "users": n}
    index, kind = build_index(vectors, exact_max, hnsw_m)
    nbr, sim = search(index, vectors, np.arange(n), kk, ef_search)
    stats = {"index": kind, "users": n, "k": kk, "seconds": round(time.perf_counter() - t0, 2)}
    if kind != "exact":
        q = np.random.default_rng(seed).choice(n, min(recall_sample, n), replace=False)
        stats["recall_at_k"] = recall_at_k(index, vectors, nbr[q], q, kk)
    logger.info("knn: %s", stats)
    return to_ids(np.asarray(ids), nbr), sim, stats


def to_ids(ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Index rows (-1: none) as ids (-1: none)."""
    return np.where(rows >= 0, ids[np.maximum(rows, 0)], -1)


def _drop_self(pos: np.ndarray, sims: np.ndarray, k: int, rows: np.ndarray | None = None):
    """Removes each query's own row from its result list (or the last entry if it is not there)."""
    rows = np.arange(len(pos)) if rows is None else rows
    is_self = pos == rows[:, None]
    drop = np.where(is_self.any(1), is_self.argmax(1), pos.shape[1] - 1)
    keep = np.ones_like(pos, dtype=bool)
    keep[np.arange(len(pos)), drop] = False
    return pos[keep].reshape(len(pos), -1)[:, :k], sims[keep].reshape(len(pos), -1)[:, :k]
