"""`native.Job` checks every sample's source and destination range against its buffers before the
C copies run (`_copy.c` copies what it is given): a wrong job is a one-line ValueError saying
what is wrong, raised before any C call, never a read or a write outside a buffer. The good jobs
next to them copy the expected bytes (tests/loaders/test_loader.py compares the native copies
with numpy's for any shapes)."""

from __future__ import annotations

import numpy as np
import pytest

from loaders.batch import native

ROW = 12  # bytes of a row below: 3 float32


class _NoCalls:
    def __getattr__(self, name):
        pytest.fail(f"a wrong job reached the C library ({name})")


@pytest.fixture
def no_c_calls(monkeypatch):
    """The C library replaced by one that fails the test when called: a wrong job is refused
    in Python."""
    monkeypatch.setattr(native, "LIB", _NoCalls())


def _rows_sources():
    return [np.arange(15, dtype=np.float32).reshape(5, 3), np.arange(6, dtype=np.float32).reshape(2, 3) + 100]


def rows_job(sources, **change):
    """4 fixed-shape rows from 2 source arrays (5 and 2 rows) into a [4, 3] float32 destination,
    any argument replaced by `change`."""
    args = dict(dst=np.zeros((4, 3), np.float32), regions=native.regions(sources), shard=np.array([0, 0, 1, 1]),
                offsets=np.array([0, 4, 0, 1]) * ROW, positions=np.array([2, 0, 3, 1]), nbytes=ROW)
    args.update(change)
    return native.Job(args.pop("dst"), args.pop("regions"), args.pop("shard"), args.pop("offsets"),
                      args.pop("positions"), **args)


def _canvas_sources():
    """One source of two images of 2-byte pixels, 3 x 5 and 4 x 2 (46 bytes), end to end."""
    first = np.arange(30, dtype=np.uint8).reshape(3, 5, 2) + 1
    second = np.arange(16, dtype=np.uint8).reshape(4, 2, 2) + 101
    return [np.concatenate([first.reshape(-1), second.reshape(-1)])], first, second


def canvas_job(sources, **change):
    """The two images and an empty one into a uint8 canvas [3, 4, 5, 2]."""
    args = dict(dst=np.full((3, 4, 5, 2), 7, np.uint8), regions=native.regions(sources),
                shard=np.zeros(3, np.int64), offsets=np.array([0, 30, 46]), positions=np.array([1, 0, 2]),
                sizes=np.array([[3, 5], [4, 2], [0, 3]]), pixel_bytes=2)
    args.update(change)
    return native.Job(args.pop("dst"), args.pop("regions"), args.pop("shard"), args.pop("offsets"),
                      args.pop("positions"), **args)


def test_good_jobs_copy_rows_and_canvas_slots():
    if native.LIB is None:
        pytest.skip("the native copies were not built (no C compiler at install time)")
    sources = _rows_sources()
    job = rows_job(sources)
    job(0, 4)
    assert np.array_equal(job.dst, np.stack([sources[0][4], sources[1][1], sources[0][0], sources[1][0]]))
    sources, first, second = _canvas_sources()
    job = canvas_job(sources)
    pool = native.Pool(2)
    with pool.running(job, 2):
        pass
    pool.shutdown()
    want = np.zeros((3, 4, 5, 2), np.uint8)
    want[1, :3, :5], want[0, :4, :2] = first, second
    assert np.array_equal(job.dst, want)


BAD_ROWS = [
    ("past its source's end", dict(offsets=np.array([0, 5, 0, 1]) * ROW),
     r"reads bytes \[60, 72\) of source region 0 of 60 bytes"),
    ("past a smaller source's end", dict(offsets=np.array([0, 4, 0, 2]) * ROW), r"sample 3 .* region 1 of 24 bytes"),
    ("before its source", dict(offsets=np.array([-ROW, 0, 0, 0])), r"reads bytes \[-12, 0\)"),
    ("between two rows", dict(offsets=np.array([0, 4 * ROW - 4, 0, ROW])), "not at a multiple of 12"),
    ("from a source that is not there", dict(shard=np.array([0, 0, 2, 1])), "names source region 2, of 2"),
    ("from a shard not mapped", "unmapped", "region 1 of 0 bytes"),
    ("to a slot past the destination", dict(positions=np.array([2, 0, 4, 1])), "slot 4, outside the destination's 4"),
    ("to a negative slot", dict(positions=np.array([2, 0, -1, 1])), "slot -1, outside"),
    ("to a slot another sample writes", dict(positions=np.array([2, 0, 2, 1])), "slot 2 .* written by two samples"),
    ("rows longer than the destination's", dict(nbytes=ROW + 4),
     "rows of 16 bytes into a destination whose rows are 12"),
    ("rows of a negative size", dict(nbytes=-1), "rows of -1 bytes"),
    ("into a strided destination", dict(dst=np.zeros((4, 6), np.float32)[:, ::2]), "C-contiguous"),
    ("into a read-only destination", "read-only", "writeable"),
    ("at positions that are not integers", dict(positions=np.array([2.0, 0, 3, 1])), "positions must be integers"),
    ("with fewer shards than samples", dict(shard=np.array([0, 0, 1])), r"shard must be integers of shape \(4,\)"),
]


@pytest.mark.parametrize("what,change,message", BAD_ROWS, ids=[b[0] for b in BAD_ROWS])
def test_a_wrong_job_of_rows_is_refused_before_the_copy(no_c_calls, what, change, message):
    sources = _rows_sources()
    if change == "unmapped":
        regions = native.regions([sources[0], None])
        change = dict(regions=regions)
    elif change == "read-only":
        dst = np.zeros((4, 3), np.float32)
        dst.flags.writeable = False
        change = dict(dst=dst)
    with pytest.raises(ValueError, match=message) as got:
        rows_job(sources, **change)
    assert str(got.value).startswith("native copy: ") and "\n" not in str(got.value)


BAD_CANVAS = [
    ("taller than the canvas", dict(sizes=np.array([[5, 5], [4, 2], [0, 3]])),
     "sample 0 is 5 x 5 pixels, which a canvas slot of 4 x 5"),
    ("of a negative side", dict(sizes=np.array([[3, 5], [-1, 2], [0, 3]])), "sample 1 is -1 x 2 pixels"),
    ("longer than its source", dict(sizes=np.array([[3, 5], [4, 4], [0, 3]])),
     r"sample 1 .* reads bytes \[30, 62\) of source region 0 of 46"),
    ("past its source's end", dict(offsets=np.array([0, 32, 46])), r"reads bytes \[32, 48\)"),
    ("between two values", "odd", "not at a multiple of 2"),
    ("of pixels not the canvas'", dict(pixel_bytes=3), "pixels of 3 bytes into a canvas of shape"),
    ("into a canvas of one axis", dict(dst=np.zeros((3, 40), np.uint8)), "pixels of 2 bytes into a canvas of shape"),
    ("to a slot another sample writes", dict(positions=np.array([1, 1, 2])), "slot 1 .* written by two samples"),
    ("with fewer sizes than samples", dict(sizes=np.array([[3, 5], [4, 2]])),
     r"sizes must be integers of shape \(3, 2\)"),
]


@pytest.mark.parametrize("what,change,message", BAD_CANVAS, ids=[b[0] for b in BAD_CANVAS])
def test_a_wrong_job_of_canvas_slots_is_refused_before_the_copy(no_c_calls, what, change, message):
    sources = _canvas_sources()[0]
    if change == "odd":  # a 16-bit canvas, its second image one byte into a value
        wide = [sources[0].view(np.uint16)]
        change = dict(dst=np.zeros((3, 4, 5, 1), np.uint16), regions=native.regions(wide),
                      offsets=np.array([0, 31, 44]), sizes=np.array([[3, 5], [1, 2], [0, 3]]))
    with pytest.raises(ValueError, match=message) as got:
        canvas_job(sources, **change)
    assert str(got.value).startswith("native copy: ") and "\n" not in str(got.value)


def test_a_range_of_samples_outside_the_job_is_refused(no_c_calls):
    job = rows_job(_rows_sources())
    for a, b in ((0, 5), (-1, 2), (3, 2)):
        with pytest.raises(ValueError, match=rf"samples \[{a}, {b}\) of a job of 4"):
            job(a, b)
