"""MovieLens-100K into the event-log contract.

Two sources load: the copy that ships inside the ``recbole==1.2.1`` wheel on PyPI
(``recbole/dataset_example/ml-100k/ml-100k.{inter,user,item}``, tab-separated with typed headers), fetched once
with ``pip download --no-deps`` into a cache folder; or a GroupLens folder (``u.data``, ``u.user``, ``u.item``).

Each rating becomes one event: label 1 when rating >= 4. Rows that do not parse (bad id, rating out of 1-5,
bad timestamp) are set aside with their line and reason in ``<out>/rejects/``, counted in the manifest, and
logged. A file that is not the expected one (missing column, wrong column count on every line) raises
``DataContractError`` naming the file and column.
"""
from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from solaris_jobs.core import events as ev
from solaris_jobs.core.events import DataContractError

logger = logging.getLogger(__name__)

RECBOLE_SPEC = "recbole==1.2.1"
RECBOLE_MEMBER = "recbole/dataset_example/ml-100k/ml-100k.{}"
GENRES = ["unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama",
          "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western"]
OCCUPATIONS = ["administrator", "artist", "doctor", "educator", "engineer", "entertainment", "executive",
               "healthcare", "homemaker", "lawyer", "librarian", "marketing", "none", "other", "programmer",
               "retired", "salesman", "scientist", "student", "technician", "writer"]


@dataclass(frozen=True)
class RawTables:
    """The three MovieLens files as strings, one frame per file, with the file name for messages."""
    inter: pd.DataFrame
    users: pd.DataFrame
    items: pd.DataFrame
    names: dict


def default_cache_dir() -> Path:
    from solaris_jobs.core.settings import cache_dir
    return cache_dir()


def fetch_recbole_wheel(cache_dir: str | os.PathLike | None = None) -> Path:
    """Returns the cached recbole wheel, downloading it with ``pip download --no-deps`` the first time."""
    cache = Path(cache_dir or default_cache_dir())
    found = sorted(cache.glob("recbole-1.2.1-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    logger.info("downloading %s into %s", RECBOLE_SPEC, cache)
    # Into a folder of this process's own, then moved into place whole: another process fetching it at the same
    # time never sees a half-written wheel.
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, RECBOLE_SPEC]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = sorted(Path(tmp).glob("recbole-1.2.1-*.whl"))
        if proc.returncode != 0 or not got:
            raise RuntimeError(f"could not download {RECBOLE_SPEC} with {' '.join(cmd)}: {proc.stderr.strip()}")
        os.replace(got[0], cache / got[0].name)
    return cache / got[0].name


def _read_recbole_member(zf: zipfile.ZipFile, wheel: Path, ext: str) -> tuple[pd.DataFrame, str]:
    name = RECBOLE_MEMBER.format(ext)
    try:
        raw = zf.read(name).decode("utf-8")
    except KeyError as e:
        raise DataContractError(f"{wheel}: member {name} not found") from e
    return _read_delimited(io.StringIO(raw), "\t", f"{wheel.name}!{name}", header=True), f"{wheel.name}!{name}"


def _read_delimited(buf, sep: str, name: str, header: bool, columns: list[str] | None = None) -> pd.DataFrame:
    """Reads a delimited text file as strings; typed recbole headers (``name:type``) lose their type suffix."""
    text = buf.read()
    # A byte-order mark (UTF-8's, or its bytes read as latin-1) is not part of the first line's first field.
    for bom in ("\ufeff", "\xef\xbb\xbf"):
        text = text.removeprefix(bom)
    lines = text.splitlines()
    if header:
        if not lines:
            raise DataContractError(f"{name}: empty file")
        columns = [c.split(":")[0] for c in lines[0].split(sep)]
        lines, first = lines[1:], 2
    else:
        first = 1
    if not lines:
        raise DataContractError(f"{name}: no data lines (empty file)")
    rows = [ln.split(sep) for ln in lines]
    width = len(columns)
    good = [r for r in rows if len(r) == width]
    if rows and not good:
        raise DataContractError(f"{name}: no line has the expected {width} columns {columns} "
                                f"(first line has {len(rows[0])}: {lines[0][:80]!r})")
    frame = pd.DataFrame([r if len(r) == width else [None] * width for r in rows], columns=columns, dtype=object)
    frame["_line"] = np.arange(first, first + len(rows))
    frame["_raw"] = lines
    frame["_width_ok"] = [len(r) == width for r in rows]
    return frame


def read_recbole(wheel: Path) -> RawTables:
    with zipfile.ZipFile(wheel) as zf:
        inter, n1 = _read_recbole_member(zf, wheel, "inter")
        users, n2 = _read_recbole_member(zf, wheel, "user")
        items, n3 = _read_recbole_member(zf, wheel, "item")
    items = items.rename(columns={"class": "genres"})
    return RawTables(inter, users, items, {"inter": n1, "users": n2, "items": n3})


def read_grouplens(folder: str | os.PathLike) -> RawTables:
    """Reads a GroupLens ml-100k folder (``u.data``, ``u.user``, ``u.item``; the latter is latin-1)."""
    folder = Path(folder)
    paths = {"inter": folder / "u.data", "users": folder / "u.user", "items": folder / "u.item"}
    for p in paths.values():
        if not p.exists():
            raise DataContractError(f"{p}: file not found (a GroupLens ml-100k folder has u.data, u.user, u.item)")
    inter = _read_delimited(io.StringIO(paths["inter"].read_text()), "\t", str(paths["inter"]), header=False,
                            columns=["user_id", "item_id", "rating", "timestamp"])
    users = _read_delimited(io.StringIO(paths["users"].read_text()), "|", str(paths["users"]), header=False,
                            columns=["user_id", "age", "gender", "occupation", "zip_code"])
    items = _read_delimited(io.StringIO(paths["items"].read_text(encoding="latin-1")), "|", str(paths["items"]),
                            header=False, columns=["item_id", "movie_title", "release_date", "video_release_date",
                                                   "url"] + [f"g{k}" for k in range(len(GENRES))])
    flags = items[[f"g{k}" for k in range(len(GENRES))]]
    items["genres"] = [" ".join(g for g, f in zip(GENRES, row) if f == "1") if ok else None
                       for row, ok in zip(flags.itertuples(index=False), items["_width_ok"])]
    items["release_year"] = items["release_date"].str[-4:]
    return RawTables(inter, users, items, {k: str(v) for k, v in paths.items()})


def _require(frame: pd.DataFrame, name: str, cols: list[str]) -> None:
    for c in cols:
        if c not in frame.columns:
            raise DataContractError(f"{name}: required column {c!r} is missing (found "
                                    f"{[c for c in frame.columns if not c.startswith('_')]})")


class _Rejects:
    """Collects set-aside rows with a reason each."""

    def __init__(self):
        self.parts: list[pd.DataFrame] = []

    def add(self, frame: pd.DataFrame, bad: np.ndarray, source: str, reason) -> pd.DataFrame:
        """Moves rows where ``bad`` is true to the rejects; ``reason`` is a string or a per-row Series."""
        if bad.any():
            sub = frame.loc[bad]
            why = reason.loc[bad] if isinstance(reason, pd.Series) else reason
            self.parts.append(pd.DataFrame({"source": source, "line": sub["_line"].astype("int64"),
                                            "raw": sub["_raw"], "reason": why}))
        return frame.loc[~bad]

    def frame(self) -> pd.DataFrame:
        if not self.parts:
            return pd.DataFrame({c: pd.Series(dtype=t) for c, t in
                                 [("source", object), ("line", "int64"), ("raw", object), ("reason", object)]})
        return pd.concat(self.parts, ignore_index=True)


def _numeric(frame: pd.DataFrame, col: str, rejects: _Rejects, source: str, lo=None, hi=None, integer=True):
    vals = pd.to_numeric(frame[col], errors="coerce")
    bad = vals.isna().to_numpy()
    if integer:
        bad |= (vals.fillna(0) % 1 != 0).to_numpy()
    if lo is not None:
        bad |= (vals < lo).fillna(False).to_numpy()
    if hi is not None:
        bad |= (vals > hi).fillna(False).to_numpy()
    reason = "column " + col + " has value " + frame[col].astype(str).str.slice(0, 40).map(repr)
    frame = frame.assign(**{col: vals})
    return rejects.add(frame, bad, source, reason)


def _unique_ids(frame: pd.DataFrame, col: str, rejects: _Rejects, source: str) -> pd.DataFrame:
    """A side table holds one row per id: later rows with an id already seen are set aside, the first is kept
    (the manifest counts them as ``duplicate <col>``)."""
    ids = frame[col].astype("int64")
    first = frame.groupby(ids)["_line"].transform("min").astype("int64").astype(str)
    reason = f"duplicate {col} has value '" + ids.astype(str) + "' (line " + first + " has it and is kept)"
    return rejects.add(frame, ids.duplicated(keep="first").to_numpy(), source, reason)


def to_contract(raw: RawTables) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Validates and converts raw MovieLens tables.

    Returns:
        (events, users, items, rejects): events as a frame in the event-log contract (label = rating >= 4);
        users with ``age_bucket``, ``gender``, ``occupation``, ``zip_region`` codes; items with
        ``release_decade`` and ``genres`` (list of genre codes); rejects with source, line, raw, reason.

    Raises:
        DataContractError: a file lacks a required column or has no parseable line at all.
    """
    rejects = _Rejects()
    inter, src = raw.inter, raw.names["inter"]
    _require(inter, src, ["user_id", "item_id", "rating", "timestamp"])
    inter = rejects.add(inter, ~inter["_width_ok"].to_numpy(), src, "wrong number of columns")
    inter = _numeric(inter, "user_id", rejects, src, lo=1)
    inter = _numeric(inter, "item_id", rejects, src, lo=1)
    inter = _numeric(inter, "rating", rejects, src, lo=1, hi=5, integer=False)
    inter = _numeric(inter, "timestamp", rejects, src, lo=0, hi=4102444800)
    dup = inter.duplicated(["user_id", "item_id", "timestamp"], keep="first").to_numpy()
    inter = rejects.add(inter, dup, src, "duplicate of an earlier (user_id, item_id, timestamp) row")
    events = pd.DataFrame({
        "user_id": inter["user_id"].astype("int64"),
        "item_id": inter["item_id"].astype("int64"),
        "event_timestamp": pd.to_datetime(inter["timestamp"].astype("int64"), unit="s", utc=True),
        "label": (inter["rating"] >= 4).astype("int8"),
        "rating": inter["rating"].astype("float32"),
    })

    users, src = raw.users, raw.names["users"]
    _require(users, src, ["user_id", "age", "gender", "occupation", "zip_code"])
    users = rejects.add(users, ~users["_width_ok"].to_numpy(), src, "wrong number of columns")
    users = _numeric(users, "user_id", rejects, src, lo=1)
    users = _numeric(users, "age", rejects, src, lo=0, hi=120)
    users = _unique_ids(users, "user_id", rejects, src)
    age_edges = np.array([18, 25, 35, 45, 50, 56])
    occ = {o: k + 1 for k, o in enumerate(OCCUPATIONS)}
    zip_first = users["zip_code"].astype(str).str[:1]
    user_side = pd.DataFrame({
        "user_id": users["user_id"].astype("int64"),
        "age_bucket": (np.searchsorted(age_edges, users["age"].to_numpy(), side="right") + 1).astype("int32"),
        "gender": users["gender"].map({"M": 1, "F": 2}).fillna(0).astype("int32"),
        "occupation": users["occupation"].map(occ).fillna(0).astype("int32"),
        "zip_region": np.where(zip_first.str.isdigit(), pd.to_numeric(zip_first, errors="coerce").fillna(-1) + 1,
                               11).astype("int32"),
    })

    items, src = raw.items, raw.names["items"]
    _require(items, src, ["item_id", "genres"])
    items = rejects.add(items, ~items["_width_ok"].to_numpy(), src, "wrong number of columns")
    items = _numeric(items, "item_id", rejects, src, lo=1)
    items = _unique_ids(items, "item_id", rejects, src)
    gcode = {g: k + 1 for k, g in enumerate(GENRES)}
    year = pd.to_numeric(items.get("release_year"), errors="coerce")
    item_side = pd.DataFrame({
        "item_id": items["item_id"].astype("int64"),
        "release_decade": np.where(year.isna(), 0, np.clip((year.fillna(1900) - 1900) // 10, 0, 12) + 1)
                          .astype("int32"),
        "genres": [[gcode[g] for g in str(s).split() if g in gcode] or [0] for s in items["genres"]],
    })
    return events, user_side, item_side, rejects.frame()


def build(out: str | os.PathLike, source: str | os.PathLike | None = None,
          cache_dir: str | os.PathLike | None = None) -> dict:
    """Writes MovieLens-100K as a SOLARIS data set under ``out``.

    Args:
        out: data root to write (events/, users.parquet, items.parquet, rejects/, manifest.json).
        source: a GroupLens folder or a recbole wheel; None fetches (or reuses the cached) recbole wheel.
        cache_dir: where the wheel is cached (default ``settings.cache_dir()``: ``~/.cache/solaris``).

    Returns:
        The manifest: counts of rows read, written and set aside (by reason), time range.
    """
    if source is None:
        raw = read_recbole(fetch_recbole_wheel(cache_dir))
    elif Path(source).is_dir():
        raw = read_grouplens(source)
    else:
        raw = read_recbole(Path(source))
    events, users, items, rejects = to_contract(raw)
    out = Path(out)
    n = ev.write_events(ev.conform(events, raw.names["inter"]), out, part="movielens")
    ev.write_table(users, out / "users.parquet")
    ev.write_table(items, out / "items.parquet")
    ev.write_rejects(rejects, out, "movielens")
    by_reason = rejects["reason"].str.replace(r" has value .*", "", regex=True).value_counts().to_dict()
    manifest = {
        "source": "movielens-100k", "origin": {k: v for k, v in raw.names.items()},
        "events": n, "users": int(events["user_id"].nunique()), "items": int(events["item_id"].nunique()),
        "positive_rate": float(events["label"].mean()) if n else None,
        "start": events["event_timestamp"].min(), "end": events["event_timestamp"].max(),
        "rejected": int(len(rejects)), "rejected_by_reason": by_reason,
    }
    ev.write_manifest(out, manifest)
    if len(rejects):
        logger.warning("set aside %d MovieLens rows (%s); see %s/rejects/movielens.parquet", len(rejects),
                       by_reason, out)
    logger.info("wrote %d events, %d users, %d items to %s", n, len(users), len(items), out)
    return manifest
