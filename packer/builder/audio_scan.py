"""The scan of a folder of audio files (`packer.builder.audio` decodes them): a record per audio
file, in sorted path order, labelled by its class folder when the files lie in two or more
top-level folders (as torchvision's ImageFolder labels images; speech-commands layouts), and
with its transcript, when RAW has any, from a sidecar `<stem>.txt` or a transcript table:

- LJSpeech's `metadata.csv`: `id|text|normalized text`, no header, the audio in `wavs/<id>.wav`
  (the normalized text is taken where there is one);
- a table with a header (Common Voice's `train.tsv`, any TSV / CSV / JSONL) naming each file
  (`path`, `file`, `file_name`, `audio`, `audio_path`, `filepath`, `wav`) and its text
  (`sentence`, `text`, `transcript`, `transcription`, `normalized_text`), relative to the
  table's folder or its `clips/` folder (Common Voice).

RAW with several tables (Common Voice's train, dev, test ...) takes the one --split names.
Everything else RAW holds is a skip with its reason: audio without a transcript when others
have one, a transcript without audio, a table row naming no file, other files.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

from packer.builder.audio import EXTS
from packer.builder.forms import extra, manifest
from packer.builder.records import Record, Scan
from packer.dataset.format import Skip, printable
from packer.errors import ConfigError, SourceError

UNDECODED = frozenset({".m4a", ".aac", ".wma"})  # audio libsndfile does not read
ALL_EXTS = EXTS | UNDECODED
PATH_FIELDS = ("path", "file", "file_name", "audio", "audio_path", "filepath", "wav")
TEXT_FIELDS = ("sentence", "text", "transcript", "transcription", "normalized_text")
LJSPEECH = "metadata.csv"


def is_audio(rel: str) -> bool:
    return os.path.splitext(rel)[1].lower() in ALL_EXTS


def scan_audio(raw: Path, files: list[tuple[str, str]], skipped: list[Skip], known: tuple[str, ...] | None,
               split: str | None, max_bytes: int, no_text: bool = False, *, quoted_tsv: bool = False,
               kept: tuple = ()) -> Scan:
    """The records of a folder of audio files (see the module docstring); `known`: the classes
    of the dataset an --append adds to; `no_text`: transcripts left out (skips); `quoted_tsv`: a
    TSV's double quotes are CSV quoting (else text, as Common Voice writes its sentences)."""
    by_rel = dict(files)
    tables, other = ([], []) if no_text else _tables(files, split, raw)
    skipped += [Skip(rel, "scan", f"the transcript table of another split, not --split {split}") for rel in other]
    texts: dict[str, str] = {}  # audio rel -> transcript, from the table
    rows: dict[str, dict] = {}  # audio rel -> its table row
    for rel in tables:
        _read_table(rel, by_rel[rel], by_rel, texts, skipped, max_bytes, quoted_tsv, rows)
    if kept and not tables:
        raise ConfigError(f"--fields: RAW {raw} has audio files without a table (Common Voice's TSV, a CSV or "
                          "JSONL with a header) whose rows hold fields to keep")
    stems = {os.path.splitext(rel)[0]: rel for rel, _ in files if os.path.splitext(rel)[1].lower() in EXTS}
    sidecars = {rel for rel, _ in files if rel.endswith(".txt") and rel[:-4] in stems and rel not in tables}
    if no_text:
        skipped += [Skip(rel, "scan", "a transcript, left out (--no-text)") for rel in sorted(sidecars)]
        sidecars = set()
    transcribed = bool(tables or sidecars)
    audio = [(rel, path) for rel, path in files if os.path.splitext(rel)[1].lower() in EXTS]
    folders = {rel.split("/", 1)[0] for rel, _ in audio if "/" in rel}
    labelled = known is not None or (len(folders) >= 2 and not tables)
    names = sorted(folders) if labelled else []
    if known is not None:
        names = [*known, *(n for n in names if n not in known)]
    index = {name: i for i, name in enumerate(names)}
    records = []
    for rel, path in files:
        ext = os.path.splitext(rel)[1].lower()
        if rel in tables or rel in sidecars or rel in other:
            continue
        if ext in UNDECODED:
            skipped.append(Skip(rel, "scan", f"{ext} audio is not read by libsndfile; convert it to FLAC or WAV"))
        elif ext not in EXTS:
            why = "a transcript without its audio" if ext == ".txt" and transcribed else f"not an audio file ({ext or 'no extension'})"
            skipped.append(Skip(rel, "scan", why))
        elif labelled and "/" not in rel:
            skipped.append(Skip(rel, "scan", "audio outside a class folder"))
        elif transcribed and rel not in texts and f"{os.path.splitext(rel)[0]}.txt" not in sidecars:
            where = f"a row of {', '.join(tables)}" if tables else "a <stem>.txt beside it"
            skipped.append(Skip(rel, "scan", f"audio without a transcript ({where})"))
        else:
            sidecar = f"{os.path.splitext(rel)[0]}.txt"
            values = extra.values(rows.get(rel, {}), kept) if kept else ()
            if isinstance(values, str):
                skipped.append(Skip(rel, "scan", values))
                continue
            records.append(Record(rel, path, label=index[rel.split("/", 1)[0]] if labelled else None,
                                  caption=by_rel[sidecar] if sidecar in sidecars else None, text=texts.get(rel),
                                  extra=values))
    typed, extras = extra.typed(records, kept)
    records = [r for r in typed if isinstance(r, Record)]
    skipped += [r for r in typed if isinstance(r, Skip)]
    if not records:
        first = f" (first skip: {skipped[0].key}: {skipped[0].reason})" if skipped else ""
        raise SourceError(f"{raw}: no audio file to pack{first}")
    shape = f"{len(records):,} audio files" + (f" in {len(names)} class folders" if labelled else "") + (
        f" with transcripts ({', '.join(tables) or '<stem>.txt'})" if transcribed else "")
    return Scan("audio", tuple(records), tuple(sorted(skipped, key=lambda s: s.key)),
                tuple(map(printable, names)) if labelled else None, why=shape,
                fields={"text": "transcript"} if transcribed else None, sources=tuple(by_rel[t] for t in tables),
                extras=extras)


def _tables(files: list[tuple[str, str]], split: str | None, raw: Path) -> tuple[list[str], list[str]]:
    """The transcript table(s) to read: LJSpeech's metadata.csv files, else the table --split
    names, else the only table there is; and the tables of other splits."""
    lj = [rel for rel, _ in files if os.path.basename(rel) == LJSPEECH and _is_ljspeech(dict(files)[rel])]
    if lj:
        return lj, []
    tables = [rel for rel, path in files if os.path.splitext(rel)[1].lower() in (".tsv", ".csv", ".jsonl")
              and _fields(path, rel) is not None]
    if split is not None:
        chosen = [rel for rel in tables if os.path.basename(rel).split(".", 1)[0] == split]
        if not chosen:
            raise ConfigError(f"--split {split!r}: {raw} has no transcript table {split}.tsv "
                              f"(its tables: {', '.join(tables) or 'none'})")
        return chosen, [rel for rel in tables if rel not in chosen]
    if len(tables) > 1:
        raise ConfigError(f"{raw}: holds the transcript tables {', '.join(tables[:6])}; pass --split NAME to build "
                          "the clips of NAME.tsv (Common Voice: train, dev, test)")
    return tables, []


def _is_ljspeech(path: str) -> bool:
    with open(path, encoding=manifest.text_encoding(path), errors="replace") as f:
        first = f.readline()
    return first.count("|") >= 1 and "," not in first.split("|", 1)[0]


def _fields(path: str, rel: str) -> tuple[str, str] | None:
    """(path field, text field) of a table with a header, None when it is not a transcript table."""
    for _, row in manifest.rows(path, rel, 1 << 20):
        if not isinstance(row, dict):
            return None
        keys = {str(k).strip().lower(): k for k in row}
        where = next((keys[k] for k in PATH_FIELDS if k in keys), None)
        text = next((keys[k] for k in TEXT_FIELDS if k in keys), None)
        return (where, text) if where is not None and text is not None else None
    return None


def _read_table(rel: str, path: str, by_rel: dict, texts: dict, skipped: list[Skip], max_bytes: int,
                quoted_tsv: bool, kept_rows: dict) -> None:
    """The transcripts a table gives, by the rel path of the audio each row names, and its row
    (`kept_rows`, for --fields); a row naming no audio file of RAW, or one named before, is a skip."""
    folder = os.path.dirname(rel)
    if os.path.basename(rel) == LJSPEECH:
        rows = _ljspeech_rows(path, rel)
        where = ("wavs",)
    else:
        fields = _fields(path, rel)
        rows = ((at, row if not isinstance(row, dict) else (row.get(fields[0]), row.get(fields[1]), row))
                for at, row in manifest.rows(path, rel, max_bytes, quoted_tsv=quoted_tsv))
        where = ("", "clips")
    for at, row in rows:
        if isinstance(row, Skip):
            skipped.append(row)
            continue
        name, text, values = row if len(row) == 3 else (*row, {})
        if not isinstance(name, str) or not isinstance(text, str) or not name.strip():
            skipped.append(Skip(f"{rel}:{at}", "scan", "a row without a file name and its text"))
            continue
        name = name.strip()
        if os.path.basename(rel) == LJSPEECH and not os.path.splitext(name)[1]:
            name += ".wav"
        found = next((c for sub in where if (c := "/".join(p for p in (folder, sub, name) if p)) in by_rel), None)
        if found is None:
            skipped.append(Skip(f"{rel}:{at}", "scan", f"names {name}, which RAW does not hold"))
        elif found in texts:
            skipped.append(Skip(f"{rel}:{at}", "scan", f"names {found} a second time (its first row is kept)"))
        else:
            texts[found] = text
            kept_rows[found] = values


def _ljspeech_rows(path: str, rel: str):
    with open(path, newline="", encoding=manifest.text_encoding(path), errors="replace") as f:
        for line, fields in enumerate(csv.reader(f, delimiter="|", quoting=csv.QUOTE_NONE), start=1):
            if not fields or not any(fields):
                continue
            if len(fields) < 2:
                yield line, Skip(f"{rel}:{line}", "scan", "not id|text|normalized text")
            else:
                yield line, (fields[0], fields[2] if len(fields) > 2 and fields[2].strip() else fields[1])
