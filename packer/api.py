"""What the `packer` command does, as Python functions: `build`, `commit`, `push`, `pull`,
`verify`, `info`, `show`, `merge`, `pack`, `unpack` and `sizes`, and `map` (a function over items,
into a dataset; `packer.Writer` writes one a sample at a time), each with the command's options as
keywords (the flags' names in snake case, their values as the flags take them or as Python
values) and URLs wherever the command takes them. The CLI (`packer.cli`) parses flags into these
calls and prints what they return; they print nothing.

    import packer
    packer.build("raw/", "out/", image_size=256, keep_aspect=True)
    packer.build("raw/", "s3://bucket/photos", zstd=3)   # built in a local dir, then pushed
    packer.verify("out/"); packer.info("s3://bucket/photos")["num_samples"]

A build with workers, from a script: call it under `if __name__ == "__main__":` (the pool's
workers start from the script's process).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

import numpy as np

from packer.builder.config import BuildConfig
from packer.builder.run import PartReport
from packer.dataset import format as fmt
from packer.dataset.archive import Transfer
from packer.dataset.reader import DatasetReader
from packer.errors import ConfigError

Progress = Callable[[int, int], None]


def build(raw: str | Path, out: str | Path, *, zstd: int | None = None, on_progress: Progress | None = None,
          **options) -> fmt.Manifest | PartReport:
    """`packer build RAW OUT [flags]`: pack RAW into the dataset dir OUT, or into a local dir and
    then to OUT in object storage when OUT is a URL (`zstd`: pushed compressed, at that level).
    The options are the command's flags, by their names in snake case, as Python values or as
    the command line spells them (below). Run again after a kill, the same call goes on where it
    stopped. `on_progress(done, total)` is called as records are packed. Returns the published
    manifest; a `part` run publishes nothing and returns what it built (`PartReport`).
"""
    unknown = sorted(set(options) - set(BUILD_OPTIONS))
    if unknown:
        raise ConfigError(f"packer.build: no option {', '.join(unknown)}; the options are {', '.join(BUILD_OPTIONS)}")
    from packer import remote

    if remote.is_url(out):
        remote.Remote(str(out))  # a URL no store of ours serves is refused before the build, not after
    config = BuildConfig(raw=Path(raw), out=_build_dir(out, options), **options)
    url = str(out) if remote.is_url(out) else None
    if zstd is not None and url is None:
        raise ConfigError(f"{out}: --zstd compresses what a build pushes to a URL; for a local dataset, packer pack it")
    from packer.builder.run import build as run_build, build_part

    if config.part is not None:
        return build_part(config, on_progress=on_progress)
    manifest = run_build(config, on_progress=on_progress)
    if url is not None:
        push(config.out, url, zstd=zstd)
    return manifest


BUILD_OPTIONS = tuple(f.name for f in BuildConfig.options())
# help(packer.build) and an editor's hints show every option, from the one declaration
build.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [inspect.Parameter("raw", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="str | Path"),
     inspect.Parameter("out", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="str | Path"),
     *(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default) for f in BuildConfig.options()),
     inspect.Parameter("zstd", inspect.Parameter.KEYWORD_ONLY, default=None),
     inspect.Parameter("on_progress", inspect.Parameter.KEYWORD_ONLY, default=None)],
    return_annotation="Manifest | PartReport")
if build.__doc__:  # None under python -OO
    build.__doc__ += "".join(f"\n    {f.name}: {f.metadata['help']}" for f in BuildConfig.options())


def map(fn, inputs, out: str | Path, *, workers: int | None = None, columns: dict[str, str] | None = None,
        shard_size: str | int = "256MB", chunk: int = 64, overwrite: bool = False, zstd: int | None = None,
        on_progress: Progress | None = None) -> fmt.Manifest:
    """`fn` over `inputs` (any sequence of picklable items: paths, rows, ids) in `workers`
    processes, its samples written as the dataset `out` (a dir, or a URL: built in a local dir,
    then pushed). `fn(item)` returns a sample dict, a list of them, or None (a skip); an
    exception is a skip with its reason (`packer info --skipped`). Output order is input order,
    the bytes the same at any worker count; run again after a kill, it goes on where it stopped.
    `columns`: specs such as {"feat": "float16[*, 768]"} (`packer.samples.schema`), else the
    first sample's. `chunk`: items a task (a task's shards are its own)."""
    from packer import remote
    from packer.samples.mapping import run

    local = where_built(out)
    manifest = run(fn, inputs, local, workers=workers, columns=columns, shard_size=shard_size, chunk=chunk,
                   overwrite=overwrite, on_progress=on_progress)
    if remote.is_url(out):
        push(local, str(out), zstd=zstd)
    elif zstd is not None:
        raise ConfigError(f"{out}: zstd compresses what a map pushes to a URL; for a local dataset, packer pack it")
    return manifest


def where_built(out: str | Path) -> Path:
    """OUT, or for a URL the local dir the build runs in (kept: the same call run again after a
    kill resumes there), pushed once the build is published."""
    from packer import remote

    return remote.build_dir(str(out)) if remote.is_url(out) else Path(out).expanduser()


def _build_dir(out: str | Path, options: dict) -> Path:
    from packer import remote

    if (options.get("append") or options.get("part")) and remote.is_url(out):
        raise ConfigError(f"{out}: --append and --part build into a local dir; pull the dataset, build there, "
                          "then packer push")
    return where_built(out)


def commit(out: str | Path, *, max_skipped: float | None = None) -> fmt.Manifest:
    """`packer commit OUT`: publish a build made of `part` runs once every shard is there."""
    from packer.builder.publish import commit as commit_parts

    return commit_parts(out, max_skipped=max_skipped)


def push(out: str | Path, url: str, *, zstd: int | None = None) -> fmt.Manifest:
    """`packer push OUT URL`: every file of the dataset dir (or archive dir) OUT, checked after
    upload, the manifest last; `zstd`: compressed at that level."""
    from packer import remote

    return remote.push(out, url, zstd=zstd)


def pull(url: str, out: str | Path) -> fmt.Manifest:
    """`packer pull URL OUT`: the dataset at URL into the new dir OUT, every file verified (a
    no-op when OUT holds that very build already)."""
    from packer import remote
    from packer.dataset.outdir import check_out

    published = remote.read_published(url)
    mine = Path(out) / fmt.MANIFEST_NAME
    if mine.is_file() and fmt.Manifest.from_json(mine.read_text(encoding="utf-8"), where=str(mine)) == published[0]:
        return published[0]
    check_out(Path(out), append=False, overwrite=False)
    return remote.pull(url, out, published=published)


def verify(path: str | Path, *, cache: bool | str | Path = False, on_progress: Progress | None = None) -> dict:
    """`packer verify PATH`: every file of a dataset dir, archive or URL re-hashed and checked
    (a URL's objects as the store holds them, never the node's cache); {"files", "size_bytes",
    "num_samples"}, or an IntegrityError naming the first damage. `cache` (True, or a cache dir):
    a URL's copies in the node's cache instead, those that no longer match removed, to be fetched
    again; {"files", "size_bytes", "removed", "cache"}."""
    from packer import remote
    from packer.dataset.archive import is_archive, verify_archive
    from packer.dataset.verify import verify as verify_dir

    if cache is not False:
        if not remote.is_url(path):
            raise ConfigError(f"{path}: --cache checks the node's cache of a URL (s3://, az://); a local dataset is "
                              "verified as it is")
        from packer.remote.verify import verify_cache

        return verify_cache(str(path), None if cache is True else cache, on_progress=on_progress)
    if remote.is_url(path):
        from packer.remote.verify import verify as verify_url

        return verify_url(str(path), on_progress=on_progress)
    root = Path(path).expanduser()
    return (verify_archive if is_archive(root) else verify_dir)(root, on_progress=on_progress)


def info(path: str | Path) -> dict:
    """`packer info PATH --json --skipped`: what a dataset dir, archive or URL holds (a URL's
    from its manifest alone, nothing else downloaded; the classes with no sample of an archive
    or a URL are not known without reading its labels: None)."""
    from packer import remote
    from packer.dataset.archive import is_archive, read_archive

    reader, extra = None, {}
    if remote.is_url(path):
        m, packed = remote.read_published(str(path))
        archived, root = packed is not None, str(path)
        if packed:
            extra = {"archive_bytes": sum(f.size_bytes for f in packed.values())}
    else:
        root = Path(path).expanduser()
        archived = is_archive(root)
        if archived:
            m, files = read_archive(root)
            extra = {"archive_bytes": sum(f.size_bytes for f in files)}
        else:
            reader = DatasetReader(root)
            m = reader.manifest
    return {
        "path": str(root),
        "format": f"{fmt.FORMAT_NAME} {m.version}" + (" (zstd archive)" if archived else ""),
        "kind": m.kind,
        "num_samples": m.num_samples,
        "num_shards": len(m.shards),
        "size_bytes": m.size_bytes,
        "columns": {c.name: {"dtype": c.dtype, "shape": list(c.shape), "ragged": c.ragged, "encoding": c.encoding}
                    for c in m.columns},
        "classes": list(m.classes) if m.classes is not None else None,
        "empty_classes": empty_classes(reader) if reader is not None else None,
        "counts": m.counts,
        "tokenizer": m.tokenizer,
        "chat_template": m.build.get("chat_template"),
        "audio": _audio(m),
        "images": _image_policy(m),
        "input": m.build.get("input"),
        "flattened": m.build.get("flattened", 0),
        "audio_clipped": m.build.get("audio_clipped", 0),
        "skipped": [{"key": k.key, "stage": k.stage, "reason": k.reason} for k in m.skipped],
        **extra,
    }


def show(path: str | Path, *, n: int = 16, png: str | Path | None = None) -> dict:
    """`packer show PATH [-n N] [--png FILE]`: N samples spread over the dataset as a user checks
    a build: each one's id, key, label and class name, caption or transcript decoded with the
    dataset's tokenizer, image size or clip seconds; with `png`, the images in a grid under
    their class names or the clips' waveforms, written there."""
    from packer import preview as shown

    reader = shown.open_reader(path)
    m = reader.manifest
    rows = shown.samples(reader, shown.spread(m.num_samples, n))
    written = shown.draw(rows, png) if png is not None else None
    return {"path": str(path), "kind": m.kind, "num_samples": m.num_samples, "png": str(written) if written else None,
            "samples": [{k: v for k, v in row.items() if k not in ("image", "audio")} |
                        ({"image_size": list(row["image"].shape[:2])} if "image" in row else {}) for row in rows],
            "lines": [shown.line(row) for row in rows]}


def empty_classes(reader: DatasetReader) -> list[str]:
    """The classes no packed sample has (an empty folder, or only files that were skipped)."""
    counts = reader.class_counts()
    return [] if counts is None else [reader.manifest.classes[i] for i in np.flatnonzero(counts == 0)]


def _audio(m: fmt.Manifest) -> dict | None:
    """An audio dataset's rate, channels and dtype, and the seconds of audio it holds (from
    the column files' sizes: nothing read)."""
    if m.audio is None:
        return None
    column = m.column("audio")
    values = sum(f.size_bytes - fmt.NPY_HEADER_BYTES for s in m.shards for f in s.files
                 if f.path.endswith(f"/{fmt.column_file_names(column)['values']}"))
    frames = values // np.dtype(column.dtype).itemsize // m.audio["channels"]
    return {**m.audio, "seconds": round(frames / m.audio["sample_rate"], 3)}


def _image_policy(m: fmt.Manifest) -> str | None:
    """How the build sized its images, in the flags' words (None: no image column)."""
    if not any(c.name in ("image", "images") for c in m.columns) or "image_size" not in m.build:
        return None  # no images, or a build that did not record how (a merge)
    size, cap = m.build.get("image_size"), m.build.get("max_side")
    store = m.build.get("store", "pixels")
    stored = f"; stored as JPEG, quality {store.partition(':')[2]} (--store {store})" if store != "pixels" else ""
    if size is None:
        return f"--image-size keep: each image at its own size{stored}"
    if cap:
        return f"--image-size {size} --keep-aspect: whole images, shorter side {size}, longer <= {cap}{stored}"
    return f"--image-size {size}: {size} x {size} centre crops{stored}"


def merge(inputs: list[str | Path], out: str | Path, *, overwrite: bool = False,
          allow_duplicate_keys: bool = False) -> fmt.Manifest:
    """`packer merge A B ... OUT`: datasets with the same columns joined, no re-encoding."""
    from packer.dataset.merge import merge as merge_dirs

    return merge_dirs(inputs, out, overwrite=overwrite, allow_duplicate_keys=allow_duplicate_keys)


def pack(out: str | Path, archive: str | Path, *, level: int = 3, threads: int | None = None,
         overwrite: bool = False) -> Transfer:
    """`packer pack OUT ARCHIVE`: a zstd archive dir of the dataset dir OUT."""
    from packer.dataset.archive import pack as pack_dir

    return pack_dir(out, archive, level=level, threads=threads, overwrite=overwrite)


def unpack(archive: str | Path, out: str | Path, *, threads: int | None = None, overwrite: bool = False) -> Transfer:
    """`packer unpack ARCHIVE OUT`: the dataset dir restored, both checksums of every file checked."""
    from packer.dataset.archive import unpack as unpack_dir

    return unpack_dir(archive, out, threads=threads, overwrite=overwrite)


def sizes(raw: str | Path, *, image_size: int = 256, max_side: int | None = None, kind: str | None = None,
          sample: int | None = None, on_progress: Progress | None = None) -> dict:
    """`packer sizes RAW --json`: the bytes RAW's images would take under each --image-size
    policy, from the headers of `sample` images spread over RAW (default 2,000; None or 0: all)."""
    from packer.builder.plan import SIZES_SAMPLE, size_report
    from packer.builder.scan import scan

    cap = max_side or 2 * image_size
    if not 1 <= image_size <= cap:
        raise ConfigError(f"--image-size {image_size} and --max-side {cap}: need 1 <= S <= N")
    found = scan(raw, kind)
    if found.kind == "text":
        raise ConfigError(f"{raw}: holds text ({found.why}); 'packer sizes' compares image storage")
    return size_report(found, image_size, cap, sample=SIZES_SAMPLE if sample is None else (sample or None),
                       on_progress=on_progress)
