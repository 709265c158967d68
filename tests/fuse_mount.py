"""A real FUSE mount for tests, with no libfuse: /dev/fuse opened, mounted with mount(2) (as
root), and its requests answered by a thread speaking the kernel's FUSE protocol. The file
system is an empty root directory: the kernel asks for its attributes (GETATTR), names in it
are not found (LOOKUP), anything else is not implemented (ENOSYS, which the kernel then stops
asking for, as it does for ACCESS). Enough for a mount point that /proc/self/mountinfo lists
under its type, as s3fs's or gcsfuse's mounts are listed, and that stat and access see.

    with fuse_mount(path, "fuse.s3fs"):  # a context manager; unmounted (lazily) at its end
        ...
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import struct
import threading

_IN = struct.Struct("<IIQQIIII")  # fuse_in_header: len, opcode, unique, nodeid, uid, gid, pid, padding
_OUT = struct.Struct("<IiQ")  # fuse_out_header: len, error, unique
LOOKUP, GETATTR, INIT, DESTROY = 1, 3, 26, 38
MS_NOSUID, MS_NODEV, MNT_DETACH = 2, 4, 2


def available() -> str | None:
    """Why a FUSE mount cannot be made here (None: it can): root, /dev/fuse, and a mount(2) that
    the sandbox allows (tried once, in a temporary dir)."""
    if os.geteuid() != 0:
        return "mounting needs root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    import tempfile

    with tempfile.TemporaryDirectory() as where:
        try:
            with fuse_mount(where):
                os.stat(where)
        except OSError as exc:
            return f"mount(2) refused: {exc}"
    return None


def _attr(uid: int, gid: int) -> bytes:
    """fuse_attr_out for the root: a directory, valid for a second."""
    attr = struct.pack("<QQQQQQIIIIIIIIII", 1, 0, 0, 0, 0, 0, 0, 0, 0, 0o40755, 2, uid, gid, 0, 4096, 0)
    return struct.pack("<QII", 1, 0, 0) + attr


def _serve(fd: int) -> None:
    while True:
        try:
            request = os.read(fd, 1 << 17)
        except OSError:  # ENODEV: unmounted
            return
        if len(request) < _IN.size:
            return
        _, opcode, unique, _, uid, gid, _, _ = _IN.unpack_from(request)
        error, body = 0, b""
        if opcode == INIT:
            major, minor = struct.unpack_from("<II", request, _IN.size)
            # fuse_init_out of protocol 7.x: major, minor, max_readahead, flags, max_background,
            # congestion_threshold, max_write, time_gran, max_pages, map_alignment, flags2, 7 unused
            body = struct.pack("<IIIIHHIIHHI7I", 7, min(minor, 31), 65536, 0, 16, 12, 65536, 1, 16, 0, 0,
                               *([0] * 7))
        elif opcode == GETATTR:
            body = _attr(uid, gid)
        elif opcode == LOOKUP:
            error = -errno.ENOENT
        elif opcode == DESTROY:
            return
        else:
            error = -errno.ENOSYS
        try:
            os.write(fd, _OUT.pack(_OUT.size + len(body), error, unique) + body)
        except OSError:  # the request was interrupted, or the mount is gone
            if opcode == INIT:
                return


@contextlib.contextmanager
def fuse_mount(target, fstype: str = "fuse"):
    """`target` (an empty dir) mounted as a FUSE file system of type `fstype` ("fuse.s3fs")."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open("/dev/fuse", os.O_RDWR)
    options = f"fd={fd},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()},allow_other".encode()
    if libc.mount(b"mmpack-test", os.fsencode(target), fstype.encode(), MS_NOSUID | MS_NODEV, options) != 0:
        os.close(fd)
        raise OSError(ctypes.get_errno(), f"mount {fstype} at {target}")
    threading.Thread(target=_serve, args=(fd,), daemon=True).start()
    try:
        yield target
    finally:
        libc.umount2(os.fsencode(target), MNT_DETACH)
        os.close(fd)
