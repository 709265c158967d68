"""The "pack the data" fix for conversations, as `trials.packed` is for an image folder: a
DataLoader whose dataset renders a chat template (it holds a transformers tokenizer with a
`chat_template`) over a JSONL, JSON or Parquet file of conversations (named among the dataset's
attributes, else in the script's argv): a sample of the file packed with `packer build
--tokenizer ... --chat-template ...` from the tokenizer's own folder, Loader(PackedDocuments)
over it timed alone, and the exact command and line of the script that replace the Dataset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .probes import ceiling
from .report import Ceiling, ChatPackedRun, Failure, Fix

PACK_CONVERSATIONS = 256  # the file's first conversations packed to measure what packing gives
EXTS = (".jsonl", ".json", ".parquet")  # what `packer build` reads conversations from
SEQ_LEN_NAMES = ("max_length", "max_seq_len", "seq_len", "max_len", "block_size")


def packed(loader) -> ChatPackedRun | Failure | None:
    """For a DataLoader over a chat-template Dataset: its file's first PACK_CONVERSATIONS
    conversations packed, then Loader(PackedDocuments(seq_len=its max_length)) alone, its rows/s
    made conversations/s (the script's samples) by the conversations a row holds. None where
    the dataset renders no chat template."""
    import torch

    dataset = getattr(loader, "dataset", None)
    tok = _tokenizer(dataset)
    if not isinstance(loader, torch.utils.data.DataLoader) or tok is None:
        return None
    try:
        source, tokenizer, template = _data_file(dataset), *_model_files(tok)
        seq_len = _seq_len(dataset)
        raw, out = _where(source)
        command = (f"mkdir -p {raw} && ln -s {source} {raw}/ && " if raw != source.parent else "") + \
            f"packer build {raw} {out} --tokenizer {tokenizer} --chat-template {template}"
        with tempfile.TemporaryDirectory(prefix="mmpack-doctor-") as tmp:
            sample, built = Path(tmp) / "raw", Path(tmp) / "out"
            _sample(source, sample / source.name)
            _build(sample, built, tokenizer, template)
            # Minimind's trainer gives a batch_sampler (batch_size None): its batches' size is the sampler's
            size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None) or 16
            return _timed(built, seq_len, size, command=command, packed_out=str(out))
    except Exception as exc:  # noqa: BLE001 - a fix it could not measure is said, not raised
        return Failure.of(exc)


def _tokenizer(dataset):
    """The transformers tokenizer with a chat template that the dataset (or one it wraps) holds."""
    seen = 0
    while dataset is not None and seen < 4:  # a Subset's, a wrapper's dataset
        for value in vars(dataset).values() if hasattr(dataset, "__dict__") else ():
            if isinstance(getattr(value, "chat_template", None), str) and hasattr(value, "apply_chat_template"):
                return value
        dataset, seen = getattr(dataset, "dataset", None), seen + 1
    return None


def _data_file(dataset) -> Path:
    """The conversations file: a path among the dataset's attributes (a list of them too), else
    the first in the script's argv (`--data_path x.jsonl`, `--data_path=x.jsonl`)."""
    attrs = [v if isinstance(v, (list, tuple)) else [v] for v in vars(dataset).values()]
    values = [v for vs in attrs for v in vs if isinstance(v, (str, os.PathLike))]
    values += [a.split("=", 1)[-1] for a in sys.argv[1:]]
    for value in values:
        path = Path(value).expanduser()
        if path.suffix.lower() in EXTS and path.is_file():
            return path.resolve()
    raise FileNotFoundError("no .jsonl, .json or .parquet file of conversations among the dataset's attributes or "
                            "the script's arguments")


def _model_files(tok) -> tuple[Path, Path]:
    """The tokenizer's tokenizer.json and the file its chat template is in (tokenizer_config.json,
    or chat_template.jinja as transformers 5 saves it), in the folder it was loaded from."""
    folder = Path(tok.name_or_path).expanduser()
    config = folder / "tokenizer_config.json"
    template = config if config.is_file() and "chat_template" in json.loads(config.read_text()) \
        else folder / "chat_template.jinja"
    if not ((folder / "tokenizer.json").is_file() and template.is_file()):
        raise FileNotFoundError(f"the tokenizer ({tok.name_or_path}) was not loaded from a folder with tokenizer.json "
                                "and its chat template: tokenizer.save_pretrained(DIR) writes one")
    text = json.loads(template.read_text())["chat_template"] if template == config else template.read_text()
    if text != tok.chat_template:
        raise ValueError(f"the script's tokenizer renders a chat template other than {template}'s: "
                         "tokenizer.save_pretrained(DIR) writes the one it uses")
    return (folder / "tokenizer.json").resolve(), template.resolve()


def _seq_len(dataset) -> int:
    """The rows' length: the dataset's max_length (or a like name), else its first item's length."""
    for name in SEQ_LEN_NAMES:
        if isinstance(getattr(dataset, name, None), int):
            return getattr(dataset, name)
    first = dataset[0]
    first = next(iter(first.values())) if isinstance(first, dict) else first[0] if isinstance(first, tuple) else first
    return int(first.shape[-1])


def _where(source: Path) -> tuple[Path, Path]:
    """RAW and OUT of the command: the file's folder, or where the folder holds other files
    `packer build` would read as conversations, a folder of the file's own (a link to it)."""
    others = [p for p in source.parent.iterdir() if p.suffix.lower() in EXTS and p != source]
    raw = source.with_suffix("") if others else source.parent
    return raw, raw.with_name(f"{raw.name}-packed")


def _sample(source: Path, to: Path) -> None:
    """The file's first PACK_CONVERSATIONS records, in its own format."""
    to.parent.mkdir(parents=True)
    suffix = source.suffix.lower()
    if suffix == ".jsonl":
        with open(source, encoding="utf-8") as f, open(to, "w", encoding="utf-8") as w:
            w.writelines(line for _, line in zip(range(PACK_CONVERSATIONS), (x for x in f if x.strip())))
    elif suffix == ".json":
        to.write_text(json.dumps(json.loads(source.read_text(encoding="utf-8"))[:PACK_CONVERSATIONS]))
    else:
        import pyarrow.parquet as pq

        pq.write_table(pq.read_table(source).slice(0, PACK_CONVERSATIONS), to)


def _build(raw: Path, out: Path, tokenizer: Path, template: Path) -> None:
    """`packer build` in a process of its own: its pool's forkserver then imports that process's
    __main__, not the script's (which would run the script's training again where unguarded)."""
    import packer

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(packer.__file__).parent.parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "packer", "build", str(raw), str(out), "--tokenizer", str(tokenizer),
                           "--chat-template", str(template), "-q"], capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"packer build of a sample: {(done.stderr.strip().splitlines() or ['failed'])[-1]}")


def _timed(built: Path, seq_len: int, batch_size: int, *, command: str, packed_out: str) -> ChatPackedRun:
    from loaders import Loader, MMapDataset, PackedDocuments

    rows = PackedDocuments(built, seq_len)
    conversations = len(MMapDataset(built, columns=["key"]))
    with Loader(rows, batch_size, seed=0) as reader:
        got = ceiling(reader)
    if isinstance(got, Ceiling) and got.samples_per_s:  # rows/s made conversations/s: the script's samples
        got = Ceiling(batches=got.batches, samples_per_s=got.samples_per_s * conversations / len(rows),
                      first_batch_s=got.first_batch_s)
    return ChatPackedRun(conversations=conversations, seq_len=seq_len, rows=len(rows), batch_size=batch_size,
                         command=command, out=packed_out, measured=got)


def pack_fix(run: ChatPackedRun, alone: float) -> Fix:
    """The measured fix: the exact command for the whole file, and the line that replaces the DataLoader."""
    rate, per_row = run.samples_per_s, run.conversations / max(run.rows, 1)
    line = (f"from loaders import Loader, PackedDocuments; loader = Loader(PackedDocuments({run.out!r}, "
            f"seq_len={run.seq_len}), batch_size={run.batch_size})")
    return Fix(fix=f"pack the data once: {run.command}; then in the script, {line} in place of the DataLoader "
                   f"(batches of tokens, labels, position_ids and cu_seqlens: whole conversations packed in rows of "
                   f"{run.seq_len} tokens, labels -100 off the assistant's turns)",
               expected=f"{rate / alone:.1f}x the data rate ({rate:,.0f} conversations/s alone)",
               how=f"measured: the first {run.conversations} conversations of its file packed with its tokenizer and "
                   f"chat template, then Loader(PackedDocuments) alone: {per_row:.1f} conversations a row",
               gain=rate / alone)
