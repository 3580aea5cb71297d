"""How ``yrcache.torch.CachedDataset`` stores a sample: one flat uint8 object
holding a JSON header and every leaf (tensor, array, bytes ...) at a 64-byte
aligned offset, written with one copy per leaf and read back as views."""

from __future__ import annotations

import json
import pickle
import warnings
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import numpy as np

from .codec import _numpy_twin, _torch_twin, is_masked
from .errors import UntrustedStoreError, YrcacheError

# A cached sample is one store object: a flat uint8 tensor holding
#   MAGIC (8 bytes) | header length (uint32 LE) | JSON header | pad | leaves
# Each leaf (tensor, array, bytes...) starts at a 64-byte aligned offset after
# the header; the header describes the sample's structure and where each leaf
# lies.  One object per sample keeps a put atomic (a reader never sees half a
# sample, concurrent writers of one index cannot mix their leaves) and a read
# one lookup and one pin.
_MAGIC = b"YRSMPL\x00\x01"
_PREFIX_LEN = 12
_ALIGN = 64
_MAX_DEPTH = 64
_PLAN_CACHE_MAX_HEADER = 1 << 16   # larger headers are parsed on every read
_NUMPY_KINDS = "biufc"


def _torch() -> Any:
    try:
        import torch
    except ImportError:  # pragma: no cover - only without the extra
        raise ImportError("yrcache.torch needs torch: pip install 'yrcache[torch]'") from None
    return torch


_quiet_readonly = False


def _tensor_from_array(arr: np.ndarray) -> Any:
    """``torch.from_numpy(arr)`` (zero-copy), or ``arr`` itself when torch has no such dtype.

    torch warns once per process when it wraps a read-only array (torch has no
    read-only tensors); the read-only arrays here are store views by design,
    so that one warning is consumed quietly instead of shown in every worker.
    """
    global _quiet_readonly
    torch = _torch()
    try:
        if _quiet_readonly or arr.flags.writeable:
            return torch.from_numpy(arr)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable",
                                    category=UserWarning)
            t = torch.from_numpy(arr)
        _quiet_readonly = True
        return t
    except TypeError:        # longdouble, datetime, ...: no torch dtype
        return arr


# ------------------------------------------------------------------ encoding


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _Encoded:
    """A sample laid out as a blob: ``header`` and the leaves' writers."""

    __slots__ = ("header", "nbytes", "writers")

    def __init__(self, header: bytes, nbytes: int, writers: list[tuple[int, int, Callable[[np.ndarray], None]]]):
        self.header = header
        self.nbytes = nbytes
        self.writers = writers

    def fill(self, dst: np.ndarray) -> None:
        """Write the blob into ``dst`` (a flat uint8 array of ``nbytes``): one copy per leaf."""
        h = self.header
        dst[:8] = np.frombuffer(_MAGIC, np.uint8)
        dst[8:12] = np.frombuffer(len(h).to_bytes(4, "little"), np.uint8)
        dst[12:12 + len(h)] = np.frombuffer(h, np.uint8)
        base = _align(_PREFIX_LEN + len(h))
        dst[12 + len(h):base] = 0
        for off, n, write in self.writers:
            if n:
                write(dst[base + off:base + off + n])


def _encode(sample: Any, allow_pickle: bool) -> _Encoded:
    """Lay ``sample`` out as a blob (copies nothing yet: ``fill`` does)."""
    torch = _torch()
    writers: list[tuple[int, int, Callable[[np.ndarray], None]]] = []
    pos = 0

    def leaf(n: int, write: Callable[[np.ndarray], None]) -> int:
        nonlocal pos
        off = pos
        writers.append((off, n, write))
        pos = _align(pos + n)
        return off

    def tensor_writer(t: Any) -> Callable[[np.ndarray], None]:
        def write(dst: np.ndarray) -> None:
            torch.from_numpy(dst).view(t.dtype).view(t.shape).copy_(t)
        return write

    def array_writer(a: np.ndarray, dt: np.dtype) -> Callable[[np.ndarray], None]:
        def write(dst: np.ndarray) -> None:
            np.copyto(dst.view(dt).reshape(a.shape), a)
        return write

    def bytes_writer(b: Any) -> Callable[[np.ndarray], None]:
        def write(dst: np.ndarray) -> None:
            dst[:] = np.frombuffer(b, np.uint8)
        return write

    def unsupported(x: Any, why: str) -> list[Any]:
        if not allow_pickle:
            raise TypeError(
                f"CachedDataset cannot store a {type(x).__name__} ({why}); samples may hold torch tensors, "
                "numpy arrays and scalars, bytes, str, int, float, bool and None, in tuples, lists and "
                "dicts with str keys: convert it in the dataset (e.g. a PIL image with "
                "torchvision.transforms.functional.pil_to_tensor or np.asarray), or create the store "
                "with pickle=True to store such values pickled")
        data = pickle.dumps(x, protocol=5)
        return ["P", leaf(len(data), bytes_writer(data)), len(data)]

    def node(x: Any, depth: int) -> list[Any]:
        if depth > _MAX_DEPTH:
            raise TypeError(f"CachedDataset samples may be nested at most {_MAX_DEPTH} levels deep")
        tx = type(x)
        if isinstance(x, torch.Tensor):
            if x.layout != torch.strided or x.is_quantized or getattr(x, "is_nested", False):
                return unsupported(x, f"a {x.layout} tensor; call .to_dense() or .dequantize()")
            t = x.detach()
            n = t.numel() * t.element_size()
            return ["T", str(t.dtype).replace("torch.", ""), list(t.shape), leaf(n, tensor_writer(t)), n]
        if isinstance(x, np.ndarray) and not is_masked(x):
            if x.dtype.kind not in _NUMPY_KINDS or x.dtype.hasobject:
                return unsupported(x, f"numpy dtype {x.dtype}; numeric and bool dtypes are supported")
            dt = x.dtype.newbyteorder("=")          # stored native: views need no swap
            return ["N", dt.str, list(x.shape), leaf(x.nbytes, array_writer(x, dt)), x.nbytes]
        if isinstance(x, np.generic) and x.dtype.kind in _NUMPY_KINDS:
            a = np.asarray(x)
            dt = a.dtype.newbyteorder("=")
            return ["G", dt.str, leaf(a.nbytes, array_writer(a, dt)), a.nbytes]
        if tx is bytes or tx is bytearray or tx is memoryview:
            b = x if tx is not memoryview else x.tobytes()
            return ["B", leaf(len(b), bytes_writer(b)), len(b)]
        if tx is int or tx is float or tx is bool or tx is str or x is None:
            return ["v", x]
        if tx is tuple or tx is list:
            return ["t" if tx is tuple else "l", *[node(v, depth + 1) for v in x]]
        if tx is dict:
            out: list[Any] = ["d"]
            for k, v in x.items():
                if type(k) is not str:
                    raise TypeError(f"CachedDataset stores dicts with str keys only, not {type(k).__name__} "
                                    f"key {k!r}")
                out += [k, node(v, depth + 1)]
            return out
        if is_masked(x):
            return unsupported(x, "its mask would be lost")
        return unsupported(x, "not a supported sample type")

    tree = node(sample, 0)
    header = json.dumps({"tree": tree, "size": pos}, separators=(",", ":")).encode()
    return _Encoded(header, _align(_PREFIX_LEN + len(header)) + pos, writers)


# ------------------------------------------------------------------ decoding

_Plan = Callable[[Any, np.ndarray], Any]


def _check_dtype(name: str) -> Any:
    torch = _torch()
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise YrcacheError(f"unknown torch dtype {name!r} in a cached sample")
    return dt


def _compile(node: list[Any], base: int, to_tensor: bool, allow_pickle: bool) -> _Plan:
    """A function ``(blob tensor, blob array) -> sample`` for one header's tree."""
    tag = node[0]
    if tag == "v":
        value = node[1]
        return lambda b, a: value
    if tag in ("t", "l"):
        parts = [_compile(n, base, to_tensor, allow_pickle) for n in node[1:]]
        if tag == "t":
            return lambda b, a: tuple([p(b, a) for p in parts])
        return lambda b, a: [p(b, a) for p in parts]
    if tag == "d":
        names = node[1::2]
        parts = [_compile(n, base, to_tensor, allow_pickle) for n in node[2::2]]
        return lambda b, a: {k: p(b, a) for k, p in zip(names, parts)}
    if tag in ("T", "N"):
        shape = tuple(int(d) for d in node[2])
        o, n = base + int(node[3]), int(node[4])
        if tag == "T":
            tdt = _check_dtype(node[1])
            ndt = _numpy_twin(tdt)
        else:
            ndt = np.dtype(node[1])
            tdt = _torch_twin(ndt) if to_tensor else None
            if tdt is None:
                def array(b: Any, a: np.ndarray) -> Any:
                    x = a[o:o + n].view(ndt).reshape(shape)
                    x.flags.writeable = False
                    return x
                return array
        if ndt is not None:        # through numpy: a third of the cost of torch's view ops
            from_numpy = _torch().from_numpy
            return lambda b, a: from_numpy(a[o:o + n].view(ndt).reshape(shape))
        return lambda b, a: b[o:o + n].view(tdt).view(shape)     # bfloat16, float8...
    if tag == "G":
        gdt = np.dtype(node[1])
        o, n = base + int(node[2]), int(node[3])
        return lambda b, a: a[o:o + n].view(gdt)[0]
    if tag in ("B", "P"):
        o, n = base + int(node[1]), int(node[2])
        if tag == "B":
            return lambda b, a: a[o:o + n].tobytes()
        if not allow_pickle:
            def refuse(b: Any, a: np.ndarray) -> Any:
                raise UntrustedStoreError(
                    "a cached sample holds a pickled value, and this store handle was opened without "
                    "pickle=True; open it with pickle=True only if you trust every process writing to it")
            return refuse
        return lambda b, a: pickle.loads(a[o:o + n].data)
    raise YrcacheError(f"unreadable cached sample: unknown node {tag!r}")


@lru_cache(maxsize=4096)
def _cached_plan(header: bytes, to_tensor: bool, allow_pickle: bool) -> tuple[_Plan, int]:
    return _plan(header, to_tensor, allow_pickle)


def _plan(header: bytes, to_tensor: bool, allow_pickle: bool) -> tuple[_Plan, int]:
    """The decoding function of a header and the blob size it needs."""
    try:
        h = json.loads(header)
        base = _align(_PREFIX_LEN + len(header))
        return _compile(h["tree"], base, to_tensor, allow_pickle), base + int(h["size"])
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise YrcacheError(f"unreadable cached sample header: {e}") from None


def _decode(key: str, blob: Any, to_tensor: bool, allow_pickle: bool) -> Any:
    """The sample in ``blob`` (a flat uint8 CPU tensor), its tensors and arrays views of it."""
    torch = _torch()
    if not (isinstance(blob, torch.Tensor) and blob.dtype == torch.uint8 and blob.dim() == 1):
        raise ValueError(f"{key!r} holds a {type(blob).__name__} that CachedDataset did not write; "
                         "pass CachedDataset(key=...) a prefix no other value uses")
    a = blob.numpy()
    head = a[:_PREFIX_LEN].tobytes()
    if head[:8] != _MAGIC:
        raise ValueError(f"{key!r} holds a uint8 tensor that CachedDataset did not write; "
                         "pass CachedDataset(key=...) a prefix no other value uses")
    hlen = int.from_bytes(head[8:], "little")
    header = a[_PREFIX_LEN:_PREFIX_LEN + hlen].tobytes()
    if hlen <= _PLAN_CACHE_MAX_HEADER:
        plan, size = _cached_plan(header, to_tensor, allow_pickle)
    else:
        plan, size = _plan(header, to_tensor, allow_pickle)
    if size > a.size:
        raise YrcacheError(f"cached sample {key!r} is truncated: {a.size} bytes, its header needs {size}")
    return plan(blob, a)
