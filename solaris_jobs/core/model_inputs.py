"""Point-in-time model inputs built from the event log: histories, counters and side features.

Everything here looks strictly before the query time: an event at time t sees the events with timestamp < t
(not file order; same-second ties are common in MovieLens and every row of a synthetic request shares one
timestamp). The same code builds training examples and inference inputs, so training and serving cannot skew.

Side tables: ``users.parquet`` / ``items.parquet`` hold integer categorical columns (one code per row, 0 =
unknown) and ``list<int>`` multi-valued columns (e.g. MovieLens genres). They become dense lookup tables indexed
by id that the models keep as buffers.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa

from solaris_jobs.core.contract import N_GAP_BUCKETS, RECENCY_INPUTS, RECENCY_WINDOWS_H, SIGNAL_UNKNOWN

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class SideSpec:
    """Vocabulary sizes of one side table: id vocabulary, categorical columns, multi-valued columns."""
    n_ids: int
    categorical: dict = field(default_factory=dict)     # column -> vocabulary size (codes 0..size-1)
    multi: dict = field(default_factory=dict)           # column -> (vocabulary size, max length)


DENSE_IDS_MAX = 1_000_000


def id_vocabulary(*ids: np.ndarray, dense_max: int = DENSE_IDS_MAX) -> np.ndarray | None:
    """None when the ids can index embedding rows directly (the largest id + 1 is at most ``dense_max`` or 4x the
    number of distinct ids); else the sorted distinct ids (sparse or hashed int64 ids: the tables get one row per
    distinct id, row 0 for unknown ids, instead of a row per possible id)."""
    distinct = np.unique(np.concatenate([np.asarray(x, np.int64) for x in ids]))
    distinct = distinct[distinct > 0]
    if not len(distinct) or distinct[-1] + 1 <= max(dense_max, 4 * len(distinct)):
        return None
    return distinct


def id_rows(ids: np.ndarray, vocab: np.ndarray | None) -> np.ndarray:
    """Embedding rows of ``ids``: the id itself (dense), or its position in ``vocab`` + 1 (0: not in it)."""
    ids = np.asarray(ids, np.int64)
    if vocab is None:
        return ids
    pos = np.minimum(np.searchsorted(vocab, ids), len(vocab) - 1)
    return np.where(vocab[pos] == ids, pos + 1, 0)


def side_tables(side: pd.DataFrame, key: str, n_ids: int,
                vocab: np.ndarray | None = None) -> tuple[SideSpec, np.ndarray, dict]:
    """Lookups for a side table, one row per embedding row.

    Args:
        side: frame with ``key`` and feature columns (ints, or lists of ints).
        key: ``user_id`` or ``item_id``.
        n_ids: id vocabulary size (ids >= n_ids map to row 0, "unknown").
        vocab: the sorted ids of a sparse vocabulary (``id_vocabulary``; then n_ids = len(vocab) + 1), or None.

    Returns:
        (spec, categorical table (n_ids, C) int64, {multi column: (n_ids, max_len) int64 padded with 0}).
    """
    cat_cols = [c for c in side.columns if c != key and not isinstance(side[c].iloc[0] if len(side) else 0,
                                                                       (list, np.ndarray))]
    multi_cols = [c for c in side.columns if c != key and c not in cat_cols]
    ids = id_rows(side[key].to_numpy(), vocab)
    keep = (ids > 0) & (ids < n_ids) if vocab is not None else (ids >= 0) & (ids < n_ids)
    ids = ids[keep]
    cat = np.zeros((n_ids, len(cat_cols)), dtype=np.int64)
    vocab = {}
    for j, c in enumerate(cat_cols):
        vals = np.clip(side[c].to_numpy()[keep].astype(np.int64), 0, None)
        cat[ids, j] = vals
        vocab[c] = int(vals.max()) + 1 if len(vals) else 1
    multi, multi_vocab = {}, {}
    for c in multi_cols:
        lists = side[c].to_numpy()[keep]
        width = max((len(x) for x in lists), default=1)
        m = np.zeros((n_ids, width), dtype=np.int64)
        for r, x in zip(ids, lists):
            m[r, : len(x)] = x
        multi[c] = m
        multi_vocab[c] = (int(m.max()) + 1, width)
    return SideSpec(n_ids, vocab, multi_vocab), cat, multi


class EventIndex:
    """The event log sorted by (user, time) and by (item, time), for point-in-time lookups.

    Args:
        events: a table in the event-log contract (all the history queries may look at; queries only ever
            see rows strictly earlier than their own time).
        label_delay_us: an event's label (and rating) is known only this long after the event (its impression at
            once): a query at ts sees the labels of events before ``ts - label_delay_us`` only, in the history
            (signal ``SIGNAL_UNKNOWN``) and in the counters (labelled events and positives), as the refresh does.
    """

    def __init__(self, events: pa.Table, label_delay_us: int = 0):
        self.label_delay_us = int(label_delay_us)
        u = events.column("user_id").to_numpy().astype(np.int64)
        i = events.column("item_id").to_numpy().astype(np.int64)
        t = events.column("event_timestamp").cast(pa.int64()).to_numpy()
        lab = events.column("label").to_numpy(zero_copy_only=False)
        lab = np.where(pd.isna(lab), -1, lab).astype(np.int8)
        rat = events.column("rating").to_numpy(zero_copy_only=False)
        rat = np.where(pd.isna(rat), 0, rat).astype(np.int8)
        self.times = np.unique(t)                          # distinct timestamps, for rank keys
        # Full sort key, so the order never depends on the input's row order (ties broken by item, label).
        order = np.lexsort((rat, lab, i, t, u))
        self.u, self.i, self.t, self.label, self.rating = u[order], i[order], t[order], lab[order], rat[order]
        self.signal = np.where(self.rating > 0, self.rating, np.select([self.label == 1, self.label == 0], [7, 6],
                                                                        SIGNAL_UNKNOWN)).astype(np.int64)
        self.u_key = self.u * len(self.times) + np.searchsorted(self.times, self.t)
        self.cum_known = np.concatenate([[0], np.cumsum(self.label >= 0)])
        self.cum_pos = np.concatenate([[0], np.cumsum(self.label == 1)])
        iorder = np.lexsort((lab, u, t, i))
        self.item_sorted = i[iorder]
        self.i_key = i[iorder] * len(self.times) + np.searchsorted(self.times, t[iorder])
        ilab = lab[iorder]
        self.icum_known = np.concatenate([[0], np.cumsum(ilab >= 0)])
        self.icum_pos = np.concatenate([[0], np.cumsum(ilab == 1)])
        self.item_t = t[iorder]
        # (user, item) pairs by time, for the log-derived recency inputs: one code per pair seen in the log.
        codes, self.pairs = pd.factorize(pd.MultiIndex.from_arrays([u, i]), sort=True)
        self.p_key = np.sort(codes.astype(np.int64) * len(self.times) + np.searchsorted(self.times, t))
        self.n = len(u)

    def _positions(self, keys_sorted: np.ndarray, ids: np.ndarray, ts: np.ndarray, id_sorted: np.ndarray):
        rank = np.searchsorted(self.times, ts, side="left")          # distinct event times < ts
        pos = np.searchsorted(keys_sorted, ids * len(self.times) + rank, side="left")
        start = np.searchsorted(id_sorted, ids, side="left")
        return start, pos

    def user_positions(self, users: np.ndarray, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each query, (first row of the user, first row of the user at or after ts) in user order."""
        return self._positions(self.u_key, users, ts, self.u)

    def history(self, users: np.ndarray, ts: np.ndarray, length: int) -> dict:
        """The ``length`` most recent events of each user strictly before ts, left-padded with zeros.

        Returns:
            dict of (Q, length) int64 arrays: ``hist_item``, ``hist_signal`` (1-5 rating, 6/7 negative/positive
            label, 8 unknown or not arrived yet), ``hist_gap`` (log2 bucket of seconds before ts); padding is 0 in
            all three.
        """
        start, pos = self.user_positions(users, ts)
        offs = np.arange(-length, 0)
        idx = pos[:, None] + offs[None, :]                              # (Q, L)
        valid = idx >= start[:, None]
        idx = np.where(valid, idx, 0)
        gap_s = np.maximum(ts[:, None] - self.t[idx], 0) / 1e6
        gap = 1 + np.minimum(np.floor(np.log2(1.0 + gap_s)), N_GAP_BUCKETS - 2).astype(np.int64)
        signal = self.signal[idx]
        if self.label_delay_us:                                         # labels that had not arrived by ts
            signal = np.where(self.t[idx] >= ts[:, None] - self.label_delay_us, SIGNAL_UNKNOWN, signal)
        return {
            "hist_item": np.where(valid, self.i[idx], 0),
            "hist_signal": np.where(valid, signal, 0),
            "hist_gap": np.where(valid, gap, 0),
        }

    def counters(self, users: np.ndarray, items: np.ndarray, ts: np.ndarray) -> dict:
        """Events before ts, and labelled events and positives whose label had arrived by ts (before ts less the
        label delay), per user and per item. float32 arrays (Q,)."""
        start, pos = self.user_positions(users, ts)
        istart, ipos = self._positions(self.i_key, items, ts, self.item_sorted)
        lpos, lipos = pos, ipos
        if self.label_delay_us:
            _, lpos = self.user_positions(users, ts - self.label_delay_us)
            _, lipos = self._positions(self.i_key, items, ts - self.label_delay_us, self.item_sorted)
        f = np.float32
        return {
            "user_cnt": (pos - start).astype(f),
            "user_known": (self.cum_known[lpos] - self.cum_known[start]).astype(f),
            "user_pos": (self.cum_pos[lpos] - self.cum_pos[start]).astype(f),
            "item_cnt": (ipos - istart).astype(f),
            "item_known": (self.icum_known[lipos] - self.icum_known[istart]).astype(f),
            "item_pos": (self.icum_pos[lipos] - self.icum_pos[istart]).astype(f),
        }


def _minutes_before(ts: np.ndarray, last: np.ndarray, has: np.ndarray) -> np.ndarray:
    return np.where(has, (ts - last) / 60e6, np.nan).astype(np.float32)


def recency(index: "EventIndex", users: np.ndarray, items: np.ndarray, ts: np.ndarray) -> dict:
    """The log-derived inputs every ranker gets (#40), from the events strictly before each row's time: minutes
    since this pair was last shown, since this item was last shown to anyone and since the user's previous event
    (NaN: never), and how often this pair was shown in the last 1 h, 6 h and 24 h. What a production ranker
    computes from its own impression log; float32 arrays (Q,) named by ``RECENCY_INPUTS``."""
    users, items, ts = (np.asarray(x, np.int64) for x in (users, items, ts))
    start, pos = index.user_positions(users, ts)
    istart, ipos = index._positions(index.i_key, items, ts, index.item_sorted)
    out = {"user_prev_min": _minutes_before(ts, index.t[np.maximum(pos - 1, 0)], pos > start),
           "item_last_min": _minutes_before(ts, index.item_t[np.maximum(ipos - 1, 0)], ipos > istart)}
    T = len(index.times)
    code = index.pairs.get_indexer(pd.MultiIndex.from_arrays([users, items])).astype(np.int64)
    seen = code >= 0
    base = np.where(seen, code, 0) * T
    p_pos = np.searchsorted(index.p_key, base + np.searchsorted(index.times, ts, side="left"), side="left")
    p_start = np.searchsorted(index.p_key, base, side="left")
    has = seen & (p_pos > p_start)
    last_rank = index.p_key[np.maximum(p_pos - 1, 0)] - base
    out["pair_last_min"] = _minutes_before(ts, index.times[np.clip(last_rank, 0, T - 1)], has)
    for h in RECENCY_WINDOWS_H:
        lo = np.searchsorted(index.p_key, base + np.searchsorted(index.times, ts - h * 3_600_000_000, side="left"))
        out[f"pair_cnt_{h}h"] = np.where(seen, p_pos - np.maximum(lo, p_start), 0).astype(np.float32)
    return {k: out[k] for k in RECENCY_INPUTS}


def time_split(ts: np.ndarray, fractions=(0.8, 0.1, 0.1)) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple]:
    """Splits rows by event time: train before the first cut, valid between, test at or after the second.

    The cuts are quantiles of the timestamps; every row with the same timestamp lands in the same split.

    Returns:
        (train mask, valid mask, test mask, (cut1, cut2) as int64 microseconds).
    """
    if abs(sum(fractions) - 1.0) > 1e-6:
        raise ValueError(f"split fractions must add up to 1, got {fractions}")
    s = np.sort(ts)
    c1 = s[min(int(len(s) * fractions[0]), len(s) - 1)]
    c2 = s[min(int(len(s) * (fractions[0] + fractions[1])), len(s) - 1)]
    return ts < c1, (ts >= c1) & (ts < c2), ts >= c2, (int(c1), int(c2))


class Batched:
    """Rows that ``batch(idx)`` turns into model inputs; ``batches`` walks them (shuffled under a seed)."""

    def __len__(self) -> int:
        raise NotImplementedError

    def batch(self, idx: np.ndarray) -> dict:
        raise NotImplementedError

    def batches(self, batch_size: int, shuffle_seed: int | None = None):
        order = np.arange(len(self))
        if shuffle_seed is not None:
            np.random.default_rng(shuffle_seed).shuffle(order)
        for s in range(0, len(order), batch_size):
            yield self.batch(order[s: s + batch_size])


@dataclass
class Arrays(Batched):
    """Model inputs already computed, one array per input, rows aligned (what ``training.fit`` and ``predict``
    take, like ``Examples``, when no history is needed: the VM). ``label`` is the BCE target (-1 unknown)."""
    arrays: dict
    label: np.ndarray

    def __len__(self) -> int:
        return len(self.label)

    def subset(self, mask: np.ndarray) -> "Arrays":
        return Arrays({k: v[mask] for k, v in self.arrays.items()}, self.label[mask])

    def batch(self, idx: np.ndarray) -> dict:
        return {"label": self.label[idx], **{k: v[idx] for k, v in self.arrays.items()}}


@dataclass
class Examples(Batched):
    """Queries (user, item, time[, label, rating]) whose model inputs are built batch by batch.

    Args:
        index: the history the queries look into.
        users, items, ts: query arrays (ts int64 microseconds).
        label, rating: targets where known (label -1 / rating 0 = unknown).
        history_len: L, the history length.
    """
    index: EventIndex
    users: np.ndarray
    items: np.ndarray
    ts: np.ndarray
    label: np.ndarray
    rating: np.ndarray
    history_len: int = 50
    extras: dict = field(default_factory=dict)        # per-row arrays added to every batch (e.g. fm_prob)
    recency: bool = False                             # add the log-derived recency inputs (the VM's)

    @classmethod
    def from_events(cls, index: EventIndex, events: pa.Table, history_len: int = 50) -> "Examples":
        lab = events.column("label").to_numpy(zero_copy_only=False)
        rat = events.column("rating").to_numpy(zero_copy_only=False)
        return cls(index, events.column("user_id").to_numpy().astype(np.int64),
                   events.column("item_id").to_numpy().astype(np.int64),
                   events.column("event_timestamp").cast(pa.int64()).to_numpy(),
                   np.where(pd.isna(lab), -1, lab).astype(np.float32),
                   np.where(pd.isna(rat), 0, rat).astype(np.float32), history_len)

    def __len__(self) -> int:
        return len(self.users)

    def subset(self, mask: np.ndarray) -> "Examples":
        return Examples(self.index, self.users[mask], self.items[mask], self.ts[mask], self.label[mask],
                        self.rating[mask], self.history_len, {k: v[mask] for k, v in self.extras.items()},
                        self.recency)

    def batch(self, idx: np.ndarray) -> dict:
        """Model inputs for rows ``idx`` as numpy arrays (see ``models.batch_to_tensors``)."""
        u, i, t = self.users[idx], self.items[idx], self.ts[idx]
        out = {"user": u, "item": i, "label": self.label[idx], "rating": self.rating[idx]}
        out.update(self.index.history(u, t, self.history_len))
        out.update(self.index.counters(u, i, t))
        if self.recency:
            out.update(recency(self.index, u, i, t))
        out.update({k: v[idx] for k, v in self.extras.items()})
        return out


def history_examples(users: np.ndarray, items: np.ndarray, at_us: int, hist_user: np.ndarray, hist_item: np.ndarray,
                     hist_ts: np.ndarray, hist_label: np.ndarray, hist_rating: np.ndarray,
                     history_len: int) -> Examples:
    """Examples for (user, item) queries at one time from flat per-user history rows (the Spark inference path).

    The history rows go through the same ``EventIndex`` as training, so inputs are built by one piece of code.
    Label -1 and rating 0 mean unknown.
    """
    table = pa.table({
        "user_id": pa.array(hist_user, pa.int64()), "item_id": pa.array(hist_item, pa.int64()),
        "event_timestamp": pa.array(hist_ts.astype(np.int64), pa.timestamp("us", tz="UTC")),
        "label": pa.array(np.where(hist_label < 0, None, hist_label), pa.int8(), from_pandas=True),
        "rating": pa.array(np.where(hist_rating <= 0, np.nan, hist_rating).astype(np.float32), from_pandas=True),
    })
    n = len(users)
    return Examples(EventIndex(table), np.asarray(users, np.int64), np.asarray(items, np.int64),
                    np.full(n, at_us, np.int64), np.full(n, -1, np.float32), np.zeros(n, np.float32), history_len)
