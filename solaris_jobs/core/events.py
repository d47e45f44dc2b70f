"""The event-log contract: schema, hour-partitioned parquet layout, validation and interval reads.

One row per ranked candidate or impression. Columns:

=================  ======================  ===========================================================
column             type                    meaning
=================  ======================  ===========================================================
user_id            int64                   the user (> 0)
item_id            int64                   the item (> 0)
event_timestamp    timestamp[us, UTC]      when the item was ranked or shown
label              int8, nullable          1 positive (click, rating >= 4), 0 negative, null unknown
rating             float32, nullable       explicit rating where the source has one (MovieLens 1-5)
request_id         int64, nullable         the ranking request the row belongs to
vm_score           float32, nullable       the score the serving ranker gave, where logged
=================  ======================  ===========================================================

On disk: ``<root>/events/date=YYYY-MM-DD/hour=HH/part-*.parquet`` (UTC), microsecond timestamps so that Spark
reads them. Side tables live beside it, both in every data set: ``<root>/users.parquet`` and ``<root>/items.parquet``
(an id column plus integer categorical columns or ``list<int32>`` multi-valued columns), rows set aside in
``<root>/rejects/``. The root may be a path or a URI (``s3a://``...): the readers open it through ``uris``."""
from __future__ import annotations

import datetime as dt
import json
import logging
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from solaris_jobs.core.uris import filesystem, join

logger = logging.getLogger(__name__)

EVENT_SCHEMA = pa.schema(
    [
        pa.field("user_id", pa.int64(), nullable=False),
        pa.field("item_id", pa.int64(), nullable=False),
        pa.field("event_timestamp", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("label", pa.int8()),
        pa.field("rating", pa.float32()),
        pa.field("request_id", pa.int64()),
        pa.field("vm_score", pa.float32()),
    ]
)
PARTITION_SCHEMA = pa.schema([pa.field("date", pa.string()), pa.field("hour", pa.string())])
REJECT_SCHEMA = pa.schema(
    [pa.field("source", pa.string()), pa.field("line", pa.int64()), pa.field("raw", pa.string()),
     pa.field("reason", pa.string())]
)


# Why an event row that reads is still set aside, in the order they are checked (the first that applies counts).
BAD_EVENT_REASONS = ("user_id is null or <= 0", "item_id is null or <= 0", "event_timestamp is null",
                     "label is not 0, 1 or null")


class DataContractError(ValueError):
    """Input that cannot be read into a SOLARIS contract; the message names the file, column and value."""


def events_dir(root: str | os.PathLike) -> Path:
    """The local event log's folder (what ``write_events`` writes)."""
    return Path(root) / "events"


def events_uri(root: str | os.PathLike) -> str:
    """The event log's folder as a URI the readers take (a path, ``file://``, ``s3a://``...): ``Path`` would fold
    ``s3a://bucket`` into ``s3a:/bucket``."""
    return join(root, "events")


def to_utc(ts: str | dt.datetime | pd.Timestamp) -> pd.Timestamp:
    """Parses a timestamp; naive values are taken as UTC."""
    t = pd.Timestamp(ts)
    return t.tz_localize("UTC") if t.tzinfo is None else t.tz_convert("UTC")


def conform(table: pa.Table | pd.DataFrame, source: str = "<table>", allow_nulls: bool = False) -> pa.Table:
    """Casts a table to EVENT_SCHEMA, adding absent optional columns as nulls.

    Args:
        table: rows with at least ``user_id``, ``item_id`` and ``event_timestamp``.
        source: name used in error messages.
        allow_nulls: keep rows with nulls in required columns (as a log read from disk may hold them: the refresh
            counts and sets them aside); the schema then marks every column nullable.

    Returns:
        A table with exactly the EVENT_SCHEMA columns, in order.

    Raises:
        DataContractError: a required column is missing or (unless ``allow_nulls``) has nulls, or a column does not
            cast.
    """
    if isinstance(table, pd.DataFrame):
        table = pa.Table.from_pandas(table, preserve_index=False)
    columns = []
    for field in EVENT_SCHEMA:
        if field.name not in table.column_names:
            if not field.nullable:
                raise DataContractError(f"{source}: required column {field.name!r} is missing "
                                        f"(found {table.column_names})")
            columns.append(pa.nulls(table.num_rows, field.type))
            continue
        col = table.column(field.name)
        if not field.nullable and col.null_count and not allow_nulls:
            raise DataContractError(f"{source}: column {field.name!r} has {col.null_count} null values")
        try:
            if pa.types.is_timestamp(col.type) and col.type.tz is None:
                col = pc.assume_timezone(col, "UTC")
            columns.append(col.cast(field.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise DataContractError(f"{source}: column {field.name!r} of type {col.type} does not cast to "
                                    f"{field.type}: {e}") from e
    schema = pa.schema([f.with_nullable(True) for f in EVENT_SCHEMA]) if allow_nulls else EVENT_SCHEMA
    return pa.Table.from_arrays(columns, schema=schema)


def write_events(table: pa.Table, root: str | os.PathLike, part: str = "part-00000") -> int:
    """Writes events under ``<root>/events`` partitioned by UTC date and hour.

    Each (date, hour) partition gets one file named ``<part>.parquet``; a rerun with the same part name
    overwrites it. Rows are sorted by (event_timestamp, user_id, item_id) so the bytes depend only on the rows.

    Returns:
        The number of rows written.
    """
    table = conform(table)
    if table.num_rows == 0:
        return 0
    table = table.sort_by([("event_timestamp", "ascending"), ("user_id", "ascending"), ("item_id", "ascending")])
    ts = table.column("event_timestamp")
    hour_key = pc.strftime(ts, format="%Y-%m-%d/%H", locale="C")
    # Rows are sorted by time, so each hour is one contiguous run.
    keys = hour_key.to_numpy(zero_copy_only=False)
    bounds = np.flatnonzero(keys[1:] != keys[:-1]) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [len(keys)]])
    base = events_dir(root)
    for s, e in zip(starts, ends):
        date, hour = keys[s].split("/")
        out = base / f"date={date}" / f"hour={hour}"
        out.mkdir(parents=True, exist_ok=True)
        _write_atomic(table.slice(s, e - s), out / f"{part}.parquet")
    return table.num_rows


def _write_atomic(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp, compression="zstd", coerce_timestamps="us", allow_truncated_timestamps=True)
    os.replace(tmp, path)


def write_table(table: pa.Table | pd.DataFrame, path: str | os.PathLike) -> None:
    """Writes one parquet file atomically (temporary file, then rename)."""
    if isinstance(table, pd.DataFrame):
        table = pa.Table.from_pandas(table, preserve_index=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(table, path)


def read_events(root: str | os.PathLike, start=None, end=None, columns: list[str] | None = None) -> pa.Table:
    """Reads the events with ``start <= event_timestamp < end`` (either bound may be None).

    Only the hour partitions that overlap the interval are opened.

    Raises:
        DataContractError: there is no event log under ``root``.
    """
    base = events_uri(root)
    fs, path = filesystem(base)
    if fs.get_file_info(path).type != pafs.FileType.Directory:
        raise DataContractError(f"{root}: no event log (expected {base}/date=YYYY-MM-DD/hour=HH/*.parquet)")
    full = pa.schema(list(EVENT_SCHEMA) + list(PARTITION_SCHEMA))
    dataset = ds.dataset(path, filesystem=fs, format="parquet", schema=full,
                         partitioning=ds.partitioning(PARTITION_SCHEMA, flavor="hive"))
    flt = None
    if start is not None:
        s = to_utc(start)
        flt = _and(flt, ds.field("date") >= s.strftime("%Y-%m-%d"))
        flt = _and(flt, ds.field("event_timestamp") >= pa.scalar(s.to_pydatetime(), EVENT_SCHEMA.field(2).type))
    if end is not None:
        e = to_utc(end)
        flt = _and(flt, ds.field("date") <= e.strftime("%Y-%m-%d"))
        flt = _and(flt, ds.field("event_timestamp") < pa.scalar(e.to_pydatetime(), EVENT_SCHEMA.field(2).type))
    cols = columns or EVENT_SCHEMA.names
    table = dataset.to_table(columns=cols, filter=flt)
    return table.sort_by([("event_timestamp", "ascending"), ("user_id", "ascending"), ("item_id", "ascending")])


DAY_FOLDER = r"date=(\d{4}-\d{2}-\d{2})"


def overlaps(first: pd.Timestamp, length: pd.Timedelta, start=None, end=None) -> bool:
    """Whether ``[first, first + length)`` (a day or hour folder of the log) can hold events of ``[start, end)``."""
    return (start is None or first + length > to_utc(start)) and (end is None or first < to_utc(end))


def log_fingerprints(root: str | os.PathLike, ranges) -> list[str]:
    """For each ``(start, end)`` of ``ranges`` (either bound may be None), a digest of the log's files that can hold
    its events: path, size and modification time of every file in the hour folders overlapping it (and of any
    file outside the ``date=/hour=`` layout). Equal digests: the log's rows of those hours are those read before;
    a late event written into an old hour, or a file rewritten, changes it. One listing serves every range (the
    day folders of their bounds, then their files), so the digests describe the log at one moment. The layout's
    contract: a row lies in the hour folder of its ``event_timestamp`` (``write_events``).

    Raises:
        DataContractError: there is no event log under ``root``.
    """
    import hashlib
    import re

    fs, base = filesystem(events_uri(root))
    if fs.get_file_info(base).type != pafs.FileType.Directory:
        raise DataContractError(f"{root}: no event log (expected {base}/date=YYYY-MM-DD/hour=HH/*.parquet)")
    ranges = list(ranges)
    firsts, lasts = [r[0] for r in ranges], [r[1] for r in ranges]
    lo = None if None in firsts or not ranges else min(map(to_utc, firsts))
    hi = None if None in lasts or not ranges else max(map(to_utc, lasts))
    files = []                                       # (hour folder's start or None, "path size mtime")
    for day in fs.get_file_info(pafs.FileSelector(base)):
        m = re.fullmatch(DAY_FOLDER, day.base_name)
        if m and day.type == pafs.FileType.Directory and not overlaps(pd.Timestamp(m.group(1), tz="UTC"),
                                                                       pd.Timedelta(days=1), lo, hi):
            continue
        sub = [day] if day.type == pafs.FileType.File else fs.get_file_info(pafs.FileSelector(day.path,
                                                                                            recursive=True))
        for f in sub:
            if f.type == pafs.FileType.File:
                rel = f.path[len(base):].lstrip("/")
                h = re.fullmatch(DAY_FOLDER + r"/hour=(\d{2})/[^/]+", rel)
                files.append((pd.Timestamp(f"{h.group(1)}T{h.group(2)}:00", tz="UTC") if h else None,
                              f"{rel}\t{f.size}\t{f.mtime_ns}"))
    hour = pd.Timedelta(hours=1)
    return [hashlib.sha256("\n".join(sorted(line for at, line in files if at is None or overlaps(at, hour, s, e)))
                           .encode()).hexdigest() for s, e in ranges]


def bad_event_counts(table: pa.Table) -> dict[str, int]:
    """Rows of an event table that ``precompute.split_bad_events`` sets aside, counted per reason."""
    return bad_event_rows(table)[1]


FUTURE_REASON = "event_timestamp is more than 1 day after now"


def bad_event_rows(table: pa.Table, now=None) -> tuple[np.ndarray, dict[str, int]]:
    """(bad-row mask, counts per reason): the rows ``precompute.split_bad_events`` sets aside (first reason that
    applies counts), and with ``now`` also rows time-stamped more than a day after it (``FUTURE_REASON``)."""
    def nonpositive(col):
        return pc.fill_null(pc.less_equal(table[col], 0), True)
    masks = [nonpositive("user_id"), nonpositive("item_id"), pc.is_null(table["event_timestamp"]),
             # A null label is an unknown one, allowed (is_in alone would call it bad: a null is in no value set).
             pc.fill_null(pc.and_(pc.is_valid(table["label"]),
                                  pc.invert(pc.is_in(table["label"], pa.array([0, 1], pa.int8())))), False)]
    reasons = list(BAD_EVENT_REASONS)
    if now is not None:
        late = pa.scalar((to_utc(now) + pd.Timedelta(days=1)).to_pydatetime(), table.schema.field(
            "event_timestamp").type)
        masks.append(pc.fill_null(pc.greater(table["event_timestamp"], late), False))
        reasons.append(FUTURE_REASON)
    taken = np.zeros(table.num_rows, bool)
    out = {}
    for reason, mask in zip(reasons, masks):
        m = mask.to_numpy(zero_copy_only=False) & ~taken
        out[reason] = int(m.sum())
        taken |= m
    return taken, out


def check_unique_ids(side: pd.DataFrame, key: str, source: str) -> None:
    """A side table holds one row per id.

    Raises:
        DataContractError: ``key`` has duplicated values (the first few are named).
    """
    dup = side[key][side[key].duplicated(keep=False)]
    if len(dup):
        vals = sorted(set(dup.tolist()))
        raise DataContractError(f"{source}: column {key} has {len(vals)} duplicated values, e.g. {vals[:5]} (a side "
                                "table holds one row per id)")


def _and(a, b):
    return b if a is None else a & b


def write_rejects(rejects: pd.DataFrame, root: str | os.PathLike, name: str) -> Path:
    """Writes set-aside rows (source, line, raw, reason) to ``<root>/rejects/<name>.parquet``."""
    path = Path(root) / "rejects" / f"{name}.parquet"
    write_table(pa.Table.from_pandas(rejects.reset_index(drop=True), schema=REJECT_SCHEMA, preserve_index=False),
                path)
    return path


def write_manifest(root: str | os.PathLike, manifest: dict) -> Path:
    path = Path(root) / "manifest.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)
    return path


def read_manifest(root: str | os.PathLike) -> dict:
    path = Path(root) / "manifest.json"
    if not path.exists():
        raise DataContractError(f"{root}: no manifest.json; create the data set with `solaris data ...`")
    return json.loads(path.read_text())


SIDE_TABLES = ("users", "items")


def read_side(root: str | os.PathLike, kind: str) -> pd.DataFrame:
    """Reads the ``users`` or ``items`` side table of a data root: a path or any URI ``uris.filesystem`` opens
    (``s3a://``...), as the event log. Every data set has both (the contract; ``solaris data movielens`` and
    ``solaris data synth`` write them): a source without side features writes the id column alone.

    Raises:
        FileNotFoundError: the side table is not there (the message names the table and its path).
        ValueError: ``kind`` is not one of ``SIDE_TABLES``.
    """
    if kind not in SIDE_TABLES:
        raise ValueError(f"no side table {kind!r} (the side tables are {', '.join(SIDE_TABLES)})")
    uri = join(root, f"{kind}.parquet")
    fs, path = filesystem(uri)
    if fs.get_file_info(path).type != pafs.FileType.File:
        raise FileNotFoundError(f"{uri}: the {kind} side table is missing (a data root holds users.parquet and "
                                "items.parquet beside events/)")
    return pq.read_table(path, filesystem=fs).to_pandas()


def split_intervals(start, end, every=None) -> list[tuple[pd.Timestamp, pd.Timestamp]]:
    """``[start, end)`` as consecutive intervals of length ``every`` (a pandas Timedelta string; the last may be
    shorter), or as one interval when ``every`` is None. Naive times are UTC."""
    start, end = to_utc(start), to_utc(end)
    if end <= start:
        raise ValueError(f"interval end {end} is not after its start {start}")
    bounds = [start]
    step = pd.Timedelta(every) if every else None
    while step is not None and bounds[-1] + step < end:
        bounds.append(bounds[-1] + step)
    return list(zip(bounds, bounds[1:] + [end]))
