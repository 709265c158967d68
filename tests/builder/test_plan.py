"""Shard plans: fixed-size image shards planned as decoding one image at a time would cut them."""

from __future__ import annotations


from hypothesis import given
from hypothesis import strategies as st






@given(n=st.integers(0, 3000), size=st.integers(1, 64), rows=st.none() | st.integers(1, 500),
       nbytes=st.none() | st.integers(1, 2_000_000))
def test_fixed_size_images_are_planned_as_one_image_at_a_time_would_be(n, size, rows, nbytes):
    """Images of one output size are planned a run of records at a time: the same shards as
    the record-by-record cut that sizes vary with ('keep')."""
    from packer.builder import plan as planning
    from packer.builder.scan import Record, Scan

    if rows is None and nbytes is None:
        rows = 100
    found = Scan("images", tuple(Record(f"c/{i}.jpg", f"/nowhere/c/{i}.jpg", label=0) for i in range(n)), ())
    fast = planning.plan(found, image_size=size, token_itemsize=2, shard_rows=rows, shard_bytes=nbytes)
    cutter = planning._Cutter(rows, nbytes, 0)
    for i in range(n):
        cutter.add(planning.Span(i), 1, planning._image_bytes(None, size))
    cutter.cut()
    assert fast.tasks == tuple(cutter.tasks)
