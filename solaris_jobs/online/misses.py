"""The miss queue: pairs the ranker asked for without a fresh pair embedding, recorded where the next refresh's
selection forces them in.

``MissQueue`` is bounded and non-blocking (a full queue drops and counts, it never blocks a request); a background
thread hands batches to a sink: ``RedisStreamSink`` (a capped Redis stream, for a Redis online store) or
``ParquetSink`` (parquet files under ``<offline>/misses/``). ``drain_misses`` moves the Redis stream into those
parquet files (the refresh DAG's ``drain_misses`` task).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from solaris_jobs.online.store_config import StoreConfig, redis_client

logger = logging.getLogger(__name__)


def miss_stream(project: str) -> str:
    return f"solaris:{project}:misses"


class RedisStreamSink:
    """Misses as entries of a Redis stream capped at ``maxlen`` (approximately): u=user, i=int64 LE item ids, t=ms."""

    def __init__(self, cfg: StoreConfig, maxlen: int = 1_000_000, timeout_s: float = 1.0):
        self.client = redis_client(cfg, timeout_s=timeout_s)
        self.stream, self.maxlen = miss_stream(cfg.project), maxlen

    def write(self, records: list[tuple[int, np.ndarray, int]]) -> None:
        with self.client.pipeline(transaction=False) as p:
            for user, items, at_ms in records:
                p.xadd(self.stream, {"u": int(user), "i": np.asarray(items, "<i8").tobytes(), "t": int(at_ms)},
                       maxlen=self.maxlen, approximate=True)
            p.execute()

    def close(self) -> None:
        self.client.close()


class ParquetSink:
    """Misses as parquet files (user_id, item_id, missed_at) in ``<offline>/misses/`` (``offline.misses_uri``; any
    URI the offline store takes), read by the next refresh."""

    def __init__(self, folder: str | Path):
        self.folder = str(folder)

    def write(self, records: list[tuple[int, np.ndarray, int]]) -> None:
        write_misses(self.folder, records)

    def close(self) -> None:
        pass


def write_misses(folder: str, records) -> str | None:
    """Writes (user, item ids, at ms) records as one parquet file, atomically; returns its path."""
    if not records:
        return None
    import pyarrow as pa
    lens = [len(r[1]) for r in records]
    table = pa.table({
        "user_id": pa.array(np.repeat([r[0] for r in records], lens), pa.int64()),
        "item_id": pa.array(np.concatenate([np.asarray(r[1], np.int64) for r in records]), pa.int64()),
        "missed_at": pa.array(np.repeat([r[2] for r in records], lens).astype("datetime64[ms]"),
                              pa.timestamp("us", tz="UTC"))})
    from solaris_jobs.core.offline import write_parquet
    return write_parquet(folder, table, f"misses-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}.parquet")


class MissQueue:
    """Bounded, non-blocking: ``put`` never waits; a background thread hands batches to the sink."""

    def __init__(self, sink, metrics, maxsize: int = 10_000, flush_s: float = 0.5):
        # metrics: the reader's ``ServingMetrics`` (anything with ``add(counts)``).
        self.sink, self.metrics, self.flush_s = sink, metrics, flush_s
        self.q: queue.Queue = queue.Queue(maxsize)
        self._stop = threading.Event()
        self._writing = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="solaris-miss-queue", daemon=True)
        self.thread.start()

    def put(self, user: int, items: np.ndarray, at_ms: int) -> None:
        try:
            self.q.put_nowait((user, items, at_ms))
            self.metrics.add({"misses_queued": len(items)})
        except queue.Full:
            self.metrics.add({"misses_dropped_queue_full": len(items)})

    def _drain(self) -> None:
        # One drain at a time: flush() returns only when everything queued before it is written (no write of the
        # background thread still in flight).
        with self._writing:
            batch = []
            while True:
                try:
                    batch.append(self.q.get_nowait())
                except queue.Empty:
                    break
            if not batch:
                return
            try:
                self.sink.write(batch)
                self.metrics.add({"misses_recorded": sum(len(b[1]) for b in batch)})
            except Exception as e:          # the queue must never take the server down: count and go on
                self.metrics.add({"misses_dropped_sink_error": sum(len(b[1]) for b in batch)})
                logger.warning("miss queue: could not record %d requests: %s", len(batch), e)

    def _run(self) -> None:
        while not self._stop.wait(self.flush_s):
            self._drain()
        self._drain()

    def flush(self) -> None:
        """Hands everything queued so far to the sink now (a replay calls this before the next refresh reads it)."""
        self._drain()

    def close(self) -> None:
        self._stop.set()
        self.thread.join(10)
        self.sink.close()


def drain_misses(cfg: StoreConfig, offline: str | Path, chunk: int = 100_000) -> dict:
    """Moves the Redis miss stream into parquet under ``<offline>/misses/`` (what the next selection reads).

    Entries are deleted from the stream only after their file is written; a crash in between only duplicates
    misses (harmless: they are a set of pairs to force in).
    """
    client = redis_client(cfg, timeout_s=max(cfg.timeout_s, 30.0))      # a read of up to `chunk` entries
    from solaris_jobs.core.offline import misses_uri
    stream, folder = miss_stream(cfg.project), misses_uri(offline)
    moved = files = 0
    try:
        while True:
            entries = client.xrange(stream, "-", "+", count=chunk)
            if not entries:
                break
            records = [(int(f[b"u"]), np.frombuffer(f[b"i"], "<i8"), int(f[b"t"])) for _, f in entries]
            write_misses(folder, records)
            client.xdel(stream, *[i for i, _ in entries])
            moved += sum(len(r[1]) for r in records)
            files += 1
    finally:
        client.close()
    return {"pairs": moved, "files": files, "folder": folder}
