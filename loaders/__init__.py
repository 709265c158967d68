"""mmpack's training-side readers over a packed dataset dir: zero-copy samples, whole batches
into reusable (pinned) buffers, token windows, packed documents, and the copy to the GPU.

Depends on `packer.dataset.reader`, never the reverse; does not import Pillow, tokenizers or pyarrow.
"""

from loaders.batched import BatchedDataset
from loaders.loader import Loader
from loaders.cuda import to_device
from loaders.views.clips import AudioClips, to_float
from loaders.views.dataset import MMapDataset
from loaders.views.iterable import MMapIterableDataset
from loaders.views.mixture import Mixture
from loaders.views.packed import PackedDocuments, pack_documents
from loaders.stateful import StatefulDataLoader
from loaders.views.tokens import TokenWindows

__all__ = ["AudioClips", "to_float", "MMapDataset", "MMapIterableDataset", "Mixture", "Loader", "BatchedDataset", "StatefulDataLoader", "TokenWindows",
           "PackedDocuments", "pack_documents", "to_device"]
