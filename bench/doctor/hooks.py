"""The hooks that watch a loop from inside: `__iter__` of DataLoader, of mmpack's Loader and of
their subclasses hands each iterator to the watch, `Tensor.to`/`.cuda` count the copies to the
GPU, and every optimizer's step marks an iteration (`steps`); all given back as they were
afterwards."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def patched(watch, classes):
    """`watch.iterate` over each iterator of `classes` (and their subclasses), and
    `watch.copies` over Tensor.to and Tensor.cuda, while active."""
    from .steps import hooked

    with _iterators_watched(watch, classes), _copies_counted(watch.copies), hooked(watch.optimizer):
        yield


@contextmanager
def _iterators_watched(watch, classes):
    """`__iter__` of every one of `classes` and of each subclass with its own (torchdata's
    StatefulDataLoader, accelerate's, one the script defines while watched) returns a watched
    iterator while active. Only the class of the loader iterated watches: a subclass's
    `__iter__` that calls `super().__iter__()` is one wait a batch, not two."""
    saved = {}

    def wrap(original):
        def __iter__(self):
            it = original(self)
            return watch.iterate(self, it) if type(self).__iter__ is __iter__ else it
        return __iter__

    def patch(cls) -> None:
        if cls not in saved:
            saved[cls] = cls.__dict__.get("__iter__")
            cls.__iter__ = wrap(cls.__iter__)

    def patch_subclass(cls, **kwargs) -> None:
        if "__iter__" in cls.__dict__:
            patch(cls)

    hooked = [cls for cls in classes if "__init_subclass__" not in cls.__dict__]
    for cls in classes:
        patch(cls)
        for sub in _subclasses(cls):
            patch_subclass(sub)
    for cls in hooked:
        cls.__init_subclass__ = classmethod(patch_subclass)
    try:
        yield
    finally:
        for cls in hooked:
            del cls.__init_subclass__
        for cls, original in saved.items():
            _restore(cls, "__iter__", original)


@contextmanager
def _copies_counted(copies):
    import torch

    saved = {name: torch.Tensor.__dict__.get(name) for name in ("to", "cuda")}
    for name in saved:
        setattr(torch.Tensor, name, copies.wrap(getattr(torch.Tensor, name)))
    try:
        yield
    finally:
        for name, original in saved.items():
            _restore(torch.Tensor, name, original)


def _restore(cls, name: str, original) -> None:
    """`cls.name` as it was: its own `original`, or none (inherited) where that is None."""
    if original is None:
        delattr(cls, name)
    else:
        setattr(cls, name, original)


def _subclasses(cls) -> list:
    found, todo = [], list(cls.__subclasses__())
    while todo:
        sub = todo.pop()
        if sub not in found:
            found.append(sub)
            todo += sub.__subclasses__()
    return found


def loader_classes() -> list:
    """The loaders watched: torch's DataLoader, and mmpack's Loader where it imports."""
    import torch

    classes = [torch.utils.data.DataLoader]
    try:
        from loaders import Loader

        classes.append(Loader)
    except ImportError:  # the script's environment may lack mmpack's loaders: DataLoader alone
        pass
    return classes
