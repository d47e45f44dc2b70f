"""The Spark precompute jobs on real MovieLens-100K and small synthetic data, with one shared Spark session."""
import datetime as dt
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch

from models import load_checkpoint
from solaris_jobs.core import events as ev
from solaris_jobs.core import offline as off
from solaris_jobs.core.model_inputs import EventIndex, Examples
from solaris_jobs.core.settings import PrecomputeConfig, Settings
from solaris_jobs.data.requests import RequestSimulator, SimulatorConfig
from solaris_jobs.pipeline import jobs
from solaris_jobs.pipeline import aggregates, history, inference, interval_state, selection, simulator, windows
from solaris_jobs.pipeline.event_source import event_source
from solaris_jobs.pipeline.spark import read_events_df
from tests.support import ML_END, ML_LOOKBACK_START, ML_START, assert_same_frames, read_sorted


def _utc(ts):
    return pd.Timestamp(ts).tz_localize("UTC") if pd.Timestamp(ts).tzinfo is None else pd.Timestamp(ts)


def _read(spark, job, dataset):
    return off.read_interval(spark, job.offline, dataset, ML_END).toPandas()


def test_spark_reads_only_the_days_of_its_bounds(spark, tmp_path):
    """A local log's reader lists and opens only the day folders that can hold events of the bounds (a run over a
    long log reads its lookback, not the log), with the rows of the pyarrow reader; no day in range: no rows."""
    from solaris_jobs.pipeline.spark import event_folders
    t = pd.Timestamp("2026-01-01T00:00:00Z")
    stamps = [t + pd.Timedelta(minutes=m) for m in (0, 59, 60, 61, 600, 24 * 60 + 5, 3 * 24 * 60)]
    ev.write_events(ev.conform(pd.DataFrame({"user_id": range(1, 8), "item_id": range(11, 18),
                                             "event_timestamp": stamps, "label": 1})), tmp_path)
    (tmp_path / "events" / "_SUCCESS").touch()                      # not a partition: ignored
    base = tmp_path / "events"
    bounds = [(None, None), ("2026-01-01T01:00:00Z", None), ("2026-01-01T00:30:00Z", "2026-01-01T10:00:01Z"),
              (None, "2026-01-02T00:05:00Z"), ("2026-01-02T01:00:00Z", "2026-01-04T00:00:00Z")]
    folders = {b: [Path(p).relative_to(tmp_path).as_posix() for p in event_folders(base, *b)] for b in bounds}
    assert folders[bounds[0]] == folders[bounds[1]] == ["events"]                # every day: the log itself
    assert folders[bounds[2]] == ["events/date=2026-01-01"]
    assert folders[bounds[3]] == ["events/date=2026-01-01", "events/date=2026-01-02"]
    assert folders[bounds[4]] == ["events/date=2026-01-02"]
    for b in bounds:
        df = read_events_df(spark, str(tmp_path), *b)
        opened = {Path(f.removeprefix("file:")).parent.parent.name for f in df.inputFiles()}
        assert opened == {p.split("/")[-1] for p in folders[b]} or folders[b] == ["events"], (b, opened)
        got = df.toPandas().sort_values("user_id")["user_id"].tolist()
        assert got == ev.read_events(tmp_path, *b).to_pandas()["user_id"].tolist(), b
    empty = read_events_df(spark, str(tmp_path), "2026-01-03T00:00:00Z", "2026-01-04T00:00:00Z")
    assert empty.columns == ev.EVENT_SCHEMA.names and empty.count() == 0
    assert event_folders("s3a://bucket/events") is None                     # not local: Spark lists it
    assert ev.events_uri("s3a://bucket/root/") == "s3a://bucket/root/events"  # not Path's s3a:/bucket
    # A file URI (both spellings) lists the same days, keeping the scheme; bounds in another zone are UTC days.
    for uri in (f"file://{base}", f"file:{base}"):
        assert event_folders(uri, "2026-01-02T01:00:00+05:00", "2026-01-02T02:00:00+05:00") == \
            [f"file://{base}/date=2026-01-01"]
    # A folder with no day partitions is not a log read as empty: Spark gets it whole (and fails on it).
    (tmp_path / "flat").mkdir()
    assert event_folders(tmp_path / "flat") is None


def test_user_batches_keep_each_users_pairs_together():
    assert inference.user_batches(np.array([], np.int64), 4) == []
    cuts = inference.user_batches(np.array([10, 1, 1, 2, 3, 1]), 4)
    assert [(c.start, c.stop) for c in cuts] == [(0, 1), (1, 3), (3, 5), (5, 6)]   # by the batch of the first pair
    n = np.array([3, 0, 5, 1, 1, 2, 7])
    cuts = inference.user_batches(n, 5)
    assert cuts[0].start == 0 and cuts[-1].stop == len(n)
    assert all(a.stop == b.start for a, b in zip(cuts, cuts[1:]))               # consecutive, every user once
    assert all(n[c].sum() < 5 + n[c].max() for c in cuts)                        # about batch_size pairs each


def test_spark_candidates_equal_the_request_simulator(spark, movielens_root):
    cfg = SimulatorConfig(n_candidates=40, n_popular=15, covisit_window=2, covisit_top=20)
    T = pd.Timestamp("1998-02-01T00:00:00Z")
    prior = windows.prior_events(read_events_df(spark, str(movielens_root), end=T), T, None).cache()
    users = windows.active_users(prior, T, 24 * 7)
    got = simulator.candidate_pairs(prior, users, T, cfg).toPandas()
    ids = sorted(users.toPandas()["user_id"])
    assert len(ids) > 20
    ref = RequestSimulator(ev.read_events(movielens_root, end=T), T, cfg).candidates(ids)
    key = ["user_id", "item_id"]
    got, ref = got.sort_values(key).reset_index(drop=True), ref.sort_values(key).reset_index(drop=True)
    pd.testing.assert_frame_equal(got[key + ["source"]], ref[key + ["source"]])
    np.testing.assert_allclose(got["retrieval_score"], ref["retrieval_score"], rtol=1e-6)
    assert got.groupby("user_id").size().max() == 40


def test_simulated_sets_hand_checked():
    """The numpy step of ``candidate_pairs``: counts summed over a user's seeds, ties by the smaller item, at most
    n_candidates - n_popular co-visited items, then popular items the user does not have yet, in rank order."""
    user = np.array([1, 1, 1, 1, 1, 2, 2, 2], np.int64)
    item = np.array([7, 5, 6, 7, 9, 8, 3, 4], np.int64)      # user 1: item 7 from two seeds (2 + 1 = 3)
    count = np.array([2, 3, 4, 1, 1, 5, 1, 1], np.int64)
    popular = np.array([9, 4, 30, 31, 32], np.int64)           # ranks 0..4
    u, i, tier, n = simulator.simulated_sets(np.array([3, 1, 2, 1]), user, item, count, popular, n_candidates=5,
                                      n_popular=3)
    got = sorted(zip(u.tolist(), i.tolist(), tier.tolist(), n.tolist()))
    assert got == sorted([
        (1, 6, 0, 4), (1, 5, 0, 3),                                # 2 co-visited: 6 (4), then 5 and 7 tie at 3: 5
        (1, 9, 1, 0), (1, 4, 1, 1), (1, 30, 1, 2),                 # then 3 popular ones: 9 was cut, so it comes back
        (2, 8, 0, 5), (2, 3, 0, 1),                                # 3 and 4 tie at 1: 3
        (2, 9, 1, 0), (2, 4, 1, 1), (2, 30, 1, 2),
        (3, 9, 1, 0), (3, 4, 1, 1), (3, 30, 1, 2), (3, 31, 1, 3), (3, 32, 1, 4)])  # no seeds: popular only
    # Fewer co-visited items leave more room: user 2 with n_popular 2 keeps 8, 3, 4, and popular 4 is skipped.
    u, i, tier, n = simulator.simulated_sets(np.array([2]), user[5:], item[5:], count[5:], popular, 5, 2)
    assert sorted(zip(i.tolist(), tier.tolist())) == [(3, 0), (4, 0), (8, 0), (9, 1), (30, 1)]
    # No co-visit rows and no popular items: nothing, without an error.
    empty = np.array([], np.int64)
    assert all(len(x) == 0 for x in simulator.simulated_sets(np.array([1]), empty, empty, empty, empty, 5, 2))


def test_selection_exclusion_and_misses_hand_checked(spark):
    scored = spark.createDataFrame(pd.DataFrame({
        "user_id": [1, 1, 1, 1, 1, 2, 2],
        "item_id": [10, 11, 12, 13, 14, 10, 15],
        "vm_score": np.array([0.9, 0.8, 0.1, 0.5, 0.2, 0.3, 0.7], np.float32),
        "source": "covisit"}))
    sel = selection.select_pairs(scored, 0.4, "user", 0.5).toPandas().set_index(["user_id", "item_id"])
    # User 1: 5 candidates -> ceil(0.4 * 5) = 2 selected (0.9, 0.8); bottom floor(0.5 * 5) = 2 (0.2, 0.1).
    assert sorted(sel.index[sel["selected"]]) == [(1, 10), (1, 11), (2, 15)]
    assert sorted(sel.index[sel["bottom"]]) == [(1, 12), (1, 14), (2, 10)]
    # With 5 more candidates of user 1 excluded before scoring, the FM budget stays ceil(0.4 * 10) = 4.
    considered = spark.createDataFrame(pd.DataFrame({"user_id": [1], "n_considered": [10]}))
    budget = selection.select_pairs(scored, 0.4, "user", 0.5, considered).toPandas()
    assert sorted(budget.loc[budget["selected"], "item_id"].tolist()) == [10, 11, 13, 14, 15]
    glob = selection.select_pairs(scored, 0.3, "global", 0.5).toPandas()
    assert sorted(glob.loc[glob["selected"], "item_id"]) == [10, 11, 15]        # top 30% of 7 scores
    t1, t2 = dt.datetime(2026, 1, 1, 1), dt.datetime(2026, 1, 1, 2)
    bottoms = spark.createDataFrame(pd.DataFrame({"run": [t1, t2, t2, t1], "user_id": [1, 1, 1, 2],
                                                  "item_id": [12, 12, 14, 10]}))
    kept, excluded = selection.exclude_negatives(scored.drop("vm_score"), bottoms, runs=2)
    # Only (1, 12) was in the bottom share in both of the last two runs.
    assert sorted(map(tuple, excluded.toPandas().to_numpy())) == [(1, 12)]
    assert kept.count() == 6
    misses = spark.createDataFrame(pd.DataFrame({"user_id": [1, 3], "item_id": [13, 99]}))
    forced = selection.force_misses(selection.select_pairs(scored, 0.4, "user", 0.5), misses).toPandas()
    forced = forced.set_index(["user_id", "item_id"])
    assert forced.loc[(1, 13), "selected"] and forced.loc[(1, 13), "source"] == "miss"
    assert forced.loc[(3, 99), "selected"] and len(forced) == 8


def test_bad_event_rows_are_set_aside_with_a_reason(spark):
    t = dt.datetime(2026, 1, 1)
    df = spark.createDataFrame(pd.DataFrame({
        "user_id": [1, None, 3, 4, -5, 6], "item_id": [1, 2, None, 4, 5, 6],
        "event_timestamp": [t, t, t, t, t, t], "label": [1, 0, 1, 7, None, None]}),
        "user_id long, item_id long, event_timestamp timestamp, label int")
    good, bad = windows.split_bad_events(df)
    assert good.toPandas()["user_id"].tolist() == [1, 6]          # an unknown (null) label is allowed
    reasons = dict(bad.toPandas()[["user_id", "reason"]].fillna(0).astype({"user_id": int}).to_numpy().tolist())
    assert reasons == {0: "user_id is null or <= 0", 3: "item_id is null or <= 0",
                       4: "label is not 0, 1 or null", -5: "user_id is null or <= 0"}
    # The refresh's validate step counts the same rows per reason without Spark.
    table = pa.Table.from_pandas(df.toPandas().astype({"label": "Int8"}), preserve_index=False)
    assert ev.bad_event_counts(table) == {**dict.fromkeys(ev.BAD_EVENT_REASONS, 0),
                                          **bad.toPandas()["reason"].value_counts().to_dict()}


def test_fm_embeddings_equal_the_model_run_directly(spark, ml_run, movielens_root, ml_models, tmp_path):
    job, stats = ml_run
    assert stats["select"]["pairs_selected"] == stats["embed"]["pairs"] > 100
    assert stats["select"]["rejected_events"] == 0
    got = _read(spark, job, "pair_embeddings").sort_values(["user_id", "item_id"]).reset_index(drop=True)
    fm, fm_meta = load_checkpoint(ml_models / "fm.pt", kind="fm")
    ae, ae_meta = load_checkpoint(ml_models / "ae.pt", kind="ae")
    assert set(got["model_version"]) == {f"{fm_meta['model_version']}+{ae_meta['model_version']}"}
    assert (got["event_timestamp"].map(_utc) == ML_END).all()
    # Reference: the training code path over the lookback's events (it only looks before T, and sees the labels
    # that had arrived by T, as the refresh's state does).
    table = ev.read_events(movielens_root, ML_LOOKBACK_START)
    n = len(got)
    delay_us = int(job.precompute.label_delay_minutes * 60e6)
    ex = Examples(EventIndex(table, label_delay_us=delay_us), got["user_id"].to_numpy(), got["item_id"].to_numpy(),
                  np.full(n, ML_END.value // 1000), np.full(n, -1.0, np.float32), np.zeros(n, np.float32), 10)
    from models import batch_to_tensors
    with torch.inference_mode():
        ref = ae.encode(fm(batch_to_tensors(ex.batch(np.arange(n))))["h"]).numpy()
    np.testing.assert_allclose(np.stack(got["embedding"]), ref, rtol=1e-4, atol=1e-5)
    # Batches of about 20 pairs: users share a batch, and a batch goes over 20 rather than split a user.
    import shutil
    sizes = got.groupby("user_id").size().to_numpy()
    cuts = inference.user_batches(sizes, 20)
    assert len(cuts) < len(sizes) and any(sizes[c].sum() > 20 for c in cuts)
    small = replace(job, offline=str(tmp_path / "offline"), precompute=replace(job.precompute, batch_size=20))
    shutil.copytree(job.offline, small.offline)
    assert jobs.embed(spark, small, ML_START, ML_END)["pairs"] == n
    again = _read(spark, small, "pair_embeddings").sort_values(["user_id", "item_id"]).reset_index(drop=True)
    np.testing.assert_allclose(np.stack(again["embedding"]), ref, rtol=1e-4, atol=1e-5)
    # Selected pairs are the top 20% of each user's scored candidates.
    sel = _read(spark, job, "selection")
    per_user = sel.groupby("user_id").agg(n=("item_id", "size"), s=("selected", "sum"))
    assert (per_user["s"] == np.maximum(1, np.ceil(per_user["n"] * 0.2))).all()
    top = sel.sort_values(["user_id", "vm_score", "item_id"], ascending=[True, False, True])
    assert (top.groupby("user_id")["selected"].apply(lambda s: s.is_monotonic_decreasing)).all()


def test_user_aggregates_and_neighbours_equal_pandas(spark, ml_run):
    job, stats = ml_run
    pairs = _read(spark, job, "pair_embeddings")
    agg = _read(spark, job, "user_aggregates").set_index("user_id").sort_index()
    ref = pairs.groupby("user_id")["embedding"].apply(lambda s: np.mean(np.stack(s), 0))
    assert list(agg.index) == list(ref.index)
    np.testing.assert_allclose(np.stack(agg["embedding"]), np.stack(ref.to_numpy()), rtol=1e-5, atol=1e-6)
    assert (agg["n_pairs"] == pairs.groupby("user_id").size().sort_index()).all()
    nb = _read(spark, job, "neighbours").set_index("user_id")
    assert stats["neighbours"]["knn"]["index"] == "exact" and len(nb) > 0
    for user, row in nb.head(20).iterrows():
        w = [(s, agg.loc[n, "embedding"]) for n, s in zip(row["neighbour_ids"], row["similarities"])
             if n in agg.index and s > 0]
        expect = sum(s * np.asarray(e) for s, e in w) / sum(s for s, _ in w)
        np.testing.assert_allclose(row["embedding"], expect, rtol=1e-4, atol=1e-5)
        assert row["n_neighbours"] == len(w) and user not in row["neighbour_ids"]


def test_rerun_of_an_interval_gives_identical_outputs(spark, ml_run, movielens_root, tmp_path):
    """A rerun replaces the interval's outputs with identical ones, also when the events come from the whole log
    read once into memory (a replay's injected event source: events after T must not leak in) and time from an
    injected clock (only the timestamps written beside the outputs follow it). It reruns in a copy of the shared
    run's store, which the other tests read as that run left it."""
    job = replace(ml_run[0], offline=str(tmp_path / "offline"))
    shutil.copytree(ml_run[0].offline, job.offline)
    before = {d: read_sorted(job.offline, d, ML_END) for d in off.DATASETS}
    whole_log = ev.read_events(movielens_root)
    assert whole_log.num_rows == 100_000
    clock = pd.Timestamp("2031-05-05T05:05:05Z")
    jobs.run(spark, job, ML_START, ML_END, events=whole_log, clock=lambda: clock)
    for d, old in before.items():
        assert_same_frames(old, read_sorted(job.offline, d, ML_END), d)
    assert off.list_intervals(job.offline, "selection") == [ML_END]
    assert off.read_stats(job.offline, "neighbours", ML_END)["written_at"] == clock.isoformat()
    # embed and neighbours read the state the selection wrote from its read of the log (every user's history and
    # counters, the item counters); without it, embed reads the log and writes the state, and neighbours without
    # any orders the log itself: the same outputs every way.
    state = off.read_stats(job.offline, "selection", ML_END)["state"]
    assert state["users_with_history"] == len(before["user_histories"]) == state["users"] > 0
    assert state["items"] == len(before["item_counters"]) > 0
    assert off.read_stats(job.offline, "pair_embeddings", ML_END)["state_from"] == "select"
    assert off.read_stats(job.offline, "neighbours", ML_END)["histories_reused"]
    for d in interval_state.STATE:
        shutil.rmtree(off.interval_uri(job.offline, d, ML_END))
    assert jobs.embed(spark, job, ML_START, ML_END)["state_from"] == "log"
    for d in ("pair_embeddings", *interval_state.STATE):
        assert_same_frames(before[d], read_sorted(job.offline, d, ML_END), d)
    shutil.rmtree(off.interval_uri(job.offline, "user_histories", ML_END))
    assert not jobs.neighbours(spark, job, ML_START, ML_END)["histories_reused"]
    for d in ("user_embeddings", "neighbours"):
        assert_same_frames(before[d], read_sorted(job.offline, d, ML_END), d)
    # Embed without a whole state reads the log and writes the state, which its rerun reads. A selection published
    # after the state (another writer, a select that wrote none) makes that state stale: it is not read.
    assert jobs.embed(spark, job, ML_START, ML_END)["state_from"] == "log"
    assert jobs.embed(spark, job, ML_START, ML_END)["state_from"] == "select"
    off.stage_table(off.read_table(job.offline, "selection", ML_END), job.offline, "selection", ML_END).publish(
        {"interval_end": ML_END.isoformat()})
    assert jobs.embed(spark, job, ML_START, ML_END)["state_from"] == "log"
    assert jobs.neighbours(spark, job, ML_START, ML_END)["histories_reused"]     # the state embed wrote for it
    for d in ("pair_embeddings", "user_embeddings", "neighbours"):
        assert_same_frames(before[d], read_sorted(job.offline, d, ML_END), d)


def test_aggregate_window_counts_a_pair_once_and_only_this_version(spark):
    T = dt.datetime(2026, 1, 2, 0)
    rows = [  # user, item, embedding, hours before T, version
        (1, 10, [1.0, 0.0], 2, "v1"), (1, 10, [3.0, 0.0], 1, "v1"),     # same pair twice: the latest counts
        (1, 11, [0.0, 2.0], 5, "v1"), (1, 12, [9.0, 9.0], 30, "v1"),    # outside the 24 h window
        (1, 13, [5.0, 5.0], 1, "v0"), (2, 10, [1.0, 1.0], 0, "v1")]     # another model version
    df = spark.createDataFrame(pd.DataFrame({
        "user_id": [r[0] for r in rows], "item_id": [r[1] for r in rows],
        "embedding": [np.array(r[2], np.float32) for r in rows],
        "event_timestamp": [T - dt.timedelta(hours=r[3]) for r in rows], "model_version": [r[4] for r in rows]}),
        "user_id long, item_id long, embedding array<float>, event_timestamp timestamp, model_version string")
    cut = pd.Timestamp(T, tz="UTC")
    latest = aggregates.latest_pairs(df, cut, 24, "v1")
    got = aggregates.user_aggregates(latest, cut, "v1").toPandas().set_index("user_id")
    assert got.loc[1, "embedding"].tolist() == [1.5, 1.0] and got.loc[1, "n_pairs"] == 2
    assert got.loc[2, "embedding"].tolist() == [1.0, 1.0]
    # Item-aware fallbacks: user 1's pairs (10: [3, 0], 11: [0, 2]) weighted by their items' similarity to the
    # target's: item 20 points as item 10 (cosine 1 against 0), so softmax([1, 0] / 0.1); item 21 has no vector
    # (equal weights); user 3 has no embedded pair (no row).
    ids, vecs = np.array([10, 11, 20]), np.array([[1, 0], [0, 1], [1, 0]], np.float32)
    targets = spark.createDataFrame(pd.DataFrame({"user_id": [1, 1, 2, 3], "item_id": [20, 21, 21, 10]}))
    fb = {(r.user_id, r.item_id): r for r in aggregates.item_aware_fallbacks(targets, latest, ids, vecs, cut, "v1",
                                                                             0.1).collect()}
    w = 1 / (1 + np.exp(-10.0))
    assert sorted(fb) == [(1, 20), (1, 21), (2, 21)]
    np.testing.assert_allclose(fb[1, 20].embedding, [3 * w, 2 * (1 - w)], rtol=1e-5)
    np.testing.assert_allclose(fb[1, 21].embedding, [1.5, 1.0], rtol=1e-6)
    assert fb[1, 20].n_pairs == 2 and fb[2, 21].embedding == [1.0, 1.0] and fb[2, 21].model_version == "v1"


def test_negative_exclusion_over_consecutive_runs_on_synthetic(spark, synth_root, synth_models, tmp_path):
    cfg = PrecomputeConfig.per_user_share(history_len=10, exclusion_runs=2, exclusion_share=0.5, active_hours=48,
                                          simulator=SimulatorConfig(n_candidates=30, n_popular=10))
    offline = str(tmp_path / "off")
    start = pd.Timestamp("2026-01-06T00:00:00Z")
    # A serving miss recorded before the first run: its pair must be forced into that run's selection.
    (tmp_path / "off" / "misses").mkdir(parents=True)
    ev.write_table(pd.DataFrame({"user_id": [3], "item_id": [10_000], "missed_at": [start - pd.Timedelta(minutes=5)]}),
                   tmp_path / "off" / "misses" / "part-0.parquet")
    stats = []
    settings = Settings(data=str(synth_root), offline=offline, models=str(synth_models), precompute=cfg)
    for h in range(3):
        stats.append(jobs.select(spark, settings, start + pd.Timedelta(hours=h), start + pd.Timedelta(hours=h + 1)))
    assert [s["exclusion_history_runs"] for s in stats] == [0, 1, 2]
    first = off.read_interval(spark, offline, "selection", start + pd.Timedelta(hours=1)).toPandas()
    miss = first[(first["user_id"] == 3) & (first["item_id"] == 10_000)]
    assert len(miss) == 1 and miss["selected"].iloc[0] and miss["source"].iloc[0] == "miss"
    assert stats[0]["forced_misses"] == 1         # an item outside the catalogue: never a candidate itself
    assert stats[0]["pairs_excluded"] == stats[1]["pairs_excluded"] == 0
    third = stats[2]
    assert third["pairs_excluded"] > 0
    assert third["pairs_scored"] == third["pairs_considered"] - third["pairs_excluded"]
    # The FM budget is a share of what was considered, so exclusion does not shrink it.
    sel3 = off.read_interval(spark, offline, "selection", start + pd.Timedelta(hours=3)).toPandas()
    assert third["pairs_selected"] >= 0.2 * third["pairs_considered"] - sel3["user_id"].nunique()
    # The excluded pairs are exactly the candidates that were bottom in both earlier runs.
    ends = off.list_intervals(offline, "selection")
    runs = [off.read_interval(spark, offline, "selection", e).toPandas() for e in ends]
    both = set(map(tuple, runs[0].loc[runs[0]["bottom"], ["user_id", "item_id"]].to_numpy())) & \
        set(map(tuple, runs[1].loc[runs[1]["bottom"], ["user_id", "item_id"]].to_numpy()))
    scored_now = set(map(tuple, runs[2][["user_id", "item_id"]].to_numpy()))
    assert not (both & scored_now)
    assert third["pairs_excluded"] <= len(both)


def _derived_models(src, out, change):
    """A copy of the models folder whose FM weights were changed by ``change(fm)``; the AE re-saved as trained on
    the new FM (its version record), so that the pair resolves; the VM copied."""
    import shutil

    from models import save_checkpoint
    out.mkdir(parents=True)
    fm, fm_meta = load_checkpoint(src / "fm.pt", kind="fm")
    with torch.no_grad():
        change(fm)
    version = save_checkpoint(fm, out / "fm.pt", extra=fm_meta["extra"])
    ae, ae_meta = load_checkpoint(src / "ae.pt", kind="ae")
    save_checkpoint(ae, out / "ae.pt", extra={**ae_meta["extra"], "fm_version": version})
    shutil.copy(src / "vm.pt", out / "vm.pt")
    return out


def test_embed_sets_non_finite_fm_outputs_aside_with_a_count(spark, ml_run, movielens_root, tmp_path):
    """An FM whose embedding of one item is infinite: every pair whose target or history holds that item has a
    non-finite output; those pairs are counted and written aside, the rest embedded as usual."""
    import shutil
    job, _ = ml_run
    sel = _read(spark, job, "selection")
    bad_item = int(sel.loc[sel["selected"], "item_id"].value_counts().index[0])
    models = _derived_models(Path(job.models), tmp_path / "models",
                             lambda fm: fm.items.ids.weight[bad_item].fill_(float("inf")))
    offline = tmp_path / "offline"
    shutil.copytree(job.offline, offline)
    s = replace(job, offline=str(offline), models=str(models))
    stats = jobs.embed(spark, s, ML_START, ML_END)
    # The reference: which selected pairs the FM, run directly, gives a non-finite h for.
    fm, _ = load_checkpoint(models / "fm.pt", kind="fm")
    pairs = sel.loc[sel["selected"], ["user_id", "item_id"]].sort_values(["user_id", "item_id"])
    n = len(pairs)
    ex = Examples(EventIndex(ev.read_events(movielens_root, ML_LOOKBACK_START)), pairs["user_id"].to_numpy(),
                  pairs["item_id"].to_numpy(), np.full(n, ML_END.value // 1000), np.full(n, -1.0, np.float32),
                  np.zeros(n, np.float32), 10)
    from models import batch_to_tensors
    with torch.inference_mode():
        finite = torch.isfinite(fm(batch_to_tensors(ex.batch(np.arange(n))))["h"]).all(1).numpy()
    assert 0 < (~finite).sum() < n
    assert stats["rejected"] == {inference.NONFINITE_REASONS[0]: int((~finite).sum())} and stats["pairs"] == finite.sum()
    rejected = off.read_table(offline, "embedding_rejects", ML_END).to_pandas()
    assert sorted(map(tuple, rejected[["user_id", "item_id"]].to_numpy())) == \
        sorted(map(tuple, pairs.loc[~finite].to_numpy()))
    assert set(rejected["reason"]) == {inference.NONFINITE_REASONS[0]}
    emb = off.read_table(offline, "pair_embeddings", ML_END).to_pandas()
    assert len(emb) == finite.sum() and np.isfinite(np.stack(emb["embedding"])).all()
    # The per-row reason: the first model whose output is not finite.
    assert inference._nonfinite(np.array([True, False, True]), np.array([True, False, False])).tolist() == [-1, 0, 1]


def test_models_are_resolved_once_and_an_interval_keeps_its_version(spark, ml_run, tmp_path):
    """The models folder is a `current` link; it is switched to a new version between an interval's embed and its
    aggregate and neighbours (a training DAG's publish): those steps keep the version embed used and stamped, and
    the models resolve with their checks (AE of this FM, history length)."""
    import shutil

    from solaris_jobs.pipeline import model_refs
    job, _ = ml_run
    reg = tmp_path / "registry"
    old = Path(job.models)
    new = _derived_models(old, reg / "versions" / "b", lambda fm: fm.trunk[0].weight.mul_(1.01))
    (reg / "current").symlink_to(old, target_is_directory=True)
    offline = tmp_path / "offline"
    shutil.copytree(job.offline, offline)
    s = replace(job, offline=str(offline), models=str(reg / "current"))
    embedded = jobs.embed(spark, s, ML_START, ML_END)
    (reg / "next").symlink_to(new, target_is_directory=True)
    (reg / "next").replace(reg / "current")                    # publish: the link now points at version b
    agg, nb = (jobs.run(spark, s, ML_START, ML_END, (step,))[step] for step in ("aggregate", "neighbours"))
    old_version = model_refs.resolve(old, ("fm", "ae")).embedding_version
    assert embedded["model_version"] == agg["model_version"] == nb["model_version"] == old_version
    assert embedded["models"]["fm"]["path"] == str((old / "fm.pt").resolve())
    # Same rows as the run that never saw the switch.
    for d in ("user_aggregates", "user_embeddings", "neighbours"):
        assert_same_frames(read_sorted(job.offline, d, ML_END), read_sorted(offline, d, ML_END), d)
    # Resolving now gives version b; its checks name what is wrong.
    assert model_refs.resolve(reg / "current", ("fm", "ae")).embedding_version != old_version
    with pytest.raises(ValueError, match="history_len 20 is not the FM's"):
        model_refs.resolve(reg / "current", ("fm", "ae"), history_len=20)
    shutil.copy(old / "ae.pt", new / "ae.pt")
    with pytest.raises(ValueError, match="ae.pt was trained on FM .*, not on"):
        model_refs.resolve(reg / "current", ("fm", "ae"))
    # An executor that finds another version at the path it was given fails instead of stamping the wrong one.
    ref = model_refs.resolve(old, ("fm",)).fm
    with pytest.raises(RuntimeError, match="now holds .* the file was replaced during the run"):
        model_refs.load(model_refs.ModelRef("fm", str(new / "fm.pt"), ref.version, ref.config))


def test_active_requery_embeds_and_queries_only_users_with_new_events(spark, ml_run, movielens_root, tmp_path):
    """``knn_requery = active``: after a full interval (index published), the next interval embeds only the users
    with events since it, queries them against the full interval's index (exact here: brute force over its
    vectors), and carries everyone else's vector and neighbour list unchanged; a changed KNN setting or an index
    ``knn_rebuild_hours`` old makes the interval full again."""
    import shutil
    job, _ = ml_run
    act = replace(job, offline=str(tmp_path / "offline"),
                  precompute=replace(job.precompute, knn_requery="active", knn_rebuild_hours=48))
    shutil.copytree(job.offline, act.offline)
    first = jobs.neighbours(spark, act, ML_START, ML_END)
    assert first["full"] and first["full_because"] == "no earlier interval" and off.is_complete(
        act.offline, "knn_index", ML_END)
    full_t1 = off.read_table(act.offline, "user_embeddings", ML_END).to_pandas().set_index("user_id")
    T2 = ML_END + pd.Timedelta(days=1)
    jobs.run(spark, act, ML_END, T2, steps=("select", "embed", "aggregate"))
    second = jobs.neighbours(spark, act, ML_END, T2)
    log = ev.read_events(movielens_root).to_pandas()
    log["event_timestamp"] = pd.to_datetime(log["event_timestamp"], utc=True)
    changed = set(log.user_id[(log.event_timestamp >= ML_END) & (log.event_timestamp < T2)])
    lookback = T2 - pd.Timedelta(days=job.precompute.lookback_days)      # users with events in T2's lookback
    with_history = set(log.user_id[(log.event_timestamp >= lookback) & (log.event_timestamp < T2)])
    assert not second["full"] and 0 < second["users_embedded"] == len(changed)
    assert second["users_carried"] == len(with_history - changed) and second["knn"]["queried"] == len(changed)
    got = off.read_table(act.offline, "user_embeddings", T2).to_pandas().set_index("user_id")
    assert set(got.index) == with_history
    stay = sorted(with_history - changed)
    for col in ("vector", "neighbour_ids", "similarities"):
        np.testing.assert_array_equal(np.stack(got.loc[stay, col]), np.stack(full_t1.loc[stay, col]))
    assert (got.loc[stay, "embedded_at"].map(_utc) == ML_END).all()
    # The changed users' vectors are what a full interval computes for them ...
    full = replace(job, offline=str(tmp_path / "full"))
    shutil.copytree(act.offline, full.offline)
    for d in ("user_embeddings", "knn_index", "neighbours"):
        shutil.rmtree(Path(full.offline) / d)
    assert jobs.neighbours(spark, full, ML_END, T2)["full"]
    ref = off.read_table(full.offline, "user_embeddings", T2).to_pandas().set_index("user_id")
    moved = sorted(changed)
    np.testing.assert_allclose(np.stack(got.loc[moved, "vector"]), np.stack(ref.loc[moved, "vector"]), atol=1e-6)
    # ... and their neighbours are the exact top-k over the index's (T1) vectors, themselves left out.
    index_ids = full_t1.index.to_numpy()
    sims = np.stack(got.loc[moved, "vector"]) @ np.stack(full_t1["vector"]).T
    sims[np.array(moved)[:, None] == index_ids[None, :]] = -np.inf
    k = job.precompute.knn_k
    top = np.argsort(-sims, axis=1, kind="stable")[:, :k]
    np.testing.assert_allclose(np.stack(got.loc[moved, "similarities"]), np.take_along_axis(sims, top, 1),
                               rtol=1e-5, atol=1e-5)
    assert all(len(set(a) - set(index_ids[t])) <= 1 for a, t in zip(got.loc[moved, "neighbour_ids"], top))
    # Full again: other KNN settings, and an index as old as knn_rebuild_hours.
    other = replace(act, precompute=replace(act.precompute, knn_k=job.precompute.knn_k + 1))
    assert "another model version or KNN settings" in jobs.neighbours(spark, other, ML_END, T2)["full_because"]
    due = replace(act, precompute=replace(act.precompute, knn_rebuild_hours=24))
    assert "24 h old or more" in jobs.neighbours(spark, due, ML_END, T2)["full_because"]


def test_merge_histories_hand_checked(spark):
    """The last L of the previous histories and the new events; entries that left the lookback dropped first."""
    prev = pd.DataFrame({"user_id": [1, 2, 3], "hist_ts": [[10, 20, 30], [5, 6], [1]], "hist_item": [[1, 2, 3], [7, 8],
                                                                                                     [9]],
                         "hist_label": [[1, 0, -1], [0, 0], [1]], "hist_rating": [[0, 0, 0], [0, 0], [4]]})
    prev = spark.createDataFrame(prev, "user_id long, hist_ts array<long>, hist_item array<long>, "
                                       "hist_label array<int>, hist_rating array<int>")
    t = [pd.Timestamp(x, unit="us", tz="UTC") for x in (40, 50, 41)]
    new = spark.createDataFrame(pd.DataFrame({"user_id": [1, 1, 4], "item_id": [4, 5, 6], "event_timestamp": t,
                                              "label": [1, None, 0], "rating": [None, 3.0, None]}),
                                "user_id long, item_id long, event_timestamp timestamp, label int, rating float")
    got = {r["user_id"]: (r["hist_ts"], r["hist_item"], r["hist_label"], r["hist_rating"])
           for r in history.merge_histories(prev, new, 3, since=pd.Timestamp(6, unit="us", tz="UTC")).collect()}
    assert got == {1: ([30, 40, 50], [3, 4, 5], [-1, 1, -1], [0, 0, 3]),    # the oldest two made room for the new
                   2: ([6], [8], [0], [0]),                                  # ts 5 left the lookback
                   4: ([41], [6], [0], [0])}                                 # user 3's only event left: no row


def test_covisit_counts_and_seeds_updated_with_new_and_leaving_events_equal_a_recount(spark):
    """The co-visit counts of [b, T) from those of [a, P): plus the pairs whose later event is in [P, T) (with each
    user's last events before P from the histories at P), less those whose earlier event is in [a, b) (with each
    leaving user's next events: from the histories, or from the log where a user has more than a history's worth
    of events after b). Random events with ties in time and item, both kinds of leaving users."""
    from pyspark.sql import functions as F
    rng = np.random.default_rng(3)
    n = 4000
    users = np.where(rng.random(n) < 0.5, rng.integers(1, 10, n), rng.integers(10, 300, n))   # heavy and light
    ev_ = pd.DataFrame({"user_id": users, "item_id": rng.integers(1, 25, n),
                        "event_timestamp": pd.to_datetime(rng.integers(0, 400, n), unit="s", utc=True),
                        "label": rng.integers(0, 2, n), "rating": np.nan, "request_id": None, "vm_score": np.nan})
    # A user whose history at P (the last 12) starts at one of two events at the same time after b: the next events
    # of its one leaving event come from the log up to that time (both events) and from the history after it.
    secs = [10, 51, 51, *range(52, 63)]
    ev_ = pd.concat([ev_, ev_.iloc[:len(secs)].assign(user_id=1000, item_id=np.arange(1, len(secs) + 1),
                                                      event_timestamp=pd.to_datetime(secs, unit="s", utc=True))])
    ev_ = spark.createDataFrame(ev_, "user_id long, item_id long, event_timestamp timestamp, label int, "
                                     "rating float, request_id long, vm_score float").cache()
    at = {k: pd.Timestamp(v * 1_000_000, unit="us", tz="UTC") for k, v in dict(a=0, b=40, P=300, T=400).items()}

    def between(x, y):
        return ev_.where((F.col("event_timestamp") >= at[x].to_pydatetime())
                         & (F.col("event_timestamp") < at[y].to_pydatetime()))

    def frame(df):
        return df.toPandas().sort_values(["seed", "item_id"]).reset_index(drop=True)
    w, L = 3, 12
    hist = history.user_histories(between("a", "P"), L).cache()
    sizes = hist.select(F.col("hist_ts")[0].alias("o")).toPandas()["o"]
    b_us = at["b"].value // 1000
    assert (sizes < b_us).sum() > 5 and (sizes >= b_us).sum() > 5        # both kinds of leaving users
    added = simulator.covisit_added(simulator.history_events(hist, w, at["b"]), between("P", "T"), w)
    after = interval_state.after_leaving(spark, event_source(ev_), hist, between("a", "b"), at["b"], at["P"], w)
    gone = simulator.covisit_gone(between("a", "b"), after, w)
    got = simulator.merge_covisit(simulator.covisit_counts(between("a", "P"), w), added, gone)
    want = simulator.covisit_counts(between("b", "T"), w)
    assert_same_frames(frame(want), frame(got), "covisit counts")
    assert frame(gone)["count"].sum() > 0 and frame(added)["count"].sum() > 0
    # Each user's 4 latest items: those at P still in the lookback and the new events' (an item's latest time).
    seeds = [simulator.merge_seeds(simulator.user_seeds(between("a", "P"), 4), between("P", "T"), 4, at["b"]),
             simulator.user_seeds(between("b", "T"), 4)]
    got_seeds, want_seeds = (x.toPandas().sort_values(["user_id", "seed"]).reset_index(drop=True) for x in seeds)
    assert_same_frames(want_seeds, got_seeds, "seeds")
    assert want_seeds.groupby("user_id").size().max() == 4
    assert len(simulator.user_seeds(between("a", "P"), 4).where(F.col("ts") < b_us).toPandas()) > 0   # some leave
    # The popular items from the last popularity_hours' events and the item counters of the lookback, as from the
    # lookback's events: a 1-second window, so that the lookback's counts order the last of the 20.
    sim = SimulatorConfig(n_candidates=20, n_popular=10, popularity_hours=1 / 3600)
    totals = history.counters(between("b", "T"))[1].select("item_id", F.col("item_cnt").alias("count"))
    pop = [simulator.popular_items(between("P", "T"), at["T"], sim, totals), simulator.popular_items(between("b", "T"), at["T"], sim)]
    got_pop, want_pop = (x.toPandas().sort_values("rank").reset_index(drop=True) for x in pop)
    assert_same_frames(want_pop, got_pop, "popular")
    assert len(want_pop) == 20
    assert between("P", "T").where(F.col("event_timestamp") >= (at["T"] - pd.Timedelta(seconds=1))
                                   .to_pydatetime()).select("item_id").distinct().count() < 15
    # The top items per seed: ties in count go to the smaller item id.
    ranked = frame(want).sort_values(["seed", "count", "item_id"], ascending=[True, False, True])
    assert_same_frames(ranked.groupby("seed").head(2).sort_values(["seed", "item_id"]).reset_index(drop=True),
                       frame(simulator.covisit_top(want, 2)), "top 2")


def test_the_state_is_updated_from_the_previous_interval_and_equals_a_rebuild(spark, synth_root, synth_models,
                                                                              tmp_path, monkeypatch):
    """Select updates the interval's state (histories, counters) from the previous interval's with the new hour
    and, under a lookback, less the hour that left it: the state and the selection equal those of a full rebuild
    (here from the same events read once into memory). A full rebuild comes every ``state_rebuild_hours``, after a
    gap, and when the log's files of the state's hours changed (a late event)."""
    data = tmp_path / "data"
    shutil.copytree(synth_root, data)
    # The per-user share: the request simulator runs every hour, on its own state.
    cfg = PrecomputeConfig.per_user_share(history_len=10, lookback_days=1.5, exclusion_runs=0, active_hours=6,
                                          state_rebuild_hours=3, state_keep_hours=1,
                                          simulator=SimulatorConfig(n_candidates=20, n_popular=5))
    inc = Settings(data=str(data), offline=str(tmp_path / "inc"), models=str(synth_models), precompute=cfg)
    ref = replace(inc, offline=str(tmp_path / "ref"), precompute=replace(cfg, state_rebuild_hours=0))
    table = ev.read_events(data)
    memory, log = event_source(table), event_source(str(data))
    start = pd.Timestamp("2026-01-07T00:00:00Z")         # the log's third day: the lookback's first hours leave
    lookback = pd.Timedelta(days=1.5)
    built = []
    for h in range(4):
        T = start + pd.Timedelta(hours=h + 1)
        state = jobs.select(spark, inc, T - pd.Timedelta(hours=1), T)["state"]
        built.append((state["built"], state["simulator"]["built"], state["pruned"]["intervals"]))
        if h in (1, 2):
            # The reference: a full rebuild from the whole lookback's events, read once into memory.
            assert jobs.select(spark, ref, T - pd.Timedelta(hours=1), T, events=memory)["state"]["built"] == "full"
            for d in ("selection", *interval_state.STATE, *interval_state.SIMULATOR):
                assert_same_frames(read_sorted(ref.offline, d, T), read_sorted(inc.offline, d, T), f"{d} {h}")
            assert ev.read_events(data, T - lookback - pd.Timedelta(hours=1), T - lookback).num_rows > 0  # left
    # Updated twice in a row, then rebuilt: the last full rebuild was 3 h before. Each select removed the state
    # that ended more than state_keep_hours (1) before its own, once there was some; the updates did not need it.
    assert built == [("full", "full", 0), ("incremental", "incremental", 0), ("incremental", "incremental", 1),
                     ("full", "full", 1)]
    for d in (*interval_state.STATE, *interval_state.SIMULATOR):
        assert off.list_intervals(inc.offline, d) == [T - pd.Timedelta(hours=1), T], d
    # The label delay (30 min, the default) honoured by the refresh: the state at T holds none of the labels of its
    # last 30 min (null in the histories, left out of the labelled-event and positive counters) and every older one.
    assert cfg.label_delay_minutes == 30
    ev_df = table.to_pandas()
    ev_df = ev_df[(ev_df.event_timestamp >= T - lookback) & (ev_df.event_timestamp < T)]
    arrived = ev_df.label.notna() & (ev_df.event_timestamp < T - pd.Timedelta(minutes=30))
    want = ev_df.assign(k=arrived, p=arrived & (ev_df.label == 1)).groupby("user_id").agg(
        user_cnt=("k", "size"), user_known=("k", "sum"), user_pos=("p", "sum")).reset_index()
    got = read_sorted(inc.offline, "user_counters", T)
    assert_same_frames(want.astype("int64"), got[list(want.columns)].astype("int64"), "user counters under delay")
    assert (want.user_known < want.user_cnt).sum() > 5 and (ev_df.label.notna() & ~arrived).sum() > 10  # labels hidden
    hist = read_sorted(inc.offline, "user_histories", T).explode(["hist_ts", "hist_label"])
    late = hist.hist_ts.astype("int64") >= (T - pd.Timedelta(minutes=30)).value // 1000
    assert late.sum() > 10 and (hist.hist_label[late] == -1).all() and (hist.hist_label[~late] >= 0).all()
    # The evaluated configuration: the whole log as lookback (nothing leaves), a budget ranked by recency whose
    # recently ranked pairs fill it, so that only the last 24 h are read.
    ev_cfg = replace(cfg, lookback_days=None, recent_hours=24, budget_per_row=0.5, select_priority="recency")
    whole_log = [replace(x, offline=x.offline + "_all", precompute=replace(
        ev_cfg, state_rebuild_hours=x.precompute.state_rebuild_hours)) for x in (inc, ref)]
    for h in (1, 2):
        T2 = start + pd.Timedelta(hours=h + 1)
        got = jobs.select(spark, whole_log[0], T2 - pd.Timedelta(hours=1), T2)
        assert got["state"]["built"] == ("full", "incremental")[h - 1] and got["simulator_skipped"]
    jobs.select(spark, whole_log[1], T2 - pd.Timedelta(hours=1), T2, events=memory)
    for d in ("selection", *interval_state.STATE):
        assert_same_frames(read_sorted(whole_log[1].offline, d, T2), read_sorted(whole_log[0].offline, d, T2), d)
    # The verifier scored only the part of the pool the budget reaches; scoring the whole pool selects the same
    # pairs with the same priority ranks.
    assert got["budget_reach"] is not None and got["pairs_beyond_reach"] > 0
    assert got["pairs_scored"] + got["pairs_beyond_reach"] == got["pairs_considered"]
    assert sum(v["pool"] for v in got["by_source"].values()) == got["pairs_considered"]
    assert sum(v["selected"] for v in got["by_source"].values()) == got["pairs_selected"] == got["budget_pairs"]
    monkeypatch.setattr(selection, "budget_reach", lambda pool, n: None)
    whole_pool = replace(whole_log[1], offline=whole_log[1].offline + "_pool")
    full = jobs.select(spark, whole_pool, T2 - pd.Timedelta(hours=1), T2, events=memory)
    assert full["pairs_scored"] == full["pairs_considered"] == got["pairs_considered"] and "budget_reach" in full
    picked = [read_sorted(x.offline, "selection", T2).query("selected")[["user_id", "item_id", "priority_rank"]]
              .reset_index(drop=True) for x in (whole_pool, whole_log[0])]
    assert_same_frames(picked[0], picked[1], "selected under the reach")

    def state_run(settings, source, T, history_len=10):
        return interval_state.StateRun(spark, settings, source, T, history_len, lambda df: df)

    def why_full(settings, source, T):
        return interval_state.previous_state(state_run(settings, source, T), T - pd.Timedelta(hours=1)).rebuild_because
    nxt = T + pd.Timedelta(hours=1)
    assert why_full(inc, log, nxt) is None

    def why_sim(settings, T, history_len=10):
        base = interval_state.previous_state(state_run(settings, log, T), T - pd.Timedelta(hours=1)).previous
        return interval_state.simulator_rebuild_reason(state_run(settings, log, T, history_len), base)
    # The request simulator's state is updated with the state, unless its settings or the history length do not
    # allow it, or the previous select skipped the simulator (and wrote none).
    assert why_sim(inc, nxt) is None
    assert "another covisit_window" in why_sim(replace(inc, precompute=replace(
        cfg, simulator=replace(cfg.simulator, covisit_window=2))), nxt)
    assert "shorter than covisit_window" in why_sim(inc, nxt, history_len=2)
    assert "no request simulator state" in why_sim(whole_log[0], T2 + pd.Timedelta(hours=1))
    # A state read from events in memory is updated from that same table (its rows cannot change), not the log's.
    T3 = start + pd.Timedelta(hours=3)
    assert why_full(replace(ref, precompute=cfg), memory, T3) is None
    assert "changed" in why_full(replace(ref, precompute=cfg), log, T3)
    assert "changed" in why_full(inc, memory, nxt)
    # What leaves the lookback between two cutoffs: only what the earlier state held (a lookback shorter than the
    # interval: all of it, not the events since).
    hour, day = pd.Timedelta(hours=1), pd.Timedelta(days=1)
    assert interval_state.leaving_hours(T, T + hour, 1.0) == (T - day, T - day + hour)
    assert interval_state.leaving_hours(T, T + 3 * hour, 1 / 24) == (T - hour, T)
    assert interval_state.leaving_hours(T, T + hour, None) is None
    # A gap: the last state does not end at the interval's start.
    assert "not at this interval's start" in why_full(inc, log, nxt + pd.Timedelta(hours=1))
    # A late event in an hour the state covers (a new file in an old hour folder): the next interval rebuilds.
    late = table.slice(0, 1).to_pandas()
    late["event_timestamp"] = T - pd.Timedelta(hours=3)
    ev.write_events(pa.Table.from_pandas(late, preserve_index=False), data, part="late")
    assert "changed" in why_full(inc, log, nxt)
