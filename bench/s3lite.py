"""A small S3 server for `bench remote` where SeaweedFS cannot go (a lent GPU host takes 64 MiB
of files with the project; `weed` is 153 MB): on 127.0.0.1 only, its objects files under one
folder (`s3lite_store`). `bench.stores.lite_server` starts it as `s3_server` starts SeaweedFS.
Standard library only, run by path: it imports nothing of the project.

It ACCEPTS ANY SIGNATURE: no request is authenticated (SigV4 headers are read past, never
checked). It is for throughput on loopback, never for a network; the reader's correctness against
a store that checks signatures is tested against SeaweedFS (tests/dataset/test_remote*.py).

It serves what `packer push`, mmpack's reader (obstore, path-style requests) and boto3 ask: PUT,
GET, HEAD, DELETE and DeleteObjects (obstore's delete); ranged GET (`Range: bytes=a-b`, `a-`,
`-n`: 206 with Content-Range, 416 past the end, a header it cannot read ignored as S3 does);
multipart upload (create, part, complete, abort); ListObjectsV2 (prefix, delimiter, max-keys,
continuation); PUT and HEAD of a bucket (its first object makes one too); S3's XML errors (404
NoSuchKey). Not: copies, versions, conditional requests, aws-chunked bodies (501 NotImplemented).
An object's user metadata (x-amz-meta-*) and content headers live in memory for the server's life.

A GET's body goes out with `socket.sendfile` (the kernel copies it, no Python loop), each
connection in a thread: `bench remote --nodes 4 --link-mb 100` needs 400 MB/s of it. On the
2-core VM (2026-12-07, shared) 8 threads of obstore GETs took 2,166 MB/s of 16 MiB objects from it
(SeaweedFS 997) and 5,399 GETs/s of 64 KiB ones (SeaweedFS 2,012).

    python bench/s3lite.py ROOT [--port N]
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit
from xml.etree import ElementTree
from xml.sax.saxutils import escape

if __package__:
    from .s3lite_store import S3Error, Store, byte_range
else:  # run by path (bench.stores.lite_server): its folder is on sys.path, no package around it
    from s3lite_store import S3Error, Store, byte_range

HOST = "127.0.0.1"  # loopback only: it checks no signature
COPY_BYTES = 1 << 20  # a request body read this much at a time
SMALL_BYTES = 64 << 10  # a body this small is read and written, not sendfile'd
KEPT_HEADERS = ("content-type", "content-encoding", "content-disposition", "content-language", "cache-control")
MAX_KEYS = 1000
IDLE_S = 300  # a kept-alive connection silent this long is closed


def _xml(root: str, fields: list[tuple[str, object]]) -> bytes:
    """`<root>` of (tag, text or a nested list of fields) in S3's namespace."""
    def body(items) -> str:
        return "".join(f"<{t}>{body(v) if isinstance(v, list) else escape(str(v))}</{t}>" for t, v in items)
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<{root} xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"{body(fields)}</{root}>").encode()


def _iso(mtime: float) -> str:
    return datetime.fromtimestamp(mtime, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


class Handler(BaseHTTPRequestHandler):
    """One connection: its requests in turn (HTTP/1.1, kept alive), path-style (/BUCKET/KEY)."""

    protocol_version = "HTTP/1.1"
    server_version = "s3lite"
    timeout = IDLE_S
    store: Store  # set on the subclass `serve` makes

    def setup(self) -> None:
        super().setup()
        # a head and its small body go out as two writes: no Nagle wait for the peer's delayed ACK
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        pass  # quiet: a request a line would cost more than it serves; errors go to log_error

    def log_error(self, format, *args) -> None:  # noqa: A002
        sys.stderr.write(f"s3lite: {self.requestline!r}: {format % args}\n")

    def do_GET(self) -> None:
        self._answer(self._get)

    def do_HEAD(self) -> None:
        self._answer(self._get)

    def do_PUT(self) -> None:
        self._answer(self._put)

    def do_POST(self) -> None:
        self._answer(self._post)

    def do_DELETE(self) -> None:
        self._answer(self._delete)

    def _answer(self, handle) -> None:
        url = urlsplit(self.path)
        bucket, _, key = unquote(url.path).lstrip("/").partition("/")
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        self._read = False
        try:
            handle(bucket, key, query)
        except S3Error as exc:
            self._error(exc, bucket, key)
        except Exception as exc:  # noqa: BLE001 - one request's failure is its answer, not the server's end
            self.log_error("%s", f"{type(exc).__name__}: {exc}")
            self._error(S3Error(500, "InternalError", f"{type(exc).__name__}: {exc}"), bucket, key)

    def _error(self, exc: S3Error, bucket: str, key: str) -> None:
        if not self._read and self._has_body():
            self.close_connection = True  # its body unread: the next request would start inside it
        body = _xml("Error", [("Code", exc.code), ("Message", str(exc)), ("Resource", f"/{bucket}/{key}"),
                              *((k.title().replace("_", ""), v) for k, v in exc.extra.items() if k != "size"),
                              ("RequestId", uuid.uuid4().hex[:16])])
        self.send_response(exc.status)
        if exc.status == 416:
            self.send_header("Content-Range", f"bytes */{exc.extra['size']}")
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(0 if self.command == "HEAD" else len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _has_body(self) -> bool:
        return int(self.headers.get("Content-Length") or 0) > 0 or "chunked" in self.headers.get("Transfer-Encoding", "")

    def _body(self):
        """The request's body as chunks, by Content-Length or chunked transfer coding; `_read`
        once it was read to its end (an error answered before then closes the connection)."""
        if self.headers.get("x-amz-content-sha256", "").startswith("STREAMING-"):
            raise S3Error(501, "NotImplemented", "s3lite does not read aws-chunked bodies (STREAMING-* payloads)")
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                yield from self._exactly(size)
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
        else:
            yield from self._exactly(int(self.headers.get("Content-Length") or 0))
        self._read = True

    def _exactly(self, n: int):
        while n > 0:
            chunk = self.rfile.read(min(n, COPY_BYTES))
            if not chunk:
                raise ConnectionError(f"the request's body ended {n:,} bytes early")
            n -= len(chunk)
            yield chunk

    def _drain(self) -> None:
        for _ in self._body():
            pass

    def _get(self, bucket: str, key: str, query: dict) -> None:
        self._drain()
        if not key:
            return self._list(bucket, query) if self.command == "GET" else self._send(200, b"", {}, bucket_of=bucket)
        f, size, etag, headers = self.store.open(bucket, key)
        with f:
            span = byte_range(self.headers.get("Range"), size)
            first, last = span or (0, size - 1)
            count = last - first + 1
            self.send_response(200 if span is None else 206)
            for name, value in headers.items():
                self.send_header(name, value)
            if "content-type" not in headers:
                self.send_header("Content-Type", "application/octet-stream")
            if span is not None:
                self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            self.send_header("ETag", etag)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(count))
            self.end_headers()
            if self.command == "HEAD" or count == 0:
                return
            if count <= SMALL_BYTES:
                f.seek(first)
                self.wfile.write(f.read(count))
            else:
                self.connection.sendfile(f, first, count)

    def _list(self, bucket: str, query: dict) -> None:
        """ListObjectsV2: keys after the continuation token (or start-after), rolled up at the
        delimiter, up to max-keys."""
        if query.get("list-type") != "2":
            raise S3Error(501, "NotImplemented", "s3lite lists by ListObjectsV2 only (list-type=2)")
        prefix, delimiter = query.get("prefix", ""), query.get("delimiter", "")
        most = min(int(query.get("max-keys") or MAX_KEYS), MAX_KEYS)
        after = query.get("continuation-token") or query.get("start-after", "")
        contents, prefixes, last, truncated = [], [], None, False
        for key in self.store.keys(bucket, prefix):
            rolled = prefix + key[len(prefix):].split(delimiter, 1)[0] + delimiter \
                if delimiter and delimiter in key[len(prefix):] else None
            name = rolled or key
            if name.encode() <= after.encode() or (rolled and prefixes and prefixes[-1] == rolled):
                continue
            if len(contents) + len(prefixes) == most:
                truncated = True
                break
            if rolled:
                prefixes.append(rolled)
            else:
                size, mtime, etag = self.store.listed(bucket, key)
                contents.append(("Contents", [("Key", key), ("LastModified", _iso(mtime)), ("ETag", etag),
                                              ("Size", size), ("StorageClass", "STANDARD")]))
            last = name
        fields = [("Name", bucket), ("Prefix", prefix), ("KeyCount", len(contents) + len(prefixes)),
                  ("MaxKeys", most), ("IsTruncated", str(truncated).lower())]
        if delimiter:
            fields.append(("Delimiter", delimiter))
        if truncated:
            fields.append(("NextContinuationToken", last))
        fields += contents + [("CommonPrefixes", [("Prefix", p)]) for p in prefixes]
        self._send(200, _xml("ListBucketResult", fields), {"Content-Type": "application/xml"})

    def _put(self, bucket: str, key: str, query: dict) -> None:
        if not key:  # CreateBucket
            self._drain()
            self.store.path(bucket, "x").parent.mkdir(exist_ok=True)
            return self._send(200, b"", {"Location": f"/{bucket}"})
        if "x-amz-copy-source" in self.headers:
            raise S3Error(501, "NotImplemented", "s3lite does not copy objects (x-amz-copy-source)")
        if "uploadId" in query:
            etag = self.store.put_part(bucket, key, query["uploadId"], int(query.get("partNumber") or 0), self._body())
        else:
            etag = self.store.put(bucket, key, self._body(), self._kept())
        self._send(200, b"", {"ETag": etag})

    def _post(self, bucket: str, key: str, query: dict) -> None:
        if "uploads" in query:
            self._drain()
            upload = self.store.create_upload(bucket, key, self._kept())
            return self._send(200, _xml("InitiateMultipartUploadResult", [
                ("Bucket", bucket), ("Key", key), ("UploadId", upload)]), {"Content-Type": "application/xml"})
        if "delete" in query and not key:
            return self._delete_many(bucket)
        if "uploadId" not in query:
            raise S3Error(501, "NotImplemented", f"s3lite does not answer POST {self.path}")
        doc = ElementTree.fromstring(b"".join(self._body()))
        parts = [(int(p.findtext("{*}PartNumber") or p.findtext("PartNumber")), p.findtext("{*}ETag") or
                  p.findtext("ETag") or "") for p in doc.iter() if p.tag.rsplit("}", 1)[-1] == "Part"]
        etag = self.store.complete(bucket, key, query["uploadId"], parts)
        self._send(200, _xml("CompleteMultipartUploadResult", [
            ("Location", f"http://{HOST}/{bucket}/{quote(key)}"), ("Bucket", bucket), ("Key", key), ("ETag", etag)]),
            {"Content-Type": "application/xml"})

    def _delete(self, bucket: str, key: str, query: dict) -> None:
        self._drain()
        if "uploadId" in query:
            self.store.abort(bucket, key, query["uploadId"])
        else:
            self.store.path(bucket, key)
            self.store.delete(bucket, key)
        self._send(204, b"", {})

    def _delete_many(self, bucket: str) -> None:
        """DeleteObjects (obstore's delete): each key named, each answered deleted."""
        doc = ElementTree.fromstring(b"".join(self._body()))
        keys = [o.findtext("{*}Key") or o.findtext("Key") for o in doc.iter() if o.tag.rsplit("}", 1)[-1] == "Object"]
        for key in keys:
            self.store.path(bucket, key)
        for key in keys:
            self.store.delete(bucket, key)
        quiet = (doc.findtext("{*}Quiet") or doc.findtext("Quiet") or "").lower() == "true"
        self._send(200, _xml("DeleteResult", [] if quiet else [("Deleted", [("Key", k)]) for k in keys]),
                   {"Content-Type": "application/xml"})

    def _kept(self) -> dict:
        """The request's headers an object keeps: its user metadata and content headers."""
        return {k.lower(): v for k, v in self.headers.items()
                if k.lower().startswith("x-amz-meta-") or k.lower() in KEPT_HEADERS}

    def _send(self, status: int, body: bytes, headers: dict, bucket_of: str | None = None) -> None:
        if bucket_of is not None:
            self.store.bucket(bucket_of)  # HEAD of a bucket: 404 NoSuchBucket where there is none
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the ranks of four nodes open their connections at once


def serve(root: Path, port: int = 0) -> Server:
    """A server of the objects under `root` on 127.0.0.1:`port` (0: a free one), not yet serving:
    call its `serve_forever` (in a thread, or the process's main)."""
    handler = type("StoreHandler", (Handler,), {"store": Store(Path(root))})
    return Server((HOST, port), handler)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="s3lite", description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path, help="the folder that holds the objects (made if missing)")
    ap.add_argument("--port", type=int, default=0, help="the port on 127.0.0.1 (default: a free one)")
    args = ap.parse_args(argv)
    try:
        server = serve(args.root, args.port)
    except OSError as exc:  # the words bench.stores looks for to start it again on another port
        print(f"s3lite: {HOST}:{args.port}: {'address already in use' if exc.errno == errno.EADDRINUSE else exc}", flush=True)
        return 1
    print(f"s3lite: {args.root} at http://{HOST}:{server.server_address[1]} (any signature accepted)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
