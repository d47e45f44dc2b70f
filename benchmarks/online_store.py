"""The online store, ours vs stock Feast, side by side in one run against one real redis-server (127.0.0.1, free
port, started and stopped here):

1. Materialization rows/s of the pair view (D=32) at each size: ``solaris materialize``'s writer (into an empty
   Redis, then a rerun over the same keys) vs ``FeatureStore.materialize`` (stock `feast materialize`) on the same
   parquet rows into an empty Redis. Both are read back through the stock SDK and compared.
2. Serving, one user x 500 candidates (100 with a pair embedding, the rest falling to a fallback tier): our
   ``FeatureReader.read`` at the product's tiers (``DEFAULT_TIERS``, the evaluated set) and with every fallback tier,
   each vs stock ``get_online_features`` on the same views.
3. The ranker: a VM with an FM slot scoring 500 candidates with the feature read, vs a plain VM (no FM features).

    .venv/bin/python benchmarks/online_store.py --rows 100000 1000000

Saves benchmarks/results/online_store.json. ``--listpack`` starts Redis with hash-max-listpack-value 512 (the
deployment setting recommended in the README; it changes memory, reported as used_memory).
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from solaris_jobs.core import offline as layout  # noqa: E402
from tests.support import RedisServer, feast_yaml  # noqa: E402

END = pd.Timestamp("2026-01-05T01:00:00Z")
VERSION = "fm-bench00000000+ae-bench00000000"
D = 32


def write_interval(offline: Path, dataset: str, df: pd.DataFrame) -> None:
    layout.write_interval(df, offline, dataset, END)


def make_offline(offline: Path, n_pairs: int, n_users: int, seed: int = 0) -> pd.DataFrame:
    """Pair embeddings (n_pairs rows, 100 pairs for user 0), user aggregates and neighbours for n_users."""
    rng = np.random.default_rng(seed)
    u = np.concatenate([np.zeros(100, np.int64), rng.integers(1, n_users, n_pairs - 100)])
    i = np.concatenate([np.arange(100), rng.integers(0, 2**40, n_pairs - 100)])
    pairs = pd.DataFrame({"user_id": u, "item_id": i}).drop_duplicates()
    pairs["embedding"] = list(rng.standard_normal((len(pairs), D)).astype(np.float32))
    pairs["event_timestamp"], pairs["model_version"] = END, VERSION
    write_interval(offline, "pair_embeddings", pairs)
    users = np.arange(n_users)
    write_interval(offline, "user_aggregates", pd.DataFrame({
        "user_id": users, "embedding": list(rng.standard_normal((n_users, D)).astype(np.float32)),
        "n_pairs": rng.integers(1, 50, n_users).astype(np.int32), "event_timestamp": END, "model_version": VERSION}))
    # The item-aware fallback (other users' pairs: user 0's candidates find none, but its fields are read from each
    # pair's hash all the same) and the user's own state.
    fb = pairs.iloc[100:].sample(min(len(pairs) - 100, n_pairs // 4), random_state=seed)
    write_interval(offline, "pair_fallbacks", pd.DataFrame({
        "user_id": fb.user_id.to_numpy(), "item_id": fb.item_id.to_numpy(),
        "embedding": list(rng.standard_normal((len(fb), D)).astype(np.float32)),
        "n_pairs": rng.integers(1, 50, len(fb)).astype(np.int32), "event_timestamp": END, "model_version": VERSION}))
    write_interval(offline, "user_states", pd.DataFrame({
        "user_id": users, "embedding": list(rng.standard_normal((n_users, D)).astype(np.float32)),
        "event_timestamp": END, "model_version": VERSION}))
    write_interval(offline, "neighbours", pd.DataFrame({
        "user_id": users, "neighbour_ids": [rng.integers(0, n_users, 10) for _ in users],
        "similarities": [rng.random(10).astype(np.float32) for _ in users],
        "embedding": list(rng.standard_normal((n_users, D)).astype(np.float32)),
        "n_neighbours": np.full(n_users, 10, np.int32), "event_timestamp": END, "model_version": VERSION}))
    return pairs


def feast_store(yaml_path: Path, offline: Path):
    from feast import FeatureStore
    os.environ["SOLARIS_OFFLINE"] = str(offline)
    spec = importlib.util.spec_from_file_location("solaris_repo_bench", ROOT / "feature_repo" / "solaris_repo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fs = FeatureStore(repo_path=str(ROOT / "feature_repo"), fs_yaml_file=yaml_path)
    fs.apply(mod.OBJECTS)
    return fs


def check_readback(fs, pairs: pd.DataFrame, k: int = 200) -> bool:
    s = pairs.sample(min(k, len(pairs)), random_state=1)
    got = fs.get_online_features(features=["pair_embeddings:embedding"], entity_rows=[
        {"user_id": int(u), "item_id": int(i)} for u, i in zip(s.user_id, s.item_id)]).to_dict()["embedding"]
    return all(g is not None and np.array_equal(np.asarray(g, np.float32), e) for g, e in zip(got, s.embedding))


def pct(xs) -> dict:
    a = np.asarray(xs)
    return {"p50_ms": round(float(np.percentile(a, 50)), 3), "p99_ms": round(float(np.percentile(a, 99)), 3),
            "mean_ms": round(float(a.mean()), 3), "n": int(len(a))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--users", type=int, default=20_000)
    ap.add_argument("--requests", type=int, default=2000, help="Serving requests for our client.")
    ap.add_argument("--stock-requests", type=int, default=300, help="Serving requests for stock Feast.")
    ap.add_argument("--skip-stock-above", type=int, default=10**9, help="Skip stock materialize above N rows.")
    ap.add_argument("--listpack", action="store_true")
    ap.add_argument("--cluster", action="store_true",
                    help="Also materialize the largest size into a 3-node Redis Cluster on loopback.")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/online_store.json"))
    args = ap.parse_args()

    import redis

    from solaris_jobs.online import store_config
    from solaris_jobs.online.materialize import materialize
    work = Path(tempfile.mkdtemp(prefix="solaris-bench-online-"))
    extra = ["--hash-max-listpack-value", "512"] if args.listpack else []
    results = {"d": D, "users": args.users, "listpack": args.listpack, "materialize": [], "cpu_count": os.cpu_count()}
    with RedisServer(work / "redis", extra=extra) as server:
        client = redis.Redis(port=server.port)
        yaml_path = feast_yaml(work / "feature_store.yaml", f'  type: redis\n  connection_string: "{server.url}"')
        cfg = store_config.load(ROOT / "feature_repo", yaml_path)
        fs = None
        for n in args.rows:
            offline = work / f"offline{n}"
            pairs = make_offline(offline, n, args.users)
            row = {"rows": len(pairs)}
            client.flushall()
            gc.collect()
            st = materialize(cfg, str(offline), END, ["pair_embeddings"], expire_from="write")
            row["ours_empty_redis"] = st["views"]["pair_embeddings"]
            row["ours_used_memory_mb"] = round(client.info("memory")["used_memory"] / 2**20, 1)
            st = materialize(cfg, str(offline), END, ["pair_embeddings"], expire_from="write")
            row["ours_rerun"] = st["views"]["pair_embeddings"]
            fs = feast_store(yaml_path, offline)
            row["ours_readback_equal"] = check_readback(fs, pairs)
            print(f"{len(pairs)} rows: ours {row['ours_empty_redis']['rows_per_s']:.0f} rows/s into an empty Redis, "
                  f"{row['ours_rerun']['rows_per_s']:.0f} rerun; read back equal: {row['ours_readback_equal']}",
                  flush=True)
            if n <= args.skip_stock_above:
                client.flushall()
                gc.collect()
                t0 = time.perf_counter()
                fs.materialize(start_date=(END - pd.Timedelta(hours=1)).to_pydatetime(),
                               end_date=(END + pd.Timedelta(seconds=1)).to_pydatetime(),
                               feature_views=["pair_embeddings"])
                secs = time.perf_counter() - t0
                row["stock_feast_materialize"] = {"seconds": round(secs, 2), "rows_per_s": round(len(pairs) / secs, 1)}
                row["stock_readback_equal"] = check_readback(fs, pairs)
                row["speedup_vs_stock"] = round(row["ours_empty_redis"]["rows_per_s"] / (len(pairs) / secs), 1)
                print(f"  stock feast materialize {len(pairs) / secs:.0f} rows/s ({secs:.1f} s); read back equal: "
                      f"{row['stock_readback_equal']}; ours/stock {row['speedup_vs_stock']}x", flush=True)
            results["materialize"].append(row)

        # Serving: the last data set, materialized by us with all views.
        client.flushall()
        materialize(cfg, str(offline), END, expire_from="write")
        results["serving"] = serving(cfg, fs, args)
        results["ranker"] = ranker(cfg, args, work)
    if args.cluster:
        from tests.support import RedisClusterServer
        with RedisClusterServer(work / "cluster") as cluster:
            ypath = feast_yaml(work / "feature_store.cluster.yaml", f'  type: redis\n  redis_type: redis_cluster\n'
                               f'  connection_string: "{cluster.url}"', registry=work / "registry_c.db")
            ccfg = store_config.load(ROOT / "feature_repo", ypath)
            st = materialize(ccfg, str(offline), END, ["pair_embeddings"], expire_from="write")
            results["cluster_3_nodes"] = st["views"]["pair_embeddings"]
            print(f"cluster (3 primaries, same machine): {st['views']['pair_embeddings']['rows_per_s']:.0f} rows/s",
                  flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: results[k] for k in ("serving", "ranker")}, indent=2))
    print(f"saved {args.out}")


def request_items(rng) -> np.ndarray:
    """100 items with a pair embedding for user 0, 400 without (they fall to a fallback tier, or to none)."""
    return rng.permutation(np.concatenate([np.arange(100), 10**13 + rng.integers(0, 10**6, 400)]))


def _ours(cfg, tiers, requests: int) -> dict:
    from solaris_jobs.online.reader import FeatureReader
    rng = np.random.default_rng(0)
    now = END + pd.Timedelta(hours=1)
    reader = FeatureReader(cfg, VERSION, D, budget_ms=50, tiers=tiers)
    for _ in range(50):
        reader.read(0, request_items(rng), now)
    lat = []
    for _ in range(requests):
        items = request_items(rng)
        t0 = time.perf_counter()
        f = reader.read(0, items, now)
        lat.append((time.perf_counter() - t0) * 1000)
    reader.close()
    return {**pct(lat), "tiers": list(reader.tiers), "tiers_last_request": pd.Series(f.tier_names()).value_counts()
            .to_dict(), "fail_open": reader.metrics.counts["fail_open"]}


def _stock(fs, view_names, requests: int) -> dict:
    rng = np.random.default_rng(0)
    feats = [f"{v}:{c}" for v in view_names for c in ("embedding", "model_version")]
    for _ in range(10):
        fs.get_online_features(features=feats, entity_rows=[{"user_id": 0, "item_id": int(i)}
                                                            for i in request_items(rng)], full_feature_names=True)
    lat = []
    for _ in range(requests):
        rows = [{"user_id": 0, "item_id": int(i)} for i in request_items(rng)]
        t0 = time.perf_counter()
        fs.get_online_features(features=feats, entity_rows=rows, full_feature_names=True).to_dict()
        lat.append((time.perf_counter() - t0) * 1000)
    return {**pct(lat), "views": list(view_names)}


def serving(cfg, fs, args) -> dict:
    """Our reader at the product's tiers (``DEFAULT_TIERS``, the evaluated set) and with every fallback tier, each
    beside stock ``get_online_features`` of the same views."""
    from solaris_jobs.online.reader import DEFAULT_TIERS, FALLBACKS
    from solaris_jobs.online.views import views
    tier_view = {v.tier: name for name, v in views().items()}
    out = {"candidates": 500, "with_pair_embedding": 100,
           "note": "stock returns raw rows (no TTL, version or tier resolution); ours returns the resolved matrix"}
    for label, tiers in (("default_tiers", DEFAULT_TIERS), ("all_tiers", FALLBACKS)):
        ours = _ours(cfg, tiers, args.requests)
        stock = _stock(fs, ["pair_embeddings", *(tier_view[t] for t in tiers)], args.stock_requests)
        out[label] = {"ours": ours, "stock_get_online_features": stock}
        print(f"serving 1 user x 500, {label} {list(tiers)}: ours p50 {ours['p50_ms']} ms p99 {ours['p99_ms']} ms; "
              f"stock get_online_features p50 {stock['p50_ms']} ms p99 {stock['p99_ms']} ms", flush=True)
    return out


def ranker(cfg, args, work: Path) -> dict:
    import torch

    from models import save_checkpoint
    from models.vm import VerticalModel, VMConfig
    from solaris_jobs.core.contract import RECENCY_INPUTS
    from solaris_jobs.online.ranker import Ranker
    from solaris_jobs.online.reader import FeatureReader
    torch.manual_seed(0)
    paths = {}
    for name, fm_dim in (("plain", 0), ("solaris", D)):
        vm = VerticalModel(VMConfig(fm_dim=fm_dim))
        paths[name] = work / f"vm_{name}.pt"
        save_checkpoint(vm, paths[name], extra={"fm_version": VERSION.split("+")[0],
                                                "ae_version": VERSION.split("+")[1]})

    def counters(user, items):
        z = np.zeros(len(items), np.float32)
        return {k: z for k in ("user_cnt", "user_known", "user_pos", "item_cnt", "item_known", "item_pos",
                               *RECENCY_INPUTS)}

    rng = np.random.default_rng(1)
    now = END + pd.Timedelta(hours=1)
    out = {}
    for name in ("plain", "solaris"):
        reader = FeatureReader(cfg, VERSION, D, budget_ms=50) if name == "solaris" else None
        rk = Ranker(paths[name], reader, counters)
        for _ in range(50):
            rk.score(0, request_items(rng), now)
        lat, feat, model = [], [], []
        for _ in range(args.requests):
            items = request_items(rng)
            t0 = time.perf_counter()
            r = rk.score(0, items, now)
            lat.append((time.perf_counter() - t0) * 1000)
            feat.append(r.features_ms)
            model.append(r.model_ms)
        out[name] = {"total": pct(lat), "features": pct(feat), "vm": pct(model)}
        if reader is not None:
            reader.close()
    out["added_p99_ms"] = round(out["solaris"]["total"]["p99_ms"] - out["plain"]["total"]["p99_ms"], 3)
    print(f"ranker p99: plain VM {out['plain']['total']['p99_ms']} ms, VM + SOLARIS features "
          f"{out['solaris']['total']['p99_ms']} ms", flush=True)
    return out


if __name__ == "__main__":
    main()
