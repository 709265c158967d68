"""A JSON array's elements streamed (`packer.builder.forms.jsonarray`): the bytes of each are
the array's, for any value, any chunk size and any start and stop at an element; an element
past the limit is scanned past and not held; a broken array is our one error."""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from packer.builder.forms import jsonarray
from packer.errors import SourceError

_TEXT = st.text(st.sampled_from('ab"\\\n\u00e9\u4e2d}]{[, \t'), max_size=8)
_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False) | _TEXT,
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
                       max_leaves=12)


@given(array=st.lists(_VALUES, max_size=6), chunk=st.integers(1, 64), indent=st.sampled_from([None, 0, 2]),
       ascii_only=st.booleans(), bom=st.booleans(), limit=st.integers(1, 200))
def test_elements_are_the_arrays_bytes_at_any_chunk_start_and_limit(array, chunk, indent, ascii_only, bom, limit):
    raw = (b"\xef\xbb\xbf" if bom else b"") + json.dumps(array, indent=indent, ensure_ascii=ascii_only).encode()
    old, jsonarray.CHUNK = jsonarray.CHUNK, chunk
    try:
        whole = list(jsonarray.elements(io.BytesIO(raw), limit=1 << 20))
        assert [json.loads(b) for _, _, b in whole] == array
        assert all(raw[at:at + n] == b for at, n, b in whole)
        capped = list(jsonarray.elements(io.BytesIO(raw), limit=limit))
        assert [(at, n, b if n <= limit else None) for at, n, b in whole] == capped
        if len(whole) >= 2:  # a shard's span: from one element up to another
            part = list(jsonarray.elements(io.BytesIO(raw), whole[1][0], whole[-1][0], limit=1 << 20))
            assert part == whole[1:-1]
    finally:
        jsonarray.CHUNK = old


@pytest.mark.parametrize("raw, words", [(b'{"a": 1}', "not a JSON array"), (b"[1, 2", "ends inside"),
                                        (b"[1 2]", "where ',' or ']' belongs"), (b'[{"a": "x}]', "ends inside"),
                                        (b"", "the end of the file"), (b'["\\', "ends inside")])
def test_a_broken_array_is_one_error_naming_where(raw, words):
    with pytest.raises(SourceError, match=words):
        list(jsonarray.elements(io.BytesIO(raw), limit=100))
