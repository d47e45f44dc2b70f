"""Feast's online-store byte formats, encoded and decoded in bulk with numpy (no feast import, no per-row protos).

What the stock Feast SDK writes and reads (feast 0.67, ``entity_key_serialization_version: 3``):

- entity key: ``<u32 n keys>`` then, for the join keys in sorted order, ``<u32 STRING=2><u32 len><name>``, then
  for their values in the same order ``<u32 INT64=4><u32 8><i64 value>``; the Redis key appends the project name.
- Redis hash field of a feature: the first 4 bytes (little endian) of murmur3_32(``"<view>:<feature>"``);
  the row's event time is the field ``_ts:<view>`` holding a ``google.protobuf.Timestamp``.
- values: serialized ``feast.types.Value`` protos (``float_list_val`` = field 16, ``string_val`` = 2, ...).

Rows of one output interval share their event time and model version, and embeddings have one width, so every
encoded row has the same length: whole batches are built as one numpy record array and sent as one buffer.
Tests check each encoder byte for byte against Feast's own functions.
"""
from __future__ import annotations

import struct

import numpy as np

STRING, INT64 = 2, 4


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _tagged(field: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


# --------------------------------------------------------------------------------------------------- keys

def entity_key_parts(join_keys: tuple[str, ...]) -> tuple[list[str], bytes, bytes]:
    """For int64 join keys: (keys in Feast's sorted order, the constant header, the per-value prefix)."""
    names = sorted(join_keys)
    head = struct.pack("<I", len(names)) + b"".join(
        struct.pack("<II", STRING, len(k.encode())) + k.encode() for k in names)
    return names, head, struct.pack("<II", INT64, 8)


def entity_keys(columns: dict[str, np.ndarray], suffix: bytes = b"") -> np.ndarray:
    """Serialized entity keys (+ ``suffix``, e.g. the project name for Redis) of int64 join-key columns.

    Returns:
        (n,) fixed-width byte records (dtype ``V<width>``); ``.tobytes()`` of a slice gives them back to back.
    """
    names, head, vprefix = entity_key_parts(tuple(columns))
    n = len(next(iter(columns.values())))
    fields = [("head", "u1", (len(head),))]
    for k in names:
        fields += [(f"p_{k}", "u1", (len(vprefix),)), (k, "<i8")]
    if suffix:
        fields.append(("suffix", "u1", (len(suffix),)))
    rec = np.empty(n, np.dtype(fields))
    rec["head"] = np.frombuffer(head, np.uint8)
    for k in names:
        rec[f"p_{k}"] = np.frombuffer(vprefix, np.uint8)
        rec[k] = np.asarray(columns[k], np.int64)
    if suffix:
        rec["suffix"] = np.frombuffer(suffix, np.uint8)
    return rec.view(np.dtype((np.void, rec.dtype.itemsize)))


def entity_key(values: dict[str, int], suffix: bytes = b"") -> bytes:
    return entity_keys({k: np.array([v]) for k, v in values.items()}, suffix)[0].tobytes()


def murmur3_32(data: bytes, seed: int = 0) -> int:
    """MurmurHash3 x86 32-bit (what Feast's ``_mmh3`` uses via the mmh3 package), unsigned."""
    import mmh3
    return mmh3.hash(data, seed, signed=False)


def field_name(view: str, feature: str) -> bytes:
    """The Redis hash field Feast uses for ``feature`` of ``view``."""
    return struct.pack("<I", murmur3_32(f"{view}:{feature}".encode()))


def ts_field(view: str) -> bytes:
    return f"_ts:{view}".encode()


# --------------------------------------------------------------------------------------------------- values

FLOAT_LIST, STRING_VAL, INT32_VAL, INT64_LIST = 16, 2, 3, 14


def float_list_prefix(dim: int) -> bytes:
    """The bytes before the raw little-endian floats in a serialized ``Value(float_list_val=[dim floats])``."""
    inner_len = 4 * dim
    inner_head = _varint(1 << 3 | 2) + _varint(inner_len) if dim else b""
    return _varint(FLOAT_LIST << 3 | 2) + _varint(len(inner_head) + inner_len) + inner_head


def float_lists(matrix: np.ndarray) -> np.ndarray:
    """Serialized ``Value(float_list_val=row)`` for each row of an (n, D) matrix, as fixed-width records."""
    m = np.ascontiguousarray(matrix, dtype="<f4")
    prefix = float_list_prefix(m.shape[1])
    rec = np.empty(len(m), np.dtype([("p", "u1", (len(prefix),)), ("v", "<f4", (m.shape[1],))]))
    rec["p"] = np.frombuffer(prefix, np.uint8)
    rec["v"] = m
    return rec.view(np.dtype((np.void, rec.dtype.itemsize)))


def string_value(s: str) -> bytes:
    return _tagged(STRING_VAL, s.encode())


def int32_values(values: np.ndarray) -> list[bytes]:
    head = _varint(INT32_VAL << 3)
    return [head + _varint(int(v) & 0xFFFFFFFFFFFFFFFF) for v in np.asarray(values, np.int64)]


def parse_int32(buf: bytes | None) -> int:
    """An int32 from a serialized Value (``int32_values``); 0 for None, an empty or another kind of Value."""
    if not buf:
        return 0
    tag, pos = _read_varint(buf, 0)
    if tag != INT32_VAL << 3:
        return 0
    v, _ = _read_varint(buf, pos)
    return v - (1 << 64) if v >= 1 << 63 else v


def int64_list(values) -> bytes:
    payload = b"".join(_varint(int(v) & 0xFFFFFFFFFFFFFFFF) for v in values)
    return _tagged(INT64_LIST, _tagged(1, payload) if len(values) else b"")


def float_list(values) -> bytes:
    v = np.asarray(values, "<f4")
    return float_list_prefix(len(v)) + v.tobytes()


def timestamp(seconds: int, nanos: int = 0) -> bytes:
    """A serialized ``google.protobuf.Timestamp``."""
    out = b""
    if seconds:
        out += b"\x08" + _varint(seconds & 0xFFFFFFFFFFFFFFFF)
    if nanos:
        out += b"\x10" + _varint(nanos)
    return out


def parse_timestamp(buf: bytes) -> float:
    """Seconds since the epoch from a serialized ``Timestamp``."""
    seconds = nanos = 0
    pos = 0
    while pos < len(buf):
        tag, pos = _read_varint(buf, pos)
        v, pos = _read_varint(buf, pos)
        if tag >> 3 == 1:
            seconds = v - (1 << 64) if v >= 1 << 63 else v
        elif tag >> 3 == 2:
            nanos = v
    return seconds + nanos / 1e9


def parse_float_lists(bufs: list, dim: int, mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Decodes serialized float-list Values of width ``dim`` (those where ``mask`` is true, if given), in bulk.

    Returns:
        ((n, dim) float32 matrix, (n,) bool: the value was a float list of that width; other rows are zeros).
    """
    prefix = float_list_prefix(dim)
    width = len(prefix) + 4 * dim
    n = len(bufs)
    out, ok = np.zeros((n, dim), np.float32), np.zeros(n, bool)
    idx = (np.flatnonzero(mask) if mask is not None else
           np.fromiter((i for i, b in enumerate(bufs) if b is not None), np.int64))
    if not len(idx):
        return out, ok
    sel = [bufs[i] for i in idx.tolist()]
    if mask is not None and None in sel:
        keep = np.fromiter((b is not None for b in sel), bool, len(sel))
        idx, sel = idx[keep], [b for b in sel if b is not None]
    right = np.fromiter(map(len, sel), np.int64, len(sel)) == width
    if not right.all():
        idx, sel = idx[right], [b for b, r in zip(sel, right) if r]
    if sel:
        a = np.frombuffer(b"".join(sel), np.uint8).reshape(-1, width)
        good = (a[:, :len(prefix)] == np.frombuffer(prefix, np.uint8)).all(axis=1)
        out[idx[good]] = a[good, len(prefix):].copy().view("<f4")
        ok[idx[good]] = True
    return out, ok
