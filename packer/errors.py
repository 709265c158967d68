"""The one exception hierarchy of mmpack, shared by packer and loaders.

Every error a user can cause is a subclass of MmpackError; the CLI prints its message as one line.
"""


class MmpackError(Exception):
    """Base class: a problem the user can fix, reported as one line."""


class ConfigError(MmpackError, ValueError):
    """Bad arguments or options (missing tokenizer, OUT exists, bad shard size); also a
    ValueError, what Python code that checks arguments raises and catches."""


class SourceError(MmpackError):
    """A raw input cannot be used: a bad record, an empty RAW, no recognisable layout."""


class ManifestError(MmpackError):
    """A manifest is missing, malformed, or of a format version this reader cannot read."""


class IntegrityError(MmpackError):
    """Column files disagree with the manifest: size, checksum, header, offsets or row counts."""


class ColumnError(ConfigError, KeyError):
    """A column the dataset does not have (also a KeyError, for code that catches one)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""
