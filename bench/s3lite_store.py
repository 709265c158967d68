"""bench/s3lite.py's objects: each a file under one folder (ROOT/BUCKET/KEY), a PUT written beside
and renamed into place, multipart uploads in progress, S3's errors and its byte ranges. Standard
library only: the server runs by path, with no package around it."""

from __future__ import annotations

import email.utils
import hashlib
import os
import re
import shutil
import threading
import uuid
from pathlib import Path

BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,62}")
COPY_BYTES = 1 << 20  # a part appended this much at a time


class S3Error(Exception):
    """An answer in S3's words: status, code, message."""

    def __init__(self, status: int, code: str, message: str, **extra):
        super().__init__(message)
        self.status, self.code, self.extra = status, code, extra


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The (first, last) byte of `size` that a Range header asks, None for the whole object (no
    header, or one this server does not read: S3 serves the whole then, as RFC 9110 lets it);
    S3Error 416 when no byte of it is in the object."""
    m = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", header or "")
    if m is None or m.group(1) == m.group(2) == "":
        return None
    first, last = m.group(1), m.group(2)
    if first == "":  # the last n bytes
        n = int(last)
        if n == 0 or size == 0:
            raise S3Error(416, "InvalidRange", "The requested range is not satisfiable", size=size)
        return max(0, size - n), size - 1
    start = int(first)
    end = size - 1 if last == "" else min(int(last), size - 1)
    if start >= size:
        raise S3Error(416, "InvalidRange", "The requested range is not satisfiable", size=size)
    return None if end < start else (start, end)


class Store:
    """Objects as files, ROOT/BUCKET/KEY; a PUT written beside them and renamed into place (a GET
    reads the old object or the new one); uploads in progress under ROOT/.uploads."""

    def __init__(self, root: Path):
        self.root = root
        self.tmp = root / ".tmp"
        self.uploads = root / ".uploads"
        for d in (root, self.tmp, self.uploads):
            d.mkdir(parents=True, exist_ok=True)
        self.meta: dict[tuple[str, str], dict] = {}  # (bucket, key) -> {"etag": ..., "headers": {...}}
        self.pending: dict[str, tuple[str, str, dict]] = {}  # upload id -> (bucket, key, headers)
        self.lock = threading.Lock()

    def path(self, bucket: str, key: str) -> Path:
        if not BUCKET.fullmatch(bucket):
            raise S3Error(400, "InvalidBucketName", f"{bucket!r} is not a bucket name")
        if any(part in ("", ".", "..") for part in key.split("/")):
            raise S3Error(400, "InvalidArgument", f"s3lite keeps objects as files and cannot keep the key {key!r}")
        return self.root / bucket / key

    def bucket(self, bucket: str) -> Path:
        found = self.root / bucket
        if not BUCKET.fullmatch(bucket) or not found.is_dir():
            raise S3Error(404, "NoSuchBucket", "The specified bucket does not exist", bucket=bucket)
        return found

    def open(self, bucket: str, key: str):
        """(file, size, etag, headers) of the object; S3Error 404 where there is none."""
        try:
            f = open(self.path(bucket, key), "rb")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise S3Error(404, "NoSuchKey", "The specified key does not exist.", key=key) from None
        st = os.fstat(f.fileno())
        etag, headers = self._meta(bucket, key, st)
        headers["Last-Modified"] = email.utils.formatdate(st.st_mtime, usegmt=True)
        return f, st.st_size, etag, headers

    def listed(self, bucket: str, key: str) -> tuple[int, float, str]:
        """(size, mtime, etag) of a key `keys` found."""
        st = os.stat(self.path(bucket, key))
        return st.st_size, st.st_mtime, self._meta(bucket, key, st)[0]

    def _meta(self, bucket: str, key: str, st: os.stat_result) -> tuple[str, dict]:
        """(etag, headers) of the object: as it was put, or made up for a file put there by hand."""
        with self.lock:
            meta = self.meta.get((bucket, key))
        if meta is None:
            return f'"{st.st_size:x}-{st.st_mtime_ns:x}"', {}
        return meta["etag"], dict(meta["headers"])

    def put(self, bucket: str, key: str, chunks, headers: dict) -> str:
        """The object made of `chunks` (bytes), replacing any; its ETag (the body's MD5, as S3's)."""
        where = self.path(bucket, key)
        digest = hashlib.md5()
        tmp = self.tmp / uuid.uuid4().hex
        try:
            with open(tmp, "wb") as f:
                for chunk in chunks:
                    digest.update(chunk)
                    f.write(chunk)
            etag = f'"{digest.hexdigest()}"'
            self._publish(tmp, where, bucket, key, etag, headers)
        finally:
            tmp.unlink(missing_ok=True)
        return etag

    def _publish(self, tmp: Path, where: Path, bucket: str, key: str, etag: str, headers: dict) -> None:
        try:
            where.parent.mkdir(parents=True, exist_ok=True)
            with self.lock:
                os.replace(tmp, where)
                self.meta[(bucket, key)] = {"etag": etag, "headers": headers}
        except (NotADirectoryError, IsADirectoryError, FileExistsError):
            raise S3Error(409, "InvalidArgument", f"s3lite keeps objects as files: {key!r} is a folder of other keys or "
                          "under a key that is an object") from None

    def delete(self, bucket: str, key: str) -> None:
        with self.lock:
            self.meta.pop((bucket, key), None)
            try:
                self.path(bucket, key).unlink()
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                pass  # S3 answers 204 for a key it does not hold

    def keys(self, bucket: str, prefix: str) -> list[str]:
        """Every key of `bucket` that starts with `prefix`, sorted as S3 lists them (by UTF-8 bytes)."""
        root = self.bucket(bucket)
        start = root / prefix.rsplit("/", 1)[0] if "/" in prefix else root
        found = [str(Path(d, name).relative_to(root)) for d, _, files in os.walk(start) for name in files]
        return sorted((k for k in found if k.startswith(prefix)), key=lambda k: k.encode())

    def create_upload(self, bucket: str, key: str, headers: dict) -> str:
        self.path(bucket, key)  # a key it cannot keep is refused now, not at the end
        upload = uuid.uuid4().hex
        (self.uploads / upload).mkdir()
        with self.lock:
            self.pending[upload] = (bucket, key, headers)
        return upload

    def _upload(self, upload: str, bucket: str, key: str) -> tuple[Path, dict]:
        with self.lock:
            pending = self.pending.get(upload)
        if pending is None or pending[:2] != (bucket, key):
            raise S3Error(404, "NoSuchUpload", "The specified multipart upload does not exist", upload_id=upload)
        return self.uploads / upload, pending[2]

    def put_part(self, bucket: str, key: str, upload: str, number: int, chunks) -> str:
        folder, _ = self._upload(upload, bucket, key)
        if not 1 <= number <= 10000:
            raise S3Error(400, "InvalidArgument", f"partNumber {number} is not in 1..10000")
        digest = hashlib.md5()
        tmp = folder / f"{number}.{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            for chunk in chunks:
                digest.update(chunk)
                f.write(chunk)
        os.replace(tmp, folder / str(number))
        (folder / f"{number}.etag").write_text(digest.hexdigest())
        return f'"{digest.hexdigest()}"'

    def complete(self, bucket: str, key: str, upload: str, parts: list[tuple[int, str]]) -> str:
        """The parts named, in their order, as the object; its ETag (MD5 of the parts' MD5s, -N)."""
        folder, headers = self._upload(upload, bucket, key)
        if not parts or [n for n, _ in parts] != sorted({n for n, _ in parts}):
            raise S3Error(400, "InvalidPartOrder", "The list of parts was not in ascending order")
        digests = []
        for number, etag in parts:
            held = folder / f"{number}.etag"
            if not held.is_file() or etag.strip('"') != held.read_text():
                raise S3Error(400, "InvalidPart", f"part {number} was not uploaded or its ETag is not {etag}")
            digests.append(bytes.fromhex(held.read_text()))
        tmp = self.tmp / uuid.uuid4().hex
        try:
            with open(tmp, "wb") as out:
                for number, _ in parts:
                    with open(folder / str(number), "rb") as part:
                        shutil.copyfileobj(part, out, COPY_BYTES)
            etag = f'"{hashlib.md5(b"".join(digests)).hexdigest()}-{len(parts)}"'
            self._publish(tmp, self.path(bucket, key), bucket, key, etag, headers)
        finally:
            tmp.unlink(missing_ok=True)
        self.abort(bucket, key, upload)
        return etag

    def abort(self, bucket: str, key: str, upload: str) -> None:
        folder, _ = self._upload(upload, bucket, key)
        with self.lock:
            self.pending.pop(upload, None)
        shutil.rmtree(folder, ignore_errors=True)
