"""The ring of batch buffers behind `Loader`: reused only when nothing refers to them.

A batch's tensors are views of a ring buffer. Whether the caller still holds one (the batch, a
tensor of it, a slice, a numpy view) shows in the buffer storage's reference count, so a buffer
is refilled only once that count is back to what it was when the buffer was made. While every
buffer is held, the producer waits (polling, without blocking the caller) until the caller asks
for the batch it is about to make; then it allocates one more buffer rather than make the
caller wait or overwrite what it holds. The usual loop, which lets go of a batch when it takes
the next, keeps reusing the same `keep` buffers: no allocation.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from loaders.internals import storage_address, storage_use_count

POLL_S = (5e-5, 2e-3)  # first and longest wait between two looks while every buffer is held


class Ring:
    """Buffers (dicts of tensors) from `make()`, at least `keep` of them."""

    def __init__(self, make: Callable[[], dict[str, torch.Tensor]], keep: int):
        self._make, self._keep = make, keep
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._buffers: list[tuple[dict, list[tuple[int, int]]]] = []  # (buffers, [(storage, its count)])
        self._filling: set[int] = set()  # ids of buffers taken and not yet given back by `filled`
        for _ in range(keep):
            self._grow()
        self.batch_bytes = sum(t.numel() * t.element_size() for t in self._buffers[0][0].values())
        """Bytes of one buffer: what a batch fills at most (a wider ragged batch gets a fresh one)."""

    def __len__(self) -> int:
        return len(self._buffers)

    def __iter__(self):
        """The buffers (dicts of tensors) the ring holds now."""
        with self._lock:
            return iter([buffers for buffers, _ in self._buffers])

    def _grow(self) -> dict:
        buffers = self._make()
        storages = [storage_address(t) for t in buffers.values()]
        self._buffers.append((buffers, [(s, storage_use_count(s)) for s in storages]))
        return buffers

    def _unused(self, entry) -> bool:
        return id(entry[0]) not in self._filling and all(storage_use_count(s) == count for s, count in entry[1])

    def _take_unused(self) -> dict | None:
        if len(self._buffers) <= self._keep:  # the usual case: the first unused one
            entry = next((entry for entry in self._buffers if self._unused(entry)), None)
            return self._fill(entry[0]) if entry is not None else None
        unused = [entry for entry in self._buffers if self._unused(entry)]
        if not unused:
            return None
        spares = {id(entry) for entry in unused[1:len(self._buffers) - self._keep + 1]}  # beyond `keep`: go
        self._buffers = [entry for entry in self._buffers if id(entry) not in spares]
        return self._fill(unused[0][0])

    def _fill(self, buffers: dict) -> dict:
        self._filling.add(id(buffers))
        return buffers

    def filled(self, buffers: dict) -> None:
        """The batch made in `buffers` is out: from now on its own views keep the buffer taken."""
        with self._lock:
            self._filling.discard(id(buffers))

    def take(self, needed: Callable[[], bool], stop: threading.Event) -> dict | None:
        """A buffer nothing refers to; a new one when none is free and `needed()` says the
        caller waits for it; None once `stop` is set."""
        wait = POLL_S[0]
        with self._lock:
            while not stop.is_set():
                buffers = self._take_unused()
                if buffers is not None:
                    return buffers
                if needed():
                    return self._fill(self._grow())
                self._wake.wait(wait)
                wait = min(2 * wait, POLL_S[1])
        return None

    def wake(self) -> None:
        """Look again now (the caller started to wait, or stops)."""
        with self._lock:
            self._wake.notify_all()
