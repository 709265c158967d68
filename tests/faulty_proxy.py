"""A loopback HTTP proxy in front of the test S3 server that spoils requests on purpose: each
request for a path containing `target` takes the next fault of a list (other requests, and those
after the list, pass through untouched); a fault written "FAULT@TEXT" is taken by the first
request whose line holds TEXT instead (the manifest's GET, a shard's), the others wait their turn:

    "reset"  the connection closed at once with a TCP reset, before any answer
    "503"    answered `503 Service Unavailable`, the connection closed
    "slowdown" answered `503 Slow Down` with S3's SlowDown error, as S3 throttles a prefix
    "slow"   passed on after a 0.5 s pause
    "silent" never answered: the connection stays open and says nothing
    "long"   passed on, LONG_BYTES more bytes after its answer's body (its length says so): an
             object, or a range, longer than the reader asked for
    "flip"   passed on, one byte of its answer's body flipped; never twice to one object (its
             path): a reader fetches a file again once on a mismatch, and an object whose bytes
             come wrong twice is a damaged one, which other tests damage at rest
    "cut"    passed on, its answer's head and the first half of its body sent, then the
             connection closed: a body cut off mid-way
    "ok"     passed on untouched (a place in the list)

`refused = b"..."`: from then on, a request whose head holds those bytes (an access key's
`Credential=KEY/`) is answered `refused_status` (400, as S3 answers it) `ExpiredToken`, as S3
answers keys whose session ended.
`outage(seconds)` stops the proxy as a restarting server does: every connection closed, new
ones refused, then back on the same port. `used` lists the faults dealt so far; `gets` counts
the GET requests for the target's paths that reached the proxy, faulty or not; `body_bytes`
the bytes of every answer's body it passed on (what came over the link). Requests and answers are read by their Content-Length
(HTTP/1.1 without pipelining: the answers come in the requests' order)."""

from __future__ import annotations

import collections
import socket
import struct
import threading
import time

FLIP_AT = 1024  # the byte of an answer's body that "flip" flips
LONG_BYTES = 32 << 20  # what "long" adds to an answer's body


class FaultyProxy:
    def __init__(self, upstream: str, faults: list[str], target: str):
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream, self.faults, self.target, self.used = (host, int(port)), list(faults), target.encode(), []
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._flipped: set[bytes] = set()
        self._open: set[socket.socket] = set()
        self.gets = 0
        self.refused: bytes | None = None
        self.refused_status = b"400 Bad Request"
        self.refusals = 0
        self._bodies = [0]
        threading.Thread(target=self._accept, args=(self.server,), daemon=True).start()

    @property
    def body_bytes(self) -> int:
        return self._bodies[0]

    def close(self) -> None:
        self.server.close()
        self._drop_connections()

    def outage(self, seconds: float) -> None:
        """Down for `seconds` from now (refusing, every connection closed), then up again."""
        self.close()

        def back() -> None:
            time.sleep(seconds)
            self.server = socket.create_server(("127.0.0.1", self.port))
            threading.Thread(target=self._accept, args=(self.server,), daemon=True).start()

        threading.Thread(target=back, daemon=True).start()

    def _drop_connections(self) -> None:
        with self._lock:
            conns, self._open = list(self._open), set()
        for c in conns:
            _close(c)

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            with self._lock:
                self._open.add(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _fault_for(self, request_line: bytes) -> str:
        path = request_line.split(b" ")[1].split(b"?")[0] if b" " in request_line else request_line
        with self._lock:
            self.gets += request_line.startswith(b"GET ") and self.target in request_line
            for i, fault in enumerate(self.faults):
                name, _, where = fault.partition("@")
                if where:
                    if where.encode() not in request_line:
                        continue
                elif self.target not in request_line or i != self._first_plain():
                    continue
                if name == "flip" and path in self._flipped:
                    return "ok"  # kept for another object's request
                self.used.append(self.faults.pop(i))
                if name == "flip":
                    self._flipped.add(path)
                return name
        return "ok"

    def _first_plain(self) -> int:
        """The place of the list's first fault without a target of its own (under the lock)."""
        return next((i for i, f in enumerate(self.faults) if "@" not in f), -1)

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.upstream)
        flips: collections.deque = collections.deque()  # per request passed on: its fault ("flip", "long", ...)
        threading.Thread(target=_answers, args=(upstream, client, flips, self._bodies), daemon=True).start()
        buf = b""
        try:
            while True:
                chunk = client.recv(65536)
                if not chunk:
                    return
                buf += chunk
                while (end := buf.find(b"\r\n\r\n")) >= 0:
                    head, length = buf[:end + 4], _length(buf[:end])
                    if len(buf) < end + 4 + length:
                        break
                    request, buf = buf[:end + 4 + length], buf[end + 4 + length:]
                    fault = self._fault_for(head.split(b"\r\n", 1)[0])
                    if self.refused and self.refused in head:
                        self.refusals += 1
                        body = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ExpiredToken</Code>'
                                b"<Message>The provided token has expired.</Message></Error>")
                        client.sendall(b"HTTP/1.1 " + self.refused_status + b"\r\nContent-Type: application/xml\r\n"
                                       b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n"
                                       + body)
                        return
                    if fault == "reset":
                        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        return
                    if fault == "slowdown":
                        body = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                                b"<Message>Please reduce your request rate.</Message></Error>")
                        client.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: "
                                       + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
                        return
                    if fault == "503":
                        client.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                        return
                    if fault == "silent":
                        while client.recv(65536):  # until the reader gives up and closes it
                            pass
                        return
                    if fault == "slow":
                        time.sleep(0.5)
                    flips.append(fault)
                    upstream.sendall(request)
        except OSError:
            pass
        finally:
            _close(client, upstream)


def _with_length(head: bytes, length: int) -> bytes:
    lines = head.split(b"\r\n")
    return b"\r\n".join(b"Content-Length: %d" % length if line.lower().startswith(b"content-length:") else line
                         for line in lines)


def _length(head: bytes) -> int:
    for line in head.lower().split(b"\r\n")[1:]:
        if line.startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def _answers(src: socket.socket, dst: socket.socket, flips: collections.deque, bodies: list) -> None:
    """The store's answers to the client, each one's body flipped at FLIP_AT, made longer, or cut
    off half-way (the connection closed), if its request's fault says so; `bodies[0]` counts
    their bytes."""
    buf, body_left, flip_at, pad, cut_at = b"", 0, -1, 0, -1
    try:
        while True:
            chunk = src.recv(65536)
            if not chunk:
                return
            out = bytearray()
            buf += chunk
            while buf:
                if body_left:  # inside an answer's body
                    take = buf[:body_left]
                    if 0 <= cut_at < len(take):  # half of it sent: the connection closes
                        dst.sendall(bytes(out) + take[:cut_at])
                        return
                    cut_at -= len(take) if cut_at >= 0 else 0
                    if 0 <= flip_at < len(take):
                        take = bytearray(take)
                        take[flip_at] ^= 0xFF
                    flip_at -= len(take)
                    out += take
                    bodies[0] += len(take)
                    body_left -= len(take)
                    buf = buf[len(take):]
                    if not body_left and pad:
                        dst.sendall(bytes(out))
                        out = bytearray()
                        for _ in range(pad >> 20):  # a MiB at a time, as long as the reader takes it
                            dst.sendall(bytes(1 << 20))
                        pad = 0
                    continue
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    break
                head, body_left = buf[:end], _length(buf[:end])
                fault = flips.popleft() if flips else "ok"
                flip_at = FLIP_AT if fault == "flip" and body_left > FLIP_AT else -1
                cut_at = body_left // 2 if fault == "cut" and body_left > 1 else -1
                if fault == "long" and body_left:
                    pad = LONG_BYTES
                    head = _with_length(head, body_left + pad)
                out += head + b"\r\n\r\n"
                buf = buf[end + 4:]
            dst.sendall(out)
    except OSError:
        pass
    finally:
        _close(src, dst)


def _close(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()
