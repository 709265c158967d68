"""The on-disk contract of an mmpack dataset dir, and nothing else (prose twin: FORMAT.md), a
module per part: the format's name, versions and layout (`layout`, FORMAT.md sections 2 and 7),
column files and dtypes (`npy`, 3-4), the manifest schema (`manifest`, 5), integrity
(`checksum`, 6) and the archive form (`archive_form`, 9). `packer.dataset.writer` and `packer.dataset.reader` both go through it;
everything is named here as `fmt.NAME`.
"""

from packer.dataset.format.archive_form import (ARCHIVE_FORMAT, ARCHIVE_NAME, ARCHIVE_SUFFIX, ArchiveFile,
                                                archive_from_json, archive_to_json)
from packer.dataset.format.checksum import (BLOCK_BYTES, FileChecksum, block_digest, checksum_of_blocks,
                                            data_block_bytes, hasher, new_checksum, rows_per_block)
from packer.dataset.format.layout import (BASE_VERSION, KIND_VERSIONS, written_version,
                                          CHECKSUM, FORMAT_NAME, FORMAT_VERSION, INPUTS_NAME, KINDS, LOCK_NAME,
                                          MANIFEST_NAME, READABLE_MAJORS, READERS_LOCK, STAGING_DIR, check_version,
                                          column_file_names, generation_name, is_column_name, is_generation,
                                          shard_dir_name, shard_path)
from packer.dataset.format.manifest import (AUDIO_DTYPES, MAX_CHANNELS, MAX_SAMPLE_RATE, audio_column, check_audio,
                                            DTYPES, ENCODINGS, HEX_DIGITS, IMAGE_LIST_INDEX, IMAGE_LISTS,
                                            LEGACY_CHECKSUMS, MAX_DIM, MAX_NDIM, Column, FileEntry, Manifest, Shard, Skip, columns_text, printable)
from packer.dataset.format.npy import (NPY_HEADER_BYTES, NPY_MAGIC, OFFSETS_DTYPE, SHAPES_DTYPE, choose_token_dtype,
                                       npy_header, parse_npy_header)

__all__ = [
    "ARCHIVE_FORMAT", "ARCHIVE_NAME", "ARCHIVE_SUFFIX", "ArchiveFile", "archive_from_json", "archive_to_json",
    "BLOCK_BYTES", "FileChecksum", "block_digest", "checksum_of_blocks", "data_block_bytes", "hasher",
    "new_checksum", "rows_per_block",
    "BASE_VERSION", "KIND_VERSIONS", "written_version", "CHECKSUM", "FORMAT_NAME", "FORMAT_VERSION", "INPUTS_NAME", "KINDS", "LOCK_NAME", "MANIFEST_NAME",
    "READABLE_MAJORS", "READERS_LOCK", "STAGING_DIR", "check_version", "column_file_names", "generation_name",
    "is_column_name", "is_generation", "shard_dir_name", "shard_path",
    "AUDIO_DTYPES", "MAX_CHANNELS", "MAX_SAMPLE_RATE", "audio_column", "check_audio", "DTYPES", "ENCODINGS", "HEX_DIGITS", "IMAGE_LIST_INDEX", "IMAGE_LISTS", "LEGACY_CHECKSUMS", "MAX_DIM", "MAX_NDIM", "Column", "FileEntry",
    "Manifest", "Shard", "Skip", "columns_text", "printable",
    "NPY_HEADER_BYTES", "NPY_MAGIC", "OFFSETS_DTYPE", "SHAPES_DTYPE", "choose_token_dtype", "npy_header",
    "parse_npy_header",
]
