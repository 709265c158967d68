"""A chat template, rendered as transformers' `apply_chat_template` renders it: the same Jinja
sandbox (`ImmutableSandboxedEnvironment`, trim_blocks and lstrip_blocks, loop controls), the
same globals (`raise_exception`, `strftime_now`, a `tojson` that leaves HTML alone, a
`namespace` that refuses underscored names) and the same variables (`messages`,
`add_generation_prompt` False, the tokenizer's named special tokens: `bos_token`, `eos_token`,
...), so the text, and so the tokens, equal what transformers gives for the conversation.

Where the assistant's tokens lie: inside `{% generation %}` blocks where the template has them
(transformers' `return_assistant_tokens_mask`), else each assistant message's rendering with
the end-of-turn text the template writes after it, found by rendering the conversation up to
it with `add_generation_prompt=True` and through it: the span between the two. A template that
renders the start of a conversation differently once it goes on (not prefix-stable) gives no
such span: that record is a skip saying to add generation blocks. A template that raises
(`raise_exception`, a missing key), or one that tries to reach Python's internals (the
sandbox's SecurityError), is the record's skip, never the build's end.
"""

from __future__ import annotations

import hashlib
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from packer.errors import ConfigError, SourceError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
INSTALL = 'pip install "mmpack[chat]" (jinja2 3.1.6 or newer)'


@dataclass(frozen=True)
class TemplateSpec:
    """What a build records of its chat template: where it was read, its text's sha256, and the
    special tokens it is rendered with."""

    path: str
    sha256: str
    source: str
    special: tuple[tuple[str, str], ...]

    def manifest(self) -> dict:
        return {"path": self.path, "sha256": self.sha256, "special_tokens": dict(self.special),
                "generation_blocks": bool(_GENERATION.search(self.source))}


def load_spec(path: str | Path, tokenizer: str | Path | None = None) -> TemplateSpec:
    """--chat-template FILE: a Jinja template, or a `tokenizer_config.json` (its `chat_template`,
    and its special tokens). A bare template takes its special tokens from the
    `tokenizer_config.json` beside the tokenizer, where there is one (a model's folder)."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--chat-template {path}: unreadable ({exc}); give a Jinja template or a "
                          "tokenizer_config.json") from None
    config = _config(path, text) if path.suffix.lower() == ".json" else None
    if config is not None:
        source = _template_of(config, path)
    else:
        source = text
        beside = Path(tokenizer).expanduser().parent / "tokenizer_config.json" if tokenizer else None
        config = _config(beside, beside.read_text(encoding="utf-8")) if beside and beside.is_file() else {}
    special = tuple((k, v) for k in SPECIAL_TOKENS if (v := _token_text(config.get(k))) is not None)
    compile_template(source, str(path))  # a template that does not parse is the build's error, at once
    return TemplateSpec(str(path.resolve()), hashlib.sha256(source.encode("utf-8")).hexdigest(), source, special)


def _config(path: Path, text: str) -> dict:
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{path}: not JSON ({exc}); give a tokenizer_config.json or a Jinja template") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: not a tokenizer_config.json (a JSON object)")
    return doc


def _template_of(config: dict, path: Path) -> str:
    found = config.get("chat_template")
    if isinstance(found, list):  # several named templates: transformers' default is "default"
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        found = named.get("default")
    if not isinstance(found, str) or not found.strip():
        raise ConfigError(f"--chat-template {path}: has no chat_template (or no 'default' one); give the model's "
                          "tokenizer_config.json, or the template as a .jinja file")
    return found


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # an AddedToken, as tokenizer_config.json stores one
        value = value.get("content")
    return value if isinstance(value, str) else None


_compiled: dict[str, object] = {}


def compile_template(source: str, where: str = "the chat template"):
    """The template compiled in transformers' sandbox (cached per process)."""
    if source in _compiled:
        return _compiled[source]
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError(f"--chat-template needs jinja2: {INSTALL}") from None
    if tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3]) < (3, 1, 6):
        raise ConfigError(f"--chat-template: jinja2 {jinja2.__version__} has known sandbox escapes; {INSTALL}")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_tracker_class(), "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=_TemplateDict(), namespace=_namespace_class())
    try:
        compiled = env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"{where}: not a Jinja template ({exc.message}, line {exc.lineno})") from None
    _compiled[source] = compiled
    return compiled


def _raise(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateDict:
    """`dict(...)` in a template, without the type's other attributes."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _namespace_class():
    import jinja2

    class TemplateNamespace(jinja2.utils.Namespace):
        """A namespace that refuses underscored names (a way out of the sandbox)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_' ({name!r})")

    return TemplateNamespace


def _tracker_class():
    """transformers' `{% generation %}` extension: the character span of each block's output
    in the rendered text, while a tracker is active."""
    import jinja2
    from jinja2.ext import Extension

    class GenerationTracker(Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(tracking=self.tracking)
            self._active = None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_block"), [], [], body).set_lineno(lineno)

        def _block(self, caller):
            out = caller()
            if self._active is not None:
                blocks, spans = self._active
                start = sum(len(b) for b in blocks)
                spans.append((start, start + len(out)))
            return out

        @contextmanager
        def tracking(self, blocks: list, spans: list):
            self._active = (blocks, spans)
            try:
                yield
            finally:
                self._active = None

    return GenerationTracker


class ChatTemplate:
    """A template ready to render conversations (a worker makes one per build)."""

    def __init__(self, spec: TemplateSpec):
        self.spec = spec
        self.compiled = compile_template(spec.source, spec.path)
        self.blocks = bool(_GENERATION.search(spec.source))
        self.variables = dict(spec.special)

    def text(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
        try:
            return self.compiled.render(messages=messages, tools=None, documents=None,
                                        add_generation_prompt=add_generation_prompt, **self.variables)
        except Exception as exc:  # noqa: BLE001 - raise_exception, a missing key, the sandbox: this record's skip
            raise SourceError(f"the chat template raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                              if str(exc) else f"the chat template raised {type(exc).__name__}") from None

    def render(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text, and the character spans of the assistant's turns in it."""
        if self.blocks:
            return self._with_blocks(messages)
        text = self.text(messages)
        spans = []
        for k, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self.text(messages[:k], add_generation_prompt=True)
            through = self.text(messages[:k + 1])
            if not (through.startswith(before) and text.startswith(through)):
                raise SourceError("the chat template renders the conversation's start differently once it goes on, so "
                                  "its assistant turns cannot be found; give the template {% generation %} blocks")
            if len(through) > len(before):
                spans.append((len(before), len(through)))
        return text, spans

    def _with_blocks(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        blocks, spans = [], []
        try:
            with self.compiled.environment.tracking(blocks, spans):
                for block in self.compiled.generate(messages=messages, tools=None, documents=None,
                                                    add_generation_prompt=False, **self.variables):
                    blocks.append(block)
        except Exception as exc:  # noqa: BLE001 - as in `text`
            raise SourceError(f"the chat template raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                              if str(exc) else f"the chat template raised {type(exc).__name__}") from None
        return "".join(blocks), spans
