"""`solaris data profile`: what a log offers SOLARIS, computed on a hand-made log whose every figure is worked out
by hand below."""
import json

import pandas as pd
import pytest
from click.testing import CliRunner

from solaris_jobs.core import events as ev
from solaris_jobs.data import profile as pr
from solaris_jobs.flows.cli import main

T = pd.Timestamp("2026-01-01T00:00:00Z")


def _log(root, rows) -> None:
    df = pd.DataFrame(rows, columns=["user_id", "item_id", "minutes", "label", "request_id"])
    df["event_timestamp"] = T + pd.to_timedelta(df.pop("minutes"), unit="min")
    df["label"] = df["label"].astype("Int8")
    ev.write_events(df, root)


def test_the_profile_of_a_hand_made_log(tmp_path):
    # Refreshes every hour from 00:00; a refresh at R embeds the pairs ranked in [R - 2 h, R) and serves them
    # for 2 h (age < 2 h). Rows counted: from 02:00 (the window after the first refresh slot).
    _log(tmp_path, [
        (1, 10, 5, 1, 1), (1, 11, 5, 0, 1),     # 00:05, request 1
        (1, 10, 90, 0, 2),                      # 01:30: not counted (before 02:00)
        (1, 10, 190, 1, 3),                     # 03:10: shown 01:30, embedded at 02:00 and 03:00: covered
        (1, 11, 190, 0, 3),                     # 03:10: shown 00:05, embedded at 01:00, 02:00 (fresh to 04:00)
        (2, 20, 330, None, 4),                  # 05:30: never shown before: not covered
        (2, 20, 345, 0, 5),                     # 05:45: shown at 05:30, after the 05:00 refresh: not covered
        (2, 20, 370, 0, 6),                     # 06:10: shown 05:45, embedded at 06:00: covered
        (1, 11, 510, 0, 7),                     # 08:30: shown 03:10, embedded at 04:00, 05:00, stale from 07:00
        (0, 11, 515, 0, 8),                     # user 0 breaks the contract: set aside
    ])
    res = CliRunner().invoke(main, ["data", "profile", str(tmp_path), "--ttl", "2h", "--window", "2h", "--json"])
    assert res.exit_code == 0, res.output
    p = json.loads(res.output)
    assert (p["events"], p["users"], p["items"]) == (10, 2, 3)
    assert list(p["set_aside"].values()) == [1]
    # 3 covered of the 6 rows from 02:00 on.
    assert p["pair_ceiling"]["rows_counted"] == 6 and p["pair_ceiling"]["ceiling"] == pytest.approx(0.5)
    # Pairs in the window of each refresh from 02:00 to 08:00: 2, 1, 2, 2, 1, 1, 1, for the 6 rows logged in their
    # intervals (2 at 03:10, 2 after 05:00, 1 after 06:00, 1 after 08:00).
    assert p["pair_ceiling"]["refreshes"] == 7 and p["pair_ceiling"]["pairs_per_row"] == pytest.approx(10 / 6)
    # Rows whose pair came in an earlier request within 24 h: 01:30, both 03:10, 05:45, 06:10, 08:30.
    assert p["pair_recurrence_24h"] == pytest.approx(6 / 9)
    # Gaps between a user's requests: user 1 85, 100, 320 min; user 2 15, 25 min.
    g = p["request_gaps"]
    assert (g["requests"], g["gaps"], g["median_minutes"], g["within_10min"], g["within_1h"]) == (7, 5, 85, 0, 0.4)
    assert p["next_day_return"] is None                         # one day: no next day to return on
    assert p["labelled_share"] == pytest.approx(8 / 9) and p["positive_rate"] == pytest.approx(2 / 8)
    assert p["verdict"][0].startswith("pairs recur: up to 50% of rows")
    assert any("1.67 FM inferences per served row" in v for v in p["verdict"])
    assert any("a small log (10 events)" in v for v in p["verdict"])
    text = CliRunner().invoke(main, ["data", "profile", str(tmp_path), "--ttl", "2h", "--window", "2h"]).output
    assert "pair-coverage ceiling (cadence 1h, TTL 2h, pool window 2h): 50.0% of 6 rows" in text


def test_a_log_whose_pairs_never_recur_says_so_and_bad_settings_are_named(tmp_path):
    # MovieLens-like: every (user, item) once, over three days; users back on the next day half the time.
    _log(tmp_path, [(u, 1000 * u + 10 * d + k, 60 * 24 * d + 7 * k, 1, None) for u in (1, 2) for d in range(3) for k in range(5)
                    if not (u == 2 and d == 1)])
    p = pr.profile(tmp_path)
    assert p["pair_ceiling"]["ceiling"] == 0.0 and p["pair_recurrence_24h"] == 0.0
    assert p["verdict"][0].startswith("pairs rarely recur: at most 0% of rows")
    # Day 0: users 1 and 2, of whom 1 is back on day 1; day 1: user 1, back on day 2.
    assert p["next_day_return"] == pytest.approx(2 / 3)
    res = CliRunner().invoke(main, ["data", "profile", str(tmp_path), "--cadence", "2h", "--ttl", "1h"])
    assert res.exit_code == 1 and "--ttl (1h) and --window (24h) must be at least the cadence (2h)" in res.output
    res = CliRunner().invoke(main, ["data", "profile", str(tmp_path), "--cadence", "often"])
    assert res.exit_code == 1 and "--cadence: not a duration: 'often'" in res.output
    res = CliRunner().invoke(main, ["data", "profile", str(tmp_path), "--cadence", "500ms"])
    assert res.exit_code == 1 and "--cadence: must be a positive number of whole seconds" in res.output


def test_the_ceiling_at_refresh_boundaries_and_at_the_ttl():
    """A showing at a refresh's own instant is after it (embedded by the next); a row whose pair's last embedding
    is exactly one TTL old is not covered (age < TTL)."""
    import numpy as np
    h = 3600 * 1_000_000
    t0 = T.value // 1000
    # Pair (3, 30): shown at 02:00:00, then at 05:00:00 (last embedded at 04:00, 1 h old) and 06:00:00 (shown at
    # 05:00, embedded at 06:00). Pair (4, 40): shown at 00:10 and 02:30, then at 06:00 (last embedded at 04:00:
    # exactly 2 h old).
    u = np.array([3, 3, 3, 4, 4, 4])
    i = np.array([30, 30, 30, 40, 40, 40])
    t = t0 + np.array([2 * h, 5 * h, 6 * h, h // 6, 5 * h // 2, 6 * h])
    got = pr.ceiling_and_budget(u, i, t, h, 2 * h, 2 * h)
    assert got["rows_counted"] == 5                          # every row from 02:00 on
    # Covered: (3, 30) at 05:00 and 06:00; (4, 40) at 02:30 (shown 00:10, embedded at 01:00 and 02:00). Not: (3, 30)
    # at 02:00 (its first showing), (4, 40) at 06:00 (its 04:00 embedding is exactly one TTL old).
    assert got["ceiling"] == pytest.approx(3 / 5)


def test_a_log_of_your_own_gets_its_protocol_dates_checked(tmp_path):
    """`solaris evaluate --data PATH`: t0..t3 given (checked against the log: in order, overlapping it, each period
    holding events) or at quantiles of its times; a log without a manifest is described by its files' digest."""
    import pyarrow as pa

    from solaris_jobs.evaluation.config import path_config
    from solaris_jobs.evaluation.protocol import data_manifest
    from solaris_jobs.evaluation.windows import protocol_of
    _log(tmp_path, [(u, 1 + (k % 7), 60 * k + u, 1, None) for u in (1, 2) for k in range(96)])   # 4 days, hourly
    table = ev.read_events(tmp_path, columns=["user_id", "item_id", "event_timestamp"])
    p = protocol_of(path_config(tmp_path, times=("2026-01-01", "2026-01-03", "2026-01-04", "2026-01-05")), table)
    assert (p.t1, p.t2, p.valid_from) == (T + pd.Timedelta(days=2), T + pd.Timedelta(days=3),
                                          T + pd.Timedelta(days=2, hours=12))
    q = protocol_of(path_config(tmp_path), table)     # quantiles 0.8 and 0.9 of the times, on hours (a 4-day log)
    assert (q.t0, q.t1, q.t2, q.t3) == (T, T + pd.Timedelta(hours=76), T + pd.Timedelta(hours=86),
                                        T + pd.Timedelta(hours=96))
    cases = [(("2026-01-01", "2026-01-03", "2026-01-02", "2026-01-05"), r"t2 \(2026-01-02T00:00:00\+00:00\) is not "
                                                                      r"after t1"),
             (("2026-02-01", "2026-02-02", "2026-02-03", "2026-02-04"), "does not overlap the log"),
             (("2025-12-01", "2025-12-02", "2026-01-02", "2026-01-03"), r"training \[t0, t1\) period holds no event"),
             (("2026-01-01", "2026-01-02"), "four dates t0,t1,t2,t3 are needed, got 2")]
    for times, message in cases:
        with pytest.raises(ValueError, match=message):
            protocol_of(path_config(tmp_path, times=times), table)
    m = data_manifest(tmp_path)
    assert m["source"] == str(tmp_path) and len(m["log"]) == 64
    res = CliRunner().invoke(main, ["evaluate", "--data", str(tmp_path), "--out", str(tmp_path / "r"), "--times",
                                    "2026-01-01,2026-01-03,2026-01-02,2026-01-05"])
    assert res.exit_code == 1 and "t2 (2026-01-02T00:00:00+00:00) is not after t1" in res.output
    for args, message in [(["--times", "2026-01-01,2026-01-02,2026-01-03,2026-01-04"], "go with --data"),
                          (["--data", str(tmp_path), "--dataset", "movielens"], "takes no --dataset"),
                          (["--data", str(tmp_path), "--split", "0.9,0.8"], "two quantiles 0 < q1 < q2 < 1")]:
        res = CliRunner().invoke(main, ["evaluate", "--out", str(tmp_path / "r"), *args])
        assert res.exit_code == 2 and message in res.output, res.output
    assert not (tmp_path / "r").exists()                          # refused before anything ran or was written
    del pa


def test_an_fm_of_your_own_that_saw_the_replay_or_test_is_refused(tmp_path):
    """`solaris evaluate --data DIR --fm package.module:factory --fm-checkpoint FILE`: an FM trained on data after
    t1 has seen the replay and test periods, and one that declares no training end may have: both refused before
    anything runs, the second unless --possibly-leaky (which the report's config then carries)."""
    from models.gru4rec import GRU4RecFM, GRUConfig
    from solaris_jobs.evaluation.protocol import check_training_end
    from solaris_jobs.evaluation.windows import given_times
    from solaris_jobs.pipeline.model_refs import load_fm
    from tests.support import save_user_fm
    _log(tmp_path / "log", [(u, 1 + (k % 7), 60 * k + u, 1, None) for u in (1, 2) for k in range(96)])
    fm = GRU4RecFM(GRUConfig(history_len=5, d_model=4, d_interaction=8))
    times = "2026-01-01,2026-01-03,2026-01-04,2026-01-05"
    base = ["evaluate", "--data", str(tmp_path / "log"), "--out", str(tmp_path / "r"), "--times", times,
            "--fm", "tests.support:user_fm", "--fm-checkpoint"]
    for until, leaky, message in [("2026-01-03T06:00:00+00:00", False, "trained on data until 2026-01-03T06:00:00"
                                                                      r"\+00:00, after t1"),
                                  (None, False, "declares no training end")]:
        save_user_fm(fm, tmp_path / "fm.pt", until)
        res = CliRunner().invoke(main, [*base, str(tmp_path / "fm.pt"), *(["--possibly-leaky"] if leaky else [])])
        assert res.exit_code == 1 and __import__("re").search(message, res.output), res.output
    assert not (tmp_path / "r").exists()
    table = ev.read_events(tmp_path / "log", columns=["user_id", "item_id", "event_timestamp"])
    p = given_times(times.split(","), table.column("event_timestamp").cast("int64").to_numpy())
    check_training_end(load_fm(tmp_path / "fm.pt", "tests.support:user_fm")[1], p, True, "fm.pt")  # flagged: let by
    save_user_fm(fm, tmp_path / "fm.pt", "2026-01-02T23:00:00+00:00")
    check_training_end(load_fm(tmp_path / "fm.pt", "tests.support:user_fm")[1], p, False, "fm.pt")
    res = CliRunner().invoke(main, ["evaluate", "--out", str(tmp_path / "r"), "--fm", "rnn"])
    assert res.exit_code == 2 and "neither a family" in res.output
