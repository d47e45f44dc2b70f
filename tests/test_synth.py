import hashlib
from dataclasses import replace

import numpy as np
import pandas as pd

from solaris_jobs.core import events as ev
from solaris_jobs.data import synth


def _digest(root):
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.parquet")):
        h.update(p.relative_to(root).as_posix().encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def test_same_seed_same_bytes_other_seed_other_data(tmp_path, synth_root, synth_cfg):
    synth.generate(synth_cfg, tmp_path / "again")
    assert _digest(tmp_path / "again") == _digest(synth_root)
    synth.generate(replace(synth_cfg, seed=8), tmp_path / "other")
    assert _digest(tmp_path / "other") != _digest(synth_root)


def test_rows_do_not_depend_on_chunking(tmp_path, synth_root, synth_cfg):
    one = replace(synth_cfg, chunk_users=synth_cfg.users)
    synth.generate(one, tmp_path / "one")
    a = ev.read_events(synth_root).to_pandas()
    b = ev.read_events(tmp_path / "one").to_pandas()
    pd.testing.assert_frame_equal(a, b)
    # Chunks are written as separate files (one per chunk and hour), never gathered into one table.
    parts = {p.name for p in (synth_root / "events").rglob("*.parquet")}
    assert parts == {"part-00000.parquet", "part-00001.parquet", "part-00002.parquet"}
    assert {p.name for p in (tmp_path / "one" / "events").rglob("*.parquet")} == {"part-00000.parquet"}


def test_traffic_shape(synth_root, synth_cfg):
    df = ev.read_events(synth_root).to_pandas()
    m = ev.read_manifest(synth_root)
    assert m["events"] == len(df)
    # Contract: ids in range, all labelled, every request ranks n_pool + n_fresh candidates at one timestamp.
    assert df["user_id"].between(1, synth_cfg.users).all() and df["item_id"].between(1, synth_cfg.items).all()
    assert df["label"].notna().all()
    sizes = df.groupby("request_id").agg(n=("item_id", "size"), t=("event_timestamp", "nunique"))
    assert (sizes["n"] == synth_cfg.n_pool + synth_cfg.n_fresh).all() and (sizes["t"] == 1).all()
    # Ad-like: the positive rate is the one asked for (the label's bias is solved on a pilot).
    assert abs(m["positive_rate"] - synth_cfg.positive_rate) < 0.015
    assert m["calibration"]["bias"] < -2 and 0 < m["calibration"]["sd_d"]
    # ... on a pilot draw outside the log: the same for any population, so no row of the log (test days included)
    # fits it.
    pilot = replace(synth_cfg, calibration_users=100)
    assert synth.calibrate(replace(pilot, users=50), synth._World(pilot)) == synth.calibrate(
        replace(pilot, users=500), synth._World(pilot))
    # ERCache (arXiv 2410.06497): about 3 in 4 of a user's consecutive requests come within 10 minutes.
    assert 0.6 < m["consecutive_requests_within_10min"] < 0.95
    # Pairs recur (the manifest's figure is recomputed from the log), users return in sessions.
    rec, rows = synth.pair_recurrence(ev.read_events(synth_root))
    assert rows == len(df) and abs(rec / rows - m["pair_recurrence_24h"]) < 1e-12
    assert m["pair_recurrence_24h"] > 0.3
    req = df.drop_duplicates("request_id").sort_values(["user_id", "event_timestamp"])
    gaps = req.groupby("user_id")["event_timestamp"].diff().dropna().dt.total_seconds()
    assert (gaps < 15 * 60).mean() > 0.3 and (gaps > 3600).mean() > 0.1     # in-session and between sessions
    # Item popularity is heavy-tailed: the top 1% of items take far more than 1% of the rows.
    counts = df["item_id"].value_counts().to_numpy()
    assert counts[: max(1, synth_cfg.items // 100)].sum() / counts.sum() > 0.05
    users = ev.read_side(synth_root, "users")
    assert len(users) == synth_cfg.users and users["segment"].between(1, synth_cfg.categories).all()


def test_sequence_share_moves_the_label_signal_and_bad_parameters_are_named(tmp_path, synth_cfg):
    """At share 0 the sequence part has no weight: the labels do not depend on fatigue or interest at all, so two
    logs that differ only in the sequence part's own scale give the same labels; at share 1 they differ."""
    import pytest
    small = replace(synth_cfg, users=60, days=1, chunk_users=60, calibration_users=60)

    def labels(share, scale):
        cfg = replace(small, sequence_share=share)
        world = synth._World(cfg)
        calib = synth.calibrate(cfg, world)
        calib = replace(calib, sd_d=calib.sd_d * scale)
        return synth._generate_chunk(cfg, world, 0, cfg.users, calib).column("label").to_numpy()
    assert np.array_equal(labels(0.0, 1.0), labels(0.0, 3.0))
    assert not np.array_equal(labels(1.0, 1.0), labels(1.0, 3.0))
    with pytest.raises(ValueError, match="positive_rate = 1.5"):
        replace(small, positive_rate=1.5)


def test_pair_recurrence_counts_only_strictly_earlier_rows():
    t0 = pd.Timestamp("2026-01-01T00:00:00Z")
    df = pd.DataFrame({"user_id": [1, 1, 1, 1, 2], "item_id": [5, 5, 5, 5, 5],
                       "event_timestamp": [t0, t0, t0 + pd.Timedelta(hours=1), t0 + pd.Timedelta(hours=30),
                                           t0 + pd.Timedelta(hours=1)]})
    rec, rows = synth.pair_recurrence(ev.conform(df))
    # Rows at t0 have no earlier row; t0+1h recurs (t0 within 24 h); t0+30h does not (29 h gap); user 2 new.
    assert (rec, rows) == (1, 5)


def test_uniform_draws_are_keyed_not_sequential():
    a = synth._uniform(3, 1, np.arange(10))
    b = synth._uniform(3, 1, np.arange(5, 10))
    assert np.array_equal(a[5:], b) and (a >= 0).all() and (a < 1).all()
    assert abs(synth._uniform(3, 1, np.arange(100_000)).mean() - 0.5) < 0.01


def test_every_row_has_its_true_click_probability_beside_the_log(synth_root):
    """``truth/`` holds the probability each row's label was drawn from (never read by a job or a model): one per
    logged row, calibrated to the positive rate, and a better predictor of the labels than any model can be."""
    import pytest
    table = ev.read_events(synth_root)
    u, i = table.column("user_id").to_numpy(), table.column("item_id").to_numpy()
    t = table.column("event_timestamp").cast("int64").to_numpy()
    y = table.column("label").to_numpy().astype(float)
    p = synth.read_truth(synth_root, u, i, t)
    assert np.isfinite(p).all() and ((p > 0) & (p < 1)).all()
    assert abs(p.mean() - y.mean()) < 0.01                      # the labels are draws from these probabilities
    bce = lambda q: float(-np.mean(y * np.log(q) + (1 - y) * np.log(1 - q)))
    assert bce(p) < bce(np.full_like(p, y.mean())) - 0.01
    assert np.isnan(synth.read_truth(synth_root, [u[0]], [i[0]], [t[0] + 1]))[0]   # not a logged row
    with pytest.raises(FileNotFoundError, match="truth"):
        synth.read_truth(synth_root / "events", u, i, t)
