"""The replay evaluation: its arithmetic on hand-made cases, the budgeted pool, and one small evaluation run end to
end through the real jobs, store and reader (twice, for determinism), with what it may and may not serve."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from solaris_jobs.core.contract import TIERS
from solaris_jobs.data.synth import SynthConfig
from solaris_jobs.evaluation import metrics
from solaris_jobs.evaluation.config import EvalConfig, refresh_settings, ttls
from solaris_jobs.evaluation.protocol import ModelsConfig
from solaris_jobs.evaluation.run import evaluate
from solaris_jobs.evaluation.targets import check_targets, sweep_point
from solaris_jobs.online.reader import FALLBACKS

NONE = TIERS.index("none")

T0 = pd.Timestamp("2026-01-01T00:00:00Z")


# ------------------------------------------------------------------------------------------------ arithmetic

def test_transfer_ratio_bootstrap_and_coverage_arithmetic_on_a_hand_made_case():
    # TR = (L_VM - L_X) / (L_VM - L_FM): 0.30 - 0.27 over 0.30 - 0.25 keeps 60% of the FM's gain.
    assert metrics.transfer_ratio(0.30, 0.27, 0.25) == pytest.approx(0.6)
    assert np.isnan(metrics.transfer_ratio(0.3, 0.2, 0.3))
    y = np.array([1, 0, 1, 0])
    p = np.array([0.8, 0.2, 0.6, 0.4])
    assert metrics.row_bce(y, p) == pytest.approx(-np.log([0.8, 0.8, 0.6, 0.6]))
    assert metrics.auc(y, p) == 1.0 and metrics.auc(np.array([1, 0]), np.array([0.2, 0.8])) == 0.0
    # Two users with different FM gains (0.4 and 0.1 per row): the gap's interval is wide, but X is halfway between
    # VM and FM on every row, so with every variant on the same resample each resample's TR is exactly 0.5 (an
    # unpaired bootstrap would spread it).
    users = np.array([1, 1, 2, 2, 2])
    l_vm = np.array([0.4, 0.6, 0.5, 0.5, 0.5])
    gain = np.array([0.4, 0.4, 0.1, 0.1, 0.1])
    l_fm, l_x = l_vm - gain, l_vm - 0.5 * gain
    labels = np.array([1, 0, 1, 0, 0])
    probs = {k: np.full(5, 0.5) for k in ("vm", "fm", "x", "kd")}
    boot = metrics.PairedBootstrap(users, 200, seed=1)
    s = metrics.summarize_losses({"vm": l_vm, "fm": l_fm, "x": l_x, "kd": l_vm - 0.1 * gain}, users, labels, probs,
                                 boot=boot, kd="kd", solaris="x")
    assert s["rows"] == 5 and s["users"] == 2 and s["tr_quoted"]
    assert s["gap"]["value"] == pytest.approx(0.22) and s["gap"]["ci"][1] - s["gap"]["ci"][0] > 0.1
    assert s["variants"]["x"]["tr"] == pytest.approx(0.5) and s["variants"]["x"]["tr_ci"] == pytest.approx((0.5, 0.5))
    assert s["variants"]["kd"]["tr"] == pytest.approx(0.1)
    assert s["criterion"]["value"] == pytest.approx(0.5 - 1.5 * 0.1) and s["criterion"]["met"]
    # dBCE = L_VM - L_X needs no FM gap: X keeps 0.11 per row, KD 0.022, so dBCE(x) - 1.5 dBCE(kd) = 0.077; on every
    # resample it is 0.35 x that resample's FM gain, so its interval is 0.35 x the gap's.
    assert s["variants"]["x"]["dbce"] == pytest.approx(0.11) and s["variants"]["kd"]["dbce"] == pytest.approx(0.022)
    c = s["dbce_criterion"]
    assert c["value"] == pytest.approx(0.077) and c["ci"] == pytest.approx(tuple(0.35 * g for g in s["gap"]["ci"]))
    assert len(c["quantiles"]) == 101 and c["quantiles"][0] - 1e-8 <= c["ci"][0] <= c["ci"][1] <= c["quantiles"][-1] + 1e-8
    # KD worse than the VM: no ratio over it is quoted (met is None), and the target says so rather than "met".
    bad = metrics.summarize_losses({"vm": l_vm, "fm": l_fm, "x": l_x, "kd": l_vm + 0.1 * gain}, users, labels,
                                   probs, boot=boot, kd="kd", solaris="x")
    assert bad["criterion"]["ci"][0] > 0 and not bad["criterion"]["kd_transfers"] and bad["criterion"]["met"] is None
    assert bad["dbce_criterion"]["value"] == pytest.approx(0.11 + 1.5 * 0.022)   # defined where no TR is quoted
    summary = {"seed": 0, "fm_gain_relative": 0.5, "tr_quoted": True, "fm_total_per_row": 0.5,
               "tr": {"solaris": 0.5, "vm_kd": -0.1}, "tr_ci": {"solaris": (0.5, 0.5), "vm_kd": (-0.1, -0.1)},
               "criterion": bad["criterion"], "coverage": {"pair_of_ceiling": 0.9, "any_tier": 0.95}}
    targets = check_targets([summary])
    assert targets["per_seed"][0]["tr_solaris_at_least_1.5x_kd"] is None
    assert targets["all_met"]["tr_solaris_at_least_1.5x_kd"] is None and targets["all_met"]["any_tier_at_least_90pct"]
    # The bootstrap resamples users, not rows: a resample holds all of a user's rows or none of them.
    b = metrics.PairedBootstrap(users, 50, seed=0)
    means = b.mean(np.array([1.0, 1.0, 0.0, 0.0, 0.0]))
    assert set(np.round(means, 6)) <= {0.0, 1.0, round(2 / 5, 6), round(4 / 7, 6), round(2 / 8, 6)}
    # No gap (FM = VM): no TR is quoted, whatever the variant did.
    flat = metrics.summarize_losses({"vm": l_vm, "fm": l_vm, "x": l_x}, users, labels, probs)
    assert not flat["tr_quoted"] and flat["variants"]["x"]["tr"] is None
    # A VM no better than the base rate: the FM's gap is real, but a ratio over that baseline is not quoted.
    weak = metrics.summarize_losses({"vm": l_vm, "fm": l_fm, "x": l_x, "base": l_vm - 0.01}, users, labels, probs,
                                    floor="base")
    assert weak["gap"]["ci"][0] > 0 and not weak["baseline_beats_floor"]["met"] and not weak["tr_quoted"]
    # MovieLens's dates: quantiles of the event times, floored to days; t3 is the day after the last event.
    from solaris_jobs.evaluation.protocol import by_quantiles
    day_us = 86_400_000_000
    P = by_quantiles(T0.value // 1000 + np.arange(100) * day_us // 4)       # 100 events over 25 days
    assert (P.t0, P.t1, P.t2, P.t3) == (T0, T0 + pd.Timedelta(days=20), T0 + pd.Timedelta(days=22),
                                         T0 + pd.Timedelta(days=25))
    assert P.t1 < P.valid_from < P.t2 and P.fm_valid_from < P.t1
    # Coverage: rows per tier as served, ages per tier.
    from solaris_jobs.online.coverage import tier_summary
    t = tier_summary(np.array([0, 0, 1, NONE]), np.array([3600.0, 7200.0, 1800.0, np.nan]))
    assert t["coverage_counts"] == {"pair": 2, "item_aware": 1, "user_aggregate": 0, "user_state": 0, "neighbour": 0,
                                    "none": 1}
    assert t["coverage"]["pair"] == 0.5 and t["age_hours"]["neighbour"] is None
    assert t["age_hours"]["pair"]["mean_h"] == 1.5 and t["age_hours"]["item_aware"]["p50_h"] == 0.5
    # The pair ceiling: a row counts if its pair was in the log before the last refresh (hourly from 0).
    h = 3_600_000_000
    log_u, log_i, log_t = np.array([1, 1, 2]), np.array([7, 8, 7]), np.array([int(0.5 * h), int(2.2 * h), 3 * h])
    rows_u, rows_i, rows_t = np.array([1, 1, 1, 2]), np.array([7, 8, 8, 7]), np.array(
        [int(1.1 * h), int(2.5 * h), int(3.1 * h), int(3.5 * h)])
    assert metrics.pair_ceiling(log_u, log_i, log_t, rows_u, rows_i, rows_t, 0, h).tolist() == [True, False, True,
                                                                                                False]


def test_budgeted_pool_ranks_recent_pairs_and_misses_inside_one_budget(spark):
    from solaris_jobs.pipeline import selection
    ts = lambda h: (T0 + pd.Timedelta(hours=h)).to_pydatetime()
    sim = spark.createDataFrame(pd.DataFrame({"user_id": [1, 1, 2], "item_id": [10, 11, 20],
                                              "source": ["covisit", "popular", "popular"],
                                              "retrieval_score": [1.0, -0.1, -0.2]}),
                                "user_id long, item_id long, source string, retrieval_score float")
    recent = spark.createDataFrame([(1, 10, ts(5)), (2, 21, ts(3)), (2, 22, ts(6))],
                                   "user_id long, item_id long, last_seen timestamp")
    misses = spark.createDataFrame([(2, 21, ts(6.5)), (3, 30, ts(4))], "user_id long, item_id long, missed_at timestamp")
    pool = selection.candidate_pool(sim, recent, misses).toPandas().sort_values(["user_id", "item_id"])
    # One row per pair; the strongest source names it; last_seen is the latest ranking or miss.
    assert pool[["user_id", "item_id", "source"]].values.tolist() == [
        [1, 10, "recent"], [1, 11, "popular"], [2, 20, "popular"], [2, 21, "recent"], [2, 22, "recent"],
        [3, 30, "miss"]]
    last = dict(zip(zip(pool.user_id, pool.item_id), pool.last_seen))
    assert pd.Timestamp(last[(2, 21)]).tz_localize(None) == pd.Timestamp(ts(6.5)).tz_localize(None)
    assert pd.isna(last[(1, 11)])
    scores = {(1, 10): 0.1, (1, 11): 0.9, (2, 20): 0.8, (2, 21): 0.2, (2, 22): 0.3, (3, 30): 0.5}
    scored = spark.createDataFrame(pool.assign(vm_score=[scores[k] for k in zip(pool.user_id, pool.item_id)]))
    # Recency: most recently ranked or missed first, then the verifier; the never-ranked pairs last. Budget 4.
    sel = selection.select_budget(scored, 4, "recency", 0.5).toPandas().sort_values("priority_rank")
    assert list(zip(sel.user_id, sel.item_id))[:4] == [(2, 21), (2, 22), (1, 10), (3, 30)]
    assert sel.selected.sum() == 4 and not sel[sel.item_id.isin([11, 20])].selected.any()
    # Verifier: the score alone, across the whole pool (misses compete like any candidate).
    sel = selection.select_budget(scored, 2, "verifier", 0.5).toPandas()
    assert set(zip(sel[sel.selected].user_id, sel[sel.selected].item_id)) == {(1, 11), (2, 20)}
    # The budget: ceil(budget x rows per interval over the window): 10 rows in 24 h, a 6 h interval, 0.5 per row.
    log = spark.createDataFrame([(1, 1, ts(h)) for h in np.linspace(0, 23, 10)],
                                "user_id long, item_id long, event_timestamp timestamp")
    assert selection.budget_pairs(log, T0 + pd.Timedelta(hours=18), T0 + pd.Timedelta(hours=24), 0.5, 24) == (2, 2.5)
    # At scale: 9.5M rows in 24 h (100K users of the scale benchmark) overflowed int64 nanoseconds as a Timedelta.
    assert selection.expected_rows(9_500_000, T0, T0 + pd.Timedelta(hours=1), 24) == 9_500_000 / 24
    assert selection.expected_rows(48, T0, T0 + pd.Timedelta(hours=1), 24) == 2.0


def test_the_budget_reach_ranks_and_selects_as_the_whole_pool(spark):
    """Under a budget ranked by recency the verifier scores only the pool's part the budget can reach: that part's
    priority ranks, scores and selection are those of ranking the whole pool, and nothing outside it is selected."""
    from solaris_jobs.pipeline import selection
    rng = np.random.default_rng(5)
    n = 3000
    # Pairs ranked over 3 hours, many in the same second and minute (ties broken by the score, then the ids);
    # a tenth never ranked (null last_seen: after every ranked pair).
    seen = pd.Series(T0 + pd.to_timedelta(rng.integers(0, 180, n) * 60 + rng.integers(0, 3, n), unit="s"))
    pool = pd.DataFrame({"user_id": rng.integers(0, 200, n), "item_id": rng.permutation(n),
                         "source": "recent", "retrieval_score": np.float32(np.nan),
                         "last_seen": seen.where(rng.random(n) > 0.1),
                         "vm_score": (rng.integers(0, 5, n) / 5).astype(np.float32)})
    scored = spark.createDataFrame(pool, "user_id long, item_id long, source string, retrieval_score float, "
                                         "last_seen timestamp, vm_score float").cache()
    key = ["user_id", "item_id"]
    cols = [*key, "vm_score", "priority_rank", "selected"]
    ranked_pairs = int(pool.last_seen.notna().sum())
    latest = pool.last_seen.dropna().sort_values(ascending=False).to_numpy()
    for budget in (0, 1, 40, 777, ranked_pairs, ranked_pairs + 1):
        whole = selection.select_budget(scored, budget, "recency", 0.5).toPandas()
        reach = selection.budget_reach(scored, budget)
        assert (reach is None) == (budget > ranked_pairs)
        if 0 < budget <= ranked_pairs:       # the minute of the budget's last pair, no earlier
            assert reach == pd.Timestamp(latest[budget - 1]).floor("min").value // 1000
        part = selection.select_budget(selection.within_reach(scored, reach), budget, "recency", 0.5, reach is None).toPandas()
        if reach is not None:
            assert part["rank"].isna().all() and part["bottom"].isna().all()
            assert len(part) < len(whole) or budget == ranked_pairs
        got = part[cols].sort_values(key).reset_index(drop=True)
        want = whole.merge(part[key], on=key)[cols].sort_values(key).reset_index(drop=True)
        pd.testing.assert_frame_equal(got, want)
        assert int(part.selected.sum()) == int(whole.selected.sum()) == min(budget, n)
        beyond = whole.merge(part[key], on=key, how="left", indicator=True).query("_merge == 'left_only'")
        assert not beyond.selected.any() and (beyond.priority_rank > budget).all()


# ------------------------------------------------------------------------------------------------ end to end

TINY = EvalConfig(
    synth=SynthConfig(users=250, items=200, days=2, seed=3, calibration_users=250), seeds=(0,), sequence_shares=(),
    train_days=1.0, served_days=0.5, test_days=0.5, valid_hours=4.0, fm_valid_hours=4.0, cadence="6h",
    budgets=(0.5, 1.0), budget=0.5, slow_cadence=2, fast_cadence="3h", fast_hours_before=3.0, fast_hours_after=3.0,
    n_candidates=10, n_boot=50, vm_epochs=2,
    vm_batch_size=512, grid_points=2, spark_master="local[2]",
    # The production reader's 10 ms would let a loaded 2-core CI machine's scheduling fail reads open at random,
    # and these tests compare runs row for row: the mechanism is the same, the budget 1 s (declared here).
    serving_budget_ms=1000.0,
    # Every fallback tier served (the product's default serves those validation kept: none on the headline's
    # traffic), so that these tests exercise each tier's replay, scoring and report.
    tiers=FALLBACKS,
    models=ModelsConfig(d_model=16, n_layers=1, d_interaction=32, d_code=8, history_len=10, fm_epochs=1,
                        vm_epochs=2, max_train_rows=None))


@pytest.fixture(scope="module")
def tiny_eval(spark, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_a")
    return out, evaluate(TINY, out)


def _strip(obj):
    """report.json without its timings (wall times, latencies, seconds, reads over the time budget)."""
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items()
                if not (k in ("timings", "latency_ms", "wall_s", "over_budget") or k.endswith("_s")
                        or "seconds" in k or k.startswith("latency"))}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def test_replay_serves_only_what_existed_at_the_request_from_models_trained_before_t1(tiny_eval):
    from solaris_jobs.core import offline as off
    from solaris_jobs.learning import replay
    out, report = tiny_eval
    P = report["protocol"]
    t1, t2 = pd.Timestamp(P["t1"]), pd.Timestamp(P["t2"])
    seed = report["per_seed"][0]
    # The FM, autoencoder and verifier saw nothing from t1 on (their own test split starts there).
    for kind in ("fm", "ae", "vm"):
        assert pd.Timestamp(seed["models"][kind]["split"]["test_from"]) == t1
    assert pd.Timestamp(seed["models"]["fm"]["split"]["valid_from"]) == pd.Timestamp(P["fm_valid_from"])
    rec = json.loads((out / "seed0" / "replay-b1" / "replay.json").read_text())
    visible = {pd.Timestamp(r["cutoff"]): pd.Timestamp(r["visible_at"]) for r in rec["refreshes"]}
    assert min(visible) == t1 and all(v - c >= pd.Timedelta("10min") for c, v in visible.items())
    served = replay.read_served(out / "seed0" / "replay-b1").to_pandas()
    assert len(served) == rec["rows"] > 1000 and rec["serving"]["counts"].get("fail_open", 0) == 0
    got = served[served.tier < NONE]
    assert len(got) > 0.3 * len(served)
    # Behind each served row: one pair, or the FM embeddings a fallback averages; nothing behind tier none.
    assert (served.n_behind[served.tier == 0] == 1).all() and (served.n_behind[served.tier == NONE] == 0).all()
    fallback = served.tier.isin([TIERS.index(t) for t in ("item_aware", "user_aggregate", "user_state", "neighbour")])
    assert (served.n_behind[fallback] >= 1).all()
    assert served.n_behind[served.tier.isin([TIERS.index("item_aware"), TIERS.index("user_aggregate")])].max() > 1
    # Every served row is at least 0 s old and was made visible before the request.
    src = got.event_timestamp - pd.to_timedelta(got.age_s, unit="s")
    assert (got.age_s >= 0).all()
    pair = got[got.tier == 0]
    src_pair = src[got.tier == 0].dt.round("s")
    assert set(src_pair) <= set(visible)
    assert (pair.event_timestamp >= src_pair.map(visible)).all()
    # ... and is exactly what that refresh computed for the pair (no later output leaks in).
    for T, rows in pair.groupby(src_pair):
        emb = off.read_table(str(out / "seed0" / "replay-b1" / "offline"), "pair_embeddings", T).to_pandas()
        emb = emb.set_index(["user_id", "item_id"])["embedding"]
        want = np.stack(emb.loc[list(zip(rows.user_id, rows.item_id))].to_numpy())
        np.testing.assert_array_equal(np.stack(rows.embedding.to_numpy()), want)
    _served_by_latest_visible_refresh(served, rec)
    assert served.event_timestamp.min() >= t1 and (served.refresh[served.tier < NONE] >= 0).all()
    assert report["per_seed"][0]["headline"]["coverage"]["test"]["rows"] == int((served.event_timestamp >= t2).sum())
    # The fast-cadence replay (its own, switching from the hourly refreshes at its window's start) obeys the same.
    fc = seed["curves"]["fast_cadence"]
    fast_dir = out / "seed0" / f"replay-fast-{TINY.fast_cadence}"
    fast_rec = json.loads((fast_dir / "replay.json").read_text())
    switch = pd.Timestamp(fc["switch_at"])
    assert [pd.Timestamp(r["cutoff"]) for r in fast_rec["refreshes"]] == list(
        pd.date_range(switch, pd.Timestamp(fc["window"][1]), freq=TINY.fast_cadence, inclusive="left"))
    fast = replay.read_served(fast_dir).to_pandas()
    assert fast.event_timestamp.min() >= switch and len(fast) > 0
    _served_by_latest_visible_refresh(fast, fast_rec)


def _served_by_latest_visible_refresh(served: pd.DataFrame, rec: dict) -> None:
    """Every row, whatever its tier, was served from the store as the latest refresh visible at its time left it
    (that refresh's outputs were visible before the request and the next refresh's were not yet), and nothing it
    served is younger than the refresh that made it: a row's source time is that refresh's cutoff or earlier."""
    visible = {pd.Timestamp(r["cutoff"]): pd.Timestamp(r["visible_at"]) for r in rec["refreshes"]}
    cut = sorted(visible)
    vis = np.array([visible[c].value for c in cut])
    ns = lambda col: np.array([t.value for t in col])
    latest = np.searchsorted(vis, ns(served.event_timestamp), side="right") - 1   # -1: before the first was visible
    np.testing.assert_array_equal(served.refresh.to_numpy(), latest)
    has = (served.tier.to_numpy() < NONE) & (latest >= 0)
    src_all = (served.event_timestamp - pd.to_timedelta(served.age_s, unit="s")).dt.round("s")[has]
    own = np.array([cut[r].value for r in served.refresh.to_numpy()[has]])
    assert has.sum() > 0 and (ns(src_all) <= own).all()


def test_vm_features_come_from_the_same_reader_and_clock_as_serving(tiny_eval):
    from solaris_jobs.evaluation import variants
    from solaris_jobs.evaluation.protocol import Protocol
    from solaris_jobs.learning import replay, training
    from solaris_jobs.pipeline import model_refs
    out, report = tiny_eval
    P = Protocol.from_dict(report["protocol"])
    models = model_refs.resolve(out / "seed0" / "models")
    data = training.load_dataset(str(out / "data-seq0.5"), models.history_len, cuts=(P.valid_from, P.t2))
    cache = variants.fm_outputs(data, models.fm.path, models.ae.path, P, out / "seed0" / "cache")
    served = replay.read_served(out / "seed0" / "derived-b0.5-x1")
    tab = variants.build_table(data, P, served, cache)
    s = served.to_pandas()
    key = pd.DataFrame({"user_id": tab.users, "item_id": tab.items,
                        "event_timestamp": pd.to_datetime(tab.ts, unit="us", utc=True), "tier": tab.served_tier})
    m = key.merge(s.drop_duplicates(["user_id", "item_id", "event_timestamp"]),
                  on=["user_id", "item_id", "event_timestamp"], how="left", suffixes=("", "_served"))
    before = m.event_timestamp < P.t1
    # Rows before t1 were served nothing (tier none); from t1 on, every row carries exactly what the reader served.
    assert (m.tier[before] == NONE).all() and m.tier_served[before].isna().all()
    assert (m.tier[~before] == m.tier_served[~before]).all()
    side = report["per_seed"][0]["headline"]["tier_shares_side_by_side"]
    test_shares = side["test rows [t2, t3)"]
    assert test_shares["none"] < 1.0 and side["validation rows [valid_from, t2)"]["none"] < 1.0
    # The training rows hold tier none for [t0, t1) and served tiers for [t1, valid_from): both are in the share.
    train = tab.split == 0
    assert 0 < (tab.served_tier[train] != NONE).mean() < 1


def test_a_smaller_budget_derived_by_masking_equals_its_own_replay(tiny_eval, spark, tmp_path):
    from solaris_jobs.core import events as events_mod
    from solaris_jobs.evaluation.protocol import Protocol
    from solaris_jobs.learning import replay
    from solaris_jobs.pipeline import event_source, model_refs
    out, report = tiny_eval
    P = Protocol.from_dict(report["protocol"])
    models = model_refs.resolve(out / "seed0" / "models")
    root = out / "data-seq0.5"
    s = refresh_settings(TINY, root, tmp_path / "offline", out / "seed0" / "models", TINY.budget)
    plan = replay.ReplayPlan(P.t1, P.t3, pd.Timedelta(TINY.cadence), pd.Timedelta(TINY.delay), ttls(TINY),
                             TINY.serving_budget_ms, TINY.serving_cooldown_s, TINY.serving_store, tuple(TINY.tiers))
    events = event_source.EventTable(events_mod.read_events(root))
    direct = replay.run(spark, s, events, models, plan, tmp_path / "direct")
    # The events' Spark copy is one partition per core, not one per Arrow batch of 10,000 rows (every step scans
    # it: 234 tasks a scan on the evaluation's log made the replay's select and embed about 2x slower).
    from solaris_jobs.pipeline.spark import parallelism
    assert events.spark(spark).rdd.getNumPartitions() <= parallelism(spark)
    a = replay.read_served(tmp_path / "direct").to_pandas()
    b = replay.read_served(out / "seed0" / "derived-b0.5-x1").to_pandas()
    assert len(a) == len(b) == direct["rows"]
    np.testing.assert_array_equal(a.tier.to_numpy(), b.tier.to_numpy())
    np.testing.assert_allclose(np.stack(a.embedding.to_numpy()), np.stack(b.embedding.to_numpy()), atol=1e-5)
    np.testing.assert_allclose(a.age_s.to_numpy(), b.age_s.to_numpy(), equal_nan=True)
    # The headline's cost: FM inferences per served row near the budget asked for (0.5: a budget is set from the
    # trailing day's rows, so the rows that come differ a little), under 1.
    per_row = report["per_seed"][0]["fm_per_row"]["per_row"]
    assert 0.3 < per_row < 0.8


def _flip_labels_from(root: Path, t: pd.Timestamp) -> int:
    """Flips the label of every event at or after ``t`` in the event files under ``root``; the number flipped."""
    import pyarrow.parquet as pq
    flipped = 0
    for f in sorted((root / "events").rglob("*.parquet")):
        table = pq.read_table(f)
        df = table.to_pandas()
        late = df.event_timestamp >= t
        if late.any():
            df.loc[late, "label"] = 1 - df.loc[late, "label"]
            flipped += int(late.sum())
            pq.write_table(pa.Table.from_pandas(df, schema=table.schema, preserve_index=False), f)
    return flipped


def test_same_seed_same_report_and_no_test_label_reaches_a_model(tiny_eval, tmp_path):
    """The same seed run again on the same log with the labels of the test period ``[t2, t3)`` flipped: every model,
    grid choice and validation loss is bit-identical (no test label reaches a model or a choice), the replay serves
    the same rows before t2, and only the test figures move. The report of the first run carries what anyone needs
    to check it (#40), and its pages render."""
    import re
    import shutil

    from solaris_jobs.core.contract import RECENCY_INPUTS
    from solaris_jobs.learning import replay
    out, report = tiny_eval
    name = f"data-seq{TINY.synth.sequence_share:g}"
    shutil.copytree(out / name, tmp_path / "b" / name)
    t2 = pd.Timestamp(report["protocol"]["t2"])
    assert _flip_labels_from(tmp_path / "b" / name, t2) > 1000
    # Without the fast cadence's own replay (suite time): it trains no model and chooses nothing.
    b = evaluate(replace(TINY, fast_cadence=None), tmp_path / "b")
    s_a, s_b = report["per_seed"][0], b["per_seed"][0]
    for m in ("fm", "ae", "vm"):
        assert {k: s_b["models"][m].get(k) for k in ("model_version", "valid_bce", "best_epoch")} == \
            {k: s_a["models"][m].get(k) for k in ("model_version", "valid_bce", "best_epoch")}, m
    assert {v: {k: x[k] for k in ("params", "valid_bce", "best_epoch", "grid")} for v, x in s_b["variants"].items()} \
        == {v: {k: x[k] for k in ("params", "valid_bce", "best_epoch", "grid")} for v, x in s_a["variants"].items()}
    served = [replay.read_served(d / "seed0" / "replay-b1").to_pandas() for d in (out, tmp_path / "b")]
    before = [x[x.event_timestamp < t2].sort_values(["event_timestamp", "user_id", "item_id"]).reset_index(drop=True)
              for x in served]
    assert len(before[0]) > 1000
    pd.testing.assert_frame_equal(before[0], before[1])
    test_a, test_b = (x["headline"]["test"]["variants"] for x in (s_a, s_b))
    assert all(test_a[v]["bce"] != test_b[v]["bce"] for v in test_a)
    # The comparison before #40 (no recency inputs), once beside: other models than the headline's, chosen on
    # validation as untouched by the test labels, and in the report.
    old_a = s_a["without_recency"]
    assert old_a["chosen"] == s_b["without_recency"]["chosen"]
    assert set(old_a["test"]["variants"]) >= {"vm", "vm_kd", "solaris"}
    assert all(old_a["test"]["variants"][v]["bce"] != test_a[v]["bce"] for v in ("vm", "vm_kd", "solaris"))
    assert "## The comparison before #40" in (out / "report.md").read_text()
    # Each tier's value on its own rows: on validation (what chooses the tiers) untouched by the test labels; on
    # test it moves with them. Every labelled served row of the split is in exactly one tier's rows.
    assert s_a["tier_value"]["validation"] == s_b["tier_value"]["validation"]
    assert s_a["tier_value"]["test"] != s_b["tier_value"]["test"]
    tv = s_a["tier_value"]["test"]
    assert set(tv) == {"pair", "item_aware", "user_aggregate", "user_state", "neighbour"} and tv["pair"]["rows"] > 0
    assert tv["user_state"]["rows"] > 0
    assert all(v["ci"][0] <= v["value"] <= v["ci"][1] and v["carries_value"] == (v["ci"][0] > 0)
               for v in tv.values() if v["rows"])
    shares = s_a["headline"]["per_tier"]
    assert all(tv[t]["rows"] == shares[t]["rows"] for t in tv)
    # What the report carries so that anyone can check it: the seed's own data draw and the commit it ran, the
    # inputs every ranker took, the label delay, and the criterion across seeds (not decided below 5 seeds).
    assert s_a["data_seed"] == TINY.synth.seed and s_a["data"]["config"]["seed"] == TINY.synth.seed
    assert re.fullmatch(r"[0-9a-f]{40}", s_a["commit"]["sha"])
    assert report["config"]["ranker_inputs"]["recency"] == list(RECENCY_INPUTS)
    assert report["config"]["label_delay_minutes"] == 30 and report["config"]["data_per_seed"] is True
    crit = report["targets"]["across_seeds"]["criterion"]
    assert crit["met"] is None and crit["ci"][0] <= crit["value"] <= crit["ci"][1] and crit["method"]
    # The headroom: the test BCE of the labels' own probabilities (the generator's truth/) is below every model's,
    # and each model's share of it above the VM is what its BCE says.
    hr = s_a["headline"]["headroom"]
    assert hr["achievable_bce"] < min(v["bce"] for v in test_a.values()) and hr["share_above_vm"]["vm"] == 0
    fm_share = (hr["bce"]["vm"] - hr["bce"]["fm"]) / (hr["bce"]["vm"] - hr["achievable_bce"])
    assert hr["share_above_vm"]["fm"] == pytest.approx(fm_share) and hr["bce"]["fm"] == pytest.approx(
        s_a["headline"]["test"]["variants"]["fm"]["bce"])
    md = (out / "report.md").read_text()
    assert "## Targets" in md and "VM + SOLARIS, all tiers" in md and "Value of each tier on its own rows" in md
    assert "Headline criterion over seeds" in md
    for png in ("tiers_over_time.png", "coverage_vs_budget.png", "tr_vs_coverage.png", "tr_per_variant.png",
                "coverage_vs_cadence.png"):
        assert (out / png).stat().st_size > 5_000 and f"]({png})" in md
    # report.html is the same report on one page: its tables rendered, every plot inline (the PNG's own bytes).
    import base64
    import re
    page = (out / "report.html").read_text()
    inline = [base64.b64decode(b) for b in re.findall(r'<img src="data:image/png;base64,([^"]+)"', page)]
    assert sorted(inline) == sorted((out / f).read_bytes() for f in re.findall(r"\]\(([^)]+\.png)\)", md))
    assert len(inline) >= 4 and "<table>" in page and "VM + SOLARIS, all tiers" in page and "src=\"http" not in page
    # The budget curve and the slower cadence are in the report, each with its measured cost.
    cu = report["per_seed"][0]["curves"]
    assert [p["budget_per_row"] for p in cu["budget"]] == [0.5, 1.0]
    assert cu["budget"][0]["fm"]["fm_inferences"] < cu["budget"][1]["fm"]["fm_inferences"]
    assert {p["cadence"] for p in cu["cadence"]} == {"12h", "6h"}
    # The fast cadence: the same test rows of its window served at 3 h, 6 h and 12 h, each with its coverage and the
    # headline VM's TR, and what the fast replay's FM inferences cost per served row.
    fc = cu["fast_cadence"]
    assert set(fc["coverage"]) == {"3h", "6h", "12h"}
    rows = {k: c["rows"] for k, c in fc["coverage"].items()}            # counted in each cadence's own served rows
    assert len(set(rows.values())) == 1 and rows["3h"] == fc["coverage"]["3h"]["headline_vm"]["rows"] > 0
    assert fc["fast_fm_per_row"] > 0 and "Fast cadence" in md
    # The post-hoc KD check: its own grid points (as many as every variant's), the best of both grids on validation,
    # and the headline's KD unchanged beside it.
    kc = report["per_seed"][0]["kd_grid_check"]
    assert [g["params"]["kd_weight"] for g in kc["grid"]] == [0.05, 0.05]
    vm_params = report["per_seed"][0]["variants"]["vm"]["params"]
    assert all({k: g["params"][k] for k in vm_params} == vm_params for g in kc["grid"])
    head_valid, ext_valid = kc["headline_grid_best"]["valid_bce"], min(g["valid_bce"] for g in kc["grid"])
    assert kc["best"]["valid_bce"] == min(head_valid, ext_valid)
    assert kc["best"]["from"] == ("check grid" if ext_valid < head_valid else "headline grid")
    assert kc["variants"]["vm_kd"]["bce"] == report["per_seed"][0]["headline"]["test"]["variants"]["vm_kd"]["bce"]
    if kc["best"]["from"] == "headline grid":
        assert kc["variants"]["vm_kd_best"]["bce"] == kc["variants"]["vm_kd"]["bce"]
    assert kc["criterion"] is None or kc["criterion"]["kd"] == "vm_kd_best"
    assert "Post hoc: VM + KD on a wider grid" in md


def test_the_tier_choice_reads_seed_0s_validation_from_the_headlines_own_runs(tiny_eval):
    """``solaris evaluate-tier-choice`` on the headline's folder: the same seed-0 replay and VMs (nothing retrained
    or replayed), each tier's value on its validation rows equal to the report's, and the tiers kept exactly those
    whose lower bound is above 0, in fallback order."""
    from solaris_jobs.evaluation import tier_choice
    from solaris_jobs.evaluation.run import choose_tiers
    from solaris_jobs.online.reader import FALLBACKS
    out, report = tiny_eval
    made = lambda: {p: p.stat().st_mtime_ns for p in [*out.rglob("done.json"), *out.rglob("vm_cache/*.pt"),
                                                       *out.rglob("trained.json")]}
    before = made()
    table = choose_tiers(TINY, out)
    assert made() == before and len(before) >= 5                 # nothing new, nothing rewritten
    assert table["validation"] == report["per_seed"][0]["tier_value"]["validation"]
    assert table["chosen"] == [t for t in FALLBACKS if table["validation"][t]["carries_value"]]
    assert table["seed"] == 0 and table["config"]["tiers"] == list(FALLBACKS) and table["method"].startswith("Declared")
    one = lambda lo: {"carries_value": lo > 0}
    assert tier_choice.choose({"neighbour": one(0.1), "pair": one(0.2), "user_state": one(-0.1),
                               "item_aware": one(0.01), "user_aggregate": None}) == ("item_aware", "neighbour")


def test_cached_outputs_are_reused_only_for_the_same_code_and_data(tiny_eval, tmp_path, monkeypatch):
    """The models' cache key holds a hash of the training code: the same code reuses the checkpoints, other code
    retrains (a seed's models once came through this cache from older code), and the replays and FM outputs carry
    their code's hash too. The hash follows the source's content and relative paths, not where the tree lies."""
    import shutil
    import sys
    from solaris_jobs.evaluation import protocol as pr
    out, _ = tiny_eval
    stamp = next(out.rglob("models/trained.json"))
    key = json.loads(stamp.read_text())["key"]
    assert key["code"] == pr.code_version(pr.MODEL_CODE) and key["data"] == pr.data_version(Path(key["root"]))
    # Every replay (headline, derived, fast) and the FM outputs are keyed on their code and data too.
    replays = [json.loads(p.read_text())["key"] for p in out.rglob("done.json")]
    assert len(replays) >= 3 and all(k["code"] == pr.code_version(pr.REPLAY_CODE) for k in replays)
    assert all(k["data"] == key["data"] for k in replays if "data" in k) and any("data" in k for k in replays)
    assert list(out.rglob(f"fm_outputs-*-{pr.code_version(pr.VARIANT_CODE)}.npz"))
    models = tmp_path / "models"
    shutil.copytree(stamp.parent, models)
    args = (Path(key["root"]), pr.Protocol.from_dict(key["protocol"]), key["seed"], models, TINY.models,
            key["label_delay_minutes"])
    assert key["label_delay_minutes"] == TINY.label_delay_minutes == 30
    written = lambda: (models / "fm.pt").stat().st_mtime_ns
    before = written()
    assert pr.train_models(*args) == json.loads(stamp.read_text())["metrics"]
    assert written() == before                                            # reused, not retrained
    monkeypatch.setattr(pr, "code_version", lambda modules=pr.MODEL_CODE: "other-code")
    pr.train_models(*args)
    assert json.loads((models / "trained.json").read_text())["key"]["code"] == "other-code"
    assert written() != before                                            # retrained: a new checkpoint
    monkeypatch.undo()
    # code_version itself, on a package written here: an edit (a comment too) changes it, a copy elsewhere does not.
    for where in ("a", "b"):
        (tmp_path / where / "pkgx").mkdir(parents=True)
        (tmp_path / where / "pkgx" / "__init__.py").write_text("X = 1\n")
        (tmp_path / where / "pkgx" / "m.py").write_text("def f():\n    return 1\n")
    versions = []
    for where, edit in (("a", None), ("b", None), ("a", "# a comment\n")):
        if edit:
            with open(tmp_path / where / "pkgx" / "m.py", "a") as f:
                f.write(edit)
        monkeypatch.syspath_prepend(str(tmp_path / where))
        versions.append(pr.source_hash(("pkgx",)))
        sys.path.remove(str(tmp_path / where))
    assert versions[0] == versions[1] != versions[2]
    with pytest.raises(ModuleNotFoundError, match="no_such_module"):
        pr.source_hash(("no_such_module",))
    # Hashed once per process: an edit during a run does not relabel what the loaded code made.
    monkeypatch.syspath_prepend(str(tmp_path / "a"))
    loaded = pr.code_version(("pkgx",))
    with open(tmp_path / "a" / "pkgx" / "m.py", "a") as f:
        f.write("# edited during the run\n")
    assert pr.code_version(("pkgx",)) == loaded == versions[2] != pr.source_hash(("pkgx",))


def test_the_demo_empties_only_the_stores_its_own_last_run_wrote(tmp_path, monkeypatch):
    """A rerun of the demo replays the same intervals, so it starts from empty stores, but deletes an embedded
    store only when its last refresh wrote it and nothing wrote it since, and its offline store only in a workdir
    that holds its settings file; a Redis store is left alone with a note."""
    from solaris_jobs.flows.demo import ENV_FILE, _fresh_stores, _mark_store
    from tests.support import feast_yaml
    db, work = tmp_path / "online.db", tmp_path / "work"
    (work / "offline" / "x").mkdir(parents=True)
    monkeypatch.setenv("FEAST_FS_YAML_FILE_PATH", str(feast_yaml(tmp_path / "fs.yaml", f"  type: sqlite\n  path: {db}")))
    notes = []
    db.write_bytes(b"someone else's rows")
    _fresh_stores(work, notes.append)                 # never marked: not the demo's; no settings file: not its workdir
    assert db.exists() and (work / "offline" / "x").exists() and "left as it is" in notes[-1]
    _mark_store(work)                                 # the demo's refresh wrote it last
    (work / ENV_FILE).write_text("")
    _fresh_stores(work, notes.append)
    assert not db.exists() and not (work / "offline").exists() and len(notes) == 1
    db.write_bytes(b"the demo's rows")
    _mark_store(work)
    db.write_bytes(b"the demo's rows, then a user's")  # written since: left alone
    _fresh_stores(work, notes.append)
    assert db.exists() and len(notes) == 2
    monkeypatch.setenv("FEAST_FS_YAML_FILE_PATH", str(feast_yaml(tmp_path / "fs.yaml",
                                                                  '  type: redis\n  connection_string: "127.0.0.1:1"')))
    _fresh_stores(work, notes.append)
    assert "not the embedded one" in notes[-1]


def test_the_demo_refreshes_on_the_evaluations_own_models_and_closes_on_its_figures(tiny_eval):
    """`solaris demo`: its refresh runs on the models the quick replay then uses (one FM training), and its closing
    table prints this run's figures, labelled as the mechanism's, and the committed full evaluation's criterion,
    labelled as that evaluation's (or says it is not committed yet)."""
    from solaris_jobs.evaluation.run import seed_models
    from solaris_jobs.flows.demo import closing_table, refresh_cron
    out, report = tiny_eval
    models = out / "seed0" / "models"
    before = {p.name: p.stat().st_mtime_ns for p in models.glob("*.pt")}
    root, P, mdir, metrics = seed_models(TINY, out, 0)
    assert mdir == models and {p.name: p.stat().st_mtime_ns for p in models.glob("*.pt")} == before
    norm = lambda x: json.loads(json.dumps(x, default=str))
    assert norm(metrics) == norm(report["per_seed"][0]["models"]) and P.to_dict() == report["protocol"]

    s, ps = report["summary"][0], report["per_seed"][0]
    lat = ps["replay"]["serving_latency_ms"]
    assert lat["latency_p99_ms"] >= lat["latency_p50_ms"] > 0

    def rows(table):            # label -> the rest of its line (labels are padded to a column)
        return {ln[:40].strip(): ln[40:].strip() for ln in table.splitlines()[1:]}
    table = closing_table(report, None)
    assert "this size shows the mechanism, not the claim" in table.splitlines()[0]
    r = rows(table)
    cov = r["coverage of the test rows by tier"]
    assert cov.startswith(", ".join(f"{t} {v:.2f}" for t, v in s["coverage"]["shares"].items() if v))
    assert f"any tier {s['coverage']['any_tier']:.2f}" in cov
    assert r["FM inferences per served row"] == (f"{s['fm_per_row']:.2f} pairs, {s['fm_total_per_row']:.2f} with the "
                                                 f"user embeddings")
    assert r["serving latency (Redis, FeatureReader)"].startswith(
        f"p50 {lat['latency_p50_ms']:.2f} ms, p99 {lat['latency_p99_ms']:.2f} ms per request of {TINY.n_candidates} "
        f"candidates ({ps['replay']['requests']:,} requests)")
    test = ps["headline"]["test"]["variants"]
    bces = r["test BCE [95% interval over users]"].split("; ")
    assert bces == [f"{name} {test[k]['bce']:.4f} [{test[k]['bce_ci'][0]:+.4f}, {test[k]['bce_ci'][1]:+.4f}]"
                    for name, k in (("VM", "vm"), ("KD", "vm_kd"), ("all tiers", "solaris"), ("FM", "fm"))]
    c = s["dbce_criterion"]
    assert r["dBCE(all tiers) - 1.5 dBCE(KD)"].startswith(f"{c['value']:+.5f} [{c['ci'][0]:+.5f}, {c['ci'][1]:+.5f}]")
    assert table.splitlines()[-1].startswith("no committed full evaluation found")

    # A committed evaluation written before #40's protocol (no across-seed criterion): its TRs, labelled superseded.
    old = {"config": report["config"], "summary": [dict(s, seed=k) for k in range(3)], "targets": {}}
    table = closing_table(report, old)
    assert "before #40's protocol" in table and "seeds 0,1,2; not this run" in table
    tr = lambda k: "-" if s["tr"].get(k) is None else f"{s['tr'][k]:.2f}"
    assert rows(table)["TR per seed"] == (f"all tiers {', '.join([tr('solaris')] * 3)}; "
                                          f"KD {', '.join([tr('vm_kd')] * 3)}")

    seeds = [dict(s, seed=k) for k in range(5)]       # a committed evaluation of five seeds, this one's figures
    committed = {"config": report["config"], "summary": seeds, "targets": check_targets(seeds)}
    crit = committed["targets"]["across_seeds"]["criterion"]
    r = rows(closing_table(report, committed))
    assert r[crit["statistic"]] == (f"{crit['value']:+.5f} [{crit['ci'][0]:+.5f}, {crit['ci'][1]:+.5f}] (seeds and "
                                    f"users resampled): " + ("met" if crit["met"] else "missed"))

    # The settings file `make airflow` sources: the refresh's settings, back through a shell.
    import subprocess

    from solaris_jobs.core.settings import Settings
    from solaris_jobs.flows.demo import refresh_env, write_env_file
    settings = refresh_settings(TINY, root, out / "offline", models, TINY.budget).override(expire_from="write")
    env = refresh_env(settings, out, P.t1, P.t1 + pd.Timedelta(TINY.cadence), pd.Timedelta(TINY.cadence), ttls(TINY))
    write_env_file(out / "solaris.env", env)
    shell = subprocess.run(["sh", "-c", f"set -a; . '{out / 'solaris.env'}'; env"], capture_output=True, text=True,
                           check=True, env={"PATH": "/usr/bin:/bin"}).stdout
    got = dict(line.split("=", 1) for line in shell.splitlines() if line.startswith("SOLARIS_"))
    assert got == {k: v for k, v in env.items() if k.startswith("SOLARIS_")}
    assert Settings.from_env(got) == settings and got["SOLARIS_REFRESH_CRON"] == "0 */6 * * *"

    assert [refresh_cron(pd.Timedelta(x)) for x in ("1h", "2h", "1d")] == ["0 * * * *", "0 */2 * * *", "0 0 * * *"]
    with pytest.raises(ValueError, match="whole number of hours dividing 24"):
        refresh_cron(pd.Timedelta("90min"))


def test_reports_of_seeds_run_apart_merge_into_one_and_refuse_other_evaluations(tiny_eval, tmp_path):
    """``solaris evaluate-merge``: seeds run on other machines or sessions join one report; the summary and targets
    are recomputed over all seeds; a repeated seed or another evaluation's settings is refused by name."""
    import copy

    from click.testing import CliRunner

    from solaris_jobs.flows.cli import main
    out, report = tiny_eval
    # A second part as `solaris evaluate --seeds 1 --no-curves` writes it (its numbers relabelled: merging is
    # bookkeeping over whole per-seed results, so which numbers they are does not matter here).
    b = copy.deepcopy(report)
    b["config"].update(seeds=[1], curves=False)
    b["per_seed"][0]["seed"] = 1
    b["per_seed"][0].pop("curves", None)
    b["summary"] = [dict(report["summary"][0], seed=1)]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "report.json").write_text(json.dumps(b))
    a_path, b_path = str(out / "report.json"), str(tmp_path / "b" / "report.json")
    runner = CliRunner()
    res = runner.invoke(main, ["evaluate-merge", b_path, a_path, "--out", str(tmp_path / "m"), "--seeds", "0,1"])
    assert res.exit_code == 0, res.output
    m = json.loads((tmp_path / "m" / "report.json").read_text())
    assert m["seeds"] == [0, 1] and m["complete"] is True and m["config"]["seeds"] == [0, 1]
    a = json.loads((out / "report.json").read_text())
    assert [s["seed"] for s in m["summary"]] == [0, 1] and m["summary"][0] == a["summary"][0]
    assert [p["seed"] for p in m["targets"]["per_seed"]] == [0, 1]
    assert m["targets"]["per_seed"][0] == a["targets"]["per_seed"][0]
    assert "curves" in m["per_seed"][0] and [p["seeds"] for p in m["merged_from"]] == [[1], [0]]
    assert "## Targets" in (tmp_path / "m" / "report.md").read_text()
    # Without seed 2 the default three seeds are not all there.
    res = runner.invoke(main, ["evaluate-merge", a_path, b_path, "--out", str(tmp_path / "m2")])
    assert res.exit_code == 0 and json.loads((tmp_path / "m2" / "report.json").read_text())["complete"] is False
    res = runner.invoke(main, ["evaluate-merge", a_path, a_path, "--out", str(tmp_path / "m3")])
    assert res.exit_code != 0 and "seed 0 is in both" in res.output
    # A sweep run alone (`solaris evaluate --seeds none --sequence-shares 0`): no seed of its own; merged, the
    # headline's share is the sweep seed's headline run, beside the point that was run.
    from solaris_jobs.evaluation import report as rep
    share0 = a["config"]["synth"]["sequence_share"]
    c = copy.deepcopy(a)
    point = sweep_point(0.0, dict(a["per_seed"][0], seed=0), 0.0123)
    c.update(seeds=[], summary=[], per_seed=[], sweep=[point], targets=check_targets([]), complete=True)
    c["config"].update(seeds=[], sequence_shares=[0.0], curves=False)
    (tmp_path / "c").mkdir()
    rep.write(c, tmp_path / "c")
    row = next(r for r in (tmp_path / "c" / "report.md").read_text().splitlines() if r.startswith("| 0 | 0.012 |"))
    assert f"| {point['bce']['vm_kd']:.5f} | {point['bce']['solaris']:.5f} |" in row
    (tmp_path / "c" / "report.json").write_text(json.dumps(c))
    res = runner.invoke(main, ["evaluate-merge", a_path, str(tmp_path / "c" / "report.json"), "--out",
                               str(tmp_path / "m5"), "--seeds", "0"])
    assert res.exit_code == 0, res.output
    m = json.loads((tmp_path / "m5" / "report.json").read_text())
    assert [x["sequence_share"] for x in m["sweep"]] == sorted([0.0, share0])
    # Not complete: the sweep lacks two of the default shares, and the report says which.
    assert m["complete"] is False and m["notes"] == ["the sweep lacks the sequence shares 0.25, 0.75 of 0, 0.25, "
                                                     "0.5, 0.75"]
    head = next(x for x in m["sweep"] if x["sequence_share"] == share0)
    assert head["vm_bce"] == a["summary"][0]["vm_bce"] and head["positive_rate"] == a["data"]["positive_rate"]
    assert m["config"]["sequence_shares"] == sorted([0.0, share0])
    # Named first, the sweep-only part does not give the merged report its settings; without the sweep seed's
    # headline run the headline share's point is said to be missing; points of two seeds are not one sweep.
    res = runner.invoke(main, ["evaluate-merge", str(tmp_path / "c" / "report.json"), a_path, "--out",
                               str(tmp_path / "m6"), "--seeds", "0"])
    assert res.exit_code == 0 and json.loads((tmp_path / "m6" / "report.json").read_text())["config"] == m["config"]
    res = runner.invoke(main, ["evaluate-merge", b_path, str(tmp_path / "c" / "report.json"), "--out",
                               str(tmp_path / "m7"), "--seeds", "1"])
    m7 = json.loads((tmp_path / "m7" / "report.json").read_text())
    assert res.exit_code == 0 and m7["complete"] is False and "share 0.5 is missing" in m7["notes"][0]
    c["sweep"] = [point, dict(point, sequence_share=0.75, seed=1)]
    (tmp_path / "c" / "report.json").write_text(json.dumps(c))
    res = runner.invoke(main, ["evaluate-merge", a_path, str(tmp_path / "c" / "report.json"), "--out",
                               str(tmp_path / "m8")])
    assert res.exit_code != 0 and "one sweep runs at one seed" in res.output
    b["config"]["n_boot"] += 1
    (tmp_path / "b" / "report.json").write_text(json.dumps(b))
    res = runner.invoke(main, ["evaluate-merge", a_path, b_path, "--out", str(tmp_path / "m4")])
    assert res.exit_code != 0 and "config differs" in res.output and "(n_boot)" in res.output and b_path in res.output


def test_the_across_seed_interval_resamples_seeds_and_users_on_a_hand_made_case():
    """Two seeds whose user resamples are constant (1 and 3): each resample's mean is 1, 2 or 3 with probability
    1/4, 1/2, 1/4, so the 95% interval is [1, 3] and the value 2. One seed whose resamples are 0 or 2 half the time
    each: the interval is [0, 2] about its point value. A seed's spread and the seeds' spread both reach the bound."""
    r = metrics.across_seeds([np.ones(50), np.full(50, 3.0)], [1.0, 3.0], n_boot=4000)
    assert r["value"] == 2.0 and r["ci"] == [1.0, 3.0] and r["seeds"] == 2 and "seeds with replacement" in r["method"]
    r = metrics.across_seeds([np.array([0.0, 2.0] * 25)], [1.0], n_boot=4000)
    assert r["value"] == 1.0 and r["ci"] == [0.0, 2.0]
    # Five seeds, each sure of itself (no user spread): only the seeds' own spread widens the interval.
    pts = [0.1, 0.2, 0.3, 0.4, 0.5]
    r = metrics.across_seeds([np.full(10, p) for p in pts], pts, n_boot=4000)
    means = np.random.default_rng(0).choice(pts, (20000, 5)).mean(axis=1)
    assert abs(r["ci"][0] - np.quantile(means, 0.025)) < 0.021 and abs(r["ci"][1] - np.quantile(means, 0.975)) < 0.021
    with pytest.raises(ValueError, match="2 seeds of resamples for 1 point"):
        metrics.across_seeds([np.ones(3), np.ones(3)], [1.0])
    # Through the reports: each seed's summary keeps its resamples' quantiles, and the targets decide the headline
    # criterion across seeds, never on fewer than MIN_SEEDS.
    from solaris_jobs.evaluation.targets import MIN_SEEDS, across_seed_summary, seed_summary
    rng = np.random.default_rng(0)

    def seed_result(seed, keep):
        users = np.repeat(np.arange(40), 5)
        l_vm = rng.uniform(0.4, 0.6, 200)
        gain = rng.uniform(0.0, 0.1, 200)
        losses = {"vm": l_vm, "fm": l_vm - gain, "solaris": l_vm - keep * gain, "vm_kd": l_vm - 0.1 * gain}
        t = metrics.summarize_losses(losses, users, np.zeros(200), {}, boot=metrics.PairedBootstrap(users, 200, seed),
                                     kd="vm_kd", solaris="solaris")
        return {"seed": seed, "headline": {"test": t, "coverage": {"test": {}}},
                "fm_per_row": {"per_row": 0.5, "total_per_row": 0.6}}

    summaries = [seed_summary(seed_result(k, 0.6)) for k in range(MIN_SEEDS)]
    a = across_seed_summary(summaries)
    assert a["criterion"]["value"] == pytest.approx(np.mean([s["dbce_criterion"]["value"] for s in summaries]))
    assert a["criterion"]["statistic"] == "dBCE(solaris) - 1.5 x dBCE(vm_kd)" and a["criterion"]["met"] is True
    assert a["dbce"]["solaris"]["ci"][0] < a["dbce"]["solaris"]["value"] < a["dbce"]["solaris"]["ci"][1]
    assert across_seed_summary(summaries[:2])["criterion"]["met"] is None           # too few seeds to decide
    worse = [seed_summary(seed_result(k, 0.1)) for k in range(MIN_SEEDS)]            # SOLARIS keeps what KD keeps
    assert across_seed_summary(worse)["criterion"]["met"] is False
    # Coverage by the tiers that carry value: per seed, the test shares of the tiers whose own lower bound is above
    # 0; across seeds, of the tiers whose across-seed bound is, averaged over the seeds.
    from solaris_jobs.evaluation.targets import check_targets
    tv = lambda q: {"value": float(np.mean(q)), "quantiles": list(q), "carries_value": bool(np.quantile(q, .025) > 0)}
    for k, s in enumerate(summaries):
        s["coverage"] = {"shares": {"pair": 0.6 + 0.05 * (k % 2), "item_aware": 0.3, "neighbour": 0.05},
                         "any_tier": 0.95, "pair_of_ceiling": 0.8}
        s["tier_value"] = {"pair": tv(np.linspace(0.01, 0.03, 11)), "item_aware": tv(np.linspace(-0.01, 0.02, 11)),
                           "neighbour": tv(np.linspace(0.01, 0.02, 11))}
    per = check_targets(summaries)
    assert [p["valued_tiers_cover_at_least_85pct"] for p in per["per_seed"]] == [False] * MIN_SEEDS   # 0.65-0.7
    valued = per["across_seeds"]["valued_coverage"]
    assert valued["tiers"] == ["pair", "neighbour"] and valued["share"] == pytest.approx(0.05 + 0.6 + 0.05 * 2 / 5)
    assert valued["met"] is False
    for s in summaries:
        s["tier_value"]["item_aware"] = tv(np.linspace(0.01, 0.02, 11))
    per = check_targets(summaries)
    assert all(p["valued_tiers_cover_at_least_85pct"] for p in per["per_seed"])
    assert per["across_seeds"]["valued_coverage"]["met"] is True


def test_a_plot_with_nothing_to_draw_says_why_inside_it_and_warns_nothing(tmp_path, monkeypatch):
    """The quick evaluation's TR plot when no TR is quoted (the demo showed an empty frame under three matplotlib
    warnings): the reason is written across the figure, and no warning is raised; with a TR, points and no note."""
    import warnings

    import matplotlib
    import matplotlib.figure
    matplotlib.use("Agg")
    from solaris_jobs.evaluation import report as rp
    texts = {}
    save = matplotlib.figure.Figure.savefig

    def spy(fig, path, *a, **k):          # what each saved figure says in its axes
        texts[Path(path).name] = [t.get_text() for ax in fig.axes for t in ax.texts]
        return save(fig, path, *a, **k)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)

    def seed(s, tr, gap_ci):
        v = {"tr": tr, "tr_ci": [tr - 0.1, tr + 0.1]} if tr is not None else {"tr": None, "tr_ci": None}
        return {"seed": s, "headline": {"test": {"gap": {"value": sum(gap_ci) / 2, "ci": gap_ci},
                                                 "variants": {"solaris": v, "kd": v}}}}
    flat = {"per_seed": [seed(0, None, [-0.0005, 0.0031])]}
    points = [{"solaris": {"tr": None, "tr_ci": None}, "coverage": {"any_tier": 0.9, "shares": {"pair": 0.5}},
               "budget_per_row": 0.5}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rp._plot_tr_per_variant({"per_seed": [seed(0, 0.4, [0.001, 0.003])]}, tmp_path)
        assert texts.pop("tr_per_variant.png") == []            # points drawn, nothing to explain
        rp._plot_tr_per_variant(flat, tmp_path)
        rp._plot_tr_vs_coverage(points, tmp_path)
    note, = texts["tr_per_variant.png"]
    assert note.startswith("Nothing to draw:") and "seed 0: the FM's gain over the VM, 0.0013 [-0.0005, 0.0031], " \
        "is not above 0" in note.replace("\n", " ")
    assert "no TR is quoted at any budget" in texts["tr_vs_coverage.png"][0].replace("\n", " ")
