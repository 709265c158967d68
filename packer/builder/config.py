"""A build's configuration: every flag of `packer build` once, each declared with what it is
for. Flags the dataset's bytes depend on (`bytes=`) go into the build's fingerprint (the
manifest's `build`), so a build run again with other ones is refused instead of resumed into a
mix; flags of how the build runs (workers, engine, part, what to do with an existing OUT) are
not hashed. A new flag is a field here with its help text (and its check in `__post_init__`),
and the code that uses it: the command's flag (`packer.cli`), the option of `packer.build`,
the fingerprint, the --append check and the context every shard gets follow from the
declaration. Values come as Python values or as the command line spells them ("keep", "256MB",
"R,G,B", "i/N").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from packer.builder.audio import DEFAULT_MAX_SECONDS, AudioSpec
from packer.builder.audio import DTYPES as AUDIO_DTYPES
from packer.builder.audio import require as require_audio
from packer.builder.forms import FORMS
from packer.builder.forms.fields import FieldOptions
from packer.builder.forms.extra import parse as parse_fields
from packer.builder.forms.labels import read_names
from packer.builder.images import DEFAULT_MAX_PIXELS
from packer.dataset import codec
from packer.dataset.format import printable
from packer.builder.text import MAX_DOC_BYTES, TokenizerSpec, file_sha256, keep_tokenizer, load_tokenizer
from packer.builder.text import resolve_eos, token_dtype
from packer.dataset import format as fmt
from packer.errors import ConfigError
from packer.system import SIZE_UNITS, available_cores

DEFAULT_SHARD_BYTES = 256 * 1024**2
ENGINES = ("local", "ray")
ALWAYS, UNLESS_DEFAULT = "always", "unless default"


def flag(default=None, *, bytes: str | None = None, append: bool = False, help: str | None = None, **cli):
    """A build flag. `bytes`: ALWAYS, in every build's fingerprint; UNLESS_DEFAULT, only where
    set, for flags added after datasets were built without them (running such a build's command
    again after an upgrade still finds it done); None, how the build runs, not what it writes.
    `append`: an --append must use the value the dataset was built with. `help`: what the flag
    does, in the command's help; with it, the field is `--kebab-case` of `packer build` and a
    keyword of `packer.build`; `cli`: argparse's own (type, choices, metavar, nargs, const; a
    bool field is a switch)."""
    return field(default=default, metadata={"bytes": bytes, "append": append, "help": help, "cli": cli})


@dataclass(frozen=True)
class BuildConfig:
    """Everything a build depends on; the CLI's flags map one-to-one onto these fields."""

    raw: Path = flag(bytes=ALWAYS)  # recorded resolved and printable
    out: Path = flag()
    kind: str | None = flag(bytes=ALWAYS, help="force the layout instead of detecting it (images, pairs, text, audio), or "
                            "the input form (parquet, tar, manifest: as --input)",
                            choices=fmt.KINDS + FORMS[1:])  # recorded as the kind the build packs, given or detected
    image_size: int | None = flag(224, bytes=ALWAYS, append=True, help="shorter side resized to S, centre-cropped "
                                  "SxS (default 224); 'keep' for each image's own size", metavar="S")
    tokenizer: Path | None = flag(bytes=ALWAYS, help="Hugging Face tokenizer.json (required for text and pairs)",
                                  type=Path, metavar="PATH")  # recorded as its file's sha256
    chat_template: Path | None = flag(bytes=UNLESS_DEFAULT, help="the model's chat template: a Jinja file, or its "
                                      "tokenizer_config.json (required to pack conversations: records of messages, "
                                      "LLaVA's JSON, DPO pairs)", type=Path, metavar="FILE")  # recorded as its sha256
    text_key: str = flag("text", bytes=ALWAYS, append=True,
                         help="JSONL key / Parquet column holding the text (default text)", metavar="KEY")
    append_eos: str | None = flag(bytes=ALWAYS, append=True, help="append the tokenizer's end token (or token ID) to "
                                  "each document", nargs="?", const="auto", metavar="ID")  # None, "auto" or an id
    special_tokens: bool = flag(False, bytes=ALWAYS, append=True,
                                help="let the tokenizer add its special tokens ([CLS] ...)")
    shard_rows: int | None = flag(bytes=ALWAYS)  # from shard_size
    shard_bytes: int | None = flag(DEFAULT_SHARD_BYTES, bytes=ALWAYS)  # from shard_size
    overwrite: bool = flag(False, help="rebuild over an existing dataset dir")
    strict: bool = flag(False, bytes=ALWAYS, help="fail the build on any skipped record")
    workers: int | None = flag(help="worker processes (default: every core)", type=int, metavar="N")
    engine: str = flag("local", help="run shards here (a process pool, the default) or as Ray tasks", choices=ENGINES)
    ray_address: str | None = flag(help="Ray cluster to join (default: a local one)", metavar="ADDRESS")
    part: tuple[int, int] | None = flag(help="build only part i (0-based) of N into a shared OUT; then 'packer commit "
                                        "OUT'", metavar="i/N")  # (i, N): no publish
    append: bool = flag(False, help="add RAW's new records to the dataset in OUT as new shards")
    allow_new_classes: bool = flag(False, help="with --append: add RAW's new class folders, numbered after the "
                                   "dataset's classes (refused otherwise: ImageFolder would number them in sorted order)")
    allow_changed: bool = flag(False, help="with --append: keep the samples of RAW files deleted or changed since the "
                                           "build (refused otherwise)")
    max_skipped: float | None = flag(help="fail the build when more than this fraction of the records found are "
                                          "skipped (e.g. 0.05)", type=float, metavar="FRACTION")
    background: tuple[int, int, int] | None = flag(bytes=ALWAYS, help="composite transparent images over this colour "
                                                   "(default: alpha dropped, as Pillow's convert)", metavar="R,G,B")
    keep_aspect: bool = flag(False, help="with --image-size S: the whole image, shorter side S, no centre crop (for "
                                         "training-time crops)")  # recorded as max_side
    max_side: int | None = flag(bytes=UNLESS_DEFAULT, append=True, help="with --keep-aspect: the longer side at most "
                                "N (default 2 x S; the image shrinks to fit)", type=int, metavar="N")
    store: str = flag("pixels", bytes=UNLESS_DEFAULT, append=True, help="images stored as decoded pixels (the "
                      "default) or as JPEG bytes: jpeg or jpeg:QUALITY (default 90), a sixth to a tenth of the bytes, "
                      "decoded as batches are read", metavar="pixels|jpeg[:Q]")
    max_pixels: int | None = flag(bytes=UNLESS_DEFAULT, help="skip an image of more pixels than N (default "
                                  f"{DEFAULT_MAX_PIXELS:,}, Pillow's decompression-bomb limit: 0.5 GB decoded)",
                                  type=int, metavar="N")
    max_doc_bytes: int = flag(MAX_DOC_BYTES, bytes=UNLESS_DEFAULT, help="skip a longer document: a .txt file, JSONL "
                              f"line or caption (default {MAX_DOC_BYTES >> 20} MiB)", type=int, metavar="N")
    shard_size: str | int | None = flag(help="rows per shard (1000) or bytes (256MB); default 256MB",
                                       metavar="SIZE")  # parsed into shard_rows / shard_bytes
    input: str | None = flag(bytes=UNLESS_DEFAULT, help="the input form, detected unless given: folder, parquet "
                             "(Hugging Face image datasets), tar (WebDataset shards), manifest (JSONL / JSON / CSV / "
                             "TSV / Parquet naming image files), coco (annotations/instances_*.json: images with their "
                             "boxes)", choices=FORMS)
    image_key: str | None = flag(bytes=UNLESS_DEFAULT, help="the field, column or tar member extension "
                                 "holding the image (default: image, image_path, img, file_name, filepath, path; jpg, "
                                 "png, webp in a tar)", metavar="KEY")
    label_key: str | None = flag(bytes=UNLESS_DEFAULT, help="... holding the label (default: label, cls, "
                                 "labels)", metavar="KEY")
    id_key: str | None = flag(bytes=UNLESS_DEFAULT, help="... holding the sample's id, its key (default: "
                              "id, key, __key__)", metavar="KEY")
    classes: Path | None = flag(bytes=UNLESS_DEFAULT, help="class names, one a line, that integer labels "
                                "index (tars, manifests; a Hugging Face ClassLabel's names otherwise)", type=Path,
                                metavar="FILE")  # recorded as its names
    split: str | None = flag(bytes=UNLESS_DEFAULT, help="build this split of a Hugging Face or WebDataset dataset: "
                             "its train-*.parquet, train-*.tar, train.jsonl or train/ files", metavar="NAME")
    manifest: Path | None = flag(bytes=UNLESS_DEFAULT, help="the manifest to read where RAW holds several (JSONL, "
                                 "JSON, CSV, TSV or Parquet naming image files; a path, or relative to RAW)", type=Path,
                                 metavar="FILE")  # recorded as given
    quoted_tsv: bool = flag(False, bytes=UNLESS_DEFAULT, help="read .tsv tables with CSV quoting (a field in double "
                            "quotes may hold tabs); by default a TSV's quotes are text, as Common Voice writes them")
    fields: str | None = flag(bytes=UNLESS_DEFAULT, help="keep these fields of each record as columns (a manifest's, "
                              "a Parquet row's, a tar sample's .json keys, a Common Voice row's), NAME=DEFAULT for a "
                              "default where a record lacks it: speaker,age=0,url=", metavar="NAME[=DEFAULT],...")
    allow_outside: bool = flag(False, bytes=UNLESS_DEFAULT, help="pack files a manifest names outside RAW (absolute "
                               "paths, '..', links out of RAW); by default each is a skip")
    no_text: bool = flag(False, bytes=UNLESS_DEFAULT, help="pack the images of an input that has captions without "
                                                            "them (else --tokenizer is needed); the audio without its "
                                                            "transcripts")
    sample_rate: int | None = flag(bytes=UNLESS_DEFAULT, append=True, help="audio: every clip resampled to this rate "
                                   "(Hz; required to pack audio)", type=int, metavar="HZ")
    channels: int | None = flag(bytes=UNLESS_DEFAULT, append=True, help="audio: 1 (the mean of a file's channels; "
                                "the default) or 2", type=int, choices=(1, 2))
    dtype: str | None = flag(bytes=UNLESS_DEFAULT, append=True, help="audio: stored as int16 PCM (the default) or "
                             "float32", choices=tuple(AUDIO_DTYPES))
    max_seconds: float | None = flag(bytes=UNLESS_DEFAULT, help="audio: skip a clip longer than this (default "
                                     f"{DEFAULT_MAX_SECONDS:g} s)", type=float, metavar="S")

    def __post_init__(self) -> None:
        if self.raw is None or self.out is None:
            raise ConfigError("a build needs RAW and OUT")
        object.__setattr__(self, "raw", Path(self.raw).expanduser())  # a shell expands ~; a Python caller's too
        object.__setattr__(self, "out", Path(self.out).expanduser())
        self._read_spellings()
        if self.kind in FORMS[1:]:  # a form named as a kind: the form forced, the kind detected
            if self.input not in (None, self.kind):
                raise ConfigError(f"--kind {self.kind} and --input {self.input}: name the input form once")
            object.__setattr__(self, "input", self.kind)
            object.__setattr__(self, "kind", None)
        if self.manifest is not None:  # one manifest named: the form is a manifest
            if self.input not in (None, "manifest"):
                raise ConfigError(f"--manifest {self.manifest} and --input {self.input}: a manifest is --input manifest")
            object.__setattr__(self, "input", "manifest")
        if self.kind is not None and self.kind not in fmt.KINDS:
            raise ConfigError(f"--kind: {self.kind!r} is not one of {', '.join(fmt.KINDS + FORMS[1:])}")
        if self.image_size is not None and not 1 <= self.image_size <= 16384:
            raise ConfigError(f"--image-size: {self.image_size} is out of range (1..16384 or 'keep')")
        if self.shard_rows is None and self.shard_bytes is None:
            raise ConfigError("--shard-size: give rows or bytes")
        if self.out.resolve() == self.raw.resolve() or self.raw.resolve() in self.out.resolve().parents:
            raise ConfigError(f"{self.out}: OUT must not lie inside RAW ({self.raw})")
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"--workers: {self.workers} must be at least 1")
        if self.engine not in ENGINES:
            raise ConfigError(f"--engine: {self.engine!r} is not one of {', '.join(ENGINES)}")
        if self.part is not None and not 0 <= self.part[0] < self.part[1]:
            raise ConfigError(f"--part: {self.part[0]}/{self.part[1]} needs 0 <= i < N")
        if self.append and (self.overwrite or self.part):
            raise ConfigError("--append cannot be combined with --overwrite or --part")
        if self.background is not None and (len(self.background) != 3 or not all(
                isinstance(v, int) and 0 <= v <= 255 for v in self.background)):
            raise ConfigError(f"--background: {self.background} is not three values 0..255 (R,G,B)")
        if self.keep_aspect and self.image_size is None:
            raise ConfigError("--keep-aspect needs a number for --image-size (the shorter side), not 'keep'")
        if self.max_side is not None and not self.keep_aspect:
            raise ConfigError("--max-side caps keep-aspect images: add --keep-aspect")
        if self.max_side is not None and not self.image_size <= self.max_side <= 65535:
            raise ConfigError(f"--max-side: {self.max_side} must lie between --image-size ({self.image_size}) and 65535")
        if self.max_pixels is not None and not 1 <= self.max_pixels <= 1 << 40:
            raise ConfigError(f"--max-pixels: {self.max_pixels} must lie between 1 and 2**40")
        if not 1 <= self.max_doc_bytes <= 1 << 40:
            raise ConfigError(f"--max-doc-bytes: {self.max_doc_bytes} must lie between 1 and 2**40")
        if self.max_skipped is not None and not 0 <= self.max_skipped <= 1:
            raise ConfigError(f"--max-skipped: {self.max_skipped} is not a fraction between 0 and 1")
        if self.sample_rate is not None and not 1000 <= self.sample_rate <= fmt.MAX_SAMPLE_RATE:
            raise ConfigError(f"--sample-rate: {self.sample_rate} Hz is out of range (1000..{fmt.MAX_SAMPLE_RATE})")
        if self.channels not in (None, 1, 2):
            raise ConfigError(f"--channels: {self.channels} is not 1 or 2")
        if self.dtype not in (None, *AUDIO_DTYPES):
            raise ConfigError(f"--dtype: {self.dtype!r} is not one of {', '.join(AUDIO_DTYPES)}")
        if self.max_seconds is not None and not 0 < self.max_seconds <= 86400:
            raise ConfigError(f"--max-seconds: {self.max_seconds:g} must be more than 0 and at most 86400 (a day)")

    def _read_spellings(self) -> None:
        """The values the command line spells as text, as the fields hold them."""
        def put(name, value):
            object.__setattr__(self, name, value)
        if isinstance(self.image_size, str):
            try:
                put("image_size", None if self.image_size == "keep" else int(self.image_size))
            except ValueError:
                raise ConfigError(f"--image-size: {self.image_size!r} is neither a number nor 'keep'") from None
        if self.shard_size is not None:
            rows, nbytes = parse_shard_size(str(self.shard_size))
            put("shard_rows", rows)
            put("shard_bytes", nbytes)
        name, quality = codec.parse_store(self.store)
        put("store", name if quality is None else f"{name}:{quality}")  # one spelling: one fingerprint
        if isinstance(self.background, str):
            try:
                put("background", tuple(int(v) for v in self.background.split(",")))
            except ValueError:
                raise ConfigError(f"--background: {self.background!r} is not R,G,B (e.g. 255,255,255)") from None
        elif self.background is not None:
            put("background", tuple(self.background))
        if isinstance(self.part, str):
            put("part", parse_part(self.part))
        elif self.part is not None:
            put("part", tuple(self.part))
        if self.tokenizer is not None:
            put("tokenizer", Path(self.tokenizer))
        if self.manifest is not None:
            put("manifest", Path(self.manifest))
        for name, kind in (("sample_rate", int), ("channels", int), ("max_seconds", float)):
            value = getattr(self, name)
            try:  # "16000" as the flag spells it, 16000.0 as a number; 16000.5 is no rate
                if value is not None and not isinstance(value, bool) and float(value) == kind(float(value)):
                    put(name, kind(float(value)))
                    continue
            except (TypeError, ValueError):
                pass
            if value is not None:
                raise ConfigError(f"--{name.replace('_', '-')}: {value!r} is not a whole number"
                                  if kind is int else f"--{name.replace('_', '-')}: {value!r} is not a number")

    def form_options(self) -> FieldOptions:
        """What the input forms' scans read (`packer.builder.forms`)."""
        return FieldOptions(image=self.image_key, text=self.text_key, label=self.label_key, id=self.id_key,
                            no_text=self.no_text, classes=read_names(self.classes) if self.classes else None,
                            split=self.split, max_doc_bytes=self.max_doc_bytes,
                            manifest=None if self.manifest is None else str(self.manifest), quoted_tsv=self.quoted_tsv,
                            allow_outside=self.allow_outside, fields=parse_fields(self.fields),
                            whole_images=(self.image_size, self.side_cap) if self.keep_aspect or self.image_size is None
                            else None)

    @staticmethod
    def options() -> tuple:
        """The fields that are flags of `packer build` and options of `packer.build`."""
        return tuple(f for f in fields(BuildConfig) if f.metadata["help"])

    @property
    def chat_image_list(self) -> str | None:
        """How a chat build stores its conversations' images: None for S x S pixels stacked, else
        the image-list encoding ("pixels-list" or "jpeg-list") of images at their own sizes or as
        JPEG (--keep-aspect, --image-size keep, --store jpeg)."""
        store = codec.parse_store(self.store)[0]
        if not (self.keep_aspect or self.image_size is None or store != "pixels"):
            return None
        return "jpeg-list" if store == codec.JPEG else "pixels-list"

    @property
    def side_cap(self) -> int | None:
        """The longer side's cap of a keep-aspect build (None: not one)."""
        return (self.max_side or 2 * self.image_size) if self.keep_aspect else None

    @property
    def num_workers(self) -> int:
        return self.workers or available_cores()

    def params(self, kind: str, tokenizer: TokenizerSpec | None, template=None) -> dict:
        """The flags the dataset's bytes depend on, by their recorded names and values: what the
        fingerprint hashes and the manifest's `build` records (not workers, engine or part)."""
        recorded = {"raw": ("raw", printable(str(self.raw.resolve()))), "kind": ("kind", kind),
                    "chat_template": ("chat_template", template.manifest() if template is not None else None),
                    "classes": ("classes", list(read_names(self.classes)) if self.classes else None),
                    "tokenizer": ("tokenizer_sha256", tokenizer.sha256 if tokenizer else None),
                    "background": ("background", list(self.background) if self.background else None),
                    "max_side": ("max_side", self.side_cap),
                    "manifest": ("manifest", None if self.manifest is None else str(self.manifest))}
        params = {}
        for f in fields(self):
            name, value = recorded.get(f.name, (f.name, getattr(self, f.name)))
            how = f.metadata["bytes"]
            if how == ALWAYS or (how == UNLESS_DEFAULT and value not in (None, f.default)):
                params[name] = value
        return params

    @staticmethod
    def append_checked() -> tuple[str, ...]:
        """The recorded names of the flags an --append must repeat."""
        return tuple(f.name for f in fields(BuildConfig) if f.metadata["append"])

    def audio_spec(self, kind: str) -> AudioSpec | None:
        """What an audio build makes of each clip (None for other kinds, which refuse the audio
        flags)."""
        given = [f"--{f.replace('_', '-')}" for f in ("sample_rate", "channels", "dtype", "max_seconds")
                 if getattr(self, f) is not None]
        if kind != "audio":
            if given:
                raise ConfigError(f"{', '.join(given)}: RAW {self.raw} holds {kind}, not audio; drop the flag, or "
                                  "pass --kind audio")
            return None
        require_audio()
        if self.sample_rate is None:
            raise ConfigError(f"--sample-rate HZ is required to pack audio (RAW {self.raw}): the rate every clip is "
                              "resampled to, e.g. 16000 for speech models")
        return AudioSpec(self.sample_rate, self.channels or 1, AUDIO_DTYPES[self.dtype or "int16"],
                         self.max_seconds or DEFAULT_MAX_SECONDS)

    def tokenizer_for(self, kind: str, why: str = "", *, transcribed: bool = True):
        """(tokenizer, TokenizerSpec) of a text or pairs build, or of audio with transcripts;
        None for images and audio without, whose builds refuse text flags."""
        if kind == "audio" and self.no_text:
            transcribed = False
        if kind == "chat" and self.tokenizer is None:
            raise ConfigError(f"--tokenizer PATH/tokenizer.json is required to pack the conversations of RAW {self.raw}: "
                              "the model's tokenizer, whose special tokens its chat template writes")
        if kind == "images" or (kind == "audio" and not transcribed):
            text_flags = [flag for flag, given in (("--tokenizer", self.tokenizer is not None),
                                                    ("--text-key", self.text_key != "text"),
                                                    ("--append-eos", self.append_eos is not None),
                                                    ("--special-tokens", self.special_tokens)) if given]
            if text_flags:
                raise ConfigError(f"{', '.join(text_flags)}: RAW {self.raw} holds images ({why}), which are not "
                                  "tokenized; drop the flag, or pass --kind pairs or --kind text if RAW is not images")
            return None
        if self.tokenizer is None:
            images = {"pairs": "; or --no-text to pack its images without their captions",
                      "audio": "; or --no-text to pack its audio without the transcripts"}.get(kind, "")
            if kind == "audio":
                raise ConfigError(f"--tokenizer PATH/tokenizer.json is required to pack the transcripts of RAW "
                                  f"{self.raw} ({why}){images}")
            raise ConfigError(f"--tokenizer PATH/tokenizer.json is required to pack {kind}: RAW {self.raw} holds "
                              f"{why}; if it is not {kind}, pass --kind{images}")
        tok = load_tokenizer(self.tokenizer)
        eos_id = resolve_eos(tok, self.append_eos)
        spec = TokenizerSpec(path=str(Path(self.tokenizer).resolve()), sha256=file_sha256(self.tokenizer),
                             vocab_size=tok.get_vocab_size(with_added_tokens=True), dtype=token_dtype(tok, eos_id),
                             eos_id=eos_id, add_special_tokens=self.special_tokens)
        keep_tokenizer(spec, tok)
        return tok, spec

    def template_for(self, kind: str):
        """A chat build's template (`packer.builder.chat.template.TemplateSpec`); None for other
        kinds, which refuse the flag."""
        if kind != "chat":
            if self.chat_template is not None:
                raise ConfigError(f"--chat-template: RAW {self.raw} holds {kind}, not conversations; drop the flag, or "
                                  "pass --kind chat")
            return None
        if self.chat_template is None:
            raise ConfigError(f"--chat-template FILE is required to pack the conversations of RAW {self.raw}: the "
                              "model's tokenizer_config.json (its chat_template), or the template as a .jinja file")
        from packer.builder.chat.template import load_spec

        return load_spec(self.chat_template, self.tokenizer)

    def columns(self, kind: str, tokenizer: TokenizerSpec | None, *, labeled: bool,
                chat: dict | None = None, extras: tuple = ()) -> tuple[fmt.Column, ...]:
        """The columns this build writes (`chat`: a chat build's fields, `packer.builder.chat.scan`;
        `extras`: --fields' columns, before the key)."""
        columns = self._columns(kind, tokenizer, labeled=labeled, chat=chat)
        return (*columns[:-1], *extras, columns[-1]) if extras else columns

    def _columns(self, kind: str, tokenizer: TokenizerSpec | None, *, labeled: bool,
                 chat: dict | None = None) -> tuple[fmt.Column, ...]:
        if kind == "chat":
            return self._chat_columns(tokenizer, chat or {})
        size = None if self.keep_aspect else self.image_size
        store, _ = codec.parse_store(self.store)
        if store != "pixels" and kind not in ("images", "pairs"):
            raise ConfigError(f"--store {self.store}: RAW {self.raw} holds {kind}, which has no images to store as "
                              "JPEG; drop the flag")
        image = fmt.Column("image", "|u1", (size, size, 3) if size else (None, None, 3),
                           encoding=codec.JPEG if store == codec.JPEG else None)
        key = fmt.Column("key", "|u1", (None,), encoding="utf-8")
        if kind == "images":  # a flat folder has no classes: no label column
            return (image, fmt.Column("label", "<i8", ()), key) if labeled else (image, key)
        if kind == "audio":
            spec = self.audio_spec(kind)
            return (fmt.audio_column(spec.dtype, spec.channels), *((fmt.Column("label", "<i8", ()),) if labeled else ()),
                    *((fmt.Column("tokens", tokenizer.dtype, (None,)),) if tokenizer else ()), key)
        tokens = fmt.Column("tokens", tokenizer.dtype, (None,))
        if kind == "pairs":  # a record with a caption and a label keeps both
            return (image, fmt.Column("label", "<i8", ()), tokens, key) if labeled else (image, tokens, key)
        return (tokens, key)


    def _chat_columns(self, tokenizer: TokenizerSpec, chat: dict) -> tuple[fmt.Column, ...]:
        key = fmt.Column("key", "|u1", (None,), encoding="utf-8")
        if chat.get("pairs"):
            return (*(fmt.Column(f"{side}_{name}", dtype, (None,)) for side in ("chosen", "rejected")
                      for name, dtype in (("tokens", tokenizer.dtype), ("loss_mask", "|u1"))), key)
        columns = (fmt.Column("tokens", tokenizer.dtype, (None,)), fmt.Column("loss_mask", "|u1", (None,)))
        if not chat.get("image"):
            return (*columns, key)
        positions = fmt.Column("image_positions", "<i8", (None,))
        if self.chat_image_list:  # each image at its own size
            listed = fmt.Column("images", "|u1", (None,), encoding=self.chat_image_list)
            index = (fmt.Column(name, dtype, shape) for name, (dtype, shape) in fmt.IMAGE_LIST_INDEX.items())
            return (*columns, listed, *index, positions, key)
        size = self.image_size
        return (*columns, fmt.Column("images", "|u1", (None, size, size, 3)), positions, key)


def parse_shard_size(text: str) -> tuple[int | None, int | None]:
    """'1000' or '1000rows' -> (rows, None); '256MB', '1GiB', '4096B' -> (None, bytes)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or (unit not in SIZE_UNITS and unit not in ("row", "rows")) or int(m.group(1)) <= 0:
        raise ConfigError(f"--shard-size: {text!r} is neither a row count (1000) nor a size (256MB)")
    if unit in ("", "row", "rows") and not text.strip().lower().endswith("b"):
        return int(m.group(1)), None
    return None, int(m.group(1)) * SIZE_UNITS[unit]


def parse_part(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if m is None:
        raise ConfigError(f"--part: {text!r} is not i/N (e.g. 0/4 for the first of 4 parts)")
    return int(m.group(1)), int(m.group(2))
