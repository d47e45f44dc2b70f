import pandas as pd

from solaris_jobs.data.requests import RequestSimulator, SimulatorConfig

T0 = pd.Timestamp("2026-01-01T00:00:00Z")


def _log(extra=()):
    rows = [  # (user, item, hours after T0)
        (1, 1, 0), (1, 2, 1), (1, 3, 2),
        (2, 1, 0), (2, 2, 1), (2, 4, 2),
        (3, 5, 0), (3, 5, 1), (3, 6, 2),
        *extra,
    ]
    return pd.DataFrame({"user_id": [r[0] for r in rows], "item_id": [r[1] for r in rows],
                         "event_timestamp": [T0 + pd.Timedelta(hours=r[2]) for r in rows]})


CFG = SimulatorConfig(n_candidates=4, n_popular=2, popularity_hours=24, history_items=2, covisit_window=1,
                      covisit_top=5)


def test_hand_checked_candidate_sets():
    sim = RequestSimulator(_log(), T0 + pd.Timedelta(hours=3), CFG)
    # Popularity in the last 24 h: 5 (x2), 1 (x2), 2 (x2) -> ties by id: 1, 2, 5, then 3, 4, 6.
    assert sim.popular.tolist() == [1, 2, 5, 3]          # capped at n_candidates
    got = sim.candidates([1, 2, 9], actual_items=[6, 2, 7])
    by_user = {u: list(zip(g["item_id"], g["source"])) for u, g in got.groupby("user_id")}
    # User 1's last two items are 2 and 3. Co-visits (lag 1): 2<->1 (twice), 2<->3, 2<->4, 1<->... so seed 2 gives
    # 1:2, 3:1, 4:1 and seed 3 gives 2:1 -> top 2 by count then id: 1 (2), 2 (1).
    assert by_user[1] == [(1, "covisit"), (2, "covisit"), (5, "popular"), (3, "popular"), (6, "actual")]
    # User 2's last items 2, 4: seed 2 -> 1:2, 3:1, 4:1; seed 4 -> 2:1 -> 1 (2), then 2, 3, 4 (1) -> 1, 2.
    assert [i for i, _ in by_user[2]] == [1, 2, 5, 3]        # the actual item 2 is already there
    # A new user gets popular items only, plus the actual item.
    assert by_user[9] == [(1, "popular"), (2, "popular"), (5, "popular"), (3, "popular"), (7, "actual")]


def test_only_the_log_before_the_cutoff_matters():
    cutoff = T0 + pd.Timedelta(hours=3)
    a = RequestSimulator(_log(), cutoff, CFG).candidates([1, 2, 3])
    later = [(1, 9, 3), (1, 9, 4), (3, 9, 5)]           # at and after the cutoff
    b = RequestSimulator(_log(later), cutoff, CFG).candidates([1, 2, 3])
    pd.testing.assert_frame_equal(a, b)
    assert a.groupby("user_id").size().max() <= CFG.n_candidates
    assert not a.duplicated(["user_id", "item_id"]).any()
