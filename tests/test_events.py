from dataclasses import replace

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from solaris_jobs.core import events as ev


def _frame():
    return pd.DataFrame({
        "user_id": [1, 2, 1, 3],
        "item_id": [10, 11, 12, 13],
        "event_timestamp": pd.to_datetime(["2026-01-01T00:59:59.123456", "2026-01-01T01:00:00",
                                           "2026-01-01T01:30:00", "2026-01-02T23:00:00"], utc=True, format="ISO8601"),
        "label": [1, 0, 1, None],
    })


def test_write_read_interval_and_layout(tmp_path):
    n = ev.write_events(ev.conform(_frame()), tmp_path, part="p0")
    assert n == 4
    files = sorted(p.relative_to(tmp_path / "events").as_posix() for p in (tmp_path / "events").rglob("*.parquet"))
    assert files == ["date=2026-01-01/hour=00/p0.parquet", "date=2026-01-01/hour=01/p0.parquet",
                     "date=2026-01-02/hour=23/p0.parquet"]
    # Microsecond UTC timestamps on disk (Spark cannot read nanoseconds).
    schema = pq.read_schema(tmp_path / "events" / files[0])
    assert schema.field("event_timestamp").type == pa.timestamp("us", tz="UTC")
    got = ev.read_events(tmp_path, "2026-01-01T01:00:00Z", "2026-01-02T00:00:00Z").to_pandas()
    assert got["item_id"].tolist() == [11, 12]       # end is exclusive, start inclusive
    whole = ev.read_events(tmp_path).to_pandas()
    assert whole["event_timestamp"].iloc[0] == pd.Timestamp("2026-01-01T00:59:59.123456Z")
    assert whole["label"].isna().sum() == 1
    # Rewriting the same part overwrites: no duplicated rows.
    ev.write_events(ev.conform(_frame()), tmp_path, part="p0")
    assert ev.read_events(tmp_path).num_rows == 4


def test_conform_names_missing_column_and_bad_type():
    with pytest.raises(ev.DataContractError, match=r"mysource: required column 'item_id' is missing"):
        ev.conform(_frame().drop(columns="item_id"), "mysource")
    bad = _frame().assign(user_id=["a", "b", "c", "d"])
    with pytest.raises(ev.DataContractError, match=r"column 'user_id' of type string"):
        ev.conform(bad, "x")


def test_read_events_without_log_is_a_clear_error(tmp_path):
    with pytest.raises(ev.DataContractError, match="no event log"):
        ev.read_events(tmp_path)


def test_validate_step_counts_bad_rows_and_stops_a_broken_interval(tmp_path):
    """The refresh's first task: rows that read but break the contract are counted per reason; past the allowed
    share the task fails with a message naming the interval, the counts and the setting."""
    from solaris_jobs.core.settings import Settings
    from solaris_jobs.flows import refresh_steps as o
    n = 20
    frame = pd.DataFrame({"user_id": [0, 0, -3] + list(range(1, n - 2)), "item_id": range(1, n + 1),
                          "event_timestamp": pd.date_range("2026-01-01T01:00", periods=n, freq="1min", tz="UTC"),
                          "label": [1, 0, 1, 7] + [1] * (n - 4)})
    ev.write_events(ev.conform(frame), tmp_path)
    s = Settings.from_env({"SOLARIS_DATA": str(tmp_path), "SOLARIS_OFFLINE": str(tmp_path / "off"),
                           "SOLARIS_MODELS": str(tmp_path), "SOLARIS_MAX_BAD_SHARE": "0.25"})
    out = o.validate(s, "2026-01-01T01:00", "2026-01-01T02:00")
    assert out["events"] == n and out["bad_events"] == {"user_id is null or <= 0": 3, "label is not 0, 1 or null": 1}
    # The same step on events already read (a replay's injected event source): the same counts.
    assert o.validate(s, "2026-01-01T01:00", "2026-01-01T02:00", events=frame) == out
    with pytest.raises(ev.DataContractError, match=r"4 of 20 rows .*user_id is null or <= 0: 3.*MAX_BAD_SHARE=0.1"):
        o.validate(replace(s, max_bad_share=0.1), "2026-01-01T01:00", "2026-01-01T02:00")
    # An interval of the far future (a wrong clock, bounds of another year): refused, not run on an empty log.
    with pytest.raises(ev.DataContractError, match=r"interval \[2026-01-01T01:00:00\+00:00, .* starts more than a "
                                                   r"day after now \(2025-12-30T00:00:00\+00:00\)"):
        o.validate(s, "2026-01-01T01:00", "2026-01-01T02:00", clock=lambda: pd.Timestamp("2025-12-30", tz="UTC"))
    with pytest.raises(ValueError, match=r"SOLARIS_MAX_BAD_SHARE \(max_bad_share\): .*less than or equal to 1 "
                                         r"\(got '2'\)"):
        Settings.from_env({"SOLARIS_DATA": "x", "SOLARIS_OFFLINE": "x", "SOLARIS_MODELS": "x",
                           "SOLARIS_MAX_BAD_SHARE": "2"})


def test_side_tables_read_from_an_s3a_data_root_as_from_the_local_one(synth_root, tmp_path, monkeypatch):
    """An ``s3a://`` data root (a real S3-API server, moto, on loopback) gives the same side tables, and the training
    loader the same side features, as the local root it was copied from (they were read from a local path built
    from the URI: an empty table, silently). A side table that is missing is a FileNotFoundError naming the table
    and its path, there and on a local root, and so is the training loader's read of that root."""
    import numpy as np
    import pyarrow.fs as pafs

    from solaris_jobs.core import uris
    from solaris_jobs.learning import training
    from tests.support import S3Server
    with S3Server(tmp_path / "s3") as s3:
        for k, v in s3.env.items():
            monkeypatch.setenv(k, v)
        s3.bucket("solaris")
        bucket = uris.filesystem("s3a://solaris")[0]
        pafs.copy_files(str(synth_root), "solaris/data", pafs.LocalFileSystem(), bucket)
        remote = "s3a://solaris/data"
        for kind in ev.SIDE_TABLES:
            local = ev.read_side(synth_root, kind)
            assert len(local) == 300 and len(local.columns) > 1
            pd.testing.assert_frame_equal(ev.read_side(remote, kind), local)
        a = training.load_dataset(str(synth_root), history_len=5)
        b = training.load_dataset(remote, history_len=5)
        assert b.user_side == a.user_side and b.item_side == a.item_side and a.item_side["categorical"]
        for side in ("user", "item"):
            (cat_a, multi_a, vocab_a), (cat_b, multi_b, vocab_b) = a.tables[side], b.tables[side]
            np.testing.assert_array_equal(cat_b, cat_a)
            assert cat_a.any() and vocab_a is None and vocab_b is None and multi_b.keys() == multi_a.keys()
            for c in multi_a:
                np.testing.assert_array_equal(multi_b[c], multi_a[c])
        bucket.delete_file("solaris/data/items.parquet")
        missing = r"s3a://solaris/data/items\.parquet: the items side table is missing"
        with pytest.raises(FileNotFoundError, match=missing):
            ev.read_side(remote, "items")
        with pytest.raises(FileNotFoundError, match=missing):
            training.load_dataset(remote, history_len=5)
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path}/users\.parquet: the users side table is missing"):
        ev.read_side(tmp_path, "users")
    with pytest.raises(ValueError, match="no side table 'user'"):
        ev.read_side(synth_root, "user")
