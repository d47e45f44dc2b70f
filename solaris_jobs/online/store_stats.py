"""What the online store holds, for an operator: keys per feature view (SQLite: counted exactly; Redis: counted by a
bounded SCAN), and the serving client's metrics from its Prometheus text (a file or an endpoint).
"""
from __future__ import annotations

import sqlite3
import urllib.request

from solaris_jobs.online import feast_format as ff
from solaris_jobs.online.store_config import StoreConfig, redis_client
from solaris_jobs.online.views import views


def keys_per_view(cfg: StoreConfig, scan_limit: int = 1_000_000) -> dict:
    """{view: number of entity keys holding it}. On Redis the keyspace is scanned (each key's ``_ts:<view>``
    fields, pipelined); past ``scan_limit`` keys the scan stops and ``{"counted": False, "scanned": n}`` says so
    rather than report a partial count as the whole."""
    names = list(views())
    if cfg.kind == "sqlite":
        if not cfg.sqlite_path.exists():
            return {n: 0 for n in names}
        conn = sqlite3.connect(f"file:{cfg.sqlite_path}?mode=ro", uri=True)
        try:
            out = {}
            for n in names:
                try:
                    out[n] = conn.execute(f'SELECT COUNT(DISTINCT entity_key) FROM "{cfg.project}_{n}"').fetchone()[0]
                except sqlite3.OperationalError:           # the table does not exist yet: nothing materialized
                    out[n] = 0
            return out
        finally:
            conn.close()
    client = redis_client(cfg, timeout_s=max(cfg.timeout_s, 30.0))      # SCANs of a large keyspace
    fields = [ff.ts_field(n) for n in names]
    counts, scanned = dict.fromkeys(names, 0), 0
    suffix = cfg.project.encode()
    try:
        batch = []
        for key in client.scan_iter(count=10_000):
            # Feast's entity keys end with the project; SOLARIS's own keys (leases, markers, the miss stream)
            # start with "solaris:" and are not entity keys.
            if not key.endswith(suffix) or key.startswith(b"solaris:"):
                continue
            batch.append(key)
            scanned += 1
            if scanned > scan_limit:
                return {"counted": False, "scanned": scanned - 1, "scan_limit": scan_limit}
            if len(batch) >= 5_000:
                _count(client, batch, fields, names, counts)
                batch = []
        _count(client, batch, fields, names, counts)
    finally:
        client.close()
    return counts


def _count(client, keys, fields, names, counts) -> None:
    if not keys:
        return
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.hmget(k, fields)
    for values in pipe.execute():
        for n, v in zip(names, values):
            counts[n] += v is not None


def serving_metrics(source: str, timeout_s: float = 5.0) -> dict:
    """The serving client's counters and latency quantiles (``ServingMetrics.prometheus()``'s text, scraped
    from an ``http(s)://`` endpoint or read from a file), as ``{metric name: value}`` with labels folded into the
    name (``solaris_serving_latency_ms{quantile="0.99"}``).

    Raises:
        ValueError: the source cannot be read, or holds no ``solaris_serving_`` metric (not a SOLARIS client's).
    """
    from prometheus_client.parser import text_string_to_metric_families
    try:
        if source.startswith(("http://", "https://")):
            with urllib.request.urlopen(source, timeout=timeout_s) as r:
                text = r.read().decode()
        else:
            with open(source) as f:
                text = f.read()
    except OSError as e:                      # URLError, a refused connection, a missing file
        raise ValueError(f"{source}: cannot read the serving metrics ({type(e).__name__}: {e})") from e
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("solaris_serving_"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    if not out:
        raise ValueError(f"{source}: no solaris_serving_* metric in it (is it a SOLARIS serving client's "
                         f"Prometheus text?)")
    return out
