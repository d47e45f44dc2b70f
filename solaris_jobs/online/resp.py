"""Redis's wire protocol (RESP) built with numpy: what the bulk writers send and the serving client's one round
trip reads with. Fixed-width records become fixed-width bulk strings, so a whole batch is one buffer with no
per-row Python. ``open_raw`` is the one place that reaches under redis-py for the socket they use.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass

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


_SLOT_TABLES: dict[tuple[int, int], np.ndarray] = {}


def _slot_table(width: int, pos: int) -> np.ndarray:
    """CRC16 (XMODEM, what Redis Cluster hashes keys with) of ``width`` zero bytes but byte ``pos`` = 0..255."""
    key = (width, pos)
    if key not in _SLOT_TABLES:
        from binascii import crc_hqx
        buf = bytearray(width)
        out = np.empty(256, np.uint16)
        for b in range(256):
            buf[pos] = b
            out[b] = crc_hqx(bytes(buf), 0)
        _SLOT_TABLES[key] = out
    return _SLOT_TABLES[key]


def key_slots(keys: np.ndarray) -> np.ndarray:
    """The Redis Cluster slot of each fixed-width key (a numpy void array), as ``redis.crc.key_slot`` computes it,
    in bulk. CRC16 with a zero start is linear over XOR, so a key's CRC is the first key's XOR the CRC of their
    difference, which is non-zero only where the keys differ (an entity key's id bytes): one table lookup per
    such byte and key. A key with a ``{`` may carry a hash tag: those go through ``key_slot`` one by one."""
    from binascii import crc_hqx
    n = len(keys)
    if n == 0:
        return np.zeros(0, np.int64)
    width = keys.dtype.itemsize
    b = np.frombuffer(keys.tobytes(), np.uint8).reshape(n, width)
    diff = b ^ b[0]
    crc = np.full(n, crc_hqx(b[0].tobytes(), 0), np.uint16)
    for pos in np.flatnonzero(diff.any(axis=0)):
        crc ^= _slot_table(width, int(pos))[diff[:, pos]]
    slots = (crc % 16384).astype(np.int64)
    tagged = np.flatnonzero((b == ord("{")).any(axis=1))
    if len(tagged):
        from redis.crc import key_slot
        slots[tagged] = [key_slot(b[i].tobytes()) for i in tagged]
    return slots


def bulk(b: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(b), b)


@dataclass(frozen=True)
class RawConnection:
    """A connection of our own to one Redis node, used raw: requests written to ``sock`` as whole buffers, replies
    read from it in bulk."""
    conn: object                # redis.connection.Connection (or SSLConnection): owns the socket
    sock: socket.socket

    def close(self) -> None:
        """Closes the socket (replies may be outstanding: the connection is never reused)."""
        self.conn.disconnect()


def open_raw(client) -> RawConnection:
    """A new connection of ``client``'s pool, connected, with its socket for raw pipelining.

    Why the raw socket: the bulk writers and the serving client send thousands of commands as one numpy-built
    buffer and check or parse the replies in bulk; redis-py's per-command and per-reply Python (about 6 us a
    reply, 14 us a command) would cost more than Redis's own work. redis-py still does the handshake: TLS, AUTH,
    SELECT, the client's timeouts.

    What it relies on in redis-py 7.4.1 (pinned): ``ConnectionPool.make_connection()`` returns a new connection
    outside the pool's bookkeeping; ``Connection.connect()`` opens it and runs the handshake; the open socket (an
    ``ssl.SSLSocket`` under TLS) is the private attribute ``Connection._sock`` (redis-py has no public accessor:
    ``_get_socket()`` is private too), and ``Connection.disconnect()`` closes it. Nothing else of redis-py's
    internals is used: a redis-py upgrade that changes these fails here, in one place.

    Raises:
        redis.ConnectionError, redis.TimeoutError: the node could not be reached or refused the handshake.
    """
    conn = client.connection_pool.make_connection()
    conn.connect()
    sock = getattr(conn, "_sock", None)
    if sock is None:
        conn.disconnect()
        raise RuntimeError("redis-py's connection has no _sock after connect(): the raw socket access in "
                           "solaris_jobs.online.resp.open_raw needs updating for this redis-py version")
    return RawConnection(conn, sock)
