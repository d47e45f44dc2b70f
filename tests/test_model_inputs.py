import numpy as np
import pandas as pd

from solaris_jobs.core import events as ev
from solaris_jobs.core.contract import SIGNAL_UNKNOWN
from solaris_jobs.core.model_inputs import RECENCY_INPUTS, EventIndex, Examples, recency, side_tables, time_split

T0 = pd.Timestamp("2026-01-01T00:00:00Z")


def _log():
    # user 1: items 10, 11 at t0 (a tie), 12 at t0+2h; user 2: item 10 at t0+1h; user 3: item 13, no label.
    return ev.conform(pd.DataFrame({
        "user_id": [1, 1, 1, 2, 3],
        "item_id": [10, 11, 12, 10, 13],
        "event_timestamp": [T0, T0, T0 + pd.Timedelta(hours=2), T0 + pd.Timedelta(hours=1),
                            T0 + pd.Timedelta(hours=1)],
        "label": [1, 0, 1, 1, None],
        "rating": [5.0, 2.0, 4.0, None, None],
    }))


def _us(ts):
    return np.array([pd.Timestamp(t).value // 1000 for t in ts], dtype=np.int64)


def test_history_is_strictly_before_query_time_with_ties():
    idx = EventIndex(_log())
    users = np.array([1, 1, 1, 2, 4])
    ts = _us([T0, T0 + pd.Timedelta(seconds=1), T0 + pd.Timedelta(hours=3), T0 + pd.Timedelta(hours=1), T0])
    h = idx.history(users, ts, length=3)
    # At t0 the two tied events of user 1 are not history; one second later both are (left-padded).
    assert h["hist_item"].tolist() == [[0, 0, 0], [0, 10, 11], [10, 11, 12], [0, 0, 0], [0, 0, 0]]
    assert h["hist_signal"][2].tolist() == [5, 2, 4]            # ratings 1-5 where known
    # Gap buckets: 1 + floor(log2(1 + seconds)); 1 s -> 2, 3 h -> 14, 1 h -> 12.
    assert h["hist_gap"][1].tolist() == [0, 2, 2]
    assert h["hist_gap"][2].tolist() == [14, 14, 12]
    c = idx.counters(np.array([1, 1, 2]), np.array([10, 10, 10]), _us([T0, T0 + pd.Timedelta(hours=3),
                                                                      T0 + pd.Timedelta(hours=2)]))
    assert c["user_cnt"].tolist() == [0, 3, 1] and c["user_pos"].tolist() == [0, 2, 1]
    assert c["item_cnt"].tolist() == [0, 2, 2] and c["item_pos"].tolist() == [0, 2, 2]


def test_unlabelled_history_signal_and_counters():
    idx = EventIndex(_log())
    h = idx.history(np.array([3]), _us([T0 + pd.Timedelta(days=1)]), length=2)
    assert h["hist_signal"].tolist() == [[0, SIGNAL_UNKNOWN]]   # no rating, no label -> "unknown" token 8
    c = idx.counters(np.array([3]), np.array([13]), _us([T0 + pd.Timedelta(days=1)]))
    assert (c["user_cnt"][0], c["user_known"][0]) == (1, 0)


def test_time_split_keeps_ties_together():
    ts = np.array([1, 2, 2, 2, 3, 4, 5, 6, 7, 8])
    tr, va, te, cuts = time_split(ts, (0.2, 0.3, 0.5))
    assert cuts == (2, 4)
    assert ts[tr].tolist() == [1] and ts[va].tolist() == [2, 2, 2, 3] and ts[te].tolist() == [4, 5, 6, 7, 8]


def test_side_tables_and_examples_batch():
    side = pd.DataFrame({"item_id": [10, 12], "category": [3, 1], "genres": [[1, 2], [4]]})
    spec, cat, multi = side_tables(side, "item_id", 14)
    assert spec.categorical == {"category": 4} and spec.multi == {"genres": (5, 2)}
    assert cat[10].tolist() == [3] and cat[11].tolist() == [0] and multi["genres"][12].tolist() == [4, 0]
    table = _log()
    ex = Examples.from_events(EventIndex(table), table, history_len=2)
    b = ex.batch(np.array([2]))                                 # the t0+2h event of user 1
    assert b["hist_item"].tolist() == [[10, 11]] and b["label"].tolist() == [1.0]


def test_recency_inputs_are_point_in_time_and_equal_a_brute_force_count():
    """Each row's log-derived inputs come from events strictly before it (a row never sees itself, a same-time row
    or a later event): checked against a direct count over a random log with many ties and repeated pairs."""
    rng = np.random.default_rng(0)
    n = 600
    minutes = rng.integers(0, 3 * 24 * 60, n) // 7 * 7                  # ties: many rows share a minute
    log = ev.conform(pd.DataFrame({
        "user_id": rng.integers(1, 6, n), "item_id": rng.integers(1, 5, n),
        "event_timestamp": T0 + pd.to_timedelta(minutes, unit="min"), "label": rng.integers(0, 2, n),
        "rating": [None] * n}))
    idx = EventIndex(log)
    d = log.to_pandas()
    t = _us(d.event_timestamp)
    # The log's own rows, and queries of pairs never shown and users never seen.
    qu = np.concatenate([d.user_id.to_numpy(), [1, 9]])
    qi = np.concatenate([d.item_id.to_numpy(), [99, 1]])
    qt = np.concatenate([t, _us([T0 + pd.Timedelta(days=1)] * 2)])
    got = recency(idx, qu, qi, qt)
    assert list(got) == list(RECENCY_INPUTS)
    for q in range(len(qu)):
        before = t < qt[q]
        pair = before & (d.user_id.to_numpy() == qu[q]) & (d.item_id.to_numpy() == qi[q])
        want = {"pair_last_min": pair, "item_last_min": before & (d.item_id.to_numpy() == qi[q]),
                "user_prev_min": before & (d.user_id.to_numpy() == qu[q])}
        for k, m in want.items():
            expect = (qt[q] - t[m].max()) / 60e6 if m.any() else np.nan
            assert np.isclose(got[k][q], expect, equal_nan=True), (k, q)
        for h in (1, 6, 24):
            assert got[f"pair_cnt_{h}h"][q] == (pair & (t >= qt[q] - h * 3_600_000_000)).sum(), (h, q)
    assert np.isnan(got["pair_last_min"][-2]) and got["pair_cnt_24h"][-2] == 0 and np.isnan(got["user_prev_min"][-1])
    # A label arrives 30 min after its event: a row's history and counters see the labels of events more than
    # 30 min before it only (the impressions at once); the same brute force.
    delay = 30 * 60_000_000
    late = EventIndex(log, label_delay_us=delay)
    c, c0 = late.counters(qu, qi, qt), idx.counters(qu, qi, qt)
    h, h0 = late.history(qu, qt, 8), idx.history(qu, qt, 8)
    lab = d.label.to_numpy()
    for q in range(len(qu)):
        arrived = t < qt[q] - delay
        for side, ids, key in (("user", d.user_id.to_numpy(), qu[q]), ("item", d.item_id.to_numpy(), qi[q])):
            assert c[f"{side}_known"][q] == (arrived & (ids == key)).sum(), (side, q)
            assert c[f"{side}_pos"][q] == (arrived & (ids == key) & (lab == 1)).sum(), (side, q)
            assert c[f"{side}_cnt"][q] == c0[f"{side}_cnt"][q]
    assert (h["hist_item"] == h0["hist_item"]).all() and (h["hist_gap"] == h0["hist_gap"]).all()
    # A history entry's signal is unknown exactly when its event is less than 30 min before the row.
    start, pos = idx.user_positions(qu, qt)
    for q in range(len(qu)):
        rows = np.arange(max(pos[q] - 8, start[q]), pos[q])
        want = np.where(idx.t[rows] >= qt[q] - delay, SIGNAL_UNKNOWN, idx.signal[rows])
        assert h["hist_signal"][q, 8 - len(rows):].tolist() == want.tolist(), q
