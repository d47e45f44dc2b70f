"""Feature store and serving against real stores: a real redis-server on a free port and SQLite, the real Feast SDK
reading what we wrote, the MovieLens refresh outputs of ``ml_run`` as data."""
import importlib.util
import json
from dataclasses import replace
from unittest.mock import ANY
import os
import signal
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import redis

from solaris_jobs.core import offline as layout
from solaris_jobs.core import uris
from solaris_jobs.online import feast_format as ff
from solaris_jobs.online import store_config
from solaris_jobs.online.materialize import materialize, materialized_intervals
from solaris_jobs.online.misses import ParquetSink, drain_misses
from solaris_jobs.online.reader import FALLBACKS, FeatureReader
from solaris_jobs.online.views import views
from tests.support import ML_END, ML_START, feast_yaml, free_port, RedisServer

REPO = Path(__file__).resolve().parent.parent / "feature_repo"
HOUR = pd.Timedelta(hours=1)


def test_feast_byte_formats_match_feast():
    from feast.infra.online_stores.helpers import _mmh3, _redis_key
    from feast.protos.feast.types.EntityKey_pb2 import EntityKey
    from feast.protos.feast.types.Value_pb2 import FloatList, Int64List, Value
    from google.protobuf.timestamp_pb2 import Timestamp
    rng = np.random.default_rng(0)
    for u, i in [(0, 0), (5, -7), (2**40, 123)]:
        ek = EntityKey(join_keys=["user_id", "item_id"], entity_values=[Value(int64_val=u), Value(int64_val=i)])
        assert ff.entity_key({"user_id": u, "item_id": i}, b"solaris") == _redis_key("solaris", ek)
        ek = EntityKey(join_keys=["user_id"], entity_values=[Value(int64_val=u)])
        assert ff.entity_key({"user_id": u}, b"p") == _redis_key("p", ek)
    assert ff.field_name("pair_embeddings", "embedding") == _mmh3("pair_embeddings:embedding")
    m = rng.standard_normal((4, 8)).astype(np.float32)
    assert [bytes(x) for x in ff.float_lists(m)] == [Value(float_list_val=FloatList(val=r)).SerializeToString()
                                                     for r in m]
    assert ff.string_value("fm-1+ae-2") == Value(string_val="fm-1+ae-2").SerializeToString()
    assert ff.int64_list([3, -1]) == Value(int64_list_val=Int64List(val=[3, -1])).SerializeToString()
    assert ff.int32_values(np.array([0, 9, -2])) == [Value(int32_val=v).SerializeToString() for v in (0, 9, -2)]
    t = Timestamp(seconds=888710400, nanos=250)
    assert ff.timestamp(888710400, 250) == t.SerializeToString()
    assert ff.parse_timestamp(t.SerializeToString()) == pytest.approx(888710400.00000025)
    good = [bytes(x) for x in ff.float_lists(m)]
    # Not a float list of width 8: absent, short, the right length with another prefix, one byte too long.
    bad = [None, b"\x12\x01a", b"\x00" * len(good[0]), good[0] + b"\x00"]
    dec, ok = ff.parse_float_lists(good[:2] + bad + good[2:], 8)
    assert np.array_equal(dec[ok], m) and ok.tolist() == [True] * 2 + [False] * 4 + [True] * 2
    assert not dec[~ok].any()
    dec, ok = ff.parse_float_lists(good + bad, 8, mask=np.array([True, False, True, True] + [True] * 4))
    assert ok.tolist() == [True, False, True, True] + [False] * 4 and np.array_equal(dec[[0, 2, 3]], m[[0, 2, 3]])


def test_materialize_sets_bad_rows_aside_with_reasons(tmp_path, monkeypatch):
    """Bad offline rows are counted per reason and never written; the good ones are served (SQLite, no Spark)."""
    end = pd.Timestamp("2026-01-05T01:00:00Z")
    # Staged, not yet published: no output to materialize; once published, read.
    good = [np.full(4, k, np.float32) for k in range(3)]
    staged = layout.stage_table(pd.DataFrame({
        "user_id": pd.array([1, 1, 1, None, 1, 1, 1], "Int64"), "item_id": [10, 11, 12, 13, 14, 15, 16],
        "embedding": [*good, good[0], None, np.ones(5, np.float32), np.array([1, np.nan, 0, 0], np.float32)],
        "event_timestamp": end, "model_version": "v1"}), str(tmp_path / "offline"), "pair_embeddings", end)
    cfg = store_config.load(REPO, feast_yaml(tmp_path / "fs.yaml", f"  type: sqlite\n  path: {tmp_path / 'o.db'}"))
    with pytest.raises(FileNotFoundError, match="no complete pair_embeddings output"):
        materialize(cfg, str(tmp_path / "offline"), end, ["pair_embeddings"], expire_from="write")
    staged.publish()
    st = materialize(cfg, str(tmp_path / "offline"), end, ["pair_embeddings"], expire_from="write")["views"]
    assert st["pair_embeddings"]["rows"] == 7 and st["pair_embeddings"]["written"] == 3
    assert st["pair_embeddings"]["rejected"] == {"null user_id": 1, "no embedding": 1, "embedding width is not 4": 1,
                                                 "non-finite embedding value": 1}
    fs = _feast(cfg.yaml_path, str(tmp_path / "offline"), monkeypatch)      # the stock SDK reads our SQLite rows
    got = fs.get_online_features(features=["pair_embeddings:embedding", "pair_embeddings:model_version"],
                                 entity_rows=[{"user_id": 1, "item_id": i} for i in (10, 11, 12)]).to_dict()
    assert np.array_equal(np.asarray(got["embedding"], np.float32), np.stack(good))
    assert got["model_version"] == ["v1"] * 3
    reader = FeatureReader(cfg, "v1", 4, misses=None, tiers=FALLBACKS)
    f = reader.read(1, [10, 11, 12, 14, 15, 16], end + HOUR)
    assert f.tier_names() == ["pair"] * 3 + ["none"] * 3
    np.testing.assert_array_equal(f.embeddings[:3], np.stack(good))
    for bad in (float("nan"), pd.NaT):                 # no age, so no TTL, can be checked against it: a clear error
        with pytest.raises(ValueError, match="request time must be a finite time"):
            reader.read(1, [10], bad)
    reader.close()
    with pytest.raises(ValueError, match="unknown feature views"):
        materialize(cfg, str(tmp_path / "offline"), end, ["pairs"])

    import json

    from click.testing import CliRunner

    from solaris_jobs.flows.cli import main
    args = ["materialize", "--offline", str(tmp_path / "offline"), "--start", (end - HOUR).isoformat(),
            "--end", end.isoformat(), "--views", "pair_embeddings", "--expire-from", "write",
            "--feature-repo", str(REPO)]
    res = CliRunner().invoke(main, args, env={"FEAST_FS_YAML_FILE_PATH": str(cfg.yaml_path)})
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["views"]["pair_embeddings"]["written"] == 3
    res = CliRunner().invoke(main, args[:-4] + ["--every", "30min", "--feature-repo", str(REPO)],
                             env={"FEAST_FS_YAML_FILE_PATH": str(cfg.yaml_path)})
    assert res.exit_code == 1 and "no complete pair_embeddings output" in res.output    # the first half-hour


def _feast(yaml_path: Path, offline: str, monkeypatch):
    """The stock Feast SDK on our repo (``feast apply`` done through the SDK)."""
    from feast import FeatureStore
    monkeypatch.setenv("SOLARIS_OFFLINE", offline)
    spec = importlib.util.spec_from_file_location("solaris_repo_under_test", REPO / "solaris_repo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fs = FeatureStore(repo_path=str(REPO), fs_yaml_file=yaml_path)
    fs.apply(mod.OBJECTS)
    return fs


def _offline(job):
    return {name: layout.read_table(job.offline, name, ML_END).to_pandas()
            for name in views()}


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


def _dump(client) -> dict:
    return {k: client.hgetall(k) for k in sorted(client.scan_iter(count=10_000))
            if not k.startswith(b"solaris:")}


def test_materialize_redis_feast_reads_it_ttls_and_reruns(ml_run, redis_server, tmp_path, monkeypatch):
    import shutil
    job, _ = ml_run
    off = _offline(job)
    offline = str(tmp_path / "offline")
    shutil.copytree(job.offline, offline)          # this test adds an interval: keep the shared outputs as they are
    cfg = store_config.load(REPO, feast_yaml(tmp_path / "fs.yaml", f'  type: redis\n  connection_string: '
                                                             f'"{redis_server.url}"'))
    client = redis.Redis(port=redis_server.port)
    client.flushall()
    # Event-time expiry on 1998 data: every row is long expired, so nothing may be written (and it is counted).
    st = materialize(cfg, offline, ML_END, expire_from="event")
    assert all(v["expired"] == v["rows"] > 0 and v["written"] == 0 for v in st["views"].values())
    assert _dump(client) == {}

    t0 = time.time()
    monkeypatch.setenv("SOLARIS_TTL_PAIR_EMBEDDINGS", "4h")     # not the user views' 24 h (the default since #39)
    st = materialize(cfg, offline, ML_END, expire_from="write")
    for name, df in off.items():
        assert st["views"][name]["rows"] == st["views"][name]["written"] == len(df), name
        assert st["views"][name]["rejected"] == {}
    assert ML_END in materialized_intervals(cfg)

    # Each key expires with its own view's TTL.
    p = off["pair_embeddings"].iloc[0]
    pkey = ff.entity_key({"user_id": int(p.user_id), "item_id": int(p.item_id)}, b"solaris")
    ukey = ff.entity_key({"user_id": int(off["user_aggregates"].user_id.iloc[0])}, b"solaris")
    elapsed = time.time() - t0 + 1
    assert 4 * 3600 - elapsed <= client.ttl(pkey) <= 4 * 3600
    assert 24 * 3600 - elapsed <= client.ttl(ukey) <= 24 * 3600

    # The stock Feast SDK reads back exactly the offline values, through the versioned FeatureService.
    fs = _feast(cfg.yaml_path, offline, monkeypatch)
    pairs = off["pair_embeddings"].sample(40, random_state=0)
    res = fs.get_online_features(features=fs.get_feature_service("solaris_v3"), full_feature_names=True,
                                 entity_rows=[{"user_id": int(u), "item_id": int(i)}
                                              for u, i in zip(pairs.user_id, pairs.item_id)]).to_df()
    np.testing.assert_array_equal(np.stack(res["pair_embeddings__embedding"]), np.stack(pairs.embedding))
    assert (res["pair_embeddings__model_version"] == pairs.model_version.to_numpy()).all()
    agg = off["user_aggregates"].set_index("user_id").loc[pairs.user_id]
    np.testing.assert_array_equal(np.stack(res["user_aggregates__embedding"]), np.stack(agg.embedding))
    assert res["user_aggregates__n_pairs"].tolist() == agg.n_pairs.tolist()
    st = off["user_states"].set_index("user_id").loc[pairs.user_id]
    np.testing.assert_array_equal(np.stack(res["user_states__embedding"]), np.stack(st.embedding))
    fb = off["pair_fallbacks"].sample(20, random_state=0)          # in the pair's hash, beside its own fields
    res = fs.get_online_features(features=fs.get_feature_service("solaris_v3"), full_feature_names=True,
                                 entity_rows=[{"user_id": int(u), "item_id": int(i)}
                                              for u, i in zip(fb.user_id, fb.item_id)]).to_df()
    np.testing.assert_array_equal(np.stack(res["pair_fallbacks__embedding"]), np.stack(fb.embedding))
    assert res["pair_fallbacks__n_pairs"].tolist() == fb.n_pairs.tolist() and res[
        "pair_embeddings__embedding"].isna().all()
    nb = off["neighbours"].set_index("user_id")
    for u, ids, emb in zip(res.user_id, res["neighbours__neighbour_ids"], res["neighbours__embedding"]):
        if u in nb.index:
            assert list(ids) == list(nb.loc[u].neighbour_ids)
            np.testing.assert_array_equal(np.asarray(emb, np.float32), nb.loc[u].embedding)

    # A rerun leaves the same contents; an older interval written afterwards never overwrites newer rows.
    before = _dump(client)
    materialize(cfg, offline, ML_END, expire_from="write")
    assert _dump(client) == before
    for name, df in off.items():
        layout.write_interval(df.assign(event_timestamp=ML_END - HOUR,
                                     embedding=[np.zeros(len(e), np.float32) for e in df.embedding]),
                           offline, name, ML_END - HOUR)
    st = materialize(cfg, offline, ML_END - HOUR, expire_from="write")
    assert st["checked_newer"] and st["views"]["pair_embeddings"]["skipped_older"] == len(off["pair_embeddings"])
    assert _dump(client) == before

    # Redis down: materialization fails loudly and records nothing.
    redis_server.stop()
    try:
        with pytest.raises(redis.ConnectionError):
            materialize(cfg, offline, ML_END, expire_from="write")
    finally:
        redis_server.start()


def _store(kind, job, tmp_path, redis_server):
    if kind == "redis":
        online = f'  type: redis\n  connection_string: "{redis_server.url}"'
        redis.Redis(port=redis_server.port).flushall()
    else:
        online = f"  type: sqlite\n  path: {tmp_path / 'online.db'}"
    cfg = store_config.load(REPO, feast_yaml(tmp_path / "fs.yaml", online))
    materialize(cfg, job.offline, ML_END, expire_from="write")
    return cfg


@pytest.fixture(params=["redis", "sqlite"])
def store(request, ml_run, tmp_path, redis_server):
    return _store(request.param, ml_run[0], tmp_path, redis_server)


def test_status_shows_each_steps_state_the_stores_keys_and_the_serving_metrics(ml_run, store, tmp_path,
                                                                              monkeypatch):
    """`solaris status` on the refreshed and materialized interval: every step done with its numbers, the keys
    per view the store holds (SQLite counted, Redis scanned), its age on the given clock, the serving client's
    metrics from its Prometheus text; an interval whose neighbours output is gone shows that step missing."""
    import shutil

    from click.testing import CliRunner

    from solaris_jobs.flows.cli import main
    job, stats = ml_run
    off = _offline(job)
    pairs = off["pair_embeddings"]
    reader = FeatureReader(store, pairs.model_version.iloc[0], len(pairs.embedding.iloc[0]), misses=None, tiers=FALLBACKS)
    user = int(pairs.user_id.iloc[0])
    reader.read(user, np.array([*pairs[pairs.user_id == user].item_id, 10**6]), ML_END + HOUR)
    reader.close()
    prom = tmp_path / "metrics.prom"
    prom.write_text(reader.metrics.prometheus())
    offline = tmp_path / "offline_status"
    shutil.copytree(job.offline, offline)
    args = ["status", "--offline", str(offline), "--feature-repo", str(REPO), "--now",
            (ML_END + 2 * HOUR).isoformat(), "--metrics", str(prom)]
    env = {"FEAST_FS_YAML_FILE_PATH": str(store.yaml_path)}
    res = CliRunner().invoke(main, [*args, "--json"], env=env)
    assert res.exit_code == 0, res.output
    st = json.loads(res.stdout)
    [row] = st["intervals"]
    assert row["interval_end"] == ML_END.isoformat() and row["complete"] and row["lease"] is None
    steps = row["steps"]
    assert steps["select"]["pairs_selected"] == stats["select"]["pairs_selected"] == len(pairs)
    assert steps["embed"]["pairs"] == len(pairs) and steps["embed"]["state"] == "done"
    assert steps["materialize"]["pair_embeddings_written"] == len(pairs)
    assert steps["report"] == {"state": "missing"}          # the report step has not run on this interval
    # Once the report step has run, its coverage per tier is in the status (the shares it wrote, rounded).
    from solaris_jobs.flows import refresh_steps as o
    monkeypatch.setenv("FEAST_FS_YAML_FILE_PATH", str(store.yaml_path))
    # (over the 3 hours before ML_END: the interval's own last hour has no logged requests)
    written = o.report(replace(job, offline=str(offline), feature_repo=str(REPO)), ML_END - 3 * HOUR, ML_END)
    st = json.loads(CliRunner().invoke(main, [*args, "--json"], env=env).stdout)
    assert st["intervals"][0]["interval_start"] == written["interval_start"]    # no start recorded but the report's
    shown = st["intervals"][0]["steps"]["report"]
    assert shown["state"] == "done" and shown["requests"] == written["requests"] > 0
    assert [shown[f"coverage_{t}"] for t in written["coverage"]] == [round(v, 4) for v in written["coverage"].values()]
    assert st["online"]["latest_materialized_end"] == ML_END.isoformat() and st["online"]["age_hours"] == 2.0
    assert st["online"]["keys"] == {"pair_embeddings": len(pairs), "pair_fallbacks": len(off["pair_fallbacks"]),
                                    "user_aggregates": off["user_aggregates"].user_id.nunique(),
                                    "user_states": off["user_states"].user_id.nunique(),
                                    "neighbours": off["neighbours"].user_id.nunique()}
    served = st["serving"]
    assert served["solaris_serving_rows_total"] == (pairs.user_id == user).sum() + 1, served
    assert served["solaris_serving_tier_pair_total"] == (pairs.user_id == user).sum()
    # The readable table, and an interval whose neighbours output is gone: that step is missing.
    shutil.rmtree(layout.interval_uri(str(offline), "neighbours", ML_END))
    res = CliRunner().invoke(main, args, env=env)
    assert res.exit_code == 0, res.output
    header, line = [x for x in res.stdout.splitlines() if x.startswith(("interval end", ML_END.isoformat()))]
    assert "cov pair" in header and line.split()[1:5] == [str(len(pairs)), str(len(pairs)),
                                                           str(stats["aggregate"]["users"]), "MISSING"]
    assert f"pair_embeddings {len(pairs):,}" in res.stdout and "solaris_serving_rows_total" in res.stdout
    # A Redis keyspace larger than the scan limit is said to be uncounted, not half counted; an unreachable
    # metrics endpoint is one clear error.
    if store.kind == "redis":
        from solaris_jobs.online.store_stats import keys_per_view
        assert keys_per_view(store, scan_limit=1) == {"counted": False, "scanned": 1, "scan_limit": 1}
    res = CliRunner().invoke(main, [*args[:-1], f"http://127.0.0.1:{free_port()}/metrics"], env=env)
    assert res.exit_code == 1 and "cannot read the serving metrics" in res.output, res.output


@pytest.fixture
def pair_ttl_4h(monkeypatch):
    """A pair TTL shorter than the user views' 24 h (the default since #39 is 24 h for all), so that the tiers'
    order over time shows: pair, then user aggregate, then nothing. Set before the store is materialized."""
    monkeypatch.setenv("SOLARIS_TTL_PAIR_EMBEDDINGS", "4h")


def test_serving_tiers_ttl_version_misses_and_fail_open(pair_ttl_4h, ml_run, store, redis_server, tmp_path):
    job, _ = ml_run
    off = _offline(job)
    pairs, agg = off["pair_embeddings"], off["user_aggregates"].set_index("user_id")
    nb = off["neighbours"].set_index("user_id")
    version = pairs.model_version.iloc[0]
    dim = len(pairs.embedding.iloc[0])
    user = int(pairs.user_id.value_counts().index[0])
    mine = pairs[pairs.user_id == user]
    unknown = np.arange(10**6, 10**6 + 20)
    items = np.concatenate([mine.item_id.to_numpy(), unknown])
    reader = FeatureReader(store, version, dim, budget_ms=200, misses_dir=tmp_path / "offline" / "misses", tiers=FALLBACKS)

    f = reader.read(user, items, ML_END + HOUR)
    n = len(mine)
    assert f.tier_names() == ["pair"] * n + ["user_aggregate"] * len(unknown)
    np.testing.assert_array_equal(f.embeddings[:n], np.stack(mine.embedding))
    np.testing.assert_array_equal(f.embeddings[n:], np.repeat(agg.loc[user].embedding[None], len(unknown), 0))
    # What stands behind each row: one pair, or the pairs the aggregate averages.
    np.testing.assert_array_equal(f.counts, [1] * n + [agg.loc[user].n_pairs] * len(unknown))
    assert agg.loc[user].n_pairs > 1
    # Past the pair TTL (4 h) the user aggregate serves; past 24 h nothing; before the interval end (a replay
    # asking for an earlier time) nothing either: it would leak the future.
    assert set(reader.read(user, items, ML_END + 4 * HOUR + pd.Timedelta(seconds=1)).tier_names()) == \
        {"user_aggregate"}
    assert set(reader.read(user, items, ML_END + 25 * HOUR).tier_names()) == {"none"}
    assert set(reader.read(user, items, ML_END - pd.Timedelta(minutes=1)).tier_names()) == {"none"}
    # A user with no aggregate gets the code of their own FM user embedding (the user state); with that tier not
    # served, the neighbour embedding.
    states = off["user_states"].set_index("user_id")
    nb_only = [u for u in nb.index if u not in agg.index and u in states.index]
    assert nb_only, "the MovieLens refresh should leave users with neighbours and a state but no pairs"
    g = reader.read(int(nb_only[0]), unknown[:5], ML_END + HOUR)
    assert g.tier_names() == ["user_state"] * 5 and (g.counts == 1).all()
    np.testing.assert_array_equal(g.embeddings, np.repeat(states.loc[nb_only[0]].embedding[None], 5, 0))
    without = FeatureReader(store, version, dim, misses=None, tiers=("user_aggregate", "neighbour"))
    g = without.read(int(nb_only[0]), unknown[:5], ML_END + HOUR)
    assert g.tier_names() == ["neighbour"] * 5
    np.testing.assert_array_equal(g.embeddings, np.repeat(nb.loc[nb_only[0]].embedding[None], 5, 0))
    assert (g.counts == nb.loc[nb_only[0]].n_neighbours).all() and nb.loc[nb_only[0]].n_neighbours > 0
    without.close()
    # A pool pair the FM did not embed: its item-aware fallback (the user's pairs weighted by their items'
    # similarity), ahead of the user aggregate.
    fb = off["pair_fallbacks"].iloc[0]
    g = reader.read(int(fb.user_id), [int(fb.item_id)], ML_END + HOUR)
    assert g.tier_names() == ["item_aware"] and g.counts[0] == fb.n_pairs > 0
    np.testing.assert_array_equal(g.embeddings[0], fb.embedding)
    with pytest.raises(ValueError, match=r"unknown fallback tiers \['pair'\]"):
        FeatureReader(store, version, dim, misses=None, tiers=("pair",))
    # Another model version than the VM's is never served.
    other = FeatureReader(store, "fm-000000000000+ae-000000000000", dim, misses=None, tiers=FALLBACKS)
    h = other.read(user, items, ML_END + HOUR)
    assert set(h.tier_names()) == {"none"} and not h.embeddings.any()
    assert other.metrics.counts["pair_other_version"] == n and other.metrics.counts["pair_missing"] == len(unknown)
    assert other.metrics.counts["user_aggregate_other_version"] == 1
    other.close()

    # Misses: every pair served without a fresh pair embedding, recorded for the next refresh.
    reader.close()
    # 4 reads of `items` (the first serves n pairs) + 5 user-state rows + the item-aware row
    expected = 4 * len(items) - n + 5 + 1
    assert reader.metrics.counts["misses_queued"] == expected
    folder = tmp_path / "offline" / "misses"
    if store.kind == "redis":
        st = drain_misses(store, tmp_path / "offline")
        assert st["pairs"] == expected
        assert redis.Redis(port=redis_server.port).xlen(f"solaris:{store.project}:misses") == 0
    got = pd.read_parquet(folder)
    assert len(got) == expected and set(got.item_id) == set(unknown) | set(mine.item_id) | {fb.item_id}

    # A store that is down, or slower than the budget, fails open: zeros, tier none, counted, no exception; and
    # queues no misses (an outage would flood the queue with pairs that may well be in the store).
    down = FeatureReader(store, version, dim, budget_ms=50, misses=ParquetSink(tmp_path / "down_misses"), tiers=FALLBACKS)
    assert down.read(user, items, ML_END + HOUR).tier_names()[0] == "pair"
    if store.kind == "redis":
        pause = redis.Redis(port=redis_server.port)
        pause.execute_command("CLIENT", "PAUSE", 1500, "ALL")         # every command now waits 1.5 s
        t0 = time.perf_counter()
        slow = down.read(user, items, ML_END + HOUR)
        waited = time.perf_counter() - t0
        assert slow.failed_open and set(slow.tier_names()) == {"none"} and not slow.embeddings.any()
        assert waited < 1.0, f"the read waited {waited:.2f}s for a paused store (budget 50 ms)"
        time.sleep(1.6)
        redis_server.stop()
        try:
            time.sleep(down.cooldown_s)
            dead = down.read(user, items, ML_END + HOUR)
            assert dead.failed_open and set(dead.tier_names()) == {"none"}
            assert down.metrics.counts["fail_open"] == 2
            assert down.read(user, items, ML_END + HOUR).failed_open     # within the cooldown: not even tried
            assert down.metrics.counts["fail_open_cooldown"] == 1
        finally:
            redis_server.start()
    else:
        store.sqlite_path.rename(store.sqlite_path.with_suffix(".moved"))
        down._reset()
        dead = down.read(user, items, ML_END + HOUR)
        assert dead.failed_open and set(dead.tier_names()) == {"none"}
        # The cooldown on an injected clock (a replay's request clock): skipped until 60 s later on that clock.
        now = [0.0]
        replayed = FeatureReader(store, version, dim, cooldown_s=60.0, misses=None, clock=lambda: now[0], tiers=FALLBACKS)
        assert replayed.read(user, items, ML_END + HOUR).failed_open
        now[0] = 59.0
        store.sqlite_path.with_suffix(".moved").rename(store.sqlite_path)
        assert replayed.read(user, items, ML_END + HOUR).failed_open
        assert replayed.metrics.counts["fail_open_cooldown"] == 1
        now[0] = 60.5
        assert not replayed.read(user, items, ML_END + HOUR).failed_open
        replayed.close()
    failed = down.metrics.counts["fail_open"] + down.metrics.counts["fail_open_cooldown"]
    assert failed == (3 if store.kind == "redis" else 1)
    assert down.metrics.counts["misses_skipped_fail_open"] == failed * len(items)
    assert down.metrics.counts["misses_queued"] == len(items) - n        # the first read's, which did read the store
    down.close()


def test_ranker_scores_with_solaris_features(ml_run, movielens_root, ml_models, redis_server, tmp_path):
    from click.testing import CliRunner

    from solaris_jobs.flows.cli import main
    from solaris_jobs.learning import training
    from solaris_jobs.online.ranker import Counters, Ranker
    job, _ = ml_run
    store = _store("sqlite", job, tmp_path, redis_server)
    off = _offline(job)
    data = training.load_dataset(str(movielens_root), history_len=10, max_train_rows=20_000)
    vm_path = tmp_path / "vm_transfer.pt"
    training.train_vm(data, vm_path, training.TrainConfig(epochs=1, history_len=10, max_train_rows=20_000),
                      mode="transfer", fm_path=ml_models / "fm.pt", ae_path=ml_models / "ae.pt")
    pairs = off["pair_embeddings"]
    user = int(pairs.user_id.value_counts().index[0])
    items = np.concatenate([pairs[pairs.user_id == user].item_id.to_numpy(), [1, 2, 3]])
    reader = FeatureReader(store, pairs.model_version.iloc[0], len(pairs.embedding.iloc[0]), misses=None, tiers=FALLBACKS)
    ranker = Ranker(vm_path, reader, Counters(movielens_root, ML_END))
    with_f = ranker.score(user, items, ML_END + HOUR)
    without = ranker.score(user, items, ML_END + HOUR, use_features=False)
    assert with_f.tiers[:-3] == ["pair"] * (len(items) - 3) and set(without.tiers) == {"none"}
    assert with_f.scores.shape == (len(items),) and ((with_f.scores > 0) & (with_f.scores < 1)).all()
    assert not np.allclose(with_f.scores, without.scores)     # the features reach the model
    with pytest.raises(ValueError, match="takes embeddings"):
        Ranker(vm_path, FeatureReader(store, "fm-x+ae-y", 8, misses=None, tiers=FALLBACKS), Counters(movielens_root, ML_END))
    reader.close()

    res = CliRunner().invoke(main, ["rank", "--vm", str(vm_path), "--data", str(movielens_root),
                                    "--user", str(user), "--items", ",".join(map(str, items)),
                                    "--at", (ML_END + HOUR).isoformat(), "--feature-repo", str(REPO)],
                             env={"FEAST_FS_YAML_FILE_PATH": str(store.yaml_path)})
    assert res.exit_code == 0, res.output
    assert "pair" in res.output and f"{len(items)} candidates" in res.output


def test_redis_cluster_materialize_feast_read_and_serving(ml_run, tmp_path, monkeypatch):
    from tests.support import RedisClusterServer
    job, _ = ml_run
    off = _offline(job)
    pairs = off["pair_embeddings"]
    with RedisClusterServer(tmp_path / "cluster") as cluster:
        cfg = store_config.load(REPO, feast_yaml(tmp_path / "fs.yaml", f"  type: redis\n  redis_type: redis_cluster\n"
                                                                 f'  connection_string: "{cluster.url}"'))
        st = materialize(cfg, job.offline, ML_END, expire_from="write")
        assert {k: v["written"] for k, v in st["views"].items()} == {k: len(v) for k, v in off.items()}
        # Keys really are spread over the three primaries.
        sizes = [redis.Redis(port=n.port).dbsize() for n in cluster.nodes]
        assert min(sizes) > 0 and sum(sizes) >= len(pairs)
        fs = _feast(cfg.yaml_path, job.offline, monkeypatch)
        s = pairs.sample(30, random_state=2)
        got = fs.get_online_features(features=["pair_embeddings:embedding"], entity_rows=[
            {"user_id": int(u), "item_id": int(i)} for u, i in zip(s.user_id, s.item_id)]).to_dict()["embedding"]
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.stack(s.embedding))
        user = int(pairs.user_id.value_counts().index[0])
        mine = pairs[pairs.user_id == user]
        reader = FeatureReader(cfg, pairs.model_version.iloc[0], len(pairs.embedding.iloc[0]), misses=None,
                               cooldown_s=0, tiers=FALLBACKS)
        items = np.concatenate([mine.item_id.to_numpy(), [10**6]])
        f = reader.read(user, items, ML_END + HOUR)
        assert f.tier_names() == ["pair"] * len(mine) + ["user_aggregate"]
        np.testing.assert_array_equal(f.embeddings[:-1], np.stack(mine.embedding))
        assert f.counts.tolist() == [1] * len(mine) + [off["user_aggregates"].set_index("user_id").loc[user].n_pairs]
        # The reader's keys went to every primary (one buffer each), and it finds them where the slots say.
        from redis.crc import key_slot
        keys = ff.entity_keys({"user_id": np.full(len(items), user, np.int64), "item_id": items}, b"solaris")
        admin = [redis.Redis(port=n.port) for n in cluster.nodes]
        owner = {int(s): j for j, a in enumerate(admin) for s in {key_slot(k.tobytes()) for k in keys}
                 if a.execute_command("CLUSTER", "COUNTKEYSINSLOT", int(s))}
        assert len(set(owner.values())) == 3
        # Resharding under a live reader: one slot of the user's pairs migrates (keys and all) to another primary.
        # While it migrates, the old primary answers ASK for the keys that left: those rows are read as missing
        # (their pair falls back to the user's aggregate), the others as before, nothing fails open.
        slot = key_slot(keys[0].tobytes())
        in_slot = [k for k in range(len(mine)) if key_slot(keys[k].tobytes()) == slot]
        src, ids = owner[slot], [a.execute_command("CLUSTER", "MYID").decode() for a in admin]
        dst = (src + 1) % 3
        admin[dst].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src])
        admin[src].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst])
        moving = admin[src].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        admin[src].execute_command("MIGRATE", "127.0.0.1", cluster.nodes[dst].port, "", 0, 5000, "KEYS", *moving)
        asked = reader.read(user, items, ML_END + HOUR)
        assert not asked.failed_open
        assert [t for k, t in enumerate(asked.tier_names()) if k in in_slot] == ["user_aggregate"] * len(in_slot)
        assert [t for k, t in enumerate(asked.tier_names()) if k not in in_slot] == [
            t for k, t in enumerate(f.tier_names()) if k not in in_slot]
        # Once the slot is the new primary's, the old one answers MOVED: the reader maps the slots again and reads
        # once more, the same features as before the migration, and nothing fails open.
        for a in admin:
            a.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst])
        again = reader.read(user, items, ML_END + HOUR)
        assert not again.failed_open and again.tier_names() == f.tier_names()
        np.testing.assert_array_equal(again.embeddings, f.embeddings)
        m = reader.metrics.snapshot()
        assert (m.get("fail_open", 0), m["cluster_remaps"], m["cluster_ask"]) == (0, 1, len(in_slot))
        reader.close()
        for a in admin:
            a.close()


def test_a_cluster_primary_killed_under_a_reader_fails_open_until_its_replica_takes_over(ml_run, tmp_path):
    """A 3-primary Redis Cluster with a replica each; one primary holding some of a user's keys is killed (SIGKILL)
    under a live reader. Until its replica takes over, every read either fails open whole (tier none, zeros: nothing
    half-read is served) or, once the cluster answers again, returns exactly the features read before the kill;
    after the failover the reader serves those features again, and the next materialize completes on the cluster as
    it is now and leaves every key as the first one wrote it."""
    from redis.crc import key_slot

    from tests.support import RedisClusterServer
    job, _ = ml_run
    pairs = _offline(job)["pair_embeddings"]
    user = int(pairs.user_id.value_counts().index[0])
    items = np.concatenate([pairs[pairs.user_id == user].item_id.to_numpy(), [10**6]])
    with RedisClusterServer(tmp_path / "cluster", replicas=1, node_timeout_ms=1000) as cluster:
        cfg = store_config.load(REPO, feast_yaml(tmp_path / "fs.yaml", f"  type: redis\n  redis_type: redis_cluster\n"
                                                                 f'  connection_string: "{cluster.url}"'))
        materialize(cfg, job.offline, ML_END, expire_from="write")
        written = {n.port: _dump(redis.Redis(port=n.port)) for n in cluster.nodes[:cluster.n]}
        reader = FeatureReader(cfg, pairs.model_version.iloc[0], len(pairs.embedding.iloc[0]), misses=None,
                               cooldown_s=0, tiers=FALLBACKS)
        before = reader.read(user, items, ML_END + HOUR)
        assert not before.failed_open and "pair" in before.tier_names()
        keys = ff.entity_keys({"user_id": np.full(len(items), user, np.int64), "item_id": items}, b"solaris")
        slots = {key_slot(k.tobytes()) for k in keys}
        roles = cluster.roles()
        victim = next(n for n in cluster.nodes[:cluster.n] if any(
            redis.Redis(port=n.port).execute_command("CLUSTER", "COUNTKEYSINSLOT", s) for s in slots))
        replica = next(p for p, (r, of) in roles.items() if r == "replica" and of == victim.port)
        # Replication is asynchronous: the replica has every write before the kill (a lag would make it differ).
        assert redis.Redis(port=victim.port).execute_command("WAIT", 1, 5000) == 1
        os.kill(victim.proc.pid, signal.SIGKILL)
        outcomes, deadline = [], time.monotonic() + 60
        while time.monotonic() < deadline:
            f = reader.read(user, items, ML_END + HOUR)
            if f.failed_open:
                assert set(f.tier_names()) == {"none"} and not f.embeddings.any()
                outcomes.append("open")
            else:
                assert f.tier_names() == before.tier_names()
                np.testing.assert_array_equal(f.embeddings, before.embeddings)
                outcomes.append("served")
                if cluster.roles().get(replica, ("",))[0] == "primary":
                    break
            time.sleep(0.05)
        assert "open" in outcomes and outcomes[-1] == "served", outcomes[-10:]
        assert cluster.roles()[replica] == ("primary", None)
        m = reader.metrics.snapshot()
        assert m["fail_open"] >= 1 and m["fail_open"] == outcomes.count("open")
        reader.close()
        # The next materialize runs on the cluster as it is now (the promoted replica in the dead primary's place).
        st = materialize(cfg, job.offline, ML_END, expire_from="write")
        assert all(v["written"] > 0 for v in st["views"].values())
        live = [n.port for n in cluster.nodes[:cluster.n] if n is not victim] + [replica]
        after = {}
        for port in live:
            after.update(_dump(redis.Redis(port=port)))
        first = {k: v for d in written.values() for k, v in d.items()}
        assert after.keys() == first.keys() and all(after[k] == v for k, v in first.items())


def test_cluster_key_slots_in_bulk_equal_redis_pys():
    """``resp.key_slots`` (CRC16 by XOR of per-byte tables, for fixed-width keys) against redis-py's ``key_slot``,
    on Feast's entity keys and on random keys, hash tags (``{...}``) included."""
    from redis.crc import key_slot

    from solaris_jobs.online.resp import key_slots
    rng = np.random.default_rng(0)
    feast_keys = ff.entity_keys({"user_id": rng.integers(1, 2**40, 3000), "item_id": rng.integers(1, 2**40, 3000)},
                                b"solaris")
    raw = rng.integers(0, 256, (3000, 24), dtype=np.uint8)
    raw[:300, 3], raw[:300, 9] = ord("{"), ord("}")            # a hash tag: the slot of bytes 4..8 only
    raw[300:400, 5] = ord("{")                                 # a brace without its pair: the whole key
    for keys in (feast_keys, np.frombuffer(raw.tobytes(), "V24")):
        assert key_slots(keys).tolist() == [key_slot(k.tobytes()) for k in keys]
    assert key_slots(feast_keys[:0]).tolist() == []


def test_a_redis_error_in_the_last_reply_is_raised_at_once(redis_server):
    """An error reply is one line where a script's reply has three: the writer raises it instead of waiting for
    lines that never come (it waited out the 60 s socket timeout, then reported a timeout)."""
    from solaris_jobs.online.views import views
    from solaris_jobs.online.writer import Encoded, RedisWriter
    cfg = store_config.StoreConfig("redis", "solaris", Path("."), Path("."), nodes=(("127.0.0.1", redis_server.port),))
    client = store_config.redis_client(cfg, timeout_s=60)
    w = RedisWriter(client)
    enc = Encoded(np.frombuffer(b"err:key1err:key2", "V8"), [np.frombuffer(b"v1v1v2v2", "V4")])
    view = views()["user_aggregates"]
    w.write(view, enc, 1, 0, 0, [b"f"])
    assert w.flush() == (2, 0)
    client.script_flush()                     # the next EVALSHA gets "-NOSCRIPT ..." (one line)
    w.write(view, enc, 2, 0, 0, [b"f"])
    with pytest.raises(RuntimeError, match="redis refused a write: NOSCRIPT"):
        w.flush()
    w.close()


@pytest.mark.parametrize("kind", ["redis", "sqlite"])
def test_writer_and_reader_as_context_managers_close_what_they_open(kind, redis_server, tmp_path):
    """One writer interface for every store (``open_writer``, ``RowGroup``); leaving a ``with`` block closes the
    writer's and the reader's connections, and an explicit ``close()`` after it still works."""
    import sqlite3

    from solaris_jobs.online.views import views
    from solaris_jobs.online.writer import Encoded, OnlineWriter, RowGroup, open_writer
    if kind == "redis":
        cfg = store_config.StoreConfig("redis", "solaris", Path("."), Path("."),
                                       nodes=(("127.0.0.1", redis_server.port),))
    else:
        cfg = store_config.StoreConfig("sqlite", "solaris", Path("."), Path("."), sqlite_path=tmp_path / "online.db")
    view, t = views()["pair_embeddings"], pd.Timestamp.now(tz="UTC").floor("s")
    emb, version = np.arange(8, dtype=np.float32).reshape(2, 4), ff.string_value("v1")
    with open_writer(cfg) as w:
        assert isinstance(w, OnlineWriter)
        keys = ff.entity_keys({"user_id": np.array([7, 7]), "item_id": np.array([10, 11])}, w.key_suffix)
        rows = Encoded(keys, [ff.float_lists(emb), np.frombuffer(version * 2, np.dtype((np.void, len(version))))])
        w.write_group(RowGroup(view, rows, t, t + HOUR, t, shared=False, check_newer=False))
        assert w.flush() == (2, 0)
        w.mark_materialized(t.isoformat(), "{}")
    if kind == "redis":
        assert w.raw is None
    else:
        with pytest.raises(sqlite3.ProgrammingError, match="closed"):
            w.conn.execute("SELECT 1")
    w.close()
    assert t in materialized_intervals(cfg)
    with FeatureReader(cfg, "v1", 4, misses=None, tiers=FALLBACKS) as reader:
        f = reader.read(7, [10, 11, 12], t + pd.Timedelta(minutes=1))
        opened = reader._own.raw if kind == "redis" else reader._own.sqlite
    assert f.tier_names() == ["pair", "pair", "none"]
    np.testing.assert_array_equal(f.embeddings[:2], emb)
    assert opened is not None and reader._states == []
    if kind == "redis":
        assert opened.sock.fileno() == -1                      # the raw socket is closed
    else:
        with pytest.raises(sqlite3.ProgrammingError, match="closed"):
            opened.execute("SELECT 1")
    reader.close()


@pytest.mark.parametrize("kind", ["redis", "redis_cluster", "sqlite"])
def test_interval_lease_one_owner_at_a_time_renewed_released_and_expiring(kind, redis_server, tmp_path):
    """Two runs of one interval: the second is refused while the first holds the lease (and told who holds it),
    the holder renews it, only the holder releases it, and a lease nobody renews expires. On a Redis Cluster the
    miss stream too: misses written by the serving client's sink come out of ``drain_misses`` whole."""
    import contextlib

    from solaris_jobs.online import lease
    from tests.support import RedisClusterServer
    stack = contextlib.ExitStack()
    if kind == "redis":
        cfg = store_config.StoreConfig("redis", "solaris", Path("."), Path("."),
                                       nodes=(("127.0.0.1", redis_server.port),))
    elif kind == "redis_cluster":
        cluster = stack.enter_context(RedisClusterServer(tmp_path / "cluster"))
        cfg = store_config.StoreConfig("redis", "solaris", Path("."), Path("."), redis_type="redis_cluster",
                                       nodes=tuple(("127.0.0.1", n.port) for n in cluster.nodes))
    else:
        cfg = store_config.StoreConfig("sqlite", "solaris", Path("."), Path("."), sqlite_path=tmp_path / "online.db")
    end, other = ML_END + pd.Timedelta(days=400), ML_END + pd.Timedelta(days=401)
    assert lease.acquire(cfg, end, "run-a", 60)["owner"] == "run-a"
    with pytest.raises(lease.LeaseHeld, match=r"is being refreshed by run 'run-a'") as held:
        lease.acquire(cfg, end, "run-b", 60)
    assert held.value.holder == "run-a" and 0 < held.value.expires_in_s <= 60
    assert lease.acquire(cfg, end, "run-a", 60)["owner"] == "run-a"          # renewed by its holder
    assert lease.acquire(cfg, other, "run-b", 60)                           # other intervals are independent
    assert not lease.release(cfg, end, "run-b") and lease.holder(cfg, end) == "run-a"
    assert lease.release(cfg, end, "run-a") and lease.holder(cfg, end) is None
    assert lease.acquire(cfg, end, "run-b", 0.3)["owner"] == "run-b"
    time.sleep(0.5)
    assert lease.holder(cfg, end) is None and lease.acquire(cfg, end, "run-c", 60)["owner"] == "run-c"
    for e, o in ((end, "run-c"), (other, "run-b")):
        assert lease.release(cfg, e, o)
    if kind == "redis_cluster":
        from solaris_jobs.core.offline import misses_uri
        from solaris_jobs.online.misses import RedisStreamSink, drain_misses
        sink = RedisStreamSink(cfg)
        sink.write([(7, np.array([1, 2, 3]), 1_700_000_000_000), (8, np.array([2**40]), 1_700_000_001_000)])
        sink.close()
        moved = drain_misses(cfg, str(tmp_path / "offline"))
        got = pd.read_parquet(misses_uri(str(tmp_path / "offline"))).sort_values(["user_id", "item_id"])
        assert moved["pairs"] == 4 and got[["user_id", "item_id"]].values.tolist() == [[7, 1], [7, 2], [7, 3],
                                                                                        [8, 2**40]]
        assert drain_misses(cfg, str(tmp_path / "offline"))["pairs"] == 0        # moved, not copied
    stack.close()
    if kind == "sqlite":
        # The operator's view and override of a failed run's lease: `solaris lease show|release`.
        import json

        from click.testing import CliRunner

        from solaris_jobs.flows.cli import main
        lease.acquire(cfg, end, "failed-run", 600)
        yaml_path = feast_yaml(tmp_path / "fs.yaml", f"  type: sqlite\n  path: {tmp_path / 'online.db'}")
        env = {"FEAST_FS_YAML_FILE_PATH": str(yaml_path)}
        runner, at = CliRunner(env=env), end.isoformat()
        res = runner.invoke(main, ["lease", "show", "--end", at])
        assert res.exit_code == 0 and json.loads(res.output)["holder"] == "failed-run", res.output
        res = runner.invoke(main, ["lease", "release", "--end", at, "--owner", "someone-else"])
        assert res.exit_code != 0 and "holds no lease" in res.output and "'failed-run'" in res.output
        res = runner.invoke(main, ["lease", "release", "--end", at, "--owner", "failed-run"])
        assert res.exit_code == 0 and lease.holder(cfg, end) is None


def test_steps_outside_spark_on_an_s3_offline_store(ml_run, redis_server, tmp_path, monkeypatch):
    """An ``s3a://`` event log and offline store, on a real S3-API server (moto) on loopback: ``validate``,
    ``drain_misses``, ``materialize``, ``report`` and ``interval_complete`` read and write the bucket through
    pyarrow exactly what they do on local folders (same stats, same Redis contents, same report), the drained
    misses land in the bucket (not in a local folder named ``s3a:``), and a backfill sees the interval as done."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    from solaris_jobs.core.settings import Settings
    from solaris_jobs.flows import refresh_steps as rs
    from solaris_jobs.online.misses import RedisStreamSink
    from tests.support import S3Server
    job, _ = ml_run
    monkeypatch.chdir(tmp_path)
    # The report serves every tier here (MovieLens pairs rarely recur; the product's default serves the pair tier
    # alone): rows served from what the bucket held.
    monkeypatch.setattr("solaris_jobs.online.reader.DEFAULT_TIERS", FALLBACKS)
    monkeypatch.setenv("FEAST_FS_YAML_FILE_PATH", str(feast_yaml(
        tmp_path / "fs.yaml", f'  type: redis\n  connection_string: "{redis_server.url}"')))
    client = redis.Redis(port=redis_server.port)
    a, b = ML_END, ML_END + 6 * HOUR                             # the served interval after ML_END: 40 logged rows
    with S3Server(tmp_path / "s3") as s3:
        for k, v in s3.env.items():
            monkeypatch.setenv(k, v)
        s3.bucket("solaris")
        bucket, local_fs = uris.filesystem("s3a://solaris")[0], pafs.LocalFileSystem()
        for day in ("date=1998-02-28", "date=1998-03-01"):
            pafs.copy_files(f"{job.data}/events/{day}", f"solaris/data/events/{day}", local_fs, bucket)
        local = Settings(data=job.data, offline=str(tmp_path / "offline"), models=job.models,
                         precompute=job.precompute, expire_from="write")
        pafs.copy_files(job.offline, str(tmp_path / "offline"), local_fs, local_fs)
        pafs.copy_files(job.offline, "solaris/offline", local_fs, bucket)
        remote = Settings(data="s3a://solaris/data", offline="s3a://solaris/offline", models=job.models,
                          precompute=job.precompute, expire_from="write")

        got = {}
        for name, s in (("local", local), ("s3", remote)):
            client.flushall()
            v = rs.run_step(s, "validate", a, b)
            assert not rs.interval_complete(s, ML_END)           # complete offline, not yet materialized
            users = np.array([1, 2, 3], np.int64)
            RedisStreamSink(store_config.load()).write([(int(u), np.array([10, 20], np.int64), 889_000_000_000)
                                                        for u in users])
            d = rs.run_step(s, "drain_misses", a, b)
            m = rs.run_step(s, "materialize", ML_START, ML_END)
            assert rs.interval_complete(s, ML_END)
            r = rs.run_step(s, "report", a, b)
            fs, misses = uris.filesystem(layout.misses_uri(s.offline))
            drained = pq.ParquetDataset(misses, filesystem=fs).read().to_pandas().sort_values(["user_id", "item_id"])
            got[name] = {"validate": v, "drain": d, "dump": _dump(client), "report": r, "drained": drained,
                         "report_file": layout.read_report(s.offline, b),
                         "materialize": {k: {c: x for c, x in st.items() if c not in ("seconds", "rows_per_s")}
                                         for k, st in m["views"].items()}}
            assert rs.backfill(s, ML_START, ML_END)[0]["status"] == "skipped"
        assert got["s3"]["validate"] == got["local"]["validate"] and got["s3"]["validate"]["events"] == 40
        assert got["s3"]["drain"]["pairs"] == 6 == got["local"]["drain"]["pairs"]
        assert got["s3"]["drained"].user_id.tolist() == [1, 1, 2, 2, 3, 3]
        assert got["s3"]["materialize"] == got["local"]["materialize"]
        assert got["s3"]["dump"] == got["local"]["dump"] and len(got["s3"]["dump"]) > 0
        for k in ("coverage", "coverage_counts", "age_hours", "requests", "events", "latest_materialized_end"):
            assert got["s3"]["report"][k] == got["local"]["report"][k], k
        assert got["s3"]["report"]["coverage"]["none"] < 1          # rows served from what the bucket held
        assert got["s3"]["report_file"]["coverage"] == got["s3"]["report"]["coverage"]
        listed = [i.path for i in bucket.get_file_info(pafs.FileSelector("solaris/offline", recursive=True))]
        assert any(p.startswith("solaris/offline/misses/") for p in listed)
        assert any(p.startswith("solaris/offline/reports/end=") for p in listed)
    assert not any(p.name.startswith("s3") for p in tmp_path.iterdir() if p.name != "s3")   # nothing local


@pytest.mark.parametrize("fault", ["connection dropped", "server killed", "server hung"])
def test_redis_failing_mid_materialization_fails_the_task_and_a_retry_completes(fault, ml_run, redis_server,
                                                                                 tmp_path, monkeypatch):
    """Redis fails between two writes of one interval (after the pair view's batch went out): the task fails
    with a ``MaterializeError`` naming the view, the interval is not recorded as materialized (though some keys
    were written), and a retry once Redis is back leaves exactly what an uninterrupted run leaves."""
    from solaris_jobs.online.materialize import MaterializeError
    from solaris_jobs.online.writer import RedisWriter
    job, _ = ml_run
    cfg = store_config.load(REPO, feast_yaml(tmp_path / "fs.yaml", f'  type: redis\n  connection_string: '
                                                             f'"{redis_server.url}"'))
    admin = redis.Redis(port=redis_server.port)
    admin.flushall()
    materialize(cfg, job.offline, ML_END, expire_from="write")
    clean = _dump(admin)
    admin.flushall()

    sends, real_send = [], RedisWriter._send

    def send_then_fail(self, payload, kind, n):
        sends.append(n)
        if len(sends) == 2:                                  # the pair view's rows are out: the store fails now
            if fault == "connection dropped":
                # Once the server has applied some of what was sent (the writer does not wait for replies between
                # its sends; under load the server may not have read the first one yet).
                deadline = time.monotonic() + 10
                while not admin.dbsize() and time.monotonic() < deadline:
                    time.sleep(0.005)
                admin.client_kill_filter(_type="normal", skipme=True)
            elif fault == "server killed":
                os.kill(redis_server.proc.pid, signal.SIGKILL)
                redis_server.proc.wait(10)
            else:
                admin.execute_command("CLIENT", "PAUSE", 3000, "ALL")
        return real_send(self, payload, kind, n)

    monkeypatch.setattr(RedisWriter, "_send", send_then_fail)
    t0 = time.monotonic()
    with pytest.raises(MaterializeError, match=r"failed in view \w+ after \d+ of its rows") as failed:
        materialize(cfg, job.offline, ML_END, expire_from="write", timeout_s=1.0)
    waited = time.monotonic() - t0
    monkeypatch.setattr(RedisWriter, "_send", real_send)
    if fault == "server killed":
        redis_server.proc = None
        redis_server.start()                               # same port, empty (no persistence)
    elif fault == "server hung":
        # Given up on after the 1 s timeout, not waited out: a 3 s pause outlasted by the task would have let it
        # finish without an error.
        assert isinstance(failed.value.__cause__, TimeoutError), failed.value.__cause__
        time.sleep(max(0.0, 3.2 - waited))                 # the pause ends
    assert ML_END not in materialized_intervals(cfg)
    if fault == "connection dropped":
        assert 0 < len(_dump(admin)) < len(clean)            # a part was written, and not marked as done
    materialize(cfg, job.offline, ML_END, expire_from="write")
    assert ML_END in materialized_intervals(cfg)
    assert _dump(redis.Redis(port=redis_server.port)) == clean


def test_redis_with_a_password_and_tls_end_to_end(ml_run, tmp_path, monkeypatch, caplog):
    """A Redis that speaks only TLS and requires AUTH, named as Feast names it (``host:port,password=...,ssl=true,
    ssl_ca_certs=...``): materialization, the stock Feast SDK, the serving reader (its raw pipelined socket is the
    TLS one), the miss stream and its drain, and the interval lease all work through it; a wrong password or a
    plain-text client is a clear error, and the serving reader fails open instead."""
    from solaris_jobs.online import lease
    from solaris_jobs.online.misses import drain_misses as drain
    job, _ = ml_run
    off = _offline(job)
    pairs, agg = off["pair_embeddings"], off["user_aggregates"].set_index("user_id")
    version, dim = pairs.model_version.iloc[0], len(pairs.embedding.iloc[0])
    with RedisServer(tmp_path / "redis", tls_dir=tmp_path / "tls", password="s3cret-pw") as server:
        yaml = feast_yaml(tmp_path / "fs.yaml", f'  type: redis\n  connection_string: "{server.connection_string}"')
        cfg = store_config.load(REPO, yaml)
        assert cfg.describe().endswith("(tls)")
        caplog.set_level("DEBUG")
        st = materialize(cfg, job.offline, ML_END, expire_from="write")
        assert all(st["views"][n]["written"] == len(df) > 0 for n, df in off.items())
        assert ML_END in materialized_intervals(cfg)

        fs = _feast(yaml, job.offline, monkeypatch)
        some = pairs.sample(20, random_state=1)
        res = fs.get_online_features(features=["pair_embeddings:embedding"], entity_rows=[
            {"user_id": int(u), "item_id": int(i)} for u, i in zip(some.user_id, some.item_id)]).to_dict()
        np.testing.assert_array_equal(np.asarray(res["embedding"], np.float32), np.stack(some.embedding))

        user = int(pairs.user_id.value_counts().index[0])
        mine = pairs[pairs.user_id == user]
        unknown = np.arange(10**6, 10**6 + 5)
        reader = FeatureReader(cfg, version, dim, budget_ms=1000, tiers=FALLBACKS)          # misses to the Redis stream
        f = reader.read(user, np.concatenate([mine.item_id.to_numpy(), unknown]), ML_END + HOUR)
        assert f.tier_names() == ["pair"] * len(mine) + ["user_aggregate"] * len(unknown)
        np.testing.assert_array_equal(f.embeddings[:len(mine)], np.stack(mine.embedding))
        np.testing.assert_array_equal(f.embeddings[len(mine):], np.repeat(agg.loc[user].embedding[None], 5, 0))
        reader.close()
        assert drain(cfg, str(tmp_path / "offline"))["pairs"] == len(unknown)

        lease.acquire(cfg, ML_END, "run-a", 60)
        with pytest.raises(lease.LeaseHeld, match="run-a"):
            lease.acquire(cfg, ML_END, "run-b", 60)

        wrong = store_config.load(REPO, feast_yaml(tmp_path / "bad.yaml", "  type: redis\n  connection_string: "
                                                   f'"{server.connection_string.replace("s3cret-pw", "nope")}"'))
        with pytest.raises(redis.AuthenticationError):
            materialize(wrong, job.offline, ML_END, expire_from="write")
        plain = store_config.load(REPO, feast_yaml(tmp_path / "plain.yaml", "  type: redis\n  connection_string: "
                                                   f'"{server.url},password=s3cret-pw"'))
        with pytest.raises(redis.ConnectionError):
            materialize(plain, job.offline, ML_END, expire_from="write", timeout_s=2)
        down = FeatureReader(wrong, version, dim, budget_ms=200, misses=None, tiers=FALLBACKS)
        g = down.read(user, mine.item_id.to_numpy(), ML_END + HOUR)
        assert g.failed_open and set(g.tier_names()) == {"none"}
        down.close()
        # The same store through an Airflow connection (what SOLARIS_REDIS_CONN_ID names), read by the real
        # Airflow SDK: the repo's feature_store.redis.yaml expands the SOLARIS_REDIS it builds. In a process of its
        # own: importing Airflow here would fix its configuration (AIRFLOW_HOME, its DB) for the rest of the
        # session, and the DAG tests, run after this module, would then find no serialized DAG.
        import subprocess
        import sys
        env = {**os.environ, "AIRFLOW_HOME": str(tmp_path / "airflow"), "AIRFLOW_CONN_SOLARIS_TEST_REDIS": json.dumps({
            "conn_type": "redis", "host": "127.0.0.1", "port": server.port, "password": "s3cret-pw", "schema": "0",
            "extra": {"ssl": "true", "ssl_ca_certs": str(tmp_path / "tls" / "cert.pem")}})}
        env.pop("SOLARIS_REDIS", None)
        res = subprocess.run([sys.executable, "-c", "import os; from solaris_jobs.online import store_config as c; "
                              "assert c.use_airflow_connection('solaris_test_redis'); print(os.environ['SOLARIS_REDIS'])"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-3000:]
        monkeypatch.setenv("SOLARIS_REDIS", res.stdout.strip().splitlines()[-1])
        via = store_config.load(REPO, REPO / "feature_store.redis.yaml")
        assert via.nodes == cfg.nodes and via.redis_params == {**cfg.redis_params, "db": 0}
        assert materialize(via, job.offline, ML_END, expire_from="write")["views"] == {
            n: {**v, "seconds": ANY, "rows_per_s": ANY} for n, v in st["views"].items()}
        with pytest.raises(ValueError, match="'password' holds a ','") as bad:
            store_config.connection_string("h", 1, password="a,b")
        assert "a,b" not in str(bad.value)
        # The password is in no step's stats (the tasks' XComs), log line, error or config repr.
        stats = json.dumps([st, list(materialized_intervals(cfg).values()), lease.holder(cfg, ML_END)], default=str)
        assert "s3cret-pw" not in stats + caplog.text + repr(cfg) + cfg.describe()


def test_one_reader_shared_by_threads_serves_what_it_serves_alone(ml_run, store):
    """A ranker's worker threads sharing one ``FeatureReader``: each thread reads on its own connection, so
    every result equals the single-threaded one and the counters add up exactly (a shared raw socket would
    interleave the threads' replies)."""
    from concurrent.futures import ThreadPoolExecutor
    pairs = _offline(ml_run[0])["pair_embeddings"]
    version, dim = pairs.model_version.iloc[0], len(pairs.embedding.iloc[0])
    users = pairs.user_id.value_counts().index[:16].to_numpy()
    extra = np.arange(10**6, 10**6 + 30)
    requests = [(int(u), np.concatenate([pairs.item_id[pairs.user_id == u].to_numpy(), extra])) for u in users]
    alone = FeatureReader(store, version, dim, budget_ms=2000, misses=None, tiers=FALLBACKS)
    want = [alone.read(u, items, ML_END + HOUR) for u, items in requests]
    alone.close()
    shared = FeatureReader(store, version, dim, budget_ms=2000, misses=None, tiers=FALLBACKS)
    rounds = 25
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda k: (k % len(requests), shared.read(*requests[k % len(requests)], ML_END + HOUR)),
                            range(rounds * len(requests))))
    for k, f in got:
        assert not f.failed_open
        np.testing.assert_array_equal(f.tiers, want[k].tiers)
        np.testing.assert_array_equal(f.embeddings, want[k].embeddings)
    c = shared.metrics.counts
    assert c["requests"] == len(got) and c["rows"] == rounds * sum(len(i) for _, i in requests)
    assert c["tier_pair"] == rounds * sum(int((w.tiers == 0).sum()) for w in want)
    assert len(shared._states) > 1                        # the threads had connections of their own
    shared.close()


def test_an_sqlite_store_is_refused_under_an_executor_of_several_hosts(tmp_path, monkeypatch):
    """Celery or Kubernetes workers on several hosts would each write their own SQLite file (features and leases
    that never meet): refused with the settings to change; a Redis store, or one host's executor, is fine. The
    DAGs' tasks run the same check before they touch the store (with Airflow's configured executor)."""
    sqlite = store_config.StoreConfig("sqlite", "solaris", tmp_path, tmp_path / "feature_store.yaml",
                                      sqlite_path=tmp_path / "online.db")
    for executor in ("CeleryExecutor", "LocalExecutor,KubernetesExecutor",
                     "gpu:airflow.providers.celery.executors.celery_executor.CeleryExecutor"):
        with pytest.raises(ValueError, match=r"SQLite online store .*online.db .* lives on one host, but Airflow's "
                                             r"(Celery|Kubernetes)Executor runs tasks on several.*"
                                             r"FEAST_FS_YAML_FILE_PATH=feature_store.redis.yaml"):
            store_config.check_shared(sqlite, executor)
    for executor in ("LocalExecutor", "SequentialExecutor", "airflow.executors.local_executor.LocalExecutor", ""):
        store_config.check_shared(sqlite, executor)
    redis_cfg = store_config.StoreConfig("redis", "solaris", tmp_path, tmp_path / "fs.yaml", nodes=(("h", 1),))
    store_config.check_shared(redis_cfg, "CeleryExecutor")
    # With no executor given, Airflow's own configuration is read (AIRFLOW__CORE__EXECUTOR).
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "CeleryExecutor")
    with pytest.raises(ValueError, match="CeleryExecutor runs tasks on several"):
        store_config.check_shared(sqlite)
