"""A conversation record as a chat build stores it: rendered with the build's template,
tokenized, its loss mask beside its tokens; with images, each decoded as an image build decodes
it (S x S, keep-aspect or its own size; pixels or JPEG) and the token where its placeholder starts; a preference pair as its chosen and its
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
from packer.dataset import codec
from packer.dataset.format import Skip
from packer.errors import SourceError


class ChatPacker:
    """What a worker needs to pack one build's conversations (made once a shard)."""

    def __init__(self, ctx):
        self.template = ChatTemplate(ctx.chat)
        self.tok = tokenizer_of(ctx.tokenizer)
        self.dtype, self.config, self.fields = ctx.tokenizer.dtype, ctx.config, ctx.fields or {}
        self.inside = Inside(ctx.config.raw)
        self.listed = ctx.config.chat_image_list  # the images' layout, as the build's columns have it
        self.quality = codec.parse_store(ctx.config.store)[1]

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
            out |= self._stored(images) | {"image_positions": positions}
        return {**out, "key": key_bytes(key)}

    def _stored(self, images: list[np.ndarray]) -> dict:
        """The conversation's images as its columns hold them: stacked S x S crops, or (an
        image list) their pixels or JPEG files one after another with each's shape and bytes."""
        if self.listed is None:
            return {"images": np.stack(images) if images else np.zeros((0, self.config.image_size,
                                                                        self.config.image_size, 3), np.uint8)}
        pieces = [codec.encode(x, self.quality).data if self.listed == "jpeg-list" else np.ascontiguousarray(x).reshape(-1)
                  for x in images]
        return {"images": np.concatenate(pieces) if pieces else np.zeros(0, np.uint8),
                "image_shapes": np.asarray([x.shape for x in images], np.int64).reshape(len(images), 3),
                "image_nbytes": np.asarray([len(x) for x in pieces], np.int64)}

    def _side(self, side: str, c: conv.Conversation) -> dict:
        if c.images:
            raise SourceError("images in a preference pair: not packed (pairs of text only)")
        text, spans = self.template.render(c.messages)
        tokens, mask, _ = encode(self.tok, text, spans, self.dtype)
        return {f"{side}_tokens": tokens, f"{side}_loss_mask": mask}

    def _decoded(self, source):
        """One image as an image build decodes it: S x S, keep-aspect (shorter side S, the longer
        at most --max-side), or at its own size (--image-size keep)."""
        return decode_image(source, self.config.image_size, writable=False, background=self.config.background,
                            max_side=self.config.side_cap)

    def _images(self, names: tuple[str | bytes, ...], folder: str) -> list[np.ndarray]:
        """The conversation's images, HxWx3 uint8, in their order (paths, or bytes)."""
        out: list = [None] * len(names)
        for k, name in enumerate(names):
            if isinstance(name, bytes):
                try:
                    out[k] = self._decoded(io.BytesIO(name))
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
                out[k] = self._decoded(path)
            except SourceError as exc:
                raise SourceError(f"image {name}: {exc}") from None
        return out
