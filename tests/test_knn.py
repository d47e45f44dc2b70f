import numpy as np

from solaris_jobs.pipeline.knn import knn


def _vectors(n, d=16, seed=0):
    v = np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _brute_force(v, k):
    sims = v @ v.T
    np.fill_diagonal(sims, -np.inf)
    order = np.argsort(-sims, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(sims, order, 1)


def test_exact_index_equals_brute_force():
    v = _vectors(300)
    ids = np.arange(1000, 1300)
    nbr, sim, stats = knn(ids, v, k=5)
    order, bsim = _brute_force(v, 5)
    assert stats["index"] == "exact" and nbr.shape == (300, 5)
    np.testing.assert_array_equal(nbr, ids[order])
    np.testing.assert_allclose(sim, bsim, rtol=1e-5, atol=1e-6)
    assert not (nbr == ids[:, None]).any()              # nobody is their own neighbour


def test_hnsw_recall_is_measured_and_high():
    v = _vectors(3000, d=32, seed=1)
    nbr, sim, stats = knn(np.arange(3000), v, k=10, exact_max=1000, recall_sample=500)
    assert stats["index"] == "hnsw"
    order, _ = _brute_force(v, 10)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(nbr, order)])
    assert recall > 0.9 and abs(recall - stats["recall_at_k"]) < 0.05


def test_tiny_populations():
    nbr, sim, stats = knn(np.array([7]), _vectors(1), k=3)
    assert nbr.shape == (1, 0)
    nbr, sim, _ = knn(np.array([7, 8]), _vectors(2), k=3)
    assert nbr.tolist() == [[8], [7]]
