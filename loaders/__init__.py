"""mmpack's training-side readers over a packed dataset dir: zero-copy samples, whole batches
into reusable (pinned) buffers, token windows, packed documents, and the copy to the GPU.

Depends on `packer.reader`, never the reverse; does not import Pillow, tokenizers or pyarrow.
"""

from .batches import BatchedDataset, Loader
from .cuda import to_device
from .dataset import MMapDataset
from .iterable import MMapIterableDataset
from .packed import PackedDocuments, pack_documents
from .stateful import StatefulDataLoader
from .tokens import TokenWindows

__all__ = ["MMapDataset", "MMapIterableDataset", "Loader", "BatchedDataset", "StatefulDataLoader", "TokenWindows",
           "PackedDocuments", "pack_documents", "to_device"]
