"""A conversation record as a chat build stores it: rendered with the build's template,
tokenized, its loss mask beside its tokens; with images, each decoded as an image build decodes
it (S x S) and the token where its placeholder starts; a preference pair as its chosen and its
rejected conversation. Any record that cannot be (`conversation`'s reasons, a template that
raises, an image missing, out of RAW or undecodable) is a Skip with its reason."""

from __future__ import annotations

import io
import os

import numpy as np

from packer.builder.chat import conversation as conv
from packer.builder.chat.encode import encode
from packer.builder.chat.template import ChatTemplate
from packer.builder.forms.manifest import Inside
from packer.builder.images import decode_image
from packer.builder.text import key_bytes, tokenizer_of
from packer.dataset.format import Skip
from packer.errors import SourceError


class ChatPacker:
    """What a worker needs to pack one build's conversations (made once a shard)."""

    def __init__(self, ctx):
        self.template = ChatTemplate(ctx.chat)
        self.tok = tokenizer_of(ctx.tokenizer)
        self.dtype, self.config, self.fields = ctx.tokenizer.dtype, ctx.config, ctx.fields or {}
        self.inside = Inside(ctx.config.raw)

    def sample(self, key: str, record, folder: str) -> dict | Skip:
        if not isinstance(record, dict):
            return Skip(key, "read", f"a {type(record).__name__}, not a record of fields")
        try:
            if self.fields.get("pairs"):
                chosen, rejected = conv.pair(record)
                return {**self._side("chosen", chosen), **self._side("rejected", rejected), "key": key_bytes(key)}
            c = conv.conversation(record)
            images = self._images(c.images, folder) if self.fields.get("image") else None
            if images is None and c.images:
                raise SourceError("an image, in a build whose conversations have none")  # not reached: the scan looks
            text, spans = self.template.render(c.messages)
            places = conv.placeholder_spans(text, len(c.images)) if images is not None else []
            tokens, mask, positions = encode(self.tok, text, spans, self.dtype, places)
        except SourceError as exc:
            return Skip(key, "chat", str(exc))
        out = {"tokens": tokens, "loss_mask": mask}
        if images is not None:
            out |= {"images": images, "image_positions": positions}
        return {**out, "key": key_bytes(key)}

    def _side(self, side: str, c: conv.Conversation) -> dict:
        if c.images:
            raise SourceError("images in a preference pair: not packed (pairs of text only)")
        text, spans = self.template.render(c.messages)
        tokens, mask, _ = encode(self.tok, text, spans, self.dtype)
        return {f"{side}_tokens": tokens, f"{side}_loss_mask": mask}

    def _images(self, names: tuple[str | bytes, ...], folder: str) -> np.ndarray:
        """The conversation's images as [K, S, S, 3] uint8, in their order (paths, or bytes)."""
        size = self.config.image_size
        out = np.empty((len(names), size, size, 3), np.uint8)
        for k, name in enumerate(names):
            if isinstance(name, bytes):
                try:
                    out[k] = decode_image(io.BytesIO(name), size, writable=False, background=self.config.background)
                except SourceError as exc:
                    raise SourceError(f"image {k} (its bytes in the row): {exc}") from None
                continue
            if "\0" in name:
                raise SourceError(f"image {name[:80]!r}: a path with a NUL byte")
            path = os.path.join(folder, name)
            if not os.path.isfile(path):
                raise SourceError(f"image {name}: no such file")
            if not self.config.allow_outside and not self.inside(path):
                raise SourceError(f"image {name}: outside RAW (an absolute path, '..' or a link out of it); pass "
                                  "--allow-outside to pack it")
            try:
                out[k] = decode_image(path, size, writable=False, background=self.config.background)
            except SourceError as exc:
                raise SourceError(f"image {name}: {exc}") from None
        return out
