"""A record's conversation as the template is given it: `messages` or `conversations`, a list
of `{role, content}` (OpenAI, Hugging Face, Minimind) or `{from, value}` (ShareGPT, LLaVA:
`human` is the user, `gpt` the assistant), an optional `system` field put first, and an
optional `image` (a path, or a list of them) whose `<image>` placeholders say where each
image goes (one per image; none: the images go first in the first user turn, as LLaVA's
preprocessing puts them). A DPO record (`prompt`, `chosen`, `rejected`) is two conversations
that share their prompt.

Messages reach the template as transformers hands them over: keys whose value is null
dropped, a message's reasoning copied under the names templates read (`reasoning_content`,
`thinking`). Anything else (an unknown role, an empty conversation, a content that is not
text, placeholders that do not match the images) is the record's skip with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from packer.errors import SourceError

MESSAGE_FIELDS = ("messages", "conversations", "conversation")
PAIR_FIELDS = ("prompt", "chosen", "rejected")
ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "system": "system",
         "tool": "tool"}
IMAGE_TOKEN = "<image>"
_REASONING = ("reasoning_content", "thinking", "reasoning")


@dataclass(frozen=True)
class Conversation:
    messages: list
    images: tuple[str | bytes, ...] = ()  # paths, or a Parquet row's image bytes


def field_of(record: dict) -> str | None:
    """The field that holds a record's messages (None: not a conversation record)."""
    return next((f for f in MESSAGE_FIELDS if isinstance(record.get(f), list)), None)


def is_pair(record: dict) -> bool:
    """A preference pair: `chosen` and `rejected` (each a whole conversation, as Minimind writes
    them, or the answers to a `prompt`)."""
    return "chosen" in record and "rejected" in record


def image_paths(record: dict) -> tuple[str | bytes, ...]:
    """The record's images as given: each a path (relative to its file's folder), or its bytes
    (a Hugging Face Parquet row's Image feature, `{bytes, path}`: its bytes where it has them)."""
    value = record.get("image", record.get("images"))
    if value is None:
        return ()
    out = []
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, dict):  # the Image feature's struct
            v = v.get("bytes") or v.get("path")
        if isinstance(v, (bytes, bytearray)) and v:
            out.append(bytes(v))
        elif isinstance(v, str) and v:
            out.append(v)
        else:
            raise SourceError("'image' is neither a path, nor image bytes, nor a list of them")
    return tuple(out)


def conversation(record: dict) -> Conversation:
    """The record's messages, normalized (see the module), with its image paths."""
    field = field_of(record)
    if field is None:
        raise SourceError(f"no conversation ({' or '.join(map(repr, MESSAGE_FIELDS))}: a list of messages)")
    messages = [_message(m, i) for i, m in enumerate(record[field])]
    system = record.get("system")
    if isinstance(system, str) and system and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system})
    if not any(m["role"] != "system" for m in messages):
        raise SourceError("an empty conversation (no user or assistant message)")
    images = image_paths(record)
    return Conversation(_placed(messages, len(images)), images)


def pair(record: dict) -> tuple[Conversation, Conversation]:
    """A DPO record's chosen and rejected conversations: its prompt (a string, or messages; none:
    each side is a whole conversation) followed by each answer (a string, or messages)."""
    prompt = _turns(record["prompt"], "user", "prompt") if "prompt" in record else []
    images = image_paths(record)
    out = []
    for name in ("chosen", "rejected"):
        messages = prompt + _turns(record[name], "assistant", name)
        out.append(Conversation(_placed(messages, len(images)), images))
    return out[0], out[1]


def _turns(value, role: str, name: str) -> list[dict]:
    if isinstance(value, str):
        if not value:
            raise SourceError(f"an empty {name!r}")
        return [{"role": role, "content": value}]
    if isinstance(value, list) and value:
        return [_message(m, i) for i, m in enumerate(value)]
    raise SourceError(f"{name!r} is {type(value).__name__}, not text or a list of messages")


def _message(m, i: int) -> dict:
    if not isinstance(m, dict):
        raise SourceError(f"message {i} is a {type(m).__name__}, not {{role, content}}")
    role = m.get("role", m.get("from"))
    content = m.get("content", m.get("value"))
    if role not in ROLES:
        raise SourceError(f"message {i} has an unknown role {str(role)[:40]!r} (known: {', '.join(ROLES)})")
    if not isinstance(content, str):
        raise SourceError(f"message {i}'s content is {type(content).__name__}, not text")
    out = {k: v for k, v in m.items() if v is not None and k not in ("from", "value")}
    out["role"], out["content"] = ROLES[role], content
    reasoning = next((out[k] for k in _REASONING if out.get(k) is not None), None)
    if reasoning is not None:  # as transformers aliases it before rendering
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _placed(messages: list[dict], images: int) -> list[dict]:
    """The messages with one placeholder per image: as given, or (none given) the images first
    in the first user turn."""
    if images == 0:  # a text conversation: "<image>" in it is text
        return messages
    found = sum(m["content"].count(IMAGE_TOKEN) for m in messages)
    if found == images:
        return messages
    if found == 0:
        first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if first is None:
            raise SourceError(f"{images} image(s) and no user turn to put them in")
        messages = list(messages)
        messages[first] = {**messages[first], "content": (IMAGE_TOKEN + "\n") * images + messages[first]["content"]}
        return messages
    raise SourceError(f"{found} {IMAGE_TOKEN} placeholder(s) for {images} image(s)")


def placeholder_spans(text: str, count: int) -> list[tuple[int, int]]:
    """The character spans of the image placeholders in the rendered text: as many as images,
    or the template dropped or repeated one (a skip)."""
    spans, at = [], text.find(IMAGE_TOKEN)
    while at >= 0:
        spans.append((at, at + len(IMAGE_TOKEN)))
        at = text.find(IMAGE_TOKEN, at + len(IMAGE_TOKEN))
    if len(spans) != count:
        raise SourceError(f"the rendered conversation holds {len(spans)} {IMAGE_TOKEN} placeholder(s) for "
                          f"{count} image(s): the template dropped or repeated one")
    return spans
