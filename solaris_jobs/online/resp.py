"""Redis's wire protocol (RESP) built with numpy: what the bulk writers send and the serving client's one round
trip reads with. Fixed-width records become fixed-width bulk strings, so a whole batch is one buffer with no
per-row Python.
"""
from __future__ import annotations

import numpy as np


def _bulk_header(width: int) -> bytes:
    return b"$%d\r\n" % width


def bulk_records(rec: np.ndarray) -> np.ndarray:
    """Fixed-width records -> RESP bulk strings (``$w\\r\\n<bytes>\\r\\n``), still fixed-width records."""
    w = rec.dtype.itemsize
    head = _bulk_header(w)
    out = np.empty(len(rec), np.dtype([("h", "u1", (len(head),)), ("v", f"V{w}"), ("e", "u1", (2,))]))
    out["h"] = np.frombuffer(head, np.uint8)
    out["v"] = rec
    out["e"] = np.frombuffer(b"\r\n", np.uint8)
    return out.view(np.dtype((np.void, out.dtype.itemsize)))


def bulk(b: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(b), b)
