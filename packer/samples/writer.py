"""`packer.Writer`: samples a user computes (features, latents, boxes, the fields they keep)
written as a dataset, a sample at a time, and published whole at `close()` as a build is: a
writer that dies or raises leaves no dataset that opens, and never half of one behind a
complete-looking manifest. The result is the format's `columns` kind (FORMAT.md 4), so
`verify`, `push`, `merge`, `info`, `Loader`, `Mixture` and object storage take it unchanged.

    with packer.Writer("out/", columns={"feat": "float16[*, 768]", "f0": "float32[*]"}) as w:
        for clip in clips:
            w.write({"feat": feat(clip), "f0": pitch(clip), "label": 3, "key": clip.name})

Columns are declared (`packer.samples.schema` specs) or taken from the first sample; a sample
that does not fit them is a ConfigError naming the sample and the column, raised before
anything of it is written. Every dataset has a `key` column: the sample's "key" (text), else
its place. Shards are cut at `shard_size` (bytes, "256MB", or rows: 1000).
"""

from __future__ import annotations

import time
from pathlib import Path

from packer.builder.config import parse_shard_size
from packer.dataset import format as fmt
from packer.dataset import outdir, writer
from packer.errors import ConfigError
from packer.samples import schema

_SAMPLE_OVERHEAD = 64


class Writer:
    """Writes the dataset dir `out` (see the module); `overwrite`: replace a dataset there."""

    def __init__(self, out: str | Path, columns: dict[str, str] | None = None, *, shard_size: str | int = "256MB",
                 overwrite: bool = False, generation: str | None = None, build: dict | None = None):
        self.out = Path(out).expanduser()
        self.rows_limit, self.bytes_limit = parse_shard_size(str(shard_size))
        self.specs = None if columns is None else declared(columns)
        self.generation = generation or outdir.new_generation()
        self.build = dict(build or {})
        self.skipped: list[fmt.Skip] = []
        self.shards: list[fmt.Shard] = []
        self._shard, self._rows, self._bytes, self._written = None, 0, 0, 0
        self._started = time.time()
        self._lock, self._done = outdir.locked(self.out), False
        self._lock.__enter__()
        try:
            outdir.check_out(self.out, append=False, overwrite=overwrite)
            outdir.prepare_generation(self.out, self.generation)
        except BaseException:
            self._unlock()
            raise

    # -- the samples --------------------------------------------------------------------------
    def write(self, sample: dict) -> None:
        """Append one sample (a dict of its columns' values; "key" optional)."""
        if not isinstance(sample, dict):
            raise ConfigError(f"sample {self._written}: a dict of column values, not {type(sample).__name__}")
        key = sample.get("key", str(self._written))
        where = f"sample {self._written} ({key!r})" if "key" in sample else f"sample {self._written}"
        if not isinstance(key, str):
            raise ConfigError(f"{where}: its key is {type(key).__name__}, not text")
        values = {k: v for k, v in sample.items() if k != "key"}
        if self.specs is None:
            self.specs = {name: schema.infer(name, value) for name, value in values.items()}
            if not self.specs:
                raise ConfigError(f"{where}: no column besides its key")
        self.write_converted(self.convert(values, key, where))

    def convert(self, values: dict, key: str, where: str) -> dict:
        """A sample's values as its columns store them, or a ConfigError naming it: the check
        that comes before anything of it is written."""
        missing = sorted(set(self.specs) - set(values))
        extra = sorted(set(values) - set(self.specs))
        if missing or extra:
            raise ConfigError(f"{where}: columns {', '.join(self.specs)}; it " +
                              (f"lacks {', '.join(missing)}" if missing else f"has {', '.join(extra)} too"))
        out = {name: schema.convert(spec, values[name], where) for name, spec in self.specs.items()}
        out["key"] = writer_key(key)
        return out

    def write_converted(self, sample: dict) -> None:
        nbytes = sum(getattr(v, "nbytes", 0) or getattr(getattr(v, "data", None), "nbytes", 0)
                     for v in sample.values()) + _SAMPLE_OVERHEAD
        if self._shard is not None and ((self.rows_limit and self._rows >= self.rows_limit) or (
                self.bytes_limit and self._bytes + nbytes > self.bytes_limit)):
            self._close_shard()
        if self._shard is None:
            index = len(self.shards)
            rel = fmt.shard_path(self.generation, index)
            self._shard = writer.ShardWriter(outdir.staging_dir(self.out), index, self.columns,
                                             final_dir=self.out / rel, rel_dir=rel)
        self._shard.add(sample)
        self._rows += 1
        self._bytes += nbytes
        self._written += 1

    def skip(self, key: str, reason: str, stage: str = "map") -> None:
        """Note a sample that is not written, with why: found = written + skipped."""
        self.skipped.append(fmt.Skip(key, stage, reason))
        self._written += 1

    @property
    def columns(self) -> tuple[fmt.Column, ...]:
        if self.specs is None:
            raise ConfigError(f"{self.out}: no sample written, and no columns declared")
        return (*(spec.column() for spec in self.specs.values()), fmt.Column("key", "|u1", (None,), encoding="utf-8"))

    def _close_shard(self) -> None:
        self.shards.append(self._shard.close())
        self._shard, self._rows, self._bytes = None, 0, 0

    # -- publish, or leave nothing ---------------------------------------------------------------
    def close(self) -> fmt.Manifest:
        """Publish the dataset: every shard whole, then the manifest (the last write)."""
        if self._done:
            raise ConfigError(f"{self.out}: this Writer is closed")
        try:
            if self._shard is not None:
                self._close_shard()
            packed = sum(s.num_samples for s in self.shards)
            if packed == 0:
                first = f" (first skip: {self.skipped[0].key}: {self.skipped[0].reason})" if self.skipped else ""
                raise ConfigError(f"{self.out}: no sample written{first}; nothing is published")
            manifest = fmt.Manifest(
                kind="columns", columns=self.columns, shards=tuple(self.shards),
                counts={"found": packed + len(self.skipped), "packed": packed, "skipped": len(self.skipped)},
                skipped=tuple(self.skipped), generation=self.generation, audio=self._audio(),
                build={**self.build, "columns": {n: s.text() for n, s in self.specs.items()},
                       "seconds": round(time.time() - self._started, 3), "mmpack_version": _version()})
            outdir.publish(self.out, manifest)
            return manifest
        except BaseException:
            self.abort()
            raise
        finally:
            self._unlock()

    def _unlock(self) -> None:
        if not self._done:
            self._done = True
            self._lock.__exit__(None, None, None)

    def _audio(self) -> dict | None:
        audio = [s for s in (self.specs or {}).values() if s.kind == "audio"]
        if not audio:
            return None
        if len(audio) > 1 or audio[0].name != "audio":
            raise ConfigError(f"{self.out}: an audio column is named 'audio', one a dataset (it has "
                              f"{', '.join(s.name for s in audio)})")
        channels = 1 if len(audio[0].shape) == 1 else audio[0].shape[1]
        return {"sample_rate": audio[0].sample_rate, "channels": channels, "dtype": "<i2"}

    def abort(self) -> None:
        """Leave nothing behind: the staged shards and this generation go."""
        import shutil

        if self._shard is not None:
            self._shard.abort()
            self._shard = None
        shutil.rmtree(self.out / self.generation, ignore_errors=True)
        shutil.rmtree(outdir.staging_dir(self.out), ignore_errors=True)

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            try:
                self.abort()
            finally:
                self._unlock()
        elif not self._done:
            self.close()


def writer_key(key: str):
    from packer.builder.text import key_bytes

    return key_bytes(key)


def declared(columns: dict) -> dict[str, schema.Spec]:
    if not isinstance(columns, dict):
        raise ConfigError("columns= maps each column's name to its spec, e.g. {'feat': 'float16[*, 768]'}")
    return {name: schema.parse(name, text) for name, text in columns.items() if name != "key"}


def _version() -> str:
    from packer import __version__

    return __version__
