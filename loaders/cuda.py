"""Host -> device: copies issued on a side CUDA stream from pinned buffers, with events, so the
batch is handed over already on the device and a host buffer is released only once its copy
has finished. Without CUDA (or with a CPU device) it yields the same batches unchanged.
"""

from __future__ import annotations

from collections import deque

import torch


def _map(fn, batch):
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: _map(fn, v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        return type(batch)(_map(fn, v) for v in batch)
    return batch


def to_device(batches, device, prefetch: int = 2):
    """Yield `batches` on `device`, `prefetch` copies ahead of the consumer.

    A host batch is let go once its copy's event has completed: Loader refills a host buffer
    once nothing refers to it. That event is synchronized after the next copy is issued, a step
    later, not right after its own: the consumer would otherwise wait for every copy's DMA in
    `next()` (a 200 MB keep-aspect batch takes milliseconds over PCIe) while the GPU, its last
    step done, has nothing queued. So one host batch more is held: the ring allocates it.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        yield from batches
        return
    stream = torch.cuda.Stream(device=device)
    pending: deque = deque()
    copying: list = []  # [event, host batch] of the last copy issued
    source = iter(batches)
    try:
        while True:
            host = next(source, _END)
            if host is _END:
                break
            with torch.cuda.stream(stream):
                on_device = _map(lambda t: t.to(device, non_blocking=True), host)
                done = torch.cuda.Event()
                done.record(stream)
            if copying:
                copying[0].synchronize()  # issued a step ago: its host buffer may be refilled now
            copying[:] = [done, host]
            del host
            pending.append((on_device, done))
            del on_device
            if len(pending) > prefetch:
                yield _counted(*pending.popleft())
        while pending:
            yield _counted(*pending.popleft())
    finally:
        if copying:  # also when the consumer stops early: no buffer let go under a running copy
            copying[0].synchronize()
        copying.clear()
        close = getattr(source, "close", None)
        if close is not None:
            close()


_END = object()


def _counted(batch, done):
    current = torch.cuda.current_stream()
    current.wait_event(done)
    _map(lambda t: t.record_stream(current), batch)
    return batch
