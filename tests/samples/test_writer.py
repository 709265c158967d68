"""`packer.Writer` from the user's side: any schema of the column types, any number of samples
and shard size, read back bit for bit (NaN payloads, -0.0 and bfloat16 included), through
MMapDataset and Loader; a sample that does not fit is an error naming it before anything of it
is written; a writer that raises publishes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import packer
from loaders import Loader, MMapDataset
from packer.errors import ConfigError

_ARRAYS = {  # spec -> (dtype, tail) of the values a column of that spec holds
    "float16[*, 3]": ("<f2", (3,)), "float32[*]": ("<f4", ()), "float64[2]": ("<f8", None), "int8[*]": ("|i1", ()),
    "uint8[*, 2]": ("|u1", (2,)), "int16[4]": ("<i2", None), "uint16[*]": ("<u2", ()), "int32[*]": ("<i4", ()),
    "uint32[3]": ("<u4", None), "int64[*, 4]": ("<i8", (4,)), "uint64[*]": ("<u8", ()), "bool[*]": ("|b1", ()),
    "bfloat16[*, 2]": ("bfloat16", (2,)),
}


def _value(rng: np.random.Generator, spec: str, n: int):
    dtype, tail = _ARRAYS[spec]
    shape = (n, *tail) if tail is not None else tuple(int(d) for d in spec.split("[")[1].rstrip("]").split(","))
    if dtype == "bfloat16":
        bits = rng.integers(-2**15, 2**15, shape, dtype=np.int16)  # any bits: NaN payloads, -0.0, infinities
        return torch.from_numpy(bits).view(torch.bfloat16)
    if np.dtype(dtype).kind == "f":  # any bits too
        width = np.dtype(dtype).itemsize
        return rng.integers(0, 256, (*shape, width), dtype=np.uint8).view(dtype).reshape(shape)
    if dtype == "|b1":
        return rng.integers(0, 2, shape).astype(bool)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)


def _same(a, b) -> bool:
    if isinstance(a, str):
        return a == b
    a = a.view(torch.int16) if a.dtype == torch.bfloat16 else torch.as_tensor(np.array(a))
    b = b.view(torch.int16) if b.dtype == torch.bfloat16 else b
    if a.dtype.is_floating_point:  # bit for bit: NaN payloads and -0.0
        a, b = a.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]), \
            b.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[b.element_size()])
    return a.shape == b.shape and torch.equal(a, b.to(a.dtype))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(st.sampled_from(sorted(_ARRAYS)), min_size=1, max_size=4, unique=True),
       extra=st.sampled_from([(), ("str",), ("bytes", "int64"), ("image",)]), count=st.integers(1, 12),
       shard=st.sampled_from(["1", "3", "1KB", "256MB"]), seed=st.integers(0, 2**16))
def test_any_schema_reads_back_bit_for_bit(tmp_path_factory, specs, extra, count, shard, seed):
    rng = np.random.default_rng(seed)
    columns = {f"c{i}": spec for i, spec in enumerate(specs)} | {f"x{i}": e for i, e in enumerate(extra)}
    samples = []
    for k in range(count):
        sample = {f"c{i}": _value(rng, spec, int(rng.integers(0, 5))) for i, spec in enumerate(specs)}
        for i, e in enumerate(extra):
            sample[f"x{i}"] = {"str": "é\u4e2d" * int(rng.integers(0, 3)), "bytes": rng.bytes(int(rng.integers(0, 6))),
                               "int64": int(rng.integers(-2**62, 2**62)),
                               "image": packer.Image(rng.integers(0, 256, (int(rng.integers(1, 9)), 5, 3),
                                                                  dtype=np.uint8))}[e]
        samples.append(sample | {"key": f"s{k}"})
    out = tmp_path_factory.mktemp("w") / "out"
    with packer.Writer(out, columns, shard_size=shard) as w:
        for sample in samples:
            w.write(sample)
    ds = MMapDataset(out)
    assert len(ds) == count and ds.manifest.kind == "columns"
    for k, sample in enumerate(samples):
        got = ds[k]
        for name, value in sample.items():
            want = value.pixels if isinstance(value, packer.Image) else value
            if isinstance(want, bytes):
                want = np.frombuffer(want, np.uint8)
            assert _same(want if isinstance(want, (str, torch.Tensor)) else np.asarray(want), got[name]), name
    batch = next(iter(Loader(ds, count, order="sequential")))
    assert batch["key"] == [s["key"] for s in samples]
    for i, spec in enumerate(specs):
        name = f"c{i}"
        for k, sample in enumerate(samples):
            want = sample[name]
            n = len(want) if "*" in spec else None
            got = batch[name][k][:n] if n is not None else batch[name][k]
            assert _same(want if isinstance(want, torch.Tensor) else np.asarray(want), got), (name, k)
    assert packer.verify(out)["num_samples"] == count


def test_a_sample_that_does_not_fit_is_an_error_naming_it_and_nothing_is_published(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"sample 2 \('b'\): column feat takes shape \['\*', 4\], not \[3, 5\]"):
        with packer.Writer(out) as w:
            w.write({"feat": np.zeros((2, 4), np.float32), "key": "a"})
            w.write({"feat": np.zeros((1, 4), np.float32)})
            w.write({"feat": np.zeros((3, 5), np.float32), "key": "b"})
    assert not (out / "manifest.json").exists()
    for bad, words in (({"feat": np.zeros((2, 4), np.int64)}, "is float32, not int64"),
                       ({"feat": np.zeros((2, 4), np.float32), "more": 1}, "has more too"),
                       ({"other": 1}, "lacks feat"), ({"feat": np.zeros(4, np.float32)}, r"not \[4\]"),
                       ({"feat": [[1.0] * 4], "key": 7}, "its key is int")):
        with pytest.raises(ConfigError, match=words), packer.Writer(tmp_path / "o2", {"feat": "float32[*, 4]"}) as w:
            w.write(bad)
    with pytest.raises(ConfigError, match="does not fit"), packer.Writer(tmp_path / "o3", {"n": "int8"}) as w:
        w.write({"n": 300})
    with pytest.raises(ConfigError, match="not a column spec"):
        packer.Writer(tmp_path / "o4", {"feat": "float17[*]"})
    assert not any((tmp_path / o / "manifest.json").exists() for o in ("o2", "o3"))


def test_a_writer_killed_leaves_nothing_that_opens_and_the_next_one_writes_there(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "out"
    code = ("import numpy as np, os, signal, packer\n"
            f"w = packer.Writer({str(out)!r}, shard_size=2)\n"
            "for i in range(7): w.write({'x': np.arange(i)})\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    assert subprocess.run([sys.executable, "-c", code]).returncode == -9
    with pytest.raises(Exception, match="no such dataset|manifest"):
        MMapDataset(out)
    with packer.Writer(out) as w:
        w.write({"x": np.arange(3)})
    assert len(MMapDataset(out)) == 1 and packer.verify(out)["files"] == 4
