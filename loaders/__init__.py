"""mmpack's training-side readers: zero-copy datasets over a packed dataset dir.

Depends on `packer.reader`, never the reverse; does not import Pillow, tokenizers or pyarrow.
"""

from .dataset import MMapDataset

__all__ = ["MMapDataset"]
