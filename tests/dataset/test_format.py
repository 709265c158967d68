"""Unit and property tests of the format: headers, dtype choice, manifest JSON, and
read(write(x)) == x through ShardWriter and the reader."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packer.dataset import format as fmt
from packer.errors import IntegrityError, ManifestError
from packer.dataset.reader import map_column
from packer.dataset.writer import ShardWriter

from ..strategies import documents, image_shapes, token_dtypes


@pytest.mark.parametrize("vocab,dtype", [(1, "<u2"), (30522, "<u2"), (65536, "<u2"), (65537, "<u4"), (200_000, "<u4")])
def test_choose_token_dtype(vocab, dtype):
    assert fmt.choose_token_dtype(vocab) == dtype


@given(shape=st.lists(st.integers(0, 10**12), min_size=1, max_size=4), dtype=st.sampled_from(["|u1", "<u2", "<u4", "<i8"]))
def test_npy_header_round_trip_and_numpy_agrees(shape, dtype, tmp_path_factory):
    header = fmt.npy_header(dtype, tuple(shape))
    assert len(header) == fmt.NPY_HEADER_BYTES
    assert fmt.parse_npy_header(header) == (np.dtype(dtype).str, tuple(shape))


def test_numpy_loads_our_files(tmp_path):
    col = fmt.Column("x", "<u4", (None,))
    with ShardWriter(tmp_path, 0, (col,)) as w:
        w.add({"x": np.arange(5, dtype="<u4")})
        w.add({"x": np.arange(3, dtype="<u4")})
        w.close()
    values = np.load(tmp_path / "shard-00000" / "x.npy", mmap_mode="r")
    offsets = np.load(tmp_path / "shard-00000" / "x.offsets.npy")
    assert values.tolist() == [0, 1, 2, 3, 4, 0, 1, 2] and offsets.tolist() == [0, 5, 8]


@settings(max_examples=40, deadline=None)
@given(docs=documents, dtype=token_dtypes, shapes=st.lists(image_shapes, min_size=1, max_size=30))
def test_read_of_write_is_identity(tmp_path_factory, docs, dtype, shapes):
    root = tmp_path_factory.mktemp("rw")
    n = min(len(docs), len(shapes))
    cols = (fmt.Column("tokens", dtype, (None,)), fmt.Column("image", "|u1", (None, None, 3)),
            fmt.Column("label", "<i8", ()))
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, s, dtype=np.uint8) for s in shapes[:n]]
    with ShardWriter(root, 3, cols) as w:
        for i in range(n):
            w.add({"tokens": np.asarray(docs[i], dtype=dtype), "image": images[i], "label": np.int64(i - 5)})
        shard = w.close()
    assert shard.num_samples == n and all(f.path.startswith("shard-00003/") for f in shard.files)
    shard_dir = root / "shard-00003"
    tokens = map_column(shard_dir, cols[0], n)
    pixels = map_column(shard_dir, cols[1], n)
    labels = map_column(shard_dir, cols[2], n)
    for i in range(n):
        assert tokens.sample(i).tolist() == docs[i]
        np.testing.assert_array_equal(pixels.sample(i), images[i])
        assert int(labels.sample(i)) == i - 5
    assert np.all(np.diff(tokens.offsets) >= 0) and tokens.offsets[-1] == len(tokens.values)


def test_a_deprecated_dtype_spelling_is_an_unreadable_header_not_a_warning():
    """One flipped bit turns "<i8" into "<a8", which numpy still reads (as bytes), with a
    DeprecationWarning; no header we write spells it so."""
    raw = fmt.npy_header("<i8", (4,))
    damaged = raw.replace(b"'<i8'", b"'<a8'")
    assert damaged != raw and bytes(a ^ b for a, b in zip(raw, damaged)).count(0) == len(raw) - 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="unreadable NPY header"):
            fmt.parse_npy_header(damaged)


@settings(max_examples=40, deadline=None)
@given(docs=documents, dtype=token_dtypes, cuts=st.lists(st.integers(0, 30), max_size=5))
def test_extend_writes_the_bytes_of_add(tmp_path_factory, docs, dtype, cuts):
    """Samples added in runs of any length (empty ones too) make the same files as one add()
    per sample."""
    root = tmp_path_factory.mktemp("ext")
    cols = (fmt.Column("tokens", dtype, (None,)), fmt.Column("image", "|u1", (None, 2, 3)),
            fmt.Column("label", "<i8", ()))
    samples = [{"tokens": np.asarray(d, dtype=dtype), "image": np.full((len(d) % 3, 2, 3), i, np.uint8),
                "label": np.int64(i - 5)} for i, d in enumerate(docs)]
    with ShardWriter(root, 0, cols) as w:
        for sample in samples:
            w.add(sample)
        one = w.close()
    with ShardWriter(root, 1, cols) as w:
        bounds = [0, *sorted(min(c, len(samples)) for c in cuts), len(samples)]
        for a, b in zip(bounds, bounds[1:]):
            w.extend(samples[a:b])
        runs = w.close()
    assert runs.num_samples == one.num_samples == len(samples)
    assert [(f.size_bytes, f.checksum) for f in runs.files] == [(f.size_bytes, f.checksum) for f in one.files]
    with pytest.raises(KeyError, match="label"), ShardWriter(root, 2, cols) as w:
        w.extend([{"tokens": np.zeros(1, dtype), "image": np.zeros((0, 2, 3), np.uint8)}])


@settings(max_examples=80, deadline=None)
@given(dtype=st.sampled_from(["|u1", "<u2", "<i8"]), rows=st.integers(0, 40),
       row_shape=st.sampled_from([(), (3,), (100, 3), (112, 112, 3), (40000,)]), cuts=st.lists(st.integers(0, 10**7)))
def test_a_column_files_checksum_is_its_header_and_row_blocks_hashed(tmp_path_factory, dtype, rows, row_shape, cuts):
    """xxh3_128_rows, written out from FORMAT.md: XXH3-128 over the digests of the header, then
    of blocks of rows_per_block whole rows. Fed in pieces of any size, or read from the file, it
    is the same."""
    import xxhash

    from packer.dataset.writer import checksum_file

    array = np.arange(rows * int(np.prod(row_shape)), dtype=dtype).reshape(rows, *row_shape)
    header = fmt.npy_header(dtype, array.shape)
    data = header + array.tobytes()
    row = array.itemsize * int(np.prod(row_shape))
    per = max(1, 65536 // row)
    blocks = [header] + [array[i:i + per].tobytes() for i in range(0, rows, per)]
    expected = xxhash.xxh3_128(b"".join(xxhash.xxh3_128_digest(b) for b in blocks)).hexdigest()
    fed = fmt.FileChecksum()
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    for a, b in zip(bounds, bounds[1:]):
        fed.update(data[a:b])
    path = tmp_path_factory.mktemp("sum") / "x.npy"
    path.write_bytes(data)
    assert fed.hexdigest() == checksum_file(path) == expected
    for damaged in (data[:50], data[:1] + b"x" + data[2:], b""):  # short, a broken header, empty
        path.write_bytes(damaged)
        assert checksum_file(path) != expected and len(checksum_file(path)) == 32


@settings(max_examples=60, deadline=None)
@given(position=st.integers(0, fmt.NPY_HEADER_BYTES - 1), bit=st.integers(0, 7))
def test_any_flipped_header_byte_is_our_error_or_harmless(tmp_path_factory, position, bit):
    root = tmp_path_factory.mktemp("flip")
    col = fmt.Column("tokens", "<u2", (None,))
    with ShardWriter(root, 0, (col,)) as w:
        for doc in ([1, 2, 3], [4], [5, 6]):
            w.add({"tokens": np.asarray(doc, dtype="<u2")})
        w.close()
    path = root / "shard-00000" / "tokens.offsets.npy"
    raw = bytearray(path.read_bytes())
    raw[position] ^= 1 << bit
    path.write_bytes(bytes(raw))
    try:
        arrays = map_column(root / "shard-00000", col, 3)
    except IntegrityError:
        return
    # a flip inside the padding or to an equivalent spelling changes nothing
    assert [arrays.sample(i).tolist() for i in range(3)] == [[1, 2, 3], [4], [5, 6]]


def test_manifest_json_round_trip_and_validation():
    hexes = ["ab" * 16, "cd" * 16]
    m = fmt.Manifest(
        kind="images",
        columns=(fmt.Column("image", "|u1", (4, 4, 3)), fmt.Column("label", "<i8", ())),
        shards=(fmt.Shard(0, 2, (fmt.FileEntry("g-0123456789abcdef/shard-00000/image.npy", 224, hexes[0]),
                                 fmt.FileEntry("g-0123456789abcdef/shard-00000/label.npy", 144, hexes[1]))),),
        counts={"found": 3, "packed": 2, "skipped": 1},
        skipped=(fmt.Skip("a/b.jpg", "decode", "truncated"),),
        classes=("a",),
        generation="g-0123456789abcdef",
    )
    again = fmt.Manifest.from_json(m.to_json())
    assert again == m
    doc = json.loads(m.to_json())
    doc["counts"]["found"] = 4
    with pytest.raises(ManifestError, match="do not add up"):
        fmt.Manifest.from_json(json.dumps(doc), where="x/manifest.json")
    with pytest.raises(ManifestError, match="not an mmpack manifest"):
        fmt.Manifest.from_json("[]")
    doc["counts"]["found"] = 3
    del doc["shards"]
    with pytest.raises(ManifestError, match="x/manifest.json: malformed"):
        fmt.Manifest.from_json(json.dumps(doc), where="x/manifest.json")


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8)


def _locations(doc, path=()):
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield (*path, k)
            yield from _locations(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield (*path, i)
            yield from _locations(v, (*path, i))


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_any_change_to_a_manifest_parses_or_is_our_manifest_error(data):
    """A manifest of the golden datasets with any field replaced by any JSON value, or removed:
    from_json returns a manifest that passes its own checks, or raises ManifestError, nothing else."""
    from pathlib import Path

    golden = Path(__file__).parents[1] / "data" / "golden"
    version = data.draw(st.sampled_from(["1.0", "3.0", "4.0"]))
    kind = data.draw(st.sampled_from(["images", "text"]))
    doc = json.loads((golden / f"v{version}-{kind}" / fmt.MANIFEST_NAME).read_text())
    for _ in range(data.draw(st.integers(1, 3))):
        locations = list(_locations(doc))
        path = data.draw(st.sampled_from(locations))
        parent = doc
        for step in path[:-1]:
            parent = parent[step]
        if data.draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(_json_values)
    try:
        m = fmt.Manifest.from_json(json.dumps(doc))
    except ManifestError:
        return
    assert m.counts["found"] == m.counts["packed"] + m.counts["skipped"] == m.num_samples + len(m.skipped)
    for shard in m.shards:
        assert all(".." not in f.path.split("/") and not f.path.startswith("/") for f in shard.files)


@settings(max_examples=200, deadline=None)
@given(shapes=st.lists(st.lists(st.one_of(st.integers(0, 4), st.integers(0, (1 << 31) - 1)), min_size=1, max_size=4)
                       .map(tuple), min_size=1, max_size=20).filter(lambda s: len({len(x) for x in s}) == 1),
       limit=st.integers(0, 1 << 62))
def test_exact_sizes_are_the_products_of_python_ints(shapes, limit):
    """Sample sizes from shapes in exact arithmetic: np.prod wraps past 2**63, so dimensions
    whose product wraps onto a sample's real size (0, say) passed the shape check."""
    from packer.dataset.reader import exact_sizes

    got = exact_sizes(np.array(shapes, np.int64), limit).tolist()
    want = [math.prod(s) if math.prod(s) <= limit else -1 for s in shapes]
    assert got == want


def test_a_shape_whose_product_wraps_is_refused(tmp_path):
    """(2**30, 2**30, 16) wraps to 0 in int64: an empty sample of that shape opened and verified."""
    from packer.errors import IntegrityError
    from packer.dataset.reader import check_shapes

    col = fmt.Column("x", "|u1", (None, None, None))
    shapes = np.array([[1 << 30, 1 << 30, 16], [2, 2, 1]], np.int64)
    assert int(np.prod(shapes[0])) == 0  # what the check used to compute
    with pytest.raises(IntegrityError, match="row 0 holds 0 values"):
        check_shapes(tmp_path / "x.shapes.npy", shapes, np.array([0, 0, 4]), col)
    check_shapes(tmp_path / "x.shapes.npy", np.array([[1 << 30, 0, 16], [2, 2, 1]]), np.array([0, 0, 4]), col)


class _Finalized:
    def __del__(self):
        sum(range(10))  # Python code run by the collector, where another thread may take over


def test_headers_read_by_many_threads_at_once_parse_every_time():
    """unpack, verify and the remote cache read NPY headers from threads. On CPython 3.11 two
    parses at once, with a collection in one of them, raised "SystemError: AST constructor
    recursion depth mismatch" (CPython gh-106905): 7 of 8 threads here, before the headers were
    parsed one at a time."""
    import gc
    import sys
    import threading

    raw = fmt.npy_header("<u2", (92325,))
    errors: list[str] = []

    def parse() -> None:
        try:
            for _ in range(1500):
                cycle = _Finalized()
                cycle.self = cycle  # freed by the collector, running __del__ inside a parse
                assert fmt.parse_npy_header(raw) == ("<u2", (92325,))
        except Exception as exc:  # noqa: BLE001 - every error is the test's finding
            errors.append(repr(exc))

    interval, threshold = sys.getswitchinterval(), gc.get_threshold()
    sys.setswitchinterval(1e-6)
    gc.set_threshold(1)
    try:
        threads = [threading.Thread(target=parse) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
        gc.set_threshold(*threshold)
    assert errors == []
