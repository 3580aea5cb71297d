"""Values <-> (meta, payload): the only place that knows dtypes.

``encode`` turns a value into a small header (``meta``, a few dozen bytes)
and one contiguous payload buffer, without copying when the value is already
contiguous host memory.  ``decoder(meta)`` returns a function that builds the
value back from a buffer over the stored bytes, zero-copy: the buffer object
(which carries the pin) is kept alive by the array/tensor built on it.

Header formats (ASCII, ';' separated; a numpy dtype string may hold '|'):
    B                      bytes-like -> read-only memoryview
    N;<dtype.str>;<shape>  numpy ndarray -> read-only ndarray
    T;<torch dtype>;<shape>  torch tensor -> CPU tensor over the stored bytes
    P                      pickled object (only with pickle=True, local only)
"""

from __future__ import annotations

import pickle
import sys
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable, TypeGuard

import numpy as np

from .errors import CorruptObjectError

if TYPE_CHECKING:
    import torch

_NUMPY_KINDS = "biufc"  # bool, signed, unsigned, float, complex
MAX_META = 4096


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - only without the extra
        raise ImportError(
            "this value needs torch: pip install 'yrcache[torch]'"
        ) from None
    return torch


def is_tensor(value: Any) -> TypeGuard[torch.Tensor]:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


_array_metas: dict = {}   # (dtype, shape) -> header: formatting it costs more than a put
_tensor_metas: dict = {}  # (torch dtype, shape) -> header

#: torch dtype name -> numpy dtype of the same bytes, and whether torch converts
#: to and from it directly (else through the torch dtype of the same size:
#: bfloat16 travels as int16).  Building a tensor over stored bytes then takes
#: numpy.frombuffer + torch.from_numpy (~2 us) instead of a uint8 view, a dtype
#: view and a reshape (~8 us).
_TORCH_NUMPY = {"float32": ("<f4", True), "float64": ("<f8", True), "float16": ("<f2", True),
                "int8": ("|i1", True), "uint8": ("|u1", True), "int16": ("<i2", True),
                "int32": ("<i4", True), "int64": ("<i8", True), "bool": ("|b1", True),
                "complex64": ("<c8", True), "complex128": ("<c16", True), "bfloat16": ("<i2", False)}


@lru_cache(maxsize=64)
def _byte_twin(tdtype: Any) -> tuple[np.dtype, bool, Any] | None:
    """``(numpy dtype, direct, torch dtype to view as)`` of a torch dtype in
    ``_TORCH_NUMPY`` on a little-endian host, else None."""
    got = _TORCH_NUMPY.get(str(tdtype).replace("torch.", "")) if sys.byteorder == "little" else None
    if got is None:
        return None
    dt = np.dtype(got[0])
    torch = _torch()
    return dt, got[1], (tdtype if got[1] else getattr(torch, f"int{dt.itemsize * 8}"))


def _shape_str(shape) -> str:
    return ",".join(str(int(d)) for d in shape)


def is_masked(value: Any) -> bool:
    """Is ``value`` a numpy masked array? Asked without touching ``np.ma``, whose first
    use imports ``numpy.ma`` (~20 ms, once per process: every DataLoader worker's
    first put paid it); no masked array exists before that module is imported."""
    ma = sys.modules.get("numpy.ma")
    return ma is not None and isinstance(value, ma.MaskedArray)


def encode(value: Any, allow_pickle: bool = False) -> tuple[bytes, Any, int]:
    """Return ``(meta, payload, nbytes)``; ``payload`` supports the buffer protocol.

    Zero-copy for contiguous bytes-like values, arrays and CPU tensors; a
    non-contiguous input is made contiguous (one copy) and a device tensor is
    copied to the host.
    """
    if type(value) is np.ndarray:
        # The common case first: a contiguous array of a (dtype, shape) seen before
        # (only native numeric dtypes are remembered) needs no copy and no checks.
        meta = _array_metas.get((value.dtype, value.shape))
        if meta is not None and value.flags.c_contiguous:
            return meta, value, value.nbytes
    if isinstance(value, (bytes, bytearray)):
        return b"B", value, len(value)
    if isinstance(value, memoryview):
        if not value.c_contiguous:
            value = memoryview(value.tobytes())
        return b"B", value, value.nbytes
    if is_masked(value):
        # Its data would be stored and its mask dropped: the value read back would
        # show masked-out entries as if they were valid.
        return _fallback(value, allow_pickle,
                         "cannot store a numpy masked array: its mask would be lost; store "
                         "value.filled(fill_value) instead, or its data and mask as two arrays "
                         "(value.data, np.ma.getmaskarray(value)), or create the store "
                         "with pickle=True to store it pickled, mask and all")
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in _NUMPY_KINDS or value.dtype.hasobject:
            return _fallback(value, allow_pickle,
                             f"numpy dtype {value.dtype} is not supported (numeric and bool dtypes are)")
        arr = value if value.flags.c_contiguous else value.copy(order="C")  # ascontiguousarray makes 0-d 1-d
        if arr.dtype.byteorder == ">":  # store native, so views need no swap
            arr = arr.astype(arr.dtype.newbyteorder("="))
        sig = (arr.dtype, arr.shape)
        meta = _array_metas.get(sig)
        if meta is None:
            meta = f"N;{arr.dtype.str};{_shape_str(arr.shape)}".encode()
            if len(_array_metas) < 4096:
                _array_metas[sig] = meta
        return meta, arr, arr.nbytes
    if is_tensor(value):
        # (each torch call costs ~0.1-2 us: the cheap checks first, the costly calls only when needed)
        t = value.detach() if value.requires_grad else value
        if not t.is_cpu:
            if t.is_meta:
                return _fallback(value, allow_pickle, "a meta tensor has no data to store; materialize "
                                 "it first (load its weights, or torch.empty_like(t, device='cpu'))")
            t = t.cpu()
        torch = _torch()
        if t.layout is not torch.strided:
            return _fallback(value, allow_pickle, _NESTED if t.is_nested else
                             "sparse tensors are not supported; call .to_dense()")
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        if not t.is_contiguous():
            t = t.contiguous()
        try:
            sig = (t.dtype, t.shape)
        except RuntimeError:            # a nested tensor has no one shape
            if t.is_nested:
                return _fallback(value, allow_pickle, _NESTED)
            raise
        meta = _tensor_metas.get(sig)
        if meta is None:
            if t.is_quantized:          # (only tensors of a quantized dtype, never cached)
                return _fallback(value, allow_pickle, _QUANTIZED)
            meta = tensor_meta(t.dtype, t.shape)
            if len(_tensor_metas) < 4096:
                _tensor_metas[sig] = meta
        nbytes = t.nbytes
        if not nbytes:
            return meta, b"", 0
        same = _byte_twin(t.dtype)        # a numpy dtype with the same bytes, or None
        if same is None:
            return meta, t.reshape(-1).view(torch.uint8).numpy(), nbytes
        return meta, (t.numpy() if same[1] else t.view(same[2]).numpy()), nbytes
    return _fallback(value, allow_pickle,
                     f"cannot store a {type(value).__name__}: store bytes, numpy arrays or torch "
                     "tensors, or open the store with pickle=True for other objects (TieredStore(..., "
                     "pickle=True), or TieredStore.attach(name, pickle=True) in an attached process)")


_NESTED = ("nested tensors are not supported; store t.to_padded_tensor(0) and the lengths, "
           "or each of t.unbind() under its own key")
_QUANTIZED = ("quantized tensors are not supported: their scale and zero point would be lost; store "
              "t.dequantize(), or t.int_repr() with t.q_scale() and t.q_zero_point() (or the "
              "per-channel ones) under keys of their own")


def tensor_meta(dtype: Any, shape) -> bytes:
    """The header of a torch tensor of ``dtype`` and ``shape`` (to fill a block in place)."""
    return f"T;{str(dtype).replace('torch.', '')};{_shape_str(shape)}".encode()


def device_filler(t: Any) -> Callable[[np.ndarray], None]:
    """``fill(dst)`` for ``put_with``: copies device tensor ``t``'s bytes into the block ``dst``."""
    def fill(dst: np.ndarray) -> None:
        if dst.size:
            torch = _torch()
            torch.from_numpy(dst).copy_(t.reshape(-1).view(torch.uint8))
    return fill


def array_meta(dtype: Any, shape) -> bytes:
    """The header of a numpy array of ``dtype`` and ``shape`` (native byte order)."""
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        dt = dt.newbyteorder("=")
    return f"N;{dt.str};{_shape_str(shape)}".encode()


def _fallback(value, allow_pickle: bool, why: str):
    if not allow_pickle:
        raise TypeError(why)
    data = pickle.dumps(value, protocol=5)
    return b"P", data, len(data)


@lru_cache(maxsize=4096)
def decoder(meta: bytes) -> Callable[[Any, int], Any]:
    """Return ``f(buffer, nbytes) -> value`` for a stored header (cached)."""
    try:
        kind = meta[:1]
        if kind == b"B":
            return lambda buf, n: memoryview(buf).toreadonly()
        if kind == b"P":
            return lambda buf, n: pickle.loads(buf)
        _, dt, shape_s = meta.decode().split(";")
        shape = tuple(int(d) for d in shape_s.split(",")) if shape_s else ()
        if kind == b"N":
            dtype = np.dtype(dt)
            flat = len(shape) == 1

            def build_array(buf, n):
                # over a read-only buffer, so nobody can flip `writeable` back on
                # (positional arguments: numpy's keyword parsing costs a microsecond)
                arr = np.frombuffer(memoryview(buf).toreadonly(), dtype, n // dtype.itemsize)
                return arr if flat else arr.reshape(shape)
            return build_array
        if kind == b"T":
            torch = _torch()
            tdtype = getattr(torch, dt)
            twin = _byte_twin(tdtype) if isinstance(tdtype, torch.dtype) else None
            flat = len(shape) == 1

            def build_tensor(buf, n):
                if n == 0:
                    return torch.empty(shape, dtype=tdtype)
                if twin is not None and n % twin[0].itemsize == 0:
                    arr = np.frombuffer(buf, twin[0], n // twin[0].itemsize)
                    t = torch.from_numpy(arr if flat else arr.reshape(shape))
                    return t if twin[1] else t.view(tdtype)
                u8 = np.frombuffer(buf, dtype=np.uint8, count=n)
                return torch.from_numpy(u8).view(tdtype).reshape(shape)
            return build_tensor
    except (ValueError, AttributeError, TypeError) as e:
        raise CorruptObjectError(f"unreadable value header {meta[:80]!r}: {e}") from None
    raise CorruptObjectError(f"unknown value header {meta[:80]!r}")


@lru_cache(maxsize=4096)
def copied_decoder(meta: bytes) -> Callable[[bytes, int, int], Any]:
    """Return ``f(data, offset, nbytes) -> value`` for a small value copied out
    of the store into ``data`` (private ``bytes``; cached).

    The hot path of a small get: the value is built straight on the immutable
    copy, so an array is read-only without a memoryview in between.
    """
    kind = meta[:1]
    if kind == b"N":
        whole = decoder(meta)             # parses and checks the header once
        dtype = flat_dtype(meta)
        if dtype is None:
            return lambda data, off, n: whole(memoryview(data)[off:off + n], n)
        size = dtype.itemsize

        def build_flat(data, off, n):
            return np.frombuffer(data, dtype, n // size, off)
        return build_flat
    if kind == b"T":                      # torch has no read-only tensors: a writable copy
        build = decoder(meta)
        return lambda data, off, n: build(bytearray(memoryview(data)[off:off + n]), n)
    build = decoder(meta)
    return lambda data, off, n: build(memoryview(data)[off:off + n], n)


@lru_cache(maxsize=4096)
def flat_dtype(meta: bytes) -> np.dtype | None:
    """The dtype of a valid 1-D ndarray header, whose values are ``np.frombuffer(payload,
    dtype)`` and nothing more (the C hot path builds those: ``HotPath.flat``); else None."""
    layout = array_layout(meta)
    return layout[0] if layout is not None and len(layout[1]) == 1 else None


@lru_cache(maxsize=4096)
def array_layout(meta: bytes) -> tuple[np.dtype, tuple[int, ...]] | None:
    """``(dtype, shape)`` of a valid ndarray header, whose values are
    ``np.frombuffer(payload, dtype).reshape(shape)`` and nothing more (the C hot
    path builds pinned ones: ``HotPath.shaped``); else None."""
    if meta[:1] != b"N":
        return None
    decoder(meta)                         # refuses a corrupt header
    _, dt, shape_s = meta.decode().split(";")
    dtype = np.dtype(dt)
    shape = tuple(int(d) for d in shape_s.split(",")) if shape_s else ()
    return (dtype, shape) if dtype.itemsize else None


@lru_cache(maxsize=4096)
def tensor_layout(meta: bytes) -> tuple[np.dtype, tuple[int, ...], Any] | None:
    """``(numpy dtype, shape, torch dtype to view as or None)`` of a valid tensor
    header whose values are ``torch.from_numpy(np.frombuffer(payload,
    dtype).reshape(shape))`` (then viewed as that torch dtype) and nothing more
    (the C hot path builds pinned ones: ``HotPath.shaped``); else None."""
    if meta[:1] != b"T":
        return None
    decoder(meta)                         # refuses a corrupt header
    _, dt, shape_s = meta.decode().split(";")
    torch = _torch()
    tdtype = getattr(torch, dt)
    twin = _byte_twin(tdtype) if isinstance(tdtype, torch.dtype) else None
    if twin is None:
        return None
    shape = tuple(int(d) for d in shape_s.split(",")) if shape_s else ()
    return twin[0], shape, (None if twin[1] else tdtype)


def describe(meta: bytes) -> dict:
    """Kind, dtype and shape of a stored header (for ``get_into`` checks and CLIs)."""
    kind = meta[:1]
    if kind in (b"B", b"P"):
        return {"kind": {b"B": "bytes", b"P": "pickle"}[kind]}
    _, dt, shape_s = meta.decode().split(";")
    shape = tuple(int(d) for d in shape_s.split(",")) if shape_s else ()
    return {"kind": "ndarray" if kind == b"N" else "tensor", "dtype": dt, "shape": shape}


#: Element sizes of torch dtypes by name: a process that only moves tensors' bytes (a
#: cluster member) checks their headers without importing torch (seconds, per process).
_TORCH_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2, "complex32": 4,
    "int32": 4, "uint32": 4, "float32": 4, "int64": 8, "uint64": 8, "float64": 8, "complex64": 8,
    "complex128": 16,
}


def check_header(meta: bytes, nbytes: int) -> None:
    """Refuse a header that does not parse, or whose shape and dtype imply another
    payload size than ``nbytes`` (``put_with`` and batches of encoded objects)."""
    if type(meta) is not bytes:
        raise TypeError(f"meta must be bytes (from codec.array_meta or codec.tensor_meta), not "
                        f"{type(meta).__name__}")
    try:
        want = _header_nbytes(meta)
    except (CorruptObjectError, ValueError, TypeError):
        raise ValueError(f"unreadable value header {meta[:60]!r}: make it with codec.array_meta or "
                         "codec.tensor_meta") from None
    if want is not None and want != nbytes:
        raise ValueError(f"header {meta[:60]!r} says {want} bytes, but nbytes={nbytes}")


@lru_cache(maxsize=4096)
def _header_nbytes(meta: bytes) -> int | None:
    return payload_nbytes(meta)


def payload_nbytes(meta: bytes) -> int | None:
    """The payload size an array or tensor header implies (None for bytes and pickles).

    Raises ``CorruptObjectError`` for a header that does not parse.
    """
    if meta[:1] == b"T":
        try:
            d = describe(meta)
        except ValueError:
            raise CorruptObjectError(f"unreadable value header {meta[:80]!r}") from None
        size = _TORCH_ITEMSIZE.get(d["dtype"])
        if size is not None and all(n >= 0 for n in d["shape"]):
            n = size
            for dim in d["shape"]:
                n *= dim
            return n
    decoder(meta)
    d = describe(meta)
    if "shape" not in d:
        return None
    n = 1
    for s in d["shape"]:
        n *= s
    return n * _stored_dtype(meta[:1], d["dtype"]).itemsize


def private_copy(value: Any) -> Any:
    """A writable copy that shares nothing with the store."""
    if isinstance(value, memoryview):
        return bytearray(value)
    if isinstance(value, np.ndarray):
        return value.copy()
    if is_tensor(value):
        return value.clone()
    return value  # unpickled objects are already private


def as_bytes_view(obj: Any) -> np.ndarray:
    """A flat writable uint8 numpy view of a host buffer/array/tensor (no copy)."""
    if is_tensor(obj):
        if obj.device.type != "cpu":
            raise TypeError("device tensors take the torch copy path")
        if not obj.is_contiguous():
            raise ValueError("get_into needs a contiguous output tensor")
        return obj.reshape(-1).view(_torch().uint8).numpy() if obj.numel() else np.empty(0, np.uint8)
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError("get_into needs a C-contiguous output array")
        if not obj.flags.writeable:
            raise ValueError("get_into needs a writable output array")
        return obj.reshape(-1).view(np.uint8)
    mv = memoryview(obj)
    if mv.readonly:
        raise ValueError("get_into needs a writable buffer (bytearray, ndarray or tensor)")
    return np.frombuffer(mv.cast("B"), dtype=np.uint8)


# ------------------------------------------------------------------ get_into


@lru_cache(maxsize=None)
def _torch_twin(dt: np.dtype):
    """torch's own equivalent of a numpy dtype (torch.from_numpy's mapping), or None."""
    try:
        return _torch().from_numpy(np.empty(0, dtype=dt)).dtype
    except (TypeError, ValueError):    # no torch dtype (longdouble, datetime) or not native order
        return None


def _numpy_twin(tdtype):
    """numpy's equivalent of a torch dtype, or None (bfloat16, float8 types, complex32...)."""
    try:
        dt = np.dtype(str(tdtype).replace("torch.", ""))
    except TypeError:
        return None
    return dt if _torch_twin(dt) == tdtype else None


def _stored_dtype(kind: bytes, dt: str):
    """The stored dtype as numpy (kind N) or torch (kind T) sees it."""
    if kind == b"N":
        return np.dtype(dt)
    tdtype = getattr(_torch(), dt, None)
    if not isinstance(tdtype, _torch().dtype):
        raise CorruptObjectError(f"unknown torch dtype {dt!r} in a stored value header")
    return tdtype


def check_into(key: str, meta: bytes, out: Any, nbytes: int) -> None:
    """Raise unless ``out`` can receive the stored value of ``key`` (header ``meta``,
    ``nbytes`` payload bytes) by a plain byte copy: the one check ``get_into`` makes.

    ``out`` must be a contiguous writable numpy array, a contiguous torch tensor
    (any device) or a writable buffer holding exactly ``nbytes`` bytes.  When the
    stored value is an array or a tensor and ``out`` is one too, its shape and
    dtype must match as well, across libraries by meaning (numpy ``float32``
    equals ``torch.float32``; ``torch.bfloat16`` only matches itself): get_into
    copies bytes, it never casts.  A stored bytes value, or a plain buffer
    ``out``, is checked for its byte count only.  Pickled values are refused.
    ValueError (TypeError for an ``out`` that is no buffer at all) says what
    differs and what to pass.  Copies nothing; O(1).
    """
    where = f"get_into({key!r}): "
    kind = meta[:1]
    if kind == b"P":
        raise ValueError(where + "the stored value is a pickled object, which cannot be copied into "
                         "a buffer; read it with get()")
    try:
        if kind not in (b"B", b"N", b"T"):
            raise ValueError("unknown kind")
        desc = describe(meta)
    except ValueError:
        raise CorruptObjectError(f"{where}unreadable value header {meta[:80]!r}") from None
    # Can out receive bytes in place at all?  (A non-contiguous device tensor would
    # otherwise be written through a temporary copy and silently keep its old data.)
    tensor_out = is_tensor(out)
    if tensor_out:
        if out.layout != _torch().strided:
            raise ValueError(where + "get_into needs a dense output tensor, not a sparse one")
        if out.is_meta or out.is_quantized:
            raise ValueError(where + f"get_into cannot write into a {'meta' if out.is_meta else 'quantized'} "
                             "tensor; pass a CPU or device tensor with memory of its own")
        if not out.is_contiguous():
            raise ValueError(where + "get_into needs a contiguous output tensor "
                             "(read into a contiguous one, then copy it over)")
        got = out.numel() * out.element_size()
    elif isinstance(out, np.ndarray):
        if not out.flags.c_contiguous:
            raise ValueError(where + "get_into needs a C-contiguous output array")
        if not out.flags.writeable:
            raise ValueError(where + "get_into needs a writable output array")
        got = out.nbytes
    else:
        try:
            mv = memoryview(out)
        except TypeError:
            raise TypeError(f"{where}out must be a numpy array, a torch tensor or a writable buffer "
                            f"(bytearray, memoryview), not {type(out).__name__}") from None
        if mv.readonly:
            raise ValueError(where + "get_into needs a writable buffer (bytearray, ndarray or tensor)")
        if not mv.c_contiguous:
            raise ValueError(where + "get_into needs a contiguous writable buffer")
        got = mv.nbytes
    typed = "shape" in desc and (tensor_out or isinstance(out, np.ndarray))
    problems = []
    if got != nbytes:
        problems.append(f"out holds {got} bytes, the stored value {nbytes}")
    if typed and tuple(out.shape) != desc["shape"]:
        problems.append(f"out has shape {tuple(out.shape)}, stored {desc['shape']}")
    want = None      # the dtype out must have, in out's own library (None: it has none)
    cast = False     # out asks for another dtype than the stored one
    if typed:
        stored = _stored_dtype(kind, desc["dtype"])
        shown = stored.name if kind == b"N" else str(stored)
        if tensor_out:
            want = stored if kind == b"T" else _torch_twin(stored)
        else:
            want = stored if kind == b"N" else _numpy_twin(stored)
        cast = want is None or out.dtype != want
        if cast:
            problems.append(f"out has dtype {out.dtype}, the stored value {shown}")
    if not problems:
        return
    if not typed:
        hint = f"pass an output of {nbytes} bytes"
    elif want is None:
        hint = (f"{'torch' if tensor_out else 'numpy'} has no dtype {shown}: pass "
                f"{'a numpy array' if tensor_out else 'a torch tensor'} of shape {desc['shape']} "
                f"and dtype {shown}")
    else:
        hint = f"pass an output of shape {desc['shape']} and dtype {want}"
    if cast:
        hint += " (get_into copies bytes, it does not cast)"
    raise ValueError(where + "; ".join(problems) + "; " + hint)


def copy_bytes(src: np.ndarray, out: Any) -> None:
    """Copy flat uint8 ``src`` into ``out`` (after ``check_into`` allowed it):
    one copy, to any device."""
    if is_tensor(out) and out.device.type != "cpu":
        torch = _torch()
        out.view(-1).view(torch.uint8).copy_(torch.from_numpy(src), non_blocking=False)
        return
    np.copyto(as_bytes_view(out), src)


def flat_bytes(value: Any) -> np.ndarray:
    """A flat uint8 view of a value returned by ``get`` (no copy; a device tensor comes to the host)."""
    if isinstance(value, np.ndarray):
        return value.reshape(-1).view(np.uint8)
    if is_tensor(value):
        return as_bytes_view(value.cpu() if value.device.type != "cpu" else value)
    return np.frombuffer(value, dtype=np.uint8)


def extent(value: Any) -> tuple[int, int]:
    """(address, byte count) of the memory under an array, a CPU tensor or a buffer."""
    if is_tensor(value):
        return value.data_ptr(), value.numel() * value.element_size()
    arr = value if isinstance(value, np.ndarray) else np.frombuffer(value, dtype=np.uint8)
    return arr.__array_interface__["data"][0], arr.nbytes

