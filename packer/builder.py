"""`packer build`: RAW -> records -> samples -> shards in staging -> manifest, published last.

Streams: one sample (or one tokenizer batch) in memory at a time, and a shard is closed as soon
as it reaches the shard size. Any error leaves OUT without a manifest, so it never opens.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from . import format as fmt
from . import writer
from .errors import ConfigError, MmpackError, SourceError
from .images import decode_image
from .sources import Record, Scan, scan
from .text import (
    Document,
    TokenizerSpec,
    encode_batch,
    iter_documents,
    load_tokenizer,
    read_caption,
    resolve_eos,
    token_dtype,
)
from .writer import sha256_file

DEFAULT_SHARD_BYTES = 256 * 1024**2
TOKENIZE_BATCH_DOCS = 512
_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1024**2, "mb": 1024**2,
          "mib": 1024**2, "g": 1024**3, "gb": 1024**3, "gib": 1024**3}


def parse_shard_size(text: str) -> tuple[int | None, int | None]:
    """'1000' or '1000rows' -> (rows, None); '256MB', '1GiB', '4096B' -> (None, bytes)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or (unit not in _UNITS and unit not in ("row", "rows")) or int(m.group(1)) <= 0:
        raise ConfigError(f"--shard-size: {text!r} is neither a row count (1000) nor a size (256MB)")
    if unit in ("", "row", "rows") and not text.strip().lower().endswith("b"):
        return int(m.group(1)), None
    return None, int(m.group(1)) * _UNITS[unit]


@dataclass(frozen=True)
class BuildConfig:
    """Everything a build depends on; the CLI's flags map one-to-one onto these fields."""

    raw: Path
    out: Path
    kind: str | None = None
    image_size: int | None = 224  # None: keep each image's own size
    tokenizer: Path | None = None
    text_key: str = "text"
    append_eos: str | None = None  # None, "auto" or an id
    special_tokens: bool = False
    shard_rows: int | None = None
    shard_bytes: int | None = DEFAULT_SHARD_BYTES
    overwrite: bool = False
    strict: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "raw", Path(self.raw))
        object.__setattr__(self, "out", Path(self.out))
        if self.kind is not None and self.kind not in fmt.KINDS:
            raise ConfigError(f"--kind: {self.kind!r} is not one of {', '.join(fmt.KINDS)}")
        if self.image_size is not None and not 1 <= self.image_size <= 16384:
            raise ConfigError(f"--image-size: {self.image_size} is out of range (1..16384 or 'keep')")
        if self.shard_rows is None and self.shard_bytes is None:
            raise ConfigError("--shard-size: give rows or bytes")
        if self.out.resolve() == self.raw.resolve() or self.raw.resolve() in self.out.resolve().parents:
            raise ConfigError(f"{self.out}: OUT must not lie inside RAW ({self.raw})")


Progress = Callable[[int, int], None]


def build(config: BuildConfig, *, on_progress: Progress | None = None) -> fmt.Manifest:
    """Build the dataset dir `config.out` from `config.raw`; returns the published manifest."""
    started = time.time()
    _check_out(config)
    found = scan(config.raw, config.kind)
    tokenizer = _tokenizer_for(config, found.kind)
    columns = _columns(config, found.kind, tokenizer)
    out = config.out
    created_out = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    if config.overwrite:
        writer.unpublish(out)
    staging = writer.staging_dir(out)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        skipped = list(found.skipped)
        if config.strict and skipped:
            raise SourceError(f"{config.raw / skipped[0].key}: {skipped[0].reason} (--strict)")
        shards = _write_shards(config, columns, _samples(config, found, tokenizer, on_progress), skipped)
        packed = sum(s.num_samples for s in shards)
        if packed == 0:
            first = f" (first: {skipped[0].key}: {skipped[0].reason})" if skipped else ""
            raise SourceError(f"{config.raw}: nothing packed, all {len(skipped)} records skipped{first}")
        manifest = fmt.Manifest(
            kind=found.kind,
            columns=columns,
            shards=tuple(shards),
            counts={"found": packed + len(skipped), "packed": packed, "skipped": len(skipped)},
            skipped=tuple(skipped),
            classes=found.classes,
            tokenizer=asdict(tokenizer[1]) if tokenizer else None,
            build=_build_params(config, found.kind, time.time() - started),
        )
        writer.publish(out, manifest)
        return manifest
    except MmpackError:
        shutil.rmtree(staging, ignore_errors=True)
        if created_out and not any(out.iterdir()):
            out.rmdir()
        raise


def _check_out(config: BuildConfig) -> None:
    out = config.out
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out}: exists and is not a directory")
    if out.is_dir() and not config.overwrite:
        leftovers = [p.name for p in out.iterdir() if p.name != fmt.STAGING_DIR]
        if leftovers:
            raise ConfigError(f"{out}: already exists and is not empty; pass --overwrite to rebuild it")
    if out.is_dir() and config.overwrite:
        ours = {fmt.MANIFEST_NAME, fmt.STAGING_DIR}
        foreign = [p.name for p in out.iterdir() if p.name not in ours and not p.name.startswith("shard-")]
        if foreign and not (out / fmt.MANIFEST_NAME).exists():
            raise ConfigError(f"{out}: not an mmpack dataset dir (holds {foreign[0]!r}); refusing to overwrite it")


def _tokenizer_for(config: BuildConfig, kind: str):
    if kind == "images":
        return None
    if config.tokenizer is None:
        raise ConfigError(f"--tokenizer PATH/tokenizer.json is required to pack {kind} (RAW {config.raw})")
    tok = load_tokenizer(config.tokenizer)
    eos_id = resolve_eos(tok, config.append_eos)
    spec = TokenizerSpec(
        path=str(Path(config.tokenizer).resolve()),
        sha256=sha256_file(Path(config.tokenizer)),
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        dtype=token_dtype(tok, eos_id),
        eos_id=eos_id,
        add_special_tokens=config.special_tokens,
    )
    return tok, spec


def _columns(config: BuildConfig, kind: str, tokenizer) -> tuple[fmt.Column, ...]:
    size = config.image_size
    image = fmt.Column("image", "|u1", (size, size, 3) if size else (None, None, 3))
    key = fmt.Column("key", "|u1", (None,), encoding="utf-8")
    if kind == "images":
        return (image, fmt.Column("label", "<i8", ()), key)
    tokens = fmt.Column("tokens", tokenizer[1].dtype, (None,))
    return (image, tokens, key) if kind == "pairs" else (tokens, key)


def _write_shards(config, columns, samples: Iterator, skipped: list[fmt.Skip]) -> list[fmt.Shard]:
    """Roll samples into shards of at most shard_rows rows / about shard_bytes bytes."""
    staging = writer.staging_dir(config.out)
    shards: list[fmt.Shard] = []
    shard = None
    try:
        for item in samples:
            if isinstance(item, fmt.Skip):
                if config.strict:
                    raise SourceError(f"{config.raw / item.key.split(':')[0]}: {item.reason} (--strict)")
                skipped.append(item)
                continue
            if shard is None:
                shard = writer.ShardWriter(staging, len(shards), columns)
            shard.add(item)
            if (config.shard_rows and shard.num_samples >= config.shard_rows) or (
                config.shard_bytes and shard.size_bytes >= config.shard_bytes
            ):
                shards.append(shard.close())
                shard = None
        if shard is not None:
            shards.append(shard.close())
            shard = None
    finally:
        if shard is not None:
            shard.abort()
    return shards


def _key_bytes(key: str) -> np.ndarray:
    return np.frombuffer(key.encode("utf-8"), dtype=np.uint8)


def _samples(config: BuildConfig, found: Scan, tokenizer, on_progress: Progress | None) -> Iterator:
    """Samples (dicts of arrays) and Skips, in record order; text is tokenized across records
    in batches of TOKENIZE_BATCH_DOCS documents."""
    total = len(found.records)

    def items() -> Iterator:
        for done, record in enumerate(found.records, start=1):
            if found.kind == "images":
                yield _image_sample(config, record)
            elif found.kind == "pairs":
                yield _pair_item(config, record)
            else:
                yield from iter_documents(record, config.text_key)
            if on_progress:
                on_progress(done, total)

    return items() if tokenizer is None else _tokenized(items(), tokenizer)


def _image_sample(config: BuildConfig, record: Record):
    try:
        pixels = decode_image(record.path, config.image_size)
    except SourceError as exc:
        return fmt.Skip(record.key, "decode", str(exc))
    return {"image": pixels, "label": np.int64(record.label), "key": _key_bytes(record.key)}


def _pair_item(config: BuildConfig, record: Record):
    try:
        caption = read_caption(record.caption)
    except SourceError as exc:
        return fmt.Skip(record.key, "caption", str(exc))
    try:
        pixels = decode_image(record.path, config.image_size)
    except SourceError as exc:
        return fmt.Skip(record.key, "decode", str(exc))
    return Document(record.key, caption), {"image": pixels}


def _tokenized(items: Iterator, tokenizer) -> Iterator:
    """Tokenize documents in batches, keeping record order (skips pass through in place)."""
    tok, spec = tokenizer
    pending: list = []

    def flush():
        docs = [p for p in pending if not isinstance(p, fmt.Skip)]
        texts = [(p if isinstance(p, Document) else p[0]).text for p in docs]
        encoded = iter(encode_batch(tok, texts, dtype=spec.dtype, eos_id=spec.eos_id,
                                    add_special_tokens=spec.add_special_tokens))
        for p in pending:
            if isinstance(p, fmt.Skip):
                yield p
                continue
            doc, extra = (p, {}) if isinstance(p, Document) else p
            tokens = next(encoded)
            if tokens.size == 0:
                yield fmt.Skip(doc.key, "tokenize", "no tokens")
            else:
                yield {**extra, "tokens": tokens, "key": _key_bytes(doc.key)}
        pending.clear()

    for item in items:
        pending.append(item)
        if len(pending) >= TOKENIZE_BATCH_DOCS:
            yield from flush()
    yield from flush()


def _build_params(config: BuildConfig, kind: str, seconds: float) -> dict:
    from . import __version__

    return {
        "raw": str(config.raw.resolve()),
        "kind": kind,
        "image_size": config.image_size,
        "text_key": config.text_key,
        "append_eos": config.append_eos,
        "special_tokens": config.special_tokens,
        "shard_rows": config.shard_rows,
        "shard_bytes": config.shard_bytes,
        "strict": config.strict,
        "seconds": round(seconds, 3),
        "created_unix": round(time.time(), 3),
        "mmpack_version": __version__,
    }
