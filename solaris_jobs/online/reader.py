"""The serving client: for one ranking request (a user, N candidate items, a clock) the FM features of every
candidate, resolved per pair through the tiers: fresh pair embedding -> the pair's item-aware fallback -> user
aggregate -> user state -> neighbour embedding -> zeros (the fallbacks served are a setting: ``tiers``). Returns an
(N, D) float32 matrix, a tier per row (``solaris_jobs.core.contract.TIERS``), the age of what was served and how many
FM embeddings stand behind it (1 for a pair, the pairs behind an item-aware fallback or an aggregate, the neighbours
averaged).

- Redis: one round trip: the HMGET of the user's hash (the user views served) and the N pair hashes (the pair view's
  fields and, when served, the item-aware fallback's: Feast keeps views of one entity key in one hash), in Feast's layout,
  written to the socket as one buffer built with numpy and parsed by hiredis (redis-py's per-command Python would
  cost ~14 us x N). Rows past their view's TTL (from their event time, since Feast does not filter by ttl), newer
  than the request (replays) or of another model version than the VM expects are never served.
- SQLite (embedded default): one query per view.
- Fail-open: a store that errors or does not answer within ``budget_ms`` gives zeros and tier none, counted, never an
  exception; after a failure the store is not tried again for ``cooldown_s`` (no timeout paid per request).
- Misses (pairs without a fresh pair embedding) go to the bounded miss queue (``solaris_jobs.online.misses``); a full
  queue drops and counts, it never blocks a request. A read that failed open queues nothing (the store was not
  read, so nothing is known to be missing; an outage must not flood the queue): its rows are counted as
  ``misses_skipped_fail_open``.
"""
from __future__ import annotations

import logging
import math
import operator
import sqlite3
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import chain, repeat
from pathlib import Path

import numpy as np
import pandas as pd

from solaris_jobs.core.contract import TIERS
from solaris_jobs.online import feast_format as ff
from solaris_jobs.online.misses import MissQueue, ParquetSink, RedisStreamSink
from solaris_jobs.online.resp import RawConnection, bulk, bulk_records, key_slots, open_raw
from solaris_jobs.online.store_config import StoreConfig, cluster_primaries, redis_client
from solaris_jobs.online.views import EMBEDDING, MODEL_VERSION, views

logger = logging.getLogger(__name__)

T_PAIR, T_NONE = TIERS.index("pair"), TIERS.index("none")
MISSING, STALE, OTHER_VERSION, FUTURE = 0, 1, 2, 3
CODE_NAMES = {MISSING: "missing", STALE: "stale", OTHER_VERSION: "other_version", FUTURE: "future"}
# The embeddings behind a fallback row.
COUNT_OF = {"pair_fallbacks": "n_pairs", "user_aggregates": "n_pairs", "neighbours": "n_neighbours"}
# The fallback tiers, in the order the reader falls back through them (pair-keyed first, then user-keyed).
FALLBACKS = tuple(t for t in TIERS if t not in ("pair", "none"))
# The fallbacks served by default: those whose value on their own rows had a validation lower bound above 0 in the
# evaluation's tier choice (``solaris evaluate-tier-choice``, benchmarks/results/tier_choice_synth.json; held equal
# by tests/test_settings.py::test_the_defaults_are_the_evaluated_configuration). The choice of 2026-12-07 (seed 0
# of the headline configuration, 6943ec0) kept none: every fallback's value on its own validation rows had a lower
# bound below 0 (item-aware -0.0023 [-0.0076, 0.0025], aggregate -0.0004 [-0.0024, 0.0015], user state -0.0005
# [-0.0031, 0.0021]; the neighbour tier served no row behind the user state). FeatureReader(tiers=...) serves any.
DEFAULT_TIERS: tuple = ()
READER_BUDGET_MS, READER_COOLDOWN_S = 10.0, 1.0      # a read's time budget; how long a failed store is skipped
PAIR_KEYS = ("user_id", "item_id")


@dataclass
class Features:
    embeddings: np.ndarray          # (N, D) float32
    tiers: np.ndarray               # (N,) int64, index into solaris_jobs.core.contract.TIERS
    latency_ms: float
    failed_open: bool = False
    ages_s: np.ndarray | None = None    # (N,) float64: seconds from the served row's event time to the request; NaN for none
    counts: np.ndarray | None = None    # (N,) int32: the embeddings behind the row (pair 1, the aggregate's n_pairs,
                                        # the neighbour row's n_neighbours; 0 for none)

    def tier_names(self) -> list[str]:
        return [TIERS[t] for t in self.tiers]


@dataclass
class ServingMetrics:
    """Counters and recent latencies a platform team can scrape (``prometheus()``)."""
    counts: Counter = field(default_factory=Counter)
    latencies_ms: deque = field(default_factory=lambda: deque(maxlen=10_000))
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, counts, latency_ms: float | None = None) -> None:
        """Adds counts (a mapping) and a latency, atomically (the reader's threads, the miss queue's thread)."""
        with self.lock:
            self.counts.update(counts)
            if latency_ms is not None:
                self.latencies_ms.append(latency_ms)

    def snapshot(self) -> dict:
        lat = np.array(self.latencies_ms) if self.latencies_ms else np.zeros(1)
        return {**dict(self.counts), "latency_p50_ms": float(np.percentile(lat, 50)),
                "latency_p99_ms": float(np.percentile(lat, 99))}

    def prometheus(self) -> str:
        lines = [f'solaris_serving_{k}_total {v}' for k, v in sorted(self.counts.items())]
        s = self.snapshot()
        lines += [f'solaris_serving_latency_ms{{quantile="0.5"}} {s["latency_p50_ms"]:.3f}',
                  f'solaris_serving_latency_ms{{quantile="0.99"}} {s["latency_p99_ms"]:.3f}']
        return "\n".join(lines) + "\n"


def epoch_seconds(now) -> float:
    """Seconds since the epoch of a time (naive times are UTC) or of a number already in seconds."""
    if isinstance(now, (int, float, np.integer, np.floating)):
        s = float(now)
    else:
        t = pd.Timestamp(now)
        s = float("nan") if t is pd.NaT else (t.tz_localize("UTC") if t.tzinfo is None else t).timestamp()
    if not math.isfinite(s):            # a caller's bug: no row's age, so no TTL, could be checked against it
        raise ValueError(f"request time must be a finite time, got {now!r}")
    return s


class FeatureReader:
    """Tiered FM features for ranking requests, from the SOLARIS online store.

    Args:
        cfg: the online store (``store_config.load()``).
        model_version: the embedding version the VM was trained with (``<fm version>+<ae version>``); rows of
            any other version are never served.
        dim: the embedding width D the VM takes.
        budget_ms: the read's time budget (socket timeout); slower or failing reads give tier none.
        misses: ``auto`` (Redis stream for a Redis store, else parquet under ``misses_dir`` if given), None (off),
            or a sink object with ``write(records)`` and ``close()``.
        tiers: the fallback tiers served where no fresh pair embedding is (``FALLBACKS``' names, tried in that
            order); None: ``DEFAULT_TIERS`` (the evaluated configuration).
        clock: what the cooldown after a failure is measured on (seconds; default the monotonic wall clock); a
            replay passes its request clock, so that a cooldown lasts as long in replayed time as in serving.

    ``close()`` (or leaving a ``with FeatureReader(...) as reader:`` block) closes every connection and flushes the
    miss queue.
    """

    def __init__(self, cfg: StoreConfig, model_version: str, dim: int, budget_ms: float = READER_BUDGET_MS,
                 cooldown_s: float = READER_COOLDOWN_S, misses="auto", misses_dir: str | Path | None = None,
                 miss_queue_size: int = 10_000, env=None, miss_flush_s: float = 0.5, tiers=None, clock=None):
        self.cfg, self.version, self.dim = cfg, model_version, dim
        tiers = DEFAULT_TIERS if tiers is None else tuple(tiers)
        unknown = set(tiers) - set(FALLBACKS)
        if unknown:
            raise ValueError(f"unknown fallback tiers {sorted(unknown)}: the fallback tiers are {list(FALLBACKS)}")
        self.budget_ms, self.cooldown_s, self.tiers = budget_ms, cooldown_s, tiers
        self._clock = clock or time.monotonic
        self.views = views(env)
        self.metrics = ServingMetrics()
        self._down_until = 0.0
        self._version_value = ff.string_value(model_version)
        # Connections are per thread (a reader shared by a ranker's threads stays correct: each thread pipelines on
        # its own socket); counters are merged under a lock.
        self._local = threading.local()
        self._states: list[_Connections] = []
        self._lock = threading.Lock()
        self._slots_epoch = 0             # bumped when a read meets a moved cluster slot: every thread maps again
        self._ts = _Timestamps()
        self._ttl = {n: v.ttl.total_seconds() for n, v in self.views.items()}
        if misses == "auto":
            misses = RedisStreamSink(cfg) if cfg.kind == "redis" else (ParquetSink(misses_dir) if misses_dir
                                                                       else None)
        self.misses = MissQueue(misses, self.metrics, miss_queue_size, miss_flush_s) if misses is not None else None
        self._suffix = cfg.project.encode() if cfg.kind == "redis" else b""     # Feast's Redis keys end so

        def fields(v, *more):
            return ([ff.field_name(v.name, EMBEDDING), ff.field_name(v.name, MODEL_VERSION), ff.ts_field(v.name)]
                    + [ff.field_name(v.name, m) for m in more])
        # (tier, view, number of fields read) per tier served, in fallback order: the pair-keyed views (the pair's
        # own embedding first), then the user-keyed fallbacks.
        served = [(TIERS.index(v.tier), v, 4 if v.name in COUNT_OF else 3) for v in self.views.values()
                  if v.tier == "pair" or v.tier in tiers]
        self._pair_views = [f for f in served if f[1].join_keys == PAIR_KEYS]
        self._fallbacks = [f for f in served if f[1].join_keys != PAIR_KEYS]
        self._user_fields = [f for _, v, n in self._fallbacks
                             for f in fields(v, *([COUNT_OF[v.name]] if n == 4 else []))]
        # No fallback served: the user's hash is still asked for one (absent) field, so that every read has the same
        # shape (an HMGET needs a field).
        self._user_fields = self._user_fields or [b"_"]
        self._pair_fields = [f for _, v, n in self._pair_views for f in fields(v, *([COUNT_OF[v.name]] if n == 4
                                                                                  else []))]
        self._pair_head = b"*%d\r\n" % (2 + len(self._pair_fields)) + bulk(b"HMGET")
        self._pair_tail = b"".join(map(bulk, self._pair_fields))

    # -- connections
    @property
    def _own(self) -> "_Connections":
        """This thread's connections."""
        own = getattr(self._local, "c", None)
        if own is None:
            own = self._local.c = _Connections()
            with self._lock:
                self._states.append(own)
        return own

    def _redis(self) -> RawConnection:
        """A dedicated connection used raw (``open_raw``): one pipelined write, hiredis replies."""
        own = self._own
        if own.raw is None:
            import hiredis
            own.client = redis_client(self.cfg, timeout_s=self.budget_ms / 1000.0)
            own.raw, own.reader = open_raw(own.client), hiredis.Reader()
        return own.raw

    def _sqlite_conn(self):
        own = self._own
        if own.sqlite is None:
            path = self.cfg.sqlite_path
            if not Path(path).exists():
                raise FileNotFoundError(f"{path}: no online store yet (run `solaris materialize`)")
            own.sqlite = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False,
                                         timeout=self.budget_ms / 1000.0)
        return own.sqlite

    # -- reads: each returns ([per user-keyed fallback served, its (embedding, version, event time s, count as a
    #    serialized Value or None) or None], [per pair-keyed view served (the pair's own first), the pairs'
    #    (embeddings, versions, event times s, counts) as lists (None where absent), a float array (NaN) and a list
    #    of serialized counts (None for a view without one)])
    def _read_redis(self, user: int, items: np.ndarray) -> list:
        ukey = ff.entity_key({"user_id": user}, self._suffix)
        pkeys = ff.entity_keys({"user_id": np.full(len(items), user, np.int64), "item_id": items}, self._suffix)
        if self.cfg.redis_type == "redis_cluster":
            replies = self._read_cluster(ukey, pkeys)
        else:
            replies = self._read_single(ukey, pkeys)
        u, ts = replies[0], self._ts
        flat = list(chain.from_iterable(replies[1:]))             # the pair views' fields per pair, flattened
        users, at = [], 0
        for _, _, n in self._fallbacks:
            users.append((u[at], u[at + 1], ts[u[at + 2]], u[at + 3] if n == 4 else None) if u[at] is not None
                         else None)
            at += n
        pairs, at, width = [], 0, len(self._pair_fields)
        for _, _, n in self._pair_views:
            pairs.append((flat[at::width], flat[at + 1::width],
                          np.fromiter(map(ts.__getitem__, flat[at + 2::width]), np.float64, len(pkeys)),
                          flat[at + 3::width] if n == 4 else None))
            at += n
        return users, pairs

    def _cluster(self) -> tuple[list, np.ndarray]:
        """This thread's raw connections to every primary of the cluster, each with its reply parser, and the slot
        -> primary map as the cluster said when they were opened (again when another thread saw a slot move)."""
        own = self._own
        if own.nodes is not None and own.slots_epoch != self._slots_epoch:
            own.drop()
        if own.nodes is None:
            import hiredis
            own.slots_epoch = self._slots_epoch
            own.client = redis_client(self.cfg, timeout_s=self.budget_ms / 1000.0)
            subs, own.node_of_slot = cluster_primaries(own.client, self.cfg, timeout_s=self.budget_ms / 1000.0)[1:]
            own.nodes = []
            try:
                for c in subs:
                    own.nodes.append((open_raw(c), hiredis.Reader(), c))
            except Exception:
                for c in subs:
                    c.close()
                own.drop()
                raise
        return own.nodes, own.node_of_slot

    def _read_cluster(self, ukey: bytes, pkeys: np.ndarray, remap: bool = True) -> list:
        """Redis Cluster: each primary gets one buffer of the HMGETs of its keys (the user's hash on its own
        primary), all sent before any reply is read: one round trip per primary, in parallel, as on one node.

        Resharding: a slot that moved answers MOVED; every thread's map is then stale (one shared epoch), this one
        maps the slots again and reads once more (counted ``cluster_remaps``; a second MOVED fails the read open).
        A slot being migrated answers ASK for keys that already left: those rows are read as missing this once
        (counted ``cluster_ask``), as the migration is moving them. Any other error reply fails the read open."""
        from redis.crc import key_slot
        nodes, of_slot = self._cluster()
        u_node, p_node = int(of_slot[key_slot(ukey)]), of_slot[key_slots(pkeys)]
        sent = []
        for j, (raw, _, _) in enumerate(nodes):
            idx = np.flatnonzero(p_node == j)
            if len(idx) or u_node == j:
                raw.sock.sendall(self._hmgets(ukey if u_node == j else None, pkeys[idx]))
                sent.append((j, idx))
        out = [None] * (1 + len(pkeys))
        for j, idx in sent:
            raw, reader, _ = nodes[j]
            got = self._replies(raw.sock, reader, len(idx) + (u_node == j), raise_errors=False)
            if u_node == j:
                out[0], got = got[0], got[1:]
            for k, r in zip(idx.tolist(), got):
                out[1 + k] = r
        errors = [r for r in out if isinstance(r, Exception)]
        if not errors:
            return out
        kinds = {str(e).split(" ", 1)[0] for e in errors}
        own = self._own
        if kinds == {"MOVED"} or kinds == {"MOVED", "ASK"}:
            if not remap:
                raise errors[0]
            with self._lock:
                self._slots_epoch += 1
            own.counts["cluster_remaps"] += 1
            own.drop()
            return self._read_cluster(ukey, pkeys, remap=False)
        if kinds == {"ASK"}:
            own.counts["cluster_ask"] += len(errors)
            absent = [[None] * len(self._user_fields)] + [[None] * len(self._pair_fields)] * len(pkeys)
            return [a if isinstance(r, Exception) else r for r, a in zip(out, absent)]
        raise next(e for e in errors if not str(e).startswith(("MOVED", "ASK")))

    def _hmgets(self, ukey: bytes | None, pkeys: np.ndarray) -> bytes:
        """One buffer: HMGET of the user's hash (the user views served; None: not on this node), then one HMGET per
        pair (fixed-width records)."""
        head = b"" if ukey is None else (b"*%d\r\n" % (2 + len(self._user_fields)) + bulk(b"HMGET") + bulk(ukey)
                                         + b"".join(map(bulk, self._user_fields)))
        if not len(pkeys):
            return head
        keys = bulk_records(pkeys)
        rec = np.empty(len(pkeys), np.dtype([("h", "u1", (len(self._pair_head),)), ("k", keys.dtype),
                                             ("f", "u1", (len(self._pair_tail),))]))
        rec["h"] = np.frombuffer(self._pair_head, np.uint8)
        rec["k"] = keys
        rec["f"] = np.frombuffer(self._pair_tail, np.uint8)
        return head + rec.tobytes()

    def _read_single(self, ukey: bytes, pkeys: np.ndarray) -> list:
        sock = self._redis().sock
        sock.sendall(self._hmgets(ukey, pkeys))
        return self._replies(sock, self._own.reader, 1 + len(pkeys))

    @staticmethod
    def _replies(sock, reader, need: int, raise_errors: bool = True) -> list:
        """The next ``need`` replies on ``sock``, parsed by hiredis; an error reply raises (``raise_errors``) or is
        returned in its place."""
        replies = []
        while True:
            # Every complete reply buffered, parsed in C. gets() returns False when none is complete; an HMGET reply
            # is always an array, never False (a top-level integer 0 would be: not a reply this loop reads).
            replies.extend(iter(reader.gets, False))
            if len(replies) >= need:
                break
            data = sock.recv(1 << 16)
            if not data:
                raise ConnectionError("redis closed the connection")
            reader.feed(data)
        if raise_errors and any(map(isinstance, replies, repeat(Exception))):
            raise next(r for r in replies if isinstance(r, Exception))
        return replies

    def _read_sqlite(self, user: int, items: np.ndarray) -> list:
        conn = self._sqlite_conn()

        def rows(view, keys: list[bytes]) -> dict:
            names = (EMBEDDING, MODEL_VERSION, *([COUNT_OF[view.name]] if view.name in COUNT_OF else []))
            q = (f'SELECT entity_key, feature_name, value, event_ts FROM "{self.cfg.project}_{view.name}" '
                 f'WHERE feature_name IN ({",".join("?" * len(names))}) '
                 f'AND entity_key IN ({",".join("?" * len(keys))})')
            try:
                found = conn.execute(q, (*names, *keys)).fetchall()
            except sqlite3.OperationalError as e:
                if "no such table" in str(e):
                    return {}
                raise
            out: dict = {}
            for k, name, value, ts in found:
                out.setdefault(k, {})[name] = value
                out[k]["_ts"] = ts
            return out

        def triple(rec, count=None):
            if rec is None or EMBEDDING not in rec:
                return None
            head = rec[EMBEDDING], rec.get(MODEL_VERSION), float(rec["_ts"])     # epoch seconds (Feast 0.67)
            return head if count is None else (*head, rec.get(count) if count else None)

        ukey = ff.entity_key({"user_id": user})
        pkeys = [k.tobytes() for k in ff.entity_keys({"user_id": np.full(len(items), user, np.int64),
                                                      "item_id": items})]
        pairs = []
        for _, v, n in self._pair_views:
            found = rows(v, pkeys)
            got = [triple(found.get(k), COUNT_OF.get(v.name, "")) or (None, None, math.nan, None) for k in pkeys]
            pairs.append(([p[0] for p in got], [p[1] for p in got], np.array([p[2] for p in got], np.float64),
                          [p[3] for p in got] if n == 4 else None))
        return ([triple(rows(v, [ukey]).get(ukey), COUNT_OF.get(v.name, "")) for _, v, _ in self._fallbacks], pairs)

    def read(self, user_id: int, item_ids, now) -> Features:
        """Features for one request. ``now``: the request time (pd.Timestamp-able, or epoch seconds). A store failure
        fails open (never raises); a request time that is not a finite time (NaN, NaT) is a ``ValueError``."""
        t0 = time.perf_counter()
        items = np.asarray(item_ids, np.int64)
        n = len(items)
        now_s = epoch_seconds(now)
        emb = np.zeros((n, self.dim), np.float32)
        tiers = np.full(n, T_NONE, np.int64)
        ages = np.full(n, np.nan)
        counts = np.zeros(n, np.int32)
        c = Counter()                  # this read's counts, merged into the metrics at the end (threads)
        c["requests"] += 1
        c["rows"] += n
        failed = False
        if self._clock() < self._down_until:
            c["fail_open_cooldown"] += 1
            failed = True
        else:
            try:
                raw = (self._read_redis if self.cfg.kind == "redis" else self._read_sqlite)(int(user_id), items)
                if (time.perf_counter() - t0) * 1000 > self.budget_ms:
                    c["over_budget"] += 1
                self._resolve(raw, now_s, emb, tiers, ages, counts, c)
            except Exception as e:
                failed = True
                emb[:], tiers[:], ages[:], counts[:] = 0.0, T_NONE, np.nan, 0     # nothing half-resolved is served
                c["fail_open"] += 1
                self._down_until = self._clock() + self.cooldown_s
                self._reset()
                logger.warning("feature read failed open (tier none for %d rows; store skipped for %.1fs): %r",
                               n, self.cooldown_s, e)
            own = self._own
            if own.counts:                          # what the read met on the way (a cluster remap, ASK replies)
                c.update(own.counts)
                own.counts.clear()
        for t, k in enumerate(np.bincount(tiers, minlength=len(TIERS)).tolist()):
            c[f"tier_{TIERS[t]}"] += k
        if self.misses is not None and n:
            if failed:
                c["misses_skipped_fail_open"] += n
            else:
                missed = items[tiers != T_PAIR]
                if len(missed):
                    self.misses.put(int(user_id), missed, int(now_s * 1000))
        ms = (time.perf_counter() - t0) * 1000
        self.metrics.add(c, ms)
        return Features(emb, tiers, ms, failed, ages, counts)

    def _check(self, row, ttl_s: float, now_s: float):
        """The embedding bytes if the row is servable, else a code (missing, other version, future, stale)."""
        if row is None or row[2] is None or math.isnan(row[2]):
            return MISSING
        if row[1] != self._version_value:
            return OTHER_VERSION
        age = now_s - row[2]
        if age < 0:
            return FUTURE
        return STALE if age > ttl_s else row[0]

    def _resolve(self, raw: tuple, now_s: float, emb: np.ndarray, tiers: np.ndarray, ages: np.ndarray,
                 counts: np.ndarray, c: Counter) -> None:
        users, pairs = raw
        fallback = None
        for (tier, view, _), row in zip(self._fallbacks, users):
            r = self._check(row, self._ttl[view.name], now_s)
            if isinstance(r, bytes):
                vec, ok = ff.parse_float_lists([r], self.dim)
                if ok[0]:
                    fallback = (tier, vec[0], now_s - row[2], ff.parse_int32(row[3]) if view.name in COUNT_OF
                                else 1)
                    break
                c["bad_width"] += 1
            else:
                c[f"{TIERS[tier]}_{CODE_NAMES[r]}"] += 1
        # The pair-keyed views in order (the pair's own embedding, then its item-aware fallback), each for the rows
        # not served yet; then the user's fallback for the rest.
        open_rows = np.ones(len(tiers), bool)
        for (tier, view, _), rows in zip(self._pair_views, pairs):
            ok = self._resolve_pairs(rows, view.name, tier, now_s, open_rows, emb, tiers, ages, counts, c)
            open_rows &= ~ok
        if fallback is not None:
            emb[open_rows] = fallback[1]
            tiers[open_rows] = fallback[0]
            ages[open_rows] = fallback[2]
            counts[open_rows] = fallback[3]

    def _resolve_pairs(self, rows, name: str, tier: int, now_s: float, want: np.ndarray, emb: np.ndarray,
                       tiers: np.ndarray, ages: np.ndarray, counts: np.ndarray, c: Counter) -> np.ndarray:
        """One pair-keyed view's rows, as ``_check`` does it row by row, in bulk (missing, then another version,
        then future, then stale), served where ``want``; returns where it served."""
        embs, versions, event_s, raw_counts = rows
        n, label = len(embs), TIERS[tier]
        present = np.fromiter(map(operator.is_not, embs, repeat(None)), bool, n) & ~np.isnan(event_s) & want
        same = np.fromiter(map(operator.eq, versions, repeat(self._version_value)), bool, n)
        age = now_s - event_s
        codes = {MISSING: want & ~present, OTHER_VERSION: present & ~same}
        current = present & same
        codes[FUTURE] = current & (age < 0)
        codes[STALE] = current & (age > self._ttl[name])
        for code, where in codes.items():
            k = int(where.sum())
            if k:
                c[f"{label}_{CODE_NAMES[code]}"] += k
        servable = current & (age >= 0) & (age <= self._ttl[name])
        m, ok = ff.parse_float_lists(embs, self.dim, servable)
        c["bad_width"] += int(servable.sum() - ok.sum())
        emb[ok] = m[ok]
        tiers[ok] = tier
        ages[ok] = age[ok]
        counts[ok] = 1 if raw_counts is None else [ff.parse_int32(raw_counts[i]) for i in np.flatnonzero(ok)]
        return ok

    def _reset(self) -> None:
        """Drops this thread's connections after a failure (a reply may be outstanding); its next read reconnects."""
        self._own.drop()

    def close(self) -> None:
        """Closes every thread's connections and flushes the miss queue."""
        if self.misses is not None:
            self.misses.close()
        with self._lock:
            states, self._states = self._states, []
        for own in states:
            own.drop()

    def __enter__(self) -> "FeatureReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Connections:
    """One thread's connections to the store, and its counts of what its reads met (merged into the metrics)."""

    def __init__(self):
        self.raw = self.reader = self.client = self.sqlite = self.nodes = self.node_of_slot = None
        self.slots_epoch, self.counts = -1, Counter()

    def drop(self) -> None:
        for c in (self.raw, self.client, self.sqlite, *(c for n in self.nodes or () for c in (n[0], n[2]))):
            try:
                if c is not None:
                    c.close()
            except Exception:
                pass
        self.raw = self.reader = self.client = self.sqlite = self.nodes = self.node_of_slot = None


class _Timestamps(dict):
    """Event times (epoch seconds, NaN for None) of serialized Timestamps, each parsed once: the rows of one
    output interval share theirs (bounded: cleared past 10,000)."""

    def __missing__(self, raw: bytes | None) -> float:
        if len(self) > 10_000:
            self.clear()
        t = self[raw] = math.nan if raw is None else ff.parse_timestamp(raw)
        return t
