"""The CPU and disk reads of the script's process and of the processes it starts (DataLoader
workers), sampled from /proc while the loop runs."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from .report import ProcessFigures


class Processes:
    """CPU seconds and bytes read from disk of this process and of every process it started
    (DataLoader workers), sampled from /proc while the loop runs: a worker's last sample stands
    for it once it is gone. Nothing where /proc is not there."""

    def __init__(self, every_s: float = 0.2):
        self.every_s, self.seen = every_s, {}  # pid -> (cpu_s, read_bytes)
        self.at_once = 0  # the most worker processes alive in one sample: a DataLoader's per epoch
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="mmpack-doctor")
        self.base = self._sample_one(os.getpid())
        # processes already there (a notebook's, a test's servers; a DataLoader's persistent
        # workers of an earlier epoch): only what they do while watched counts
        self.before = {pid: got for pid in _descendants(os.getpid()) if (got := self._sample_one(pid)) is not None}
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            self.sample()

    def sample(self) -> None:
        children = _descendants(os.getpid())
        for pid in [os.getpid(), *children]:
            got = self._sample_one(pid)
            if got is not None:
                self.seen[pid] = got
        self.at_once = max(self.at_once, sum(self._working(pid) for pid in children))

    def _working(self, pid: int) -> bool:
        """Started while watched, or busy since: an idle process that was already there is no worker."""
        return pid not in self.before or self.seen.get(pid, (0.0, 0))[0] > self.before[pid][0]

    def _sample_one(self, pid: int):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu = (int(stat[11]) + int(stat[12])) / self.tick
            io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
            return cpu, int(io.get("read_bytes", 0))
        except (OSError, ValueError, IndexError):
            return None

    def report(self, wall_s: float) -> ProcessFigures:
        self.stop.set()
        self.sample()
        me = os.getpid()
        base_cpu, base_read = self.base or (0.0, 0)
        zero = (0.0, 0)
        workers = {pid: (v[0] - self.before.get(pid, zero)[0], v[1] - self.before.get(pid, zero)[1])
                   for pid, v in self.seen.items() if pid != me and self._working(pid)}
        cpu = sum(v[0] for v in workers.values())
        own = self.seen.get(me, (base_cpu, base_read))
        # busy over the workers alive together, not every pid seen: a DataLoader without
        # persistent_workers starts a new set each epoch
        at_once = min(len(workers), max(self.at_once, 1))
        return ProcessFigures(worker_processes=len(workers), workers_at_once=at_once, cpu_s_workers=cpu,
                              started=sum(pid not in self.before for pid in workers),
                              worker_cpu_busy=cpu / (wall_s * at_once) if workers and wall_s > 0 else None,
                              cpu_s_main_total=own[0] - base_cpu,
                              read_bytes=own[1] - base_read + sum(v[1] for v in workers.values()))


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                children = []
            out += children
            todo += children
    return out
