"""`bench doctor` on a Minimind-style SFT script (tests/tools/doctor_chat.py): it is told to pack
its conversations, with the exact `packer build ... --chat-template` command for the JSONL it
reads and the `PackedDocuments` line that replaces its DataLoader, measured; the command, run,
builds a dataset that opens."""

from __future__ import annotations

import shlex
import sys

import pytest

from .test_doctor import ROOT, _doctor

pytest.importorskip("transformers")


@pytest.mark.timing
def test_a_chat_sft_dataset_is_told_the_exact_packer_build_and_the_packed_documents_line(tmp_path):
    from bench import dialogue
    from bench.chat_bench import model_folder
    from loaders import Loader, PackedDocuments
    from packer.cli import main

    tmp = tmp_path.resolve()
    model = model_folder(tmp / "model")
    data = dialogue.write_minimind(tmp / "data" / "sft.jsonl", 120, seed=3)
    (tmp / "data" / "notes.txt").write_text("not conversations: packer build skips it")
    report, proc = _doctor(tmp_path, "--data_path", data, "--tokenizer_path", model, steps=6,
                           script=ROOT / "tests" / "tools" / "doctor_chat.py")
    assert report["verdict"].startswith("data-bound"), report["verdict"]
    first, out = report["fixes"][0], tmp / "data-packed"
    command = (f"packer build {tmp / 'data'} {out} --tokenizer {model / 'tokenizer.json'} --chat-template "
               f"{model / 'tokenizer_config.json'}")
    line = f"from loaders import Loader, PackedDocuments; loader = Loader(PackedDocuments('{out}', seq_len=512), batch_size=8)"
    assert first["fix"].startswith(f"pack the data once: {command}; then in the script, {line} in place of the DataLoader")
    assert first["how"].startswith("measured") and first["gain"] > 3 and first["fix"] in proc.stdout
    assert report["packed"]["conversations"] == 120 and report["packed"]["seq_len"] == 512
    assert main([*shlex.split(command)[1:], "-q"]) == 0  # the command, run: a dataset that opens and packs
    with Loader(PackedDocuments(out, seq_len=512), batch_size=8) as loader:
        batch = next(iter(loader))
    assert batch["tokens"].shape == (8, 512) and (batch["labels"] != -100).any()


def test_the_chat_file_is_found_in_the_dataset_or_argv_and_given_a_folder_of_its_own_beside_others(tmp_path,
                                                                                                     monkeypatch):
    from bench.doctor.chat import _data_file, _where

    f = tmp_path / "data" / "sft.jsonl"
    f.parent.mkdir()
    f.write_text("{}\n")
    dataset = type("SFT", (), {})()
    dataset.data_files = [str(f)]  # an attribute, a list of paths too
    assert _data_file(dataset) == f.resolve()
    dataset.data_files = []
    monkeypatch.setattr(sys, "argv", ["train.py", "--lr", "1", f"--data_path={f}"])  # else the script's argv
    assert _data_file(dataset) == f.resolve()
    assert _where(f) == (f.parent, tmp_path / "data-packed")
    (f.parent / "dpo.jsonl").write_text("{}\n")  # another file packer build would read: a folder of its own
    assert _where(f) == (f.parent / "sft", f.parent / "sft-packed")
