"""Ad-like synthetic traffic in the event-log contract, at any scale, deterministic under a seed.

What it models (all parameters in :class:`SynthConfig`):

* Users return over days in sessions. Each user has a heavy-tailed activity rate (log-normal, median
  ``session_rate`` sessions/day). Inside a session requests follow each other minutes apart
  (``request_gap_minutes``); a session goes on with probability ``p_continue`` after each request.
* Each request ranks ``n_pool + n_fresh`` candidates: ``n_pool`` from a per-user pool of ``pool_size`` items that
  changes slowly (each slot is replaced with probability ``1 - exp(-gap / pool_half_life)``), and ``n_fresh``
  popular items drawn from a Zipf law. So the same user-item pairs come back across requests, as ads do.
* The label (click) is a hidden non-linear function of the pair and the user's recent history, in two parts:
  a *static* part (a saturating affinity ``tanh(<u, v>)`` and item popularity) that ids and side features can
  learn, and a *sequence* part (the user's current interest, an exponentially decaying mean of the items they
  clicked, rectified; and fatigue from recent impressions of the same pair, decaying with
  ``fatigue_half_life_hours``) that only a model of the user's history can see. ``sequence_share`` is the share
  of the logit's signal variance that comes from the sequence part; ``signal_scale`` the standard deviation of
  the whole signal in logit units; the bias is solved so that the positive rate is ``positive_rate``. The
  standardisation and the bias are calibrated on a pilot draw of ``calibration_users`` users who are not in the
  log (ids from ``PILOT_ID0``; a few fixed-point rounds since clicks feed the interest state), so they depend only
  on the parameters and the seed, and no row of the log, in any period, is used to fit them.
* Users have side features ``segment`` (their favourite category, informative) and ``region`` (noise); items
  have ``category`` (informative).

Why these defaults (fixed before any evaluation run; see docs/data.md "Synthetic ad-like traffic"):

* ``p_continue`` 0.8 with 3-minute gaps: about 76% of a user's consecutive requests come within 10 minutes, the
  share Meta's ERCache (arXiv 2410.06497) reports for consecutive user-model inferences in ads.
* ``session_rate`` median 1.2 sessions/day, log-normal (sigma 1): about 0.67 of a month's users are active on a
  given day, the DAU/MAU ratio Meta reports for its apps; activity is heavy-tailed.
* ``positive_rate`` 5%: an ad-like click rate (MovieLens' "rating >= 4" is 55%, not ad-like).
* ``pool_half_life_days`` 2: per-user ad rankings stay stable over short periods (Meta's negative exclusion
  filtering relies on it), and campaigns turn over in days.

Determinism: every random draw is a counter-based hash of (seed, stream, user, request index, slot), so the rows
do not depend on how users are split into chunks, and the same seed and parameters give the same bytes. Users
are generated ``chunk_users`` at a time; a chunk's rows are written and dropped before the next, so memory is
bounded by the chunk, not the whole log.
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from solaris_jobs.core import events as ev

logger = logging.getLogger(__name__)

LATENT = 8
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class SynthConfig:
    """Parameters of the synthetic traffic (documented in the module docstring)."""
    users: int = 10_000
    items: int = 5_000
    days: float = 7.0
    seed: int = 0
    start: str = "2026-01-05T00:00:00Z"
    categories: int = 24
    zipf_exponent: float = 1.05
    session_rate: float = 1.2          # median sessions per day; log-normal across users
    session_rate_sigma: float = 1.0
    p_continue: float = 0.8            # chance a session has another request
    request_gap_minutes: float = 3.0
    pool_size: int = 40
    pool_half_life_days: float = 2.0
    n_pool: int = 8
    n_fresh: int = 2
    interest_half_life_hours: float = 12.0
    fatigue_half_life_hours: float = 24.0
    positive_rate: float = 0.05        # target share of positive labels (the bias is solved for it)
    sequence_share: float = 0.5        # share of the label's signal variance only a sequence model can see
    signal_scale: float = 1.5          # std of the label's signal in logit units
    calibration_users: int = 2_000
    calibration_rounds: int = 3
    max_requests: int = 5_000
    chunk_users: int = 50_000

    def __post_init__(self):
        for name, lo, hi in (("positive_rate", 0.0, 1.0), ("sequence_share", 0.0, 1.0), ("p_continue", 0.0, 1.0)):
            v = getattr(self, name)
            if not (lo <= v <= hi) or (name == "positive_rate" and v in (lo, hi)):
                raise ValueError(f"SynthConfig.{name} = {v} is outside [{lo}, {hi}]")


@dataclass(frozen=True)
class Calibration:
    """How the label's two parts are scaled: logit = bias + a_s (static - mu_s) / sd_s + a_d (seq - mu_d) / sd_d,
    with a_s = scale sqrt(1 - share), a_d = scale sqrt(share)."""
    bias: float = -3.0
    mu_s: float = 0.0
    sd_s: float = 1.0
    mu_d: float = 0.0
    sd_d: float = 1.0


def _mix(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _uniform(seed: int, stream: int, *keys) -> np.ndarray:
    """Uniform [0, 1) draws, a pure function of (seed, stream, keys); keys broadcast like numpy arrays."""
    with np.errstate(over="ignore"):
        h = _mix(np.uint64(seed) * _GOLDEN + np.uint64(stream))
        for k in keys:
            h = _mix(h ^ (np.asarray(k).astype(np.uint64) + _GOLDEN))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _normal(seed: int, stream: int, *keys) -> np.ndarray:
    u1 = _uniform(seed, stream, *keys)
    u2 = _uniform(seed, stream + 7919, *keys)
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)


class _World:
    """The global part of the simulation: items, categories, popularity."""

    def __init__(self, cfg: SynthConfig):
        self.cfg = cfg
        m, c, s = cfg.items, cfg.categories, cfg.seed
        idx = np.arange(m)
        self.category = np.floor(_uniform(s, 1, idx) * c).astype(np.int64)
        centroids = _normal(s, 2, np.arange(c)[:, None], np.arange(LATENT)[None, :])
        self.centroids = centroids / np.linalg.norm(centroids, axis=1, keepdims=True)
        noise = _normal(s, 3, idx[:, None], np.arange(LATENT)[None, :]) / math.sqrt(LATENT)
        self.vec = 0.8 * self.centroids[self.category] + 0.6 * noise          # (M, LATENT)
        rank = np.argsort(_uniform(s, 4, idx), kind="stable")                  # item at each popularity rank
        weight = np.empty(m)
        weight[rank] = 1.0 / np.arange(1, m + 1) ** cfg.zipf_exponent
        self.weight = weight / weight.sum()
        self.pop_z = (np.log(weight) - np.log(weight).mean()) / np.log(weight).std()
        self.global_order = rank
        self.global_cdf = np.cumsum(weight[rank]) / weight.sum()
        # Per-category Zipf: items sorted by (category, popularity), CDF of segment c shifted to (c, c+1].
        order = np.lexsort((-weight, self.category))
        self.cat_order = order
        cat_sorted = self.category[order]
        w = weight[order]
        seg_total = np.bincount(cat_sorted, weights=w, minlength=c)
        cum = np.cumsum(w)
        seg_start = np.concatenate([[0.0], np.cumsum(seg_total)[:-1]])
        self.cat_cdf = cat_sorted + (cum - seg_start[cat_sorted]) / np.maximum(seg_total[cat_sorted], 1e-300)
        self.cat_has_items = seg_total > 0

    def popular(self, u: np.ndarray) -> np.ndarray:
        return self.global_order[np.minimum(np.searchsorted(self.global_cdf, u, side="right"), self.cfg.items - 1)]

    def in_category(self, cat: np.ndarray, u: np.ndarray) -> np.ndarray:
        pos = np.searchsorted(self.cat_cdf, cat + u, side="right")
        item = self.cat_order[np.minimum(pos, self.cfg.items - 1)]
        return np.where(self.cat_has_items[cat], item, self.popular(u))


def _user_side(cfg: SynthConfig, ids: np.ndarray, world: _World) -> dict:
    s = cfg.seed
    fav = np.floor(_uniform(s, 10, ids[:, None], np.arange(3)[None, :]) * cfg.categories).astype(np.int64)
    noise = _normal(s, 11, ids[:, None], np.arange(LATENT)[None, :]) / math.sqrt(LATENT)
    vec = 0.9 * world.centroids[fav[:, 0]] + 0.8 * noise
    rate = cfg.session_rate * np.exp(cfg.session_rate_sigma * _normal(s, 12, ids))
    region = np.floor(_uniform(s, 13, ids) * 10).astype(np.int64)
    return {"fav": fav, "vec": vec, "rate": np.minimum(rate, 24.0), "region": region}


def _draw_pool_items(cfg, world, users, fav, keys_step, slots):
    """Items for pool slots: 70% from the user's favourite categories, 30% globally popular (Zipf)."""
    s = cfg.seed
    u_kind = _uniform(s, 20, users[:, None], keys_step[:, None], slots[None, :])
    u_cat = _uniform(s, 21, users[:, None], keys_step[:, None], slots[None, :])
    u_item = _uniform(s, 22, users[:, None], keys_step[:, None], slots[None, :])
    which = np.floor(u_cat * 3).astype(np.int64)
    cats = np.take_along_axis(fav, which, axis=1)
    return np.where(u_kind < 0.7, world.in_category(cats, u_item), world.popular(u_item))


@dataclass
class _Users:
    """A chunk's users as the simulation goes, request by request (arrays indexed by the user's row)."""
    ids: np.ndarray
    side: dict              # ``_user_side``
    pool: np.ndarray        # (n, pool_size): the item in each pool slot
    heat: np.ndarray        # (n, pool_size): recent impressions of each pool slot, decaying (fatigue)
    interest: np.ndarray    # (n, LATENT): the current interest, moved by clicks
    t: np.ndarray           # the time of the next request (seconds from the start)
    last_t: np.ndarray      # the time of the previous one
    alive: np.ndarray       # whether the next request is before the horizon


@dataclass(frozen=True)
class _Request:
    """The ``step``-th request of every user still active."""
    rows: np.ndarray        # their rows in ``_Users``
    uid: np.ndarray
    tt: np.ndarray          # its time
    stepk: np.ndarray       # the step, per row (a key of the draws)
    gap: np.ndarray         # seconds since the user's previous request


@dataclass(frozen=True)
class _Candidates:
    """A request's candidates: ``n_pool`` pool slots (``pick``) and ``n_fresh`` popular items."""
    pick: np.ndarray        # (r, n_pool): the pool slots shown
    pool_heat: np.ndarray   # (r, n_pool): their fatigue before this request
    items: np.ndarray       # (r, K): 0-based item indices
    item_heat: np.ndarray   # (r, K): fatigue of each candidate (0 for the popular ones)


def _start_users(cfg: SynthConfig, world: _World, lo: int, hi: int) -> _Users:
    """Users lo+1..hi (ids are 1-based) before their first request: side features, pools, first request times."""
    ids = np.arange(lo + 1, hi + 1, dtype=np.int64)
    side = _user_side(cfg, ids, world)
    n = len(ids)
    pool = _draw_pool_items(cfg, world, ids, side["fav"], np.full(n, 0xFFFF), np.arange(cfg.pool_size))   # (n, P)
    # First request: the user's session process is already running at the start (memoryless).
    t = -np.log1p(-_uniform(cfg.seed, 30, ids)) / side["rate"] * 86400.0
    return _Users(ids, side, pool, np.zeros((n, cfg.pool_size)), np.zeros((n, LATENT)), t, t.copy(),
                  t < cfg.days * 86400.0)


def _drift_pools(cfg: SynthConfig, world: _World, users: _Users, req: _Request) -> None:
    """Slow pool drift: each slot replaced with probability 1 - exp(-gap / half-life) (a new slot is not
    fatigued); the fatigue of the others cools since the previous request."""
    rows, slots = req.rows, np.arange(cfg.pool_size)
    p_rep = 1.0 - np.exp(-req.gap / (cfg.pool_half_life_days * 86400.0) * math.log(2))
    rep = _uniform(cfg.seed, 40, req.uid[:, None], req.stepk[:, None], slots[None, :]) < p_rep[:, None]
    cool = np.exp(-req.gap / (cfg.fatigue_half_life_hours * 3600.0) * math.log(2))
    users.heat[rows] *= cool[:, None]
    if rep.any():
        fresh_pool = _draw_pool_items(cfg, world, req.uid, users.side["fav"][rows], req.stepk, slots)
        users.pool[rows] = np.where(rep, fresh_pool, users.pool[rows])
        users.heat[rows] = np.where(rep, 0.0, users.heat[rows])


def _candidates(cfg: SynthConfig, world: _World, users: _Users, req: _Request) -> _Candidates:
    """Candidates: n_pool distinct pool slots + n_fresh popular items."""
    s = cfg.seed
    keys = _uniform(s, 41, req.uid[:, None], req.stepk[:, None], np.arange(cfg.pool_size)[None, :])
    pick = np.argsort(keys, axis=1)[:, : cfg.n_pool]                                       # (r, n_pool)
    pool_items = np.take_along_axis(users.pool[req.rows], pick, axis=1)
    pool_heat = np.take_along_axis(users.heat[req.rows], pick, axis=1)
    fresh = world.popular(_uniform(s, 42, req.uid[:, None], req.stepk[:, None], np.arange(cfg.n_fresh)[None, :]))
    return _Candidates(pick, pool_heat, np.concatenate([pool_items, fresh], axis=1),          # (r, K)
                       np.concatenate([pool_heat, np.zeros(fresh.shape)], axis=1))


def _clicks(cfg: SynthConfig, world: _World, calib: Calibration, users: _Users, req: _Request,
            cand: _Candidates, raw: list | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The hidden click model: a static part (ids and side features can learn it) and a sequence part.

    Returns:
        (clicks (r, K) bool, the candidates' vectors (r, K, LATENT), the users' interest decayed to now, the true
        click probabilities (r, K) the clicks were drawn from).
    """
    a_s = cfg.signal_scale * math.sqrt(1.0 - cfg.sequence_share)
    a_d = cfg.signal_scale * math.sqrt(cfg.sequence_share)
    v = world.vec[cand.items]                                                              # (r, K, LATENT)
    decay = np.exp(-req.gap / (cfg.interest_half_life_hours * 3600.0) * math.log(2))
    cur_interest = users.interest[req.rows] * decay[:, None]
    aff = np.einsum("rkd,rd->rk", v, users.side["vec"][req.rows])
    cur = np.einsum("rkd,rd->rk", v, cur_interest)
    static = 1.6 * np.tanh(1.5 * aff) + 0.35 * world.pop_z[cand.items]
    seq = 3.0 * np.maximum(cur, 0.0) - 0.45 * np.log1p(cand.item_heat) * (1.0 + (aff < 0))
    if raw is not None:
        raw.append((static.ravel(), seq.ravel()))
    logit = (calib.bias + a_s * (static - calib.mu_s) / calib.sd_s + a_d * (seq - calib.mu_d) / calib.sd_d)
    k_cand = cfg.n_pool + cfg.n_fresh
    prob = 1.0 / (1.0 + np.exp(-logit))
    y = _uniform(cfg.seed, 43, req.uid[:, None], req.stepk[:, None], np.arange(k_cand)[None, :]) < prob
    return y, v, cur_interest, prob


def _after_clicks(users: _Users, req: _Request, cand: _Candidates, y: np.ndarray, v: np.ndarray,
                  cur_interest: np.ndarray) -> None:
    """State updates: interest moves toward the clicked items, shown pool slots warm up (fatigue)."""
    rows = req.rows
    clicked = y.sum(axis=1)
    mean_clicked = np.einsum("rk,rkd->rd", y, v) / np.maximum(clicked, 1)[:, None]
    users.interest[rows] = np.where(clicked[:, None] > 0, 0.5 * cur_interest + 0.5 * mean_clicked, cur_interest)
    sub = users.heat[rows]
    np.put_along_axis(sub, cand.pick, cand.pool_heat + 1.0, axis=1)
    users.heat[rows] = sub


def _next_requests(cfg: SynthConfig, users: _Users, req: _Request) -> None:
    """Next request: same session minutes later, or a new session hours to days later."""
    s, rows, tt = cfg.seed, req.rows, req.tt
    users.last_t[rows] = tt
    cont = _uniform(s, 44, req.uid, req.stepk) < cfg.p_continue
    e = -np.log1p(-_uniform(s, 45, req.uid, req.stepk))
    nxt = tt + np.where(cont, e * cfg.request_gap_minutes * 60.0, e / users.side["rate"][rows] * 86400.0)
    users.t[rows] = nxt
    users.alive[rows] = nxt < cfg.days * 86400.0


EVENT_COLUMNS = ("user_id", "item_id", "event_timestamp", "label", "request_id")
# Beside the log, never in it: each row's true click probability (``truth/``), so that a report can show the
# achievable BCE and how much of that headroom each model reaches. No job and no model reads it.
TRUTH_DIR = "truth"


def _log_request(out: dict, step: int, req: _Request, cand: _Candidates, y: np.ndarray, prob: np.ndarray) -> None:
    """Appends a request's rows (one per candidate) to ``out``'s columns (``event_timestamp`` in seconds) and
    their true click probabilities."""
    k_cand = cand.items.shape[1]
    out["user_id"].append(np.repeat(req.uid, k_cand))
    out["item_id"].append(cand.items.ravel() + 1)
    out["event_timestamp"].append(np.repeat(req.tt, k_cand))
    out["label"].append(y.ravel())
    out["request_id"].append(np.repeat(req.uid * 65536 + step, k_cand))
    out["click_prob"].append(prob.ravel())


def _events_table(cfg: SynthConfig, out: dict) -> pa.Table:
    """The logged rows as a table in the event-log contract."""
    if not out["user_id"]:
        return ev.conform(pd.DataFrame({c: pd.Series(dtype="int64") for c in ["user_id", "item_id"]})
                          .assign(event_timestamp=pd.Series(dtype="datetime64[us, UTC]")))
    ts_us = _event_us(cfg, out)
    table = pa.table({
        "user_id": np.concatenate(out["user_id"]),
        "item_id": np.concatenate(out["item_id"]),
        "event_timestamp": pa.array(ts_us, pa.timestamp("us", tz="UTC")),
        "label": np.concatenate(out["label"]).astype(np.int8),
        "request_id": np.concatenate(out["request_id"]),
    })
    return ev.conform(table)


def _event_us(cfg: SynthConfig, out: dict) -> np.ndarray:
    start_us = ev.to_utc(cfg.start).value // 1000
    return start_us + np.floor(np.concatenate(out["event_timestamp"]) * 1e6).astype(np.int64)


def _truth_table(cfg: SynthConfig, out: dict) -> pa.Table:
    """Each logged row's key (user, item, time) and its true click probability, rows in the log's order."""
    if not out["user_id"]:
        return pa.table({"user_id": pa.array([], pa.int64()), "item_id": pa.array([], pa.int64()),
                         "event_timestamp": pa.array([], pa.timestamp("us", tz="UTC")),
                         "click_prob": pa.array([], pa.float32())})
    return pa.table({"user_id": np.concatenate(out["user_id"]).astype(np.int64),
                     "item_id": np.concatenate(out["item_id"]).astype(np.int64),
                     "event_timestamp": pa.array(_event_us(cfg, out), pa.timestamp("us", tz="UTC")),
                     "click_prob": np.concatenate(out["click_prob"]).astype(np.float32)})


def _generate_chunk(cfg: SynthConfig, world: _World, lo: int, hi: int, calib: Calibration,
                    raw: list | None = None, truth: list | None = None) -> pa.Table:
    """Simulates users lo+1..hi (ids are 1-based) and returns their events.

    ``raw``: when a list, the (static, sequence) parts of every row's logit are appended to it (the calibration).
    ``truth``: when a list, the rows' true click probabilities are appended to it as a table (``_truth_table``).
    """
    users = _start_users(cfg, world, lo, hi)
    out = {c: [] for c in (*EVENT_COLUMNS, "click_prob")}
    for step in range(cfg.max_requests):
        rows = np.flatnonzero(users.alive)
        if rows.size == 0:
            break
        tt = users.t[rows]
        req = _Request(rows, users.ids[rows], tt, np.full(rows.size, step), tt - users.last_t[rows])
        _drift_pools(cfg, world, users, req)
        cand = _candidates(cfg, world, users, req)
        y, v, cur_interest, prob = _clicks(cfg, world, calib, users, req, cand, raw)
        _after_clicks(users, req, cand, y, v, cur_interest)
        _log_request(out, step, req, cand, y, prob)
        _next_requests(cfg, users, req)
    if truth is not None:
        truth.append(_truth_table(cfg, out))
    return _events_table(cfg, out)


def _solve_bias(offset: np.ndarray, rate: float) -> float:
    """The b with mean(sigmoid(b + offset)) = rate (bisection; the mean is increasing in b)."""
    lo, hi = -30.0, 30.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if np.mean(1.0 / (1.0 + np.exp(-(mid + offset)))) < rate:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


# Bumped whenever the same config gives other rows (2: the calibration pilot left the log), so caches keyed on the
# config (the evaluation's data sets) regenerate instead of serving rows of an older generator.
GENERATOR_VERSION = 2

# Pilot users' ids: far beyond any population the generator makes, so the pilot is an independent draw of the same
# process and never one of the log's users (whose test-period rows would otherwise fit a generator parameter).
PILOT_ID0 = 1 << 40


def calibrate(cfg: SynthConfig, world: _World) -> Calibration:
    """Standardisation of the label's two parts and the bias for ``positive_rate``, from a pilot draw of
    ``calibration_users`` users outside the log (ids ``PILOT_ID0 + 1 ...``); repeated ``calibration_rounds`` times
    because clicks move the interest state."""
    n = cfg.calibration_users
    calib = Calibration()
    a_s = cfg.signal_scale * math.sqrt(1.0 - cfg.sequence_share)
    a_d = cfg.signal_scale * math.sqrt(cfg.sequence_share)
    for _ in range(cfg.calibration_rounds):
        raw: list = []
        _generate_chunk(cfg, world, PILOT_ID0, PILOT_ID0 + n, calib, raw)
        if not raw:
            return calib
        st = np.concatenate([r[0] for r in raw])
        sq = np.concatenate([r[1] for r in raw])
        mu_s, sd_s = float(st.mean()), float(st.std()) or 1.0
        mu_d, sd_d = float(sq.mean()), float(sq.std()) or 1.0
        offset = a_s * (st - mu_s) / sd_s + a_d * (sq - mu_d) / sd_d
        calib = Calibration(_solve_bias(offset, cfg.positive_rate), mu_s, sd_s, mu_d, sd_d)
    return calib


def pair_recurrence(table: pa.Table, window_hours: float = 24.0) -> tuple[int, int]:
    """Counts rows whose (user, item) pair was already ranked for that user in the previous ``window_hours``.

    "Previous" is strictly earlier (an earlier request), so duplicates inside one request do not count.
    All rows of a user must be in ``table``.

    Returns:
        (recurrent rows, all rows).
    """
    if table.num_rows == 0:
        return 0, 0
    u = table.column("user_id").to_numpy()
    i = table.column("item_id").to_numpy()
    t = table.column("event_timestamp").cast(pa.int64()).to_numpy()
    order = np.lexsort((t, i, u))
    u, i, t = u[order], i[order], t[order]
    same = (u[1:] == u[:-1]) & (i[1:] == i[:-1])
    # Earliest strictly-earlier row of the pair: walk back over same-timestamp rows by using the run start.
    dt_prev = np.diff(t)
    # Time since the last *distinct* timestamp of the same pair.
    new_ts = np.concatenate([[True], ~same | (dt_prev > 0)])
    last_distinct = np.maximum.accumulate(np.where(new_ts, np.arange(len(t)), 0))
    prev_idx = last_distinct - 1          # the row before this timestamp run
    ok = prev_idx >= 0
    pi = np.where(ok, prev_idx, 0)
    rec = ok & (u[pi] == u) & (i[pi] == i) & (t - t[pi] <= window_hours * 3600e6) & (t[pi] < t)
    return int(rec.sum()), len(t)


def _consecutive_gaps(table: pa.Table, within_s: float) -> np.ndarray:
    """(consecutive request pairs of one user less than ``within_s`` apart, all consecutive request pairs)."""
    if table.num_rows == 0:
        return np.zeros(2, np.int64)
    u = table.column("user_id").to_numpy()
    t = table.column("event_timestamp").cast(pa.int64()).to_numpy()
    r = table.column("request_id").to_numpy()
    first = np.concatenate([[True], r[1:] != r[:-1]])
    u, t = u[first], t[first]
    order = np.lexsort((t, u))
    u, t = u[order], t[order]
    same = u[1:] == u[:-1]
    return np.array([int((same & (np.diff(t) < within_s * 1e6)).sum()), int(same.sum())], np.int64)


def generate(cfg: SynthConfig, out: str | os.PathLike, progress: bool = False) -> dict:
    """Generates the data set under ``out`` chunk by chunk and writes its manifest.

    Returns:
        The manifest: parameters, rows, users with events, positive rate, pair recurrence, seconds taken.
    """
    t0 = time.perf_counter()
    out = Path(out)
    world = _World(cfg)
    calib = calibrate(cfg, world)
    logger.info("label calibration: %s", calib)
    bounds = list(range(0, cfg.users, cfg.chunk_users)) + [cfg.users]
    chunks = list(zip(bounds[:-1], bounds[1:]))
    if progress:
        from tqdm import tqdm
        chunks = tqdm(chunks, desc="synth chunks", unit="chunk")
    n_rows = n_pos = n_rec = n_users = 0
    gaps = np.zeros(2, np.int64)           # consecutive requests of a user: within 10 minutes, all
    out.mkdir(parents=True, exist_ok=True)
    users_writer = pq.ParquetWriter(out / ".users.parquet.tmp", pa.schema(
        [("user_id", pa.int64()), ("segment", pa.int32()), ("region", pa.int32())]), compression="zstd")
    try:
        for k, (lo, hi) in enumerate(chunks):
            truth: list = []
            table = _generate_chunk(cfg, world, lo, hi, calib, truth=truth)
            ev.write_events(table, out, part=f"part-{k:05d}")
            (out / TRUTH_DIR).mkdir(exist_ok=True)
            pq.write_table(truth[0], out / TRUTH_DIR / f"part-{k:05d}.parquet", compression="zstd")
            rec, rows = pair_recurrence(table)
            n_rows += rows
            n_rec += rec
            n_pos += int(pa.compute.sum(table.column("label")).as_py() or 0)
            n_users += len(np.unique(table.column("user_id").to_numpy()))
            gaps += _consecutive_gaps(table, 600.0)
            ids = np.arange(lo + 1, hi + 1, dtype=np.int64)
            side = _user_side(cfg, ids, world)
            users_writer.write_table(pa.table({"user_id": ids, "segment": side["fav"][:, 0].astype(np.int32) + 1,
                                               "region": side["region"].astype(np.int32) + 1}))
            logger.info("chunk %d: users %d-%d, %d rows", k, lo + 1, hi, rows)
    finally:
        users_writer.close()
    os.replace(out / ".users.parquet.tmp", out / "users.parquet")
    ev.write_table(pa.table({"item_id": np.arange(1, cfg.items + 1, dtype=np.int64),
                             "category": (world.category + 1).astype(np.int32)}), out / "items.parquet")
    manifest = {
        "source": "synthetic", "generator_version": GENERATOR_VERSION, "config": asdict(cfg), "events": n_rows,
        "users_with_events": n_users,
        "positive_rate": n_pos / max(n_rows, 1), "pair_recurrence_24h": n_rec / max(n_rows, 1),
        "consecutive_requests_within_10min": float(gaps[0] / max(gaps[1], 1)), "calibration": asdict(calib),
        "rejected": 0, "seconds": round(time.perf_counter() - t0, 2), "truth": TRUTH_DIR,
    }
    ev.write_manifest(out, manifest)
    logger.info("synthetic: %d rows, %d users, positive rate %.3f, 24h pair recurrence %.3f in %.1fs", n_rows,
                n_users, manifest["positive_rate"], manifest["pair_recurrence_24h"], manifest["seconds"])
    return manifest


def read_truth(root: str | os.PathLike, users: np.ndarray, items: np.ndarray, ts_us: np.ndarray) -> np.ndarray:
    """The true click probability of each given row (user, item, event time in microseconds) of a synthetic data
    set; NaN for a row not in it.

    Raises:
        FileNotFoundError: ``root`` has no ``truth/`` (not a synthetic data set, or one made before it was written).
    """
    folder = Path(root) / TRUTH_DIR
    if not folder.is_dir():
        raise FileNotFoundError(f"{root}: no {TRUTH_DIR}/ with the rows' true click probabilities (a synthetic data "
                                "set from `solaris data synth` has one)")
    table = pq.read_table(folder)
    t = pd.DataFrame({"user_id": table.column("user_id").to_numpy(), "item_id": table.column("item_id").to_numpy(),
                      "t": table.column("event_timestamp").cast(pa.int64()).to_numpy(),
                      "click_prob": table.column("click_prob").to_numpy()})
    keys = pd.DataFrame({"user_id": np.asarray(users, np.int64), "item_id": np.asarray(items, np.int64),
                         "t": np.asarray(ts_us, np.int64)})
    got = keys.merge(t.drop_duplicates(["user_id", "item_id", "t"]), on=["user_id", "item_id", "t"], how="left")
    return got["click_prob"].to_numpy(np.float64)
