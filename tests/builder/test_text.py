"""The text side of a build, from the user's side: a --text-key typo, documents too large for a
worker, flags that do not apply, and what a token batch holds between documents."""

from __future__ import annotations

import io
import json
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loaders import Loader, MMapDataset, PackedDocuments, TokenWindows
from packer.cli import main
from packer.errors import ConfigError
from packer.dataset.reader import load_manifest


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_text_key_no_record_has_is_a_config_error_naming_the_keys(tmp_path, minilm, capsys):
    """A --text-key typo skipped 76% of the records and exited 0."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = tmp_path / "raw"
    raw.mkdir()
    with open(raw / "docs.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"id": i, "text": f"document number {i}"}) + "\n" for i in range(20))
    for key in ("txt", "texte"):
        assert main(["build", str(raw), str(tmp_path / "out"), "--tokenizer", str(minilm), "--text-key", key]) == 2
        err = one_line(capsys.readouterr().err)
        assert f"--text-key '{key}': no record of docs.jsonl has it" in err and "'id', 'text'" in err
    (raw / "docs.jsonl").unlink()
    pq.write_table(pa.table({"body": ["a document", "another one"]}), raw / "docs.parquet")
    assert main(["build", str(raw), str(tmp_path / "out"), "--tokenizer", str(minilm)]) == 2
    assert "docs.parquet has no such column (its columns are 'body')" in one_line(capsys.readouterr().err)
    assert main(["build", str(raw), str(tmp_path / "out"), "--tokenizer", str(minilm), "--text-key", "body", "-q"]) == 0


def test_a_key_written_with_escapes_is_found(tmp_path, minilm):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "docs.jsonl").write_text('{"\\u0074ext": "escaped key"}\n{"text": "plain"}\n{"other": 1}\n')
    assert main(["build", str(raw), str(tmp_path / "out"), "--tokenizer", str(minilm), "-q"]) == 0
    assert load_manifest(tmp_path / "out").counts == {"found": 3, "packed": 2, "skipped": 1}


def test_a_document_over_max_doc_bytes_is_a_skip_with_its_reason(tmp_path, minilm):
    raw = tmp_path / "raw"
    raw.mkdir()
    big = "word " * 60_000  # 300 KB
    with open(raw / "docs.jsonl", "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": "small one"}) + "\n" + json.dumps({"text": big}) + "\n")
        f.write(json.dumps({"text": "small two"}) + "\n")
    (raw / "book.txt").write_text(big)
    (raw / "note.txt").write_text("a short note")
    out = tmp_path / "out"
    assert main(["build", str(raw), str(out), "--tokenizer", str(minilm), "--max-doc-bytes", "100000", "-q"]) == 0
    m = load_manifest(out)
    skips = {s.key: s.reason for s in m.skipped}
    assert set(skips) == {"docs.jsonl:2", "book.txt"}
    assert "over --max-doc-bytes 100,000" in skips["docs.jsonl:2"] and "300,000 bytes" in skips["book.txt"]
    assert m.counts == {"found": 5, "packed": 3, "skipped": 2}
    assert main(["build", str(raw), str(tmp_path / "all"), "--tokenizer", str(minilm), "-q"]) == 0
    assert load_manifest(tmp_path / "all").counts["packed"] == 5  # the default cap (64 MiB) takes them


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 300), max_size=12), limit=st.integers(1, 120), last_newline=st.booleans())
def test_read_lines_splits_as_a_file_does_and_drops_only_long_lines(lengths, limit, last_newline):
    from packer.builder.text import read_lines

    lines = [bytes([97 + i % 26]) * n + b"\n" for i, n in enumerate(lengths)]
    if lines and not last_newline:
        lines[-1] = lines[-1][:-1]
    got = list(read_lines(io.BytesIO(b"".join(lines)), limit))
    assert [n for _, n in got] == [len(x) for x in lines if x]
    assert [raw for raw, _ in got] == [x if len(x.rstrip(b"\n")) <= limit else None for x in lines if x]


def test_read_lines_holds_a_long_line_in_bounded_memory(tmp_path):
    """The plan and the workers read JSONL through read_lines: a 64 MB line costs a few MB."""
    from packer.builder.text import read_lines

    path = tmp_path / "big.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"text": "' + b"x" * (64 << 20) + b'"}\n{"text": "after"}\n')
    tracemalloc.start()
    with open(path, "rb") as f:
        got = [(raw, n) for raw, n in read_lines(f, 1 << 20)]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert got[0] == (None, (64 << 20) + 13) and got[1][0] == b'{"text": "after"}\n'
    assert peak < 8 << 20, peak


def test_text_flags_on_an_image_build_are_refused(tmp_path, image_raw, minilm, capsys):
    """--tokenizer was ignored on an image build, without a word."""
    assert main(["build", str(image_raw), str(tmp_path / "out"), "--tokenizer", str(minilm)]) == 2
    err = one_line(capsys.readouterr().err)
    assert "--tokenizer: RAW" in err and "holds images" in err and "--kind" in err


def test_token_windows_longer_than_the_corpus_are_refused(built):
    """A TokenWindows longer than the corpus had length 0, silently."""
    n = TokenWindows(built["text"], 8).num_tokens
    with pytest.raises(ConfigError, match=f"holds {n:,} tokens, and a window of seq_len {n:,} needs {n + 1:,}"):
        TokenWindows(built["text"], n)
    assert len(TokenWindows(built["text"], n - 1)) == 1


def test_the_padding_value_is_the_users_and_lengths_say_where_it_starts(built):
    """Ragged token batches are padded with 0 unless told otherwise (0 is a real token of many
    vocabularies): padding_value sets it, for MMapDataset batches and PackedDocuments rows."""
    for pad in (0, -100):
        ds = MMapDataset(built["text"], columns=["tokens"], padding_value=pad)
        for batch in Loader(ds, 4, seed=1, num_threads=1):
            tokens, lengths = batch["tokens"], batch["tokens_lengths"]
            for row, n in zip(tokens, lengths.tolist()):
                assert (row[n:] == pad).all()
        for batch in ds.batched(4, seed=1):
            for row, n in zip(batch["tokens"], batch["tokens_lengths"].tolist()):
                assert (row[n:] == pad).all()
        for batch in Loader(PackedDocuments(built["text"], 256, padding_value=pad), 4, num_threads=1):
            for row, positions, n in zip(batch["tokens"], batch["position_ids"], batch["lengths"].tolist()):
                assert (row[n:] == pad).all() and (positions[n:] == 0).all()
