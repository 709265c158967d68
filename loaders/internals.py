"""The private torch APIs the loaders rely on, and nothing else: each is named here once, and
tests/test_internals.py checks the meaning mmpack relies on, so that a torch release that changes
one fails that test instead of a guarantee (a held batch refilled, a worker's batch copied).

- `torch._C._storage_Use_Count`: how many tensors refer to a storage. The ring refills a batch
  buffer only when this is back to its count at allocation (`loaders.batch.ring`); torch has no public
  way to ask whether a caller still holds a view of a tensor.
- `torch.UntypedStorage._new_shared`: a storage in shared memory, which a DataLoader worker's
  batch is gathered into so that DataLoader passes it by file descriptor, uncopied (torch's own
  `default_collate` does the same); the public `share_memory_()` would allocate it twice.
"""

from __future__ import annotations

import torch


def storage_address(tensor: torch.Tensor) -> int:
    """The address of the tensor's storage object, to ask its use count without making a Python
    storage object each time (valid while the tensor lives)."""
    return tensor.untyped_storage()._cdata


def storage_use_count(address: int) -> int:
    """The tensors (views included) that refer to the storage at `address`."""
    return torch._C._storage_Use_Count(address)


def shared_storage(nbytes: int) -> torch.UntypedStorage:
    """`nbytes` of uninitialised shared memory, as a storage."""
    return torch.UntypedStorage._new_shared(nbytes)
