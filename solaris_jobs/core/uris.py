"""Where SOLARIS's files live: a URI (a path, ``file://``, ``s3a://``, ``gs://``, ``hdfs://``...) as the pyarrow
file system and path that open it, outside Spark. The offline store (``offline``) and the data set's files
(``events``: the event log and the side tables) are read and written through it.
"""
from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.fs as pafs


def join(base, *parts: str) -> str:
    """``base/part/...`` as a URI: ``Path`` would fold ``s3a://bucket`` into ``s3a:/bucket``."""
    return "/".join([str(base).rstrip("/"), *parts])


def filesystem(uri) -> tuple[pafs.FileSystem, str]:
    """The pyarrow file system and path for a URI (``s3a://``/``s3n://`` as ``s3://``, with the standard AWS
    settings: credentials, ``AWS_ENDPOINT_URL``; plain paths are local).

    Raises:
        ValueError: a scheme pyarrow cannot open here (the message names it).
    """
    s = str(uri)
    if "://" not in s and not s.startswith("file:"):
        return pafs.LocalFileSystem(), os.path.abspath(s)
    if s.startswith("file:") and not s.startswith("file://"):
        s = "file://" + s[len("file:"):]                    # Hadoop's file:/abs
    scheme, rest = s.split("://", 1)
    if scheme == "file":
        return pafs.LocalFileSystem(), rest
    if scheme in ("s3a", "s3n"):
        s = f"s3://{rest}"
    try:
        return pafs.FileSystem.from_uri(s)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as e:
        raise ValueError(f"{uri}: cannot open this file system outside Spark ({e})") from e
