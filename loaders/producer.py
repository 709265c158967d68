"""The producer of a Loader's pass: a thread that makes batches ahead of the caller, at most a
fixed number ahead, handing them over in order, with its errors re-raised in the caller and a stop
that works at any point (the pass left early, `Loader.close()`, the interpreter's exit)."""

from __future__ import annotations

import atexit
import itertools
import queue
import threading

from packer.errors import ConfigError

# The producers of iterations still open: stopped when the interpreter exits. Python lets daemon
# threads run on into its finalization and ends them when they next take the GIL, with a forced
# unwind that aborts the process ("terminate called without an active exception", exit 134) if
# it passes C++ code that released the GIL (numpy's unique and sorts do): a script that exits
# with a batch still being made ahead (a peek with next(iter(loader)), a break out of the loop
# with the iterator kept) crashed at exit about one time in three.
_PRODUCERS: set = set()
_STOPPED = object()  # what a producer stopped before the pass's end (close(), exit) hands over last


def stop_all(producers) -> None:
    for stop, wake, _ in list(producers):
        stop.set()
        wake()
    for _, _, thread in list(producers):
        thread.join(timeout=10)


atexit.register(stop_all, _PRODUCERS)


def made_ahead(make, more, ahead: int, wake, running: set):
    """The batches of a pass, b = 0, 1, ... while `more(b)`, each made by `make(b, needed, stop)`:
    the first in the caller's thread (it waits for it), the others on a producer thread, at most
    `ahead` before the caller asks for them (`needed()`: the caller waits for this one now;
    `stop`: set once the pass is over). `wake()` unblocks a producer waiting for a buffer;
    `running` holds the producer while it runs (as does the module's set of every open one,
    stopped at exit)."""
    ready: queue.SimpleQueue = queue.SimpleQueue()
    credit = threading.Semaphore(ahead)  # batches the producer may make before they are asked for
    stop = threading.Event()
    waiting_for = [-1]  # the batch the consumer is blocked on, if any
    first = make(0, lambda: True, stop)

    def produce():
        try:
            b = 1
            while more(b):
                while not credit.acquire(timeout=0.1):
                    if stop.is_set():
                        ready.put(_STOPPED)
                        return
                batch = make(b, lambda: waiting_for[0] == b, stop)  # noqa: B023 - called within make, this b
                if batch is None:
                    ready.put(_STOPPED)
                    return
                ready.put(batch)
                del batch
                b += 1
            ready.put(None)
        except BaseException as exc:  # re-raised in the consumer
            ready.put(exc)

    producer = threading.Thread(target=produce, daemon=True, name="mmpack-loader")
    producer.start()
    handle = (stop, wake, producer)
    _PRODUCERS.add(handle)
    running.add(handle)
    try:
        yield first
        del first
        credit.release()  # the caller asks for the next batch: one more may be made
        for b in itertools.count(1):  # the batches, then the end (or an error)
            try:
                item = ready.get_nowait()
            except queue.Empty:
                waiting_for[0] = b
                wake()
                item = ready.get()
                waiting_for[0] = -1
            if item is None:
                break
            if item is _STOPPED:
                raise ConfigError("this Loader was closed while the pass was open; iterate it again for a new pass")
            if isinstance(item, BaseException):
                raise item
            yield item
            del item
            credit.release()
    finally:
        stop.set()
        wake()
        producer.join()
        _PRODUCERS.discard(handle)
        running.discard(handle)
