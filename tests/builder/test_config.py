"""Build flags: each declared once, in `BuildConfig`, as what the bytes depend on or as how the
build runs; the CLI takes them by name, the fingerprint and the --append check follow."""

from __future__ import annotations

from dataclasses import fields

import pytest

from packer import BuildConfig
from packer.builder.config import ALWAYS, UNLESS_DEFAULT
from packer.cli import _parser
from packer.errors import ConfigError

DERIVED = {"shard_rows", "shard_bytes"}  # from shard_size
NOT_FLAGS = {"quiet", "cmd", "func", "zstd", "raw", "out"}  # how it prints, argparse's, how a URL is pushed, positionals


def _build_options() -> set[str]:
    build = next(a for a in _parser()._subparsers._group_actions[0].choices.items() if a[0] == "build")[1]
    return {a.dest for a in build._actions if a.dest != "help"}


def test_every_build_flag_is_a_config_field_and_an_option_of_packer_build():
    """One declaration: a field with its help is the command's flag and `packer.build`'s keyword."""
    import inspect

    import packer

    options = {f.name for f in BuildConfig.options()}
    assert _build_options() - NOT_FLAGS == options
    assert {f.name for f in fields(BuildConfig)} - options == DERIVED | {"raw", "out"}
    keywords = {n for n, p in inspect.signature(packer.build).parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert keywords == options | {"zstd", "on_progress"}


def test_packer_build_takes_the_command_lines_spellings_and_refuses_unknown_options(tmp_path):
    import packer

    config = BuildConfig(tmp_path / "raw", tmp_path / "o", image_size="keep", shard_size="1000",
                         background="1,2,3", part="1/4")
    assert (config.image_size, config.shard_rows, config.shard_bytes, config.background, config.part) == \
        (None, 1000, None, (1, 2, 3), (1, 4))
    with pytest.raises(ConfigError, match="no option image_sizes"):
        packer.build(tmp_path / "raw", tmp_path / "o", image_sizes=64)


def test_every_field_says_whether_the_bytes_depend_on_it(tmp_path):
    for f in fields(BuildConfig):
        assert f.metadata.get("bytes") in (ALWAYS, UNLESS_DEFAULT, None), f.name
    hashed = {f.name for f in fields(BuildConfig) if f.metadata["bytes"]}
    assert {"workers", "engine", "ray_address", "part", "overwrite", "append", "max_skipped"}.isdisjoint(hashed)
    config = BuildConfig(tmp_path / "raw", tmp_path / "out", workers=3, engine="ray", part=(0, 2))
    assert config.params("images", None) == BuildConfig(tmp_path / "raw", tmp_path / "out").params("images", None)


def test_builds_without_the_newer_flags_keep_the_fingerprint_earlier_versions_wrote(tmp_path):
    """The params hashed into the fingerprint are 0.4's for any build that does not set a flag
    added since: running a finished build's command again after an upgrade finds it done."""
    keys_04 = {"raw", "kind", "image_size", "tokenizer_sha256", "text_key", "append_eos", "special_tokens",
               "shard_rows", "shard_bytes", "strict", "background"}
    for size in (64, None):
        assert set(BuildConfig(tmp_path / "raw", tmp_path / "o", image_size=size).params("images", None)) == keys_04
    aspect = BuildConfig(tmp_path / "raw", tmp_path / "o", image_size=64, keep_aspect=True)
    assert aspect.params("images", None)["max_side"] == 128
    assert BuildConfig(tmp_path / "raw", tmp_path / "o", max_doc_bytes=10).params("text", None)["max_doc_bytes"] == 10


def test_append_checks_the_flags_that_change_a_samples_bytes():
    assert set(BuildConfig.append_checked()) == {"image_size", "text_key", "append_eos", "special_tokens", "max_side",
                                                 "sample_rate", "channels", "dtype", "store"}


def test_a_config_without_raw_or_out_is_refused():
    with pytest.raises(ConfigError):
        BuildConfig()


@pytest.mark.parametrize("text", ["4096B", "64KB", "64kib", "256MB", "1GiB", "2g"])
def test_a_cache_limit_reads_sizes_as_shard_size_does(text):
    """One size means one number of bytes wherever a user writes it (binary units)."""
    from packer.builder.config import parse_shard_size
    from packer.remote import parse_limit

    assert parse_limit(text) == parse_shard_size(text)[1]
    assert parse_limit("1.5GB") == 3 * 2**29
