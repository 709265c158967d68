"""Which field of a record plays which role (the image, its caption, its label, its id), from
the usual spellings or from the flags that name them, with one error when a named field is
nowhere: a typo must not skip a whole dataset and exit 0."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from packer.errors import ConfigError

ROLES = ("image", "text", "label", "id")
SPELLINGS = {  # the names datasets use, in the order they are tried
    "image": ("image", "image_path", "img", "file_name", "filepath", "path", "jpg", "jpeg", "png", "webp"),
    "text": ("text", "caption", "txt"),
    "label": ("label", "cls", "labels"),
    "id": ("id", "key", "__key__"),
}
FLAGS = {"image": "--image-key", "text": "--text-key", "label": "--label-key", "id": "--id-key"}
DEFAULT_TEXT_KEY = "text"  # --text-key's default: other spellings are tried too while it is left so


@dataclass(frozen=True)
class FieldOptions:
    """The fields the user named (None: detect), `no_text` (captions left out on purpose) and
    the other options an input form reads (`packer.builder.config.BuildConfig.form_options`)."""

    image: str | None = None
    text: str | None = None
    label: str | None = None
    id: str | None = None
    no_text: bool = False
    classes: tuple[str, ...] | None = None  # --classes FILE's names
    split: str | None = None
    max_doc_bytes: int = 64 << 20
    manifest: str | None = None  # --manifest FILE: the one manifest to read
    quoted_tsv: bool = False  # a TSV's double quotes are CSV quoting, not text
    allow_outside: bool = False  # a manifest may name files outside RAW
    fields: tuple = ()  # --fields: the records' other fields kept (`extra.Field`s)
    whole_images: tuple[int | None, int | None] | None = None  # (S, max side) of a keep-aspect or 'keep' build

    def named(self, role: str) -> str | None:
        value = getattr(self, role)
        return None if role == "text" and value == DEFAULT_TEXT_KEY else value


def choose(names: Iterable[str], options: FieldOptions, where: str, *, roles=ROLES,
           spellings=SPELLINGS) -> dict[str, str | None]:
    """The field of each role among `names` (the columns, keys or extensions of `where`): the
    one the user named, which must be there, else the first usual spelling that is; the text
    not at all with --no-text."""
    names = list(names)
    chosen: dict[str, str | None] = {}
    for role in roles:
        given = options.named(role)
        if given is not None:
            if given not in names:
                raise ConfigError(f"{FLAGS[role]} {given!r}: {where} has no such field (it has "
                                  f"{', '.join(map(repr, names[:12])) or 'none'}); pass the one that holds the {role}")
            chosen[role] = given
        else:
            chosen[role] = next((n for n in spellings[role] if n in names and n not in chosen.values()), None)
    if options.no_text:
        chosen["text"] = None
    return chosen


def describe(fields: dict[str, str | None]) -> str:
    """'image: image, label: label' for messages and `packer info`."""
    return ", ".join(f"{role}: {name}" for role, name in fields.items() if name is not None)
