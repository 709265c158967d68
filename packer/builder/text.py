"""The text stage of a build: documents streamed from raw files, and the tokenizer pipeline.

Documents come from `.txt` (one per file), `.jsonl` (one per line, key `text` by default) and
`.parquet` (one per row, read by record batch, never the whole file). Every line or row is
either yielded as a document or as a Skip with its reason. Tokenizers are Hugging Face
`tokenizer.json` files, with truncation and padding switched off so no document loses tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np

from packer.errors import ConfigError, SourceError
from packer.dataset.format import Skip, choose_token_dtype
from packer.dataset.writer import file_digest
from packer.builder.records import JSONL, PARQUET, TXT, Record

PARQUET_BATCH_ROWS = 1024
# A document longer than this (a .txt file, a JSONL line, a Parquet value, a caption) is a skip by
# default: tokenizing one takes a worker's memory many times over (ids, offsets and token strings
# for every token), and the whole line is in memory before it is parsed. A book is a few MB of
# text, far below it. --max-doc-bytes sets another cap.
MAX_DOC_BYTES = 64 << 20
LINE_CHUNK = 1 << 20  # the rest of an over-long line is read and dropped in pieces of this size
TOKENIZE_BATCH_DOCS = 64
ENCODE_AHEAD = 2  # batches being encoded while the shard's thread reads and writes
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]", "<|im_end|>")


@dataclass(frozen=True)
class Document:
    key: str
    text: str


def _utf8(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SourceError(f"not UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 4]!r})") from None


def read_lines(f, limit: int) -> Iterator[tuple[bytes | None, int]]:
    """(line, its bytes) of a binary file from where it stands, in memory bounded by `limit`: a
    line longer than `limit` (its newline not counted) comes as (None, its bytes), read and
    dropped in pieces."""
    while True:
        raw = f.readline(limit + 1)
        if not raw:
            return
        if len(raw) <= limit or raw.endswith(b"\n"):
            yield raw, len(raw)
            continue
        nbytes = len(raw)
        while not raw.endswith(b"\n"):
            raw = f.readline(LINE_CHUNK)
            if not raw:
                break
            nbytes += len(raw)
        yield None, nbytes


def too_long(nbytes: int, limit: int) -> str:
    return f"{nbytes:,} bytes, over --max-doc-bytes {limit:,}"


def read_bounded(path: str | Path, limit: int) -> bytes:
    """A whole file of at most `limit` bytes; SourceError for a longer one, without reading it."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(limit + 1) if size <= limit else b""
    if size > limit or len(raw) > limit:
        raise SourceError(too_long(max(size, len(raw)), limit))
    return raw


def read_caption(path: str | Path, limit: int = MAX_DOC_BYTES) -> str:
    """A caption from `<stem>.txt` (the whole file, stripped) or `<stem>.json` ({"caption": ...})."""
    path = Path(path)
    try:
        raw = read_bounded(path, limit)
    except OSError as exc:
        raise SourceError(f"caption unreadable ({exc.strerror})") from None
    text = _utf8(raw)
    if path.suffix.lower() == ".json":
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SourceError(f"caption is not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("caption"), str):
            raise SourceError('caption JSON has no string "caption" key')
        text = doc["caption"]
    text = text.strip()
    if not text:
        raise SourceError("empty caption")
    return text


def iter_documents(record: Record, text_key: str = "text", start: int = 0, stop: int | None = None,
                   first_line: int = 1, *, max_bytes: int = MAX_DOC_BYTES) -> Iterator[Document | Skip]:
    """Documents of one text file, in line / row order, or skips with reasons (a document of
    more than `max_bytes` among them). A piece of a file (a shard's span): JSONL bytes
    [start, stop) starting at line `first_line`; Parquet rows [start, stop)."""
    ext = os.path.splitext(record.path)[1].lower()
    try:
        if ext == TXT:
            yield _check(Document(record.key, _utf8(read_bounded(record.path, max_bytes))))
        elif ext == JSONL:
            yield from _iter_jsonl(record, text_key, start, stop, first_line, max_bytes)
        elif ext == PARQUET:
            yield from _iter_parquet(record, text_key, start, stop, max_bytes)
        else:
            yield Skip(record.key, "read", f"not a text file ({ext})")
    except SourceError as exc:  # a whole-file problem: reported once, by the file's first piece
        if start == 0:
            yield Skip(record.key, "read", str(exc))
    except OSError as exc:
        if start == 0:
            yield Skip(record.key, "read", f"unreadable ({exc.strerror or exc})")


def _check(doc: Document) -> Document | Skip:
    return doc if doc.text.strip() else Skip(doc.key, "read", "empty document")


def _iter_jsonl(record: Record, text_key: str, start: int, stop: int | None, first_line: int,
                max_bytes: int) -> Iterator[Document | Skip]:
    with open(record.path, "rb") as f:
        f.seek(start)
        pos = start
        for number, (raw, nbytes) in enumerate(read_lines(f, max_bytes), start=first_line):
            if stop is not None and pos >= stop:
                break
            pos += nbytes
            key = f"{record.key}:{number}"
            if raw is None:
                yield Skip(key, "read", f"a line of {too_long(nbytes, max_bytes)}")
                continue
            try:
                line = _utf8(raw)
            except SourceError as exc:
                yield Skip(key, "read", str(exc))
                continue
            if not line.strip():
                yield Skip(key, "read", "blank line")
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                yield Skip(key, "read", f"invalid JSON ({exc.msg})")
                continue
            if not isinstance(obj, dict) or text_key not in obj:
                yield Skip(key, "read", f"no {text_key!r} key")
            elif not isinstance(obj[text_key], str):
                yield Skip(key, "read", f"{text_key!r} is {type(obj[text_key]).__name__}, not a string")
            else:
                yield _check(Document(key, obj[text_key]))


def _iter_parquet(record: Record, text_key: str, start: int, stop: int | None,
                  max_bytes: int) -> Iterator[Document | Skip]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pfile = pq.ParquetFile(record.path)
    except (pa.ArrowException, OSError) as exc:
        raise SourceError(f"not a readable Parquet file ({exc})") from None
    if text_key not in pfile.schema_arrow.names:
        raise SourceError(f"no {text_key!r} column (columns: {', '.join(pfile.schema_arrow.names)})")
    meta = pfile.metadata
    stop = meta.num_rows if stop is None else stop
    groups, first, begin = [], 0, 0  # row groups overlapping [start, stop); first row of the first
    for g in range(meta.num_row_groups):
        end = begin + meta.row_group(g).num_rows
        if end > start and begin < stop:
            if not groups:
                first = begin
            groups.append(g)
        begin = end
    row = first
    try:
        for batch in pfile.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=groups, columns=[text_key]):
            for value in batch.column(0).to_pylist():
                key = f"{record.key}:{row}"
                row += 1
                if row - 1 < start:
                    continue
                if row - 1 >= stop:
                    return
                if not isinstance(value, str):
                    yield Skip(key, "read", f"{text_key!r} is {type(value).__name__}, not a string")
                elif 4 * len(value) > max_bytes and len(value.encode("utf-8", "surrogatepass")) > max_bytes:
                    yield Skip(key, "read", too_long(len(value.encode("utf-8", "surrogatepass")), max_bytes))
                else:
                    yield _check(Document(key, value))
    except pa.ArrowException as exc:
        yield Skip(f"{record.key}:{row}", "read", f"unreadable from this row on ({exc})")


# -- tokenization -------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenizerSpec:
    """What the manifest records about the tokenizer a dataset was built with."""

    path: str
    sha256: str
    vocab_size: int
    dtype: str
    eos_id: int | None
    add_special_tokens: bool


def file_sha256(path: str | Path) -> str:
    """A tokenizer file's identity (the manifest's `tokenizer.sha256`, compared by merge)."""
    try:
        return file_digest(path, hashlib.sha256()).hexdigest()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the tokenizer ({exc.strerror or exc})") from None


def load_tokenizer(path: str | Path):
    """A `tokenizers.Tokenizer` with truncation and padding off; ConfigError for a bad file."""
    from tokenizers import Tokenizer

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: tokenizer file not found (pass --tokenizer PATH/tokenizer.json)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        raise ConfigError(f"{path}: not a Hugging Face tokenizer.json ({exc})") from None
    tok.no_truncation()
    tok.no_padding()
    return tok


def resolve_eos(tok, append_eos: str | int | None) -> int | None:
    """None (no EOS), "auto" (the tokenizer's end token), or an explicit id."""
    if append_eos is None:
        return None
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if append_eos == "auto":
        for token in EOS_CANDIDATES:
            token_id = tok.token_to_id(token)
            if token_id is not None:
                return token_id
        raise ConfigError(
            f"--append-eos: the tokenizer has none of the end tokens {', '.join(EOS_CANDIDATES)}; "
            "give the id explicitly (--append-eos ID)"
        )
    try:
        token_id = int(append_eos)
    except ValueError:
        raise ConfigError(f"--append-eos: {append_eos!r} is not a token id") from None
    if not 0 <= token_id < max(vocab, 1 << 32):
        raise ConfigError(f"--append-eos: id {token_id} is negative or too large")
    return token_id


def token_dtype(tok, eos_id: int | None) -> str:
    vocab = tok.get_vocab_size(with_added_tokens=True)
    return choose_token_dtype(max(vocab, (eos_id or 0) + 1))


def encode_batch(tok, texts: list[str], *, dtype: str, eos_id: int | None, add_special_tokens: bool) -> list[np.ndarray]:
    """Token ids of each text, in the stored dtype; `tokenizers` runs the batch on its threads.
    `encode_batch_fast` (tokenizers >= 0.20) gives the same ids without computing character
    offsets, which nothing here stores: a fifth less time for the MiniLM tokenizer on Python text."""
    out = []
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    for enc in encode(texts, add_special_tokens=add_special_tokens):
        ids = enc.ids if eos_id is None else [*enc.ids, eos_id]
        out.append(np.asarray(ids, dtype=dtype))
    return out


def key_bytes(key: str) -> np.ndarray:
    """A sample's key as the uint8 row of its `key` column."""
    return np.frombuffer(key.encode("utf-8"), dtype=np.uint8)


# -- the pipeline of a shard ---------------------------------------------------------------
_tokenizers: dict[tuple[str, str], object] = {}  # (path, sha256) -> tokenizer, per process


def keep_tokenizer(spec: TokenizerSpec, tok) -> None:
    """The build process has loaded the tokenizer already: shards built here use that one."""
    _tokenizers[spec.path, spec.sha256] = tok


def tokenizer_of(spec: TokenizerSpec):
    """The build's tokenizer, loaded once per process; keyed by the file's sha256 as well as its
    path, so a file rewritten between two builds in one process is loaded again, and one
    changed during a build is refused rather than used for some shards."""
    tok = _tokenizers.get((spec.path, spec.sha256))
    if tok is None:
        if file_sha256(spec.path) != spec.sha256:
            raise ConfigError(f"{spec.path}: the tokenizer file changed during the build; build again")
        tok = _tokenizers[spec.path, spec.sha256] = load_tokenizer(spec.path)
    return tok


def tokenized(items: Iterator, spec: TokenizerSpec, done: Callable[[int], None],
              busy: Callable[[int, int], None] | None = None) -> Iterator:
    """Samples {"tokens", "key"} (plus the item's other fields) of documents or (document,
    fields) items, tokenized in batches, in order; Skips pass through in place, and a document
    the tokenizer refuses or turns into no tokens becomes one. `done(n)`: n more items are out.
    `busy(lo, hi)`: from now on, until the next call, only items lo..hi-1 (by their place in
    `items`) are being read or tokenized: one of them killed the process if it dies.

    Batches are encoded on threads (`tokenizers` releases the GIL and runs its own Rust
    threads), ENCODE_AHEAD at a time, while this thread reads the next documents and writes the
    samples of the oldest batch: the tokenizer's threads always have a second batch to work on
    while one batch's longest document finishes, and reading and writing no longer leave the
    cores idle between batches."""
    tok = tokenizer_of(spec)

    def encode(batch: list) -> list:
        texts = [(p if isinstance(p, Document) else p[0]).text for p in batch if not isinstance(p, Skip)]
        args = dict(dtype=spec.dtype, eos_id=spec.eos_id, add_special_tokens=spec.add_special_tokens)
        try:
            return encode_batch(tok, texts, **args)
        except Exception:  # noqa: BLE001 - one document the tokenizer refuses (a lone surrogate): find it
            return [_encode_one(tok, text, args) for text in texts]

    def samples(batch: list, encoding: Future) -> Iterator:
        encoded = iter(encoding.result())
        for p in batch:
            if isinstance(p, Skip):
                yield p
                continue
            doc, extra = (p, {}) if isinstance(p, Document) else p
            tokens = next(encoded)
            if isinstance(tokens, Exception):
                yield Skip(doc.key, "tokenize", f"{type(tokens).__name__}: {str(tokens).splitlines()[0][:200]}")
            elif tokens.size == 0:
                yield Skip(doc.key, "tokenize", "no tokens")
            else:
                yield {**extra, "tokens": tokens, "key": key_bytes(doc.key)}
        done(len(batch))

    encoder = ThreadPoolExecutor(ENCODE_AHEAD, thread_name_prefix="mmpack-encode")
    inflight: deque = deque()  # (first item's place, batch, its encoding)
    read = 0  # items read so far
    try:
        while True:
            if busy is not None:  # the batches in flight and the one about to be read
                busy(inflight[0][0] if inflight else read, read + TOKENIZE_BATCH_DOCS)
            batch = list(islice(items, TOKENIZE_BATCH_DOCS))
            if not batch:
                break
            inflight.append((read, batch, encoder.submit(encode, batch)))
            read += len(batch)
            if len(inflight) > ENCODE_AHEAD:
                yield from samples(*inflight.popleft()[1:])
        while inflight:
            if busy is not None:
                busy(inflight[0][0], read)
            yield from samples(*inflight.popleft()[1:])
    finally:  # also when the shard is dropped half-way (a full disk): no batch is started after
        encoder.shutdown(wait=True, cancel_futures=True)


def _encode_one(tok, text: str, args: dict):
    """One document's ids, or the exception the tokenizer raised for it."""
    try:
        return encode_batch(tok, [text], **args)[0]
    except Exception as exc:  # noqa: BLE001
        return exc
