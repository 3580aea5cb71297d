"""DataLoader helpers: cache a dataset's samples in a store, or serve a store's values.

``CachedDataset`` wraps a map-style dataset: the first time any DataLoader
worker produces sample ``i``, it is stored in a ``TieredStore``; from then on
every worker, and every later epoch, reads it back zero-copy from shared
memory.  ``StoreDataset`` serves values that are already in a store, by key
list or prefix.  Both pickle cleanly (the store travels by name), so they work
with ``DataLoader(num_workers>0)`` under ``fork`` and ``spawn`` and with
``persistent_workers=True``.

>>> from yrcache import TieredStore
>>> from yrcache.torch import CachedDataset, StoreDataset
>>> import numpy as np
>>> with TieredStore(dram="64MiB") as store:
...     ds = CachedDataset([(np.full(3, i, np.float32), i) for i in range(4)], store, key="toy/")
...     ds[1]                                   # computed, cached, read back
...     ds[1]                                   # served from the store
...     ds.stats()
...     len(StoreDataset(store, prefix="toy/"))
(tensor([1., 1., 1.]), 1)
(tensor([1., 1., 1.]), 1)
{'hits': 1, 'misses': 1, 'uncached': 0}
1

torch is imported when the first dataset object is made, not by ``import
yrcache.torch``.  See docs/dataloader.md.
"""

from __future__ import annotations

import hashlib
import operator
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from . import codec
from ._sample import _decode, _encode, _tensor_from_array, _torch
from .errors import StoreFullError, YrcacheError

if TYPE_CHECKING:
    from .store import TieredStore
    from .tiers.dram import Word

__all__ = ["CachedDataset", "StoreDataset"]

_RETRY_FULL_AFTER = 1.0            # seconds a worker skips puts after StoreFullError


class _MapDataset(Protocol):
    """What ``CachedDataset`` needs of a dataset: ``len(ds)`` and ``ds[i]``."""

    def __getitem__(self, index: int, /) -> Any: ...

    def __len__(self) -> int: ...


# ---------------------------------------------------------------- torch base


_dataset_types: dict[type, type] = {}


def _with_dataset_base(cls: type) -> type:
    """``cls`` made a subclass of ``torch.utils.data.Dataset`` too (created once per class)."""
    t = _dataset_types.get(cls)
    if t is None:
        dataset = _torch().utils.data.Dataset
        if issubclass(cls, dataset):
            return cls
        t = type(cls.__name__, (cls, dataset), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__, "_yr_plain": cls})
        _dataset_types[cls] = t
    return t


def _rebuild(cls: type[_LazyDataset], state: dict[str, Any]) -> Any:
    obj = cls.__new__(cls)
    obj.__setstate__(state)
    return obj


class _LazyDataset:
    """Base of the datasets here: instances are ``torch.utils.data.Dataset``s.

    The class itself cannot derive from torch's ``Dataset`` without importing
    torch at module import; so each instance is made of a subclass that also
    derives from it (``isinstance(ds, torch.utils.data.Dataset)`` holds and
    ``ds1 + ds2`` works), created when the first instance is made.
    """

    _yr_plain: type

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        t: Any = _with_dataset_base(cls)
        return object.__new__(t)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_local_")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __reduce__(self) -> tuple[Any, ...]:
        # By the plain class: the dynamic subclass is not importable by name.
        return (_rebuild, (getattr(type(self), "_yr_plain", type(self)), self.__getstate__()))


if TYPE_CHECKING:
    from torch.utils.data import Dataset as _DatasetBase
else:
    _DatasetBase = _LazyDataset


# ------------------------------------------------------------------ counters


class _LocalWord:
    """A process-local stand-in for a store word (when the store had no room for one)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def cas(self, expected: int, desired: int) -> bool:
        if self.value != expected:
            return False
        self.value = desired
        return True


def _add(word: Word | _LocalWord, n: int) -> int:
    """Add ``n`` to a shared counter; returns the old value."""
    while True:
        v = word.value
        if word.cas(v, v + n):
            return v


_tokens: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _dataset_token(dataset: Any) -> str:
    """A random name for ``dataset``, the same while this object lives."""
    try:
        tok = _tokens.get(dataset)
        if tok is None:
            tok = _tokens[dataset] = uuid.uuid4().hex[:12]
        return tok
    except TypeError:       # not weak-referenceable or not hashable: a name per wrapper
        return uuid.uuid4().hex[:12]


_STATS = ("hits", "misses", "uncached")


def _allows_pickle(store: TieredStore) -> bool:
    return store.pickle


# ------------------------------------------------------------------ datasets


class CachedDataset(_DatasetBase):
    """A map-style dataset whose samples are cached in ``store`` on first use.

    ``ds[i]`` looks up sample ``i`` in the store; on a miss it calls
    ``dataset[i]``, stores the sample (one copy per tensor or array into
    shared memory) and returns it read back from the store.  Every DataLoader
    worker, every later epoch and every process attached to the store then
    reads it zero-copy: tensors and arrays come back as read-only views of the
    shared pages (torch has no read-only tensors: do not modify them in place,
    or pass ``copy=True``).  ``__getitems__`` looks up a whole batch under one
    lock hold.

    Samples may be torch tensors (any dtype and shape, stored contiguous, read
    back as CPU tensors), numpy arrays of numeric or bool dtype (read back as
    tensors of the same dtype and shape, zero-copy, or with
    ``to_tensor=False`` as read-only arrays), numpy scalars, ``bytes`` (read
    back as ``bytes``), ``str``, ``int``, ``float``, ``bool`` and ``None``,
    nested in tuples, lists and dicts with ``str`` keys.  Anything else raises
    ``TypeError``, unless the store was opened with ``pickle=True`` (then it
    is pickled).  A sample is cached as it is: cache the deterministic part of
    a pipeline (decoding) and apply random augmentation after it.

    ``key``: where sample ``i`` lives.  A str is a prefix (``key + str(i)``)
    or, if it holds ``{``, a template (``key.format(i)``, e.g.
    ``"train/{:08d}"``); a callable maps ``i`` to the key (a module-level
    function under spawn: lambdas do not pickle).  The default,
    ``"cached/<token>/"``, is private to this dataset object (the token is
    random, the same for every wrapper of the same object in this process);
    pass a key to share a cache between processes that build their own
    dataset objects (DDP ranks), or across runs over a ``persist=True`` store.

    When the store is full (``StoreFullError``), the sample is returned
    uncached, a ``RuntimeWarning`` is shown once and ``stats()["uncached"]``
    counts it; a worker retries putting after a second.  ``priority`` and
    ``ttl`` are passed to each put (over a ``policy="cache"`` store, cold
    samples are dropped instead and computed again when needed).

    ``stats()`` counts hits and misses of every process using this object.

    >>> import torch
    >>> from yrcache import TieredStore
    >>> from torch.utils.data import DataLoader
    >>> data = [(torch.full((2, 2), float(i)), i) for i in range(8)]
    >>> with TieredStore(dram="64MiB") as store:
    ...     ds = CachedDataset(data, store, key="sq/")
    ...     for epoch in range(2):
    ...         for x, y in DataLoader(ds, batch_size=4):
    ...             pass
    ...     ds.stats(), x.shape, y.tolist()
    ({'hits': 8, 'misses': 8, 'uncached': 0}, torch.Size([4, 2, 2]), [4, 5, 6, 7])
    """

    def __init__(self, dataset: _MapDataset, store: TieredStore,
                 key: str | Callable[[int], str] | None = None, *, to_tensor: bool = True,
                 copy: bool = False, priority: int = 0, ttl: float | None = None) -> None:
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise TypeError(f"CachedDataset wraps a map-style dataset (with __getitem__ and __len__), not "
                            f"{type(dataset).__name__}; an iterable has no index to cache samples under "
                            "(list(it) first if it is small)")
        self.dataset = dataset
        self.store = store
        if key is None:
            key = f"cached/{_dataset_token(dataset)}/"
        if not (isinstance(key, str) or callable(key)):
            raise TypeError(f"key must be a str prefix or template, or a callable index -> str, "
                            f"not {type(key).__name__}")
        if isinstance(key, str) and "{" in key:
            try:
                key.format(0)
            except (IndexError, KeyError, ValueError) as e:
                raise ValueError(f"key template {key!r} cannot format an index: {e}; "
                                 "use one positional field such as 'train/{:08d}'") from None
        self.key = key
        self.to_tensor = bool(to_tensor)
        self.copy = bool(copy)
        self.priority = priority
        self.ttl = ttl
        # The counters are named after the key, so that the datasets made over and over for one
        # key (a loop, every run over a persist=True store) share three words, not three each.
        self._token = (hashlib.sha1(key.encode()).hexdigest()[:32] if isinstance(key, str)
                       else uuid.uuid4().hex)
        # created now, while the store likely has room; stats() counts from their values now
        self._base = [int(w.value) for w in self._words()]

    @property
    def prefix(self) -> str | None:
        """The key prefix of the cached samples (None for a callable key).

        >>> from yrcache import TieredStore
        >>> with TieredStore(dram="16MiB") as store:
        ...     CachedDataset([b"a"], store, key="img/").prefix
        'img/'
        """
        k = self.key
        if callable(k):
            return None
        return k.split("{", 1)[0]

    def key_of(self, index: int) -> str:
        """The store key of sample ``index``.

        >>> from yrcache import TieredStore
        >>> with TieredStore(dram="16MiB") as store:
        ...     CachedDataset([b"a"], store, key="img/{:04d}").key_of(0)
        'img/0000'
        """
        k = self.key
        if isinstance(k, str):
            return k.format(index) if "{" in k else k + str(index)
        return k(index)

    def __len__(self) -> int:
        return len(self.dataset)

    def _index(self, index: Any) -> int:
        i, n = operator.index(index), len(self.dataset)
        if not -n <= i < n:       # (-n-1 would read sample n-1 and cache it under a key of its own)
            raise IndexError(f"index {i} is out of range for a dataset of {n} samples")
        return i + n if i < 0 else i

    def __getitem__(self, index: int) -> Any:
        i = self._index(index)
        key = self.key_of(i)
        blob = self.store.get(key, copy=self.copy)
        if blob is not None:
            _add(self._words()[0], 1)
            return _decode(key, blob, self.to_tensor, _allows_pickle(self.store))
        return self._cache(key, self.dataset[i])

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Samples of a batch of indices: one store lookup for all of them
        (the DataLoader calls this when batching); misses are computed once
        each, through the dataset's own ``__getitems__`` when it has one.

        >>> from yrcache import TieredStore
        >>> with TieredStore(dram="16MiB") as store:
        ...     ds = CachedDataset([b"a", b"b"], store, key="g/")
        ...     ds.__getitems__([1, 0, 1]), ds.stats()
        ([b'b', b'a', b'b'], {'hits': 1, 'misses': 2, 'uncached': 0})
        """
        idx = [self._index(i) for i in indices]
        keys = [self.key_of(i) for i in idx]
        blobs = self.store.mget(keys, copy=self.copy)
        allow = _allows_pickle(self.store)
        out: list[Any] = [None] * len(idx)
        missing: dict[int, list[int]] = {}
        for p, blob in enumerate(blobs):
            if blob is None:
                missing.setdefault(idx[p], []).append(p)
            else:
                out[p] = _decode(keys[p], blob, self.to_tensor, allow)
        hits = len(idx) - sum(len(ps) for ps in missing.values())
        if hits:
            _add(self._words()[0], hits)
        if missing:
            todo = list(missing)
            many = getattr(self.dataset, "__getitems__", None)
            samples = many(todo) if many is not None else [self.dataset[i] for i in todo]
            if len(samples) != len(todo):
                raise ValueError(f"{type(self.dataset).__name__}.__getitems__ returned {len(samples)} samples "
                                 f"for {len(todo)} indices; it must return one per index, in order")
            for i, sample in zip(todo, samples):
                ps = missing[i]
                out[ps[0]] = self._cache(keys[ps[0]], sample)
                for p in ps[1:]:           # the same index again in this batch: another view
                    blob = self.store.get(keys[p], copy=self.copy)
                    if blob is None:       # (not cached: the store is full)
                        out[p] = out[ps[0]]
                    else:
                        _add(self._words()[0], 1)
                        out[p] = _decode(keys[p], blob, self.to_tensor, allow)
        return out

    def _cache(self, key: str, sample: Any) -> Any:
        """Store a freshly computed sample and return it as read back."""
        _add(self._words()[1], 1)
        allow = _allows_pickle(self.store)
        enc = _encode(sample, allow)
        torch = _torch()
        if time.monotonic() >= getattr(self, "_local_full_until", 0.0):
            try:
                self.store.put_with(key, codec.tensor_meta(torch.uint8, (enc.nbytes,)), enc.nbytes,
                                    enc.fill, priority=self.priority, ttl=self.ttl)
            except StoreFullError as e:
                self._local_full_until = time.monotonic() + _RETRY_FULL_AFTER
                self._uncached(e)
            else:
                blob = self.store.get(key, copy=self.copy)
                if blob is not None:       # (None: dropped or expired at once)
                    return _decode(key, blob, self.to_tensor, allow)
        else:
            self._uncached(None)
        # Not cached: lay it out privately all the same, so it comes back in the same form.
        buf = torch.empty(enc.nbytes, dtype=torch.uint8)
        enc.fill(buf.numpy())
        return _decode(key, buf, self.to_tensor, allow)

    def _uncached(self, err: StoreFullError | None) -> None:
        if _add(self._words()[2], 1) == self._base[2]:
            why = f" ({err})" if err is not None else ""
            warnings.warn(
                f"CachedDataset: store {self.store.name!r} is full{why}; samples that do not fit are "
                "returned uncached (counted in stats()['uncached']); give the store more room "
                "(dram=, ssd=) or create it with policy='cache'", RuntimeWarning, stacklevel=4)

    def _words(self) -> list[Word | _LocalWord]:
        """The shared counters (hits, misses, uncached), looked up once per process."""
        words: list[Word | _LocalWord] | None = getattr(self, "_local_words", None)
        if words is None:
            try:
                words = [self.store.word(f"yrcache.torch/{self._token}/{s}") for s in _STATS]
            except (YrcacheError, MemoryError):
                words = [_LocalWord() for _ in _STATS]
            self._local_words = words
        return words

    def stats(self) -> dict[str, int]:
        """Counts since this dataset object was made, over every process using it (its
        workers included), and over the other ``CachedDataset`` objects of this store with
        the same ``key`` string meanwhile (they share three counters in the store).

        ``hits``: samples served from the store; ``misses``: samples the
        wrapped dataset computed; ``uncached``: misses that did not fit in the
        store.  (Only this process's, if the store had no room for the
        counters when the dataset was made.)

        >>> from yrcache import TieredStore
        >>> with TieredStore(dram="16MiB") as store:
        ...     ds = CachedDataset([b"a", b"b"], store, key="b/")
        ...     _ = ds[0], ds[0], ds[1]
        ...     ds.stats()
        {'hits': 1, 'misses': 2, 'uncached': 0}
        """
        return {s: int(w.value) - b for s, w, b in zip(_STATS, self._words(), self._base)}

    def clear(self) -> int:
        """Delete every cached sample of this dataset from the store; returns how many.

        Views already returned stay valid.  O(len(dataset)) deletes.

        >>> from yrcache import TieredStore
        >>> with TieredStore(dram="16MiB") as store:
        ...     ds = CachedDataset([b"a", b"b"], store, key="b/")
        ...     _ = ds[1]
        ...     ds.clear()
        1
        """
        return sum(self.store.delete(self.key_of(i)) for i in range(len(self)))

    def __repr__(self) -> str:
        key = self.key if isinstance(self.key, str) else getattr(self.key, "__name__", repr(self.key))
        return f"CachedDataset({type(self.dataset).__name__}, store={self.store.name!r}, key={key!r})"


class StoreDataset(_DatasetBase):
    """A map-style dataset over values already in ``store``.

    ``keys``: the keys to serve, in this order; or ``prefix``: every key under
    it, listed once, here, in sorted (byte) order (zero-pad numbers, such as
    ``f"img/{i:08d}"``, for numeric order); neither: every key.  ``ds[i]``
    reads ``store[key i]`` zero-copy: a tensor as the store returns it (a CPU
    tensor over the shared pages), a numpy array as a tensor of the same dtype
    and shape (zero-copy; ``to_tensor=False`` keeps the read-only array),
    bytes as ``bytes``; ``copy=True`` returns private writable copies instead.
    ``transform`` is applied to each value (in the worker).  A key deleted or
    expired after the listing raises ``KeyError``.  The key list is kept as
    one numpy buffer, so forked workers do not copy it page by page.

    >>> import torch
    >>> from yrcache import TieredStore
    >>> with TieredStore(dram="16MiB") as store:
    ...     for i in range(3):
    ...         store[f"x/{i}"] = torch.full((2,), i)
    ...     ds = StoreDataset(store, prefix="x/")
    ...     len(ds), ds[2], ds.key_of(0)
    (3, tensor([2, 2]), 'x/0')
    """

    def __init__(self, store: TieredStore, keys: Iterable[str] | None = None, prefix: str | None = None, *,
                 to_tensor: bool = True, copy: bool = False,
                 transform: Callable[[Any], Any] | None = None) -> None:
        if keys is not None and prefix is not None:
            raise ValueError("pass keys= or prefix=, not both")
        if keys is None:
            listed = sorted(store.keys(prefix or ""))
            if not listed and prefix:
                raise ValueError(f"store {store.name!r} has no keys under prefix {prefix!r}")
        else:
            if isinstance(keys, str):
                raise TypeError("keys must be an iterable of str, not one str (did you mean prefix=?)")
            listed = list(keys)
            for k in listed:
                if not isinstance(k, str):
                    raise TypeError(f"keys must be str, not {type(k).__name__} {k!r}")
        encoded = [k.encode() for k in listed]
        self._offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(k) for k in encoded], out=self._offsets[1:])
        self._keys = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()
        self.store = store
        self.prefix = prefix
        self.to_tensor = bool(to_tensor)
        self.copy = bool(copy)
        self.transform = transform

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def key_of(self, index: int) -> str:
        """The key of item ``index`` (negative indices count from the end).

        >>> from yrcache import TieredStore
        >>> with TieredStore(dram="16MiB") as store:
        ...     StoreDataset(store, keys=["b", "a"]).key_of(-1)
        'a'
        """
        n = len(self)
        i = operator.index(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {index} out of range for a StoreDataset of {n} keys")
        return self._keys[self._offsets[i]:self._offsets[i + 1]].tobytes().decode()

    def _value(self, key: str, index: int, v: Any) -> Any:
        if v is None:
            raise KeyError(f"{key!r} (index {index}) is no longer in store {self.store.name!r}: "
                           "deleted or expired after the StoreDataset listed it")
        if isinstance(v, np.ndarray) and self.to_tensor:
            v = _tensor_from_array(v)
        elif isinstance(v, memoryview):
            v = v.tobytes()
        return self.transform(v) if self.transform is not None else v

    def __getitem__(self, index: int) -> Any:
        key = self.key_of(index)
        return self._value(key, index, self.store.get(key, copy=self.copy))

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Items of a batch of indices, looked up under one lock hold.

        >>> from yrcache import TieredStore
        >>> with TieredStore(dram="16MiB") as store:
        ...     store.mset({"a": b"1", "b": b"2"})
        ...     StoreDataset(store).__getitems__([1, 0])
        [b'2', b'1']
        """
        keys = [self.key_of(i) for i in indices]
        values = self.store.mget(keys, copy=self.copy)
        return [self._value(k, i, v) for k, i, v in zip(keys, indices, values)]

    def __repr__(self) -> str:
        what = f"prefix={self.prefix!r}" if self.prefix is not None else f"{len(self)} keys"
        return f"StoreDataset(store={self.store.name!r}, {what})"
