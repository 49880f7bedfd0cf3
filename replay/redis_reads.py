"""Reading payloads off the socket without redis-py's copies.

Without hiredis (not a dependency here) redis-py parses replies in Python through a BytesIO:
each 64 KiB the socket gives is written into it, then read out, joined to the rest of the
value and sliced free of its CRLF, five copies and a dozen Python calls for a ~0.45 MiB
record. A claim's MGET of eight records took 0.6-0.9 ms a group that way, as long as the raw
write of the same bytes (bench/replay.py). ``BulkReadBuffer`` reads a long bulk string straight
from the socket into one buffer of its final size, the kernel's copy only: ~0.1 ms a group.

Long values come back as ``bytearray`` (``bytes`` would copy them once more): the store only
reads payloads that long, and the codec takes either. Shorter replies (ids, counters, script
replies) stay on redis-py's own path, unchanged.
"""

from __future__ import annotations

import socket
from io import SEEK_END
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

BULK_MIN = 1 << 16
"""Bulk strings at least this long take the direct path: payloads, never ids or counters."""

try:  # redis-py's pure-Python parsers; absent or moved in some release: use its defaults
    from redis._parsers import _RESP2Parser, _RESP3Parser
    from redis._parsers.socket import SERVER_CLOSED_CONNECTION_ERROR, SocketBuffer
    from redis.utils import DEFAULT_RESP_VERSION, HIREDIS_AVAILABLE, SENTINEL
except ImportError:  # pragma: no cover - depends on the installed redis-py
    SocketBuffer = None


if SocketBuffer is not None:

    class BulkReadBuffer(SocketBuffer):
        """redis-py's socket buffer, but a long bulk string is read into its own buffer."""

        def read(self, length: int, timeout: Any = SENTINEL) -> bytes | bytearray:
            if length < BULK_MIN:
                return super().read(length, timeout)
            value = bytearray(length + 2)  # the value and its CRLF
            view = memoryview(value)
            try:
                got = self._buffer.readinto(view)  # what redis-py has read past the header
                self._recv_into(view, got, timeout)
            finally:
                view.release()
            del value[length:]  # the CRLF; truncating the end copies nothing
            return value

        def _recv_into(self, view: memoryview, got: int, timeout: Any) -> None:
            """Fill ``view[got:]`` from the socket. On any error what was received is put
            back in the buffer, so the parser's rewind to the reply's start (redis-py's
            contract for an interrupted read) still finds every byte."""
            start, sock = got, self._sock
            if timeout is not SENTINEL:
                sock.settimeout(timeout)
            try:
                while got < len(view):
                    n = sock.recv_into(view[got:])
                    if n == 0:
                        raise RedisConnectionError(SERVER_CLOSED_CONNECTION_ERROR)
                    got += n
            except BaseException as exc:
                self._keep(view[start:got])
                if isinstance(exc, socket.timeout):  # as redis-py's own buffer reports it
                    raise RedisTimeoutError("Timeout reading from socket") from None
                raise
            finally:
                if timeout is not SENTINEL:
                    sock.settimeout(self.socket_timeout)

        def _keep(self, data: memoryview) -> None:
            buf = self._buffer
            pos = buf.tell()
            buf.seek(0, SEEK_END)
            buf.write(data)
            buf.seek(pos)

    class _BulkReads:
        """Parser mixin: the connection's socket buffer is a ``BulkReadBuffer``."""

        def on_connect(self, connection: Any) -> None:
            super().on_connect(connection)  # type: ignore[misc]
            self._buffer = BulkReadBuffer(self._sock, self.socket_read_size,
                                          connection.socket_timeout)

    class BulkRESP2Parser(_BulkReads, _RESP2Parser):
        pass

    class BulkRESP3Parser(_BulkReads, _RESP3Parser):
        pass


def bulk_parser_kwargs(url: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``parser_class`` for a client of ``url``, to add to its keyword arguments; empty when
    hiredis parses (C, no copies to save) or this redis-py lacks the parsers named above."""
    if SocketBuffer is None or HIREDIS_AVAILABLE:
        return {}
    from redis.connection import parse_url

    protocol = kwargs.get("protocol") or parse_url(url).get("protocol") or DEFAULT_RESP_VERSION
    # The parser must match the protocol: a RESP3 connection given a RESP2 parser subclass
    # keeps it (redis-py only swaps its own class), and push replies would not parse.
    return {"parser_class": BulkRESP3Parser if int(protocol) == 3 else BulkRESP2Parser}


def reads_bulk_directly(client: Any) -> bool:
    """Whether ``client``'s connections read long values through ``BulkReadBuffer`` (for
    tests: a redis-py upgrade that bypasses the hook must not go unnoticed)."""
    if SocketBuffer is None:
        return False
    conn = client.connection_pool.get_connection()
    try:
        conn.connect()
        return isinstance(getattr(conn._parser, "_buffer", None), BulkReadBuffer)
    finally:
        client.connection_pool.release(conn)
