"""codec.check_into (the one get_into check) and codec.encode's refusals, called directly.

check_into is tested over the whole matrix: numpy or torch output x numpy or
torch stored value, matching and mismatching dtypes and shapes, stored bytes,
plain buffers, pickled values and outputs that cannot receive bytes in place.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from yrcache import codec
from yrcache.errors import CorruptObjectError

torch = pytest.importorskip("torch")

KEY = "w/\t1"                   # any key: messages name it by repr
PREFIX = f"get_into({KEY!r}): "

# numpy dtype <-> torch dtype pairs that mean the same thing
TWINS = [
    (np.float32, torch.float32), (np.float64, torch.float64), (np.float16, torch.float16),
    (np.int8, torch.int8), (np.int16, torch.int16), (np.int32, torch.int32), (np.int64, torch.int64),
    (np.uint8, torch.uint8), (np.uint16, torch.uint16), (np.uint32, torch.uint32),
    (np.uint64, torch.uint64), (np.bool_, torch.bool), (np.complex64, torch.complex64),
    (np.complex128, torch.complex128),
]
TWIN_IDS = [np.dtype(n).name for n, _ in TWINS]

# pairs of equal item size and different meaning: a byte copy between them is garbage
SAME_SIZE_OTHER_MEANING = [
    (np.float32, torch.int32), (np.int32, torch.float32), (np.float32, torch.uint32),
    (np.float16, torch.bfloat16), (np.uint16, torch.bfloat16), (np.int16, torch.float16),
    (np.uint8, torch.bool), (np.bool_, torch.int8), (np.int64, torch.float64),
    (np.float64, torch.complex64), (np.uint8, torch.float8_e4m3fn), (np.int8, torch.float8_e5m2),
]
OTHER_IDS = [f"{np.dtype(n).name}-{str(t)[6:]}" for n, t in SAME_SIZE_OTHER_MEANING]


def stored(value):
    """(meta, nbytes) of ``value`` as the store would keep it."""
    meta, _payload, nbytes = codec.encode(value)
    return meta, nbytes


def ok(value, out) -> None:
    meta, nbytes = stored(value)
    assert codec.check_into(KEY, meta, out, nbytes) is None


def refused(value, out, *mentions, exc=ValueError) -> str:
    meta, nbytes = stored(value)
    with pytest.raises(exc) as ei:
        codec.check_into(KEY, meta, out, nbytes)
    msg = str(ei.value)
    assert msg.startswith(PREFIX), msg
    for m in mentions:
        assert m in msg, f"{m!r} not in {msg!r}"
    return msg


# ------------------------------------------------------- numpy stored value


def test_numpy_stored_numpy_out_same_dtype_and_shape():
    ok(np.zeros((3, 4), np.float32), np.empty((3, 4), np.float32))
    ok(np.zeros((), np.int64), np.empty((), np.int64))               # 0-d
    ok(np.zeros((0, 5), np.float64), np.empty((0, 5), np.float64))   # empty


def test_numpy_stored_numpy_out_other_dtype_same_bytes():
    msg = refused(np.zeros(4, np.float32), np.empty(4, np.int32),
                  "out has dtype int32", "float32", "pass an output of shape (4,) and dtype float32",
                  "does not cast")
    assert "bytes" not in msg.split(";")[0]


def test_numpy_stored_big_endian_out_is_another_dtype():
    refused(np.zeros(4, np.float32), np.empty(4, ">f4"), "dtype >f4")


def test_numpy_stored_numpy_out_other_shape_same_bytes():
    refused(np.zeros((3, 4), np.float64), np.empty((4, 3), np.float64),
            "out has shape (4, 3), stored (3, 4)", "pass an output of shape (3, 4)")
    refused(np.zeros((3, 4), np.float64), np.empty(12, np.float64), "shape (12,)")


def test_numpy_stored_numpy_out_other_size():
    msg = refused(np.zeros((3, 4), np.float64), np.empty((3, 5), np.float64),
                  "out holds 120 bytes, the stored value 96", "out has shape (3, 5), stored (3, 4)")
    assert "does not cast" not in msg


@pytest.mark.parametrize("np_dt,t_dt", TWINS, ids=TWIN_IDS)
def test_numpy_stored_torch_out_twin_dtype(np_dt, t_dt):
    ok(np.zeros((2, 3), np_dt), torch.empty((2, 3), dtype=t_dt))


@pytest.mark.parametrize("np_dt,t_dt", SAME_SIZE_OTHER_MEANING, ids=OTHER_IDS)
def test_numpy_stored_torch_out_other_dtype(np_dt, t_dt):
    """The bug this fixes: a float32 array read into an int32 tensor was accepted (garbage)."""
    refused(np.zeros((2, 3), np_dt), torch.empty((2, 3), dtype=t_dt), f"out has dtype {t_dt}",
            "does not cast")


def test_numpy_float32_into_torch_int32_names_what_to_pass():
    refused(np.zeros(8, np.float32), torch.empty(8, dtype=torch.int32),
            "out has dtype torch.int32, the stored value float32",
            "pass an output of shape (8,) and dtype torch.float32")


def test_numpy_stored_torch_out_other_shape():
    refused(np.zeros((2, 3), np.float32), torch.empty((3, 2)), "out has shape (3, 2), stored (2, 3)")


def test_numpy_dtype_without_torch_twin_into_tensor():
    value = np.zeros(2, np.longdouble)
    out = torch.empty(value.nbytes, dtype=torch.uint8).view(-1)
    refused(value, out, "torch has no dtype", "pass a numpy array")


# ------------------------------------------------------- torch stored value


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16, torch.float32, torch.bool,
                                torch.complex64, torch.float8_e4m3fn, torch.int64])
def test_torch_stored_torch_out_same_dtype(dt):
    ok(torch.zeros((4, 2), dtype=dt), torch.empty((4, 2), dtype=dt))


def test_torch_stored_torch_out_other_dtype_same_bytes():
    refused(torch.zeros(6, dtype=torch.bfloat16), torch.empty(6, dtype=torch.float16),
            "out has dtype torch.float16, the stored value torch.bfloat16",
            "dtype torch.bfloat16", "does not cast")
    refused(torch.zeros(6, dtype=torch.float32), torch.empty(6, dtype=torch.int32), "torch.int32")


def test_torch_stored_torch_out_other_shape():
    refused(torch.zeros((16, 8), dtype=torch.bfloat16), torch.empty((8, 16), dtype=torch.bfloat16),
            "out has shape (8, 16), stored (16, 8)")
    refused(torch.zeros((16, 8), dtype=torch.bfloat16), torch.empty((16, 9), dtype=torch.bfloat16),
            "out holds 288 bytes, the stored value 256")


@pytest.mark.parametrize("np_dt,t_dt", TWINS, ids=TWIN_IDS)
def test_torch_stored_numpy_out_twin_dtype(np_dt, t_dt):
    ok(torch.zeros((3, 2), dtype=t_dt), np.empty((3, 2), np_dt))


@pytest.mark.parametrize("np_dt,t_dt", SAME_SIZE_OTHER_MEANING, ids=OTHER_IDS)
def test_torch_stored_numpy_out_other_dtype(np_dt, t_dt):
    refused(torch.zeros((3, 2), dtype=t_dt), np.empty((3, 2), np_dt), f"out has dtype {np.dtype(np_dt)}")


def test_bfloat16_stored_numpy_out_has_no_twin():
    refused(torch.zeros(4, dtype=torch.bfloat16), np.empty(4, np.uint16),
            "numpy has no dtype torch.bfloat16", "pass a torch tensor of shape (4,) and dtype torch.bfloat16")


def test_torch_stored_numpy_out_other_shape():
    refused(torch.zeros((3, 2)), np.empty((2, 3), np.float32), "out has shape (2, 3), stored (3, 2)")


# ---------------------------------------------------------- bytes and buffers


@pytest.mark.parametrize("out", [
    bytearray(16), memoryview(bytearray(16)), np.empty(16, np.uint8), np.empty((2, 2), np.float32),
    np.empty(2, np.complex64), torch.empty(4, dtype=torch.int32),
], ids=["bytearray", "memoryview", "u8", "f32-2x2", "c64", "torch-int32"])
def test_bytes_stored_any_out_of_the_same_size(out):
    ok(b"x" * 16, out)


def test_bytes_stored_other_size():
    refused(b"x" * 10, bytearray(9), "out holds 9 bytes, the stored value 10", "pass an output of 10 bytes")
    refused(b"x" * 10, np.empty(11, np.uint8), "out holds 11 bytes")
    refused(b"x" * 8, torch.empty(3, dtype=torch.int32), "out holds 12 bytes, the stored value 8")


@pytest.mark.parametrize("value", [np.arange(6, dtype=np.float32).reshape(2, 3),
                                   torch.zeros((2, 3), dtype=torch.bfloat16)], ids=["numpy", "torch"])
def test_typed_stored_buffer_out_checks_bytes_only(value):
    n = stored(value)[1]
    ok(value, bytearray(n))
    ok(value, memoryview(bytearray(n)))
    refused(value, bytearray(n + 1), f"out holds {n + 1} bytes, the stored value {n}",
            f"pass an output of {n} bytes")


def test_pickled_value_refused():
    meta, nbytes = b"P", len(pickle.dumps({"a": 1}))
    with pytest.raises(ValueError) as ei:
        codec.check_into(KEY, meta, bytearray(nbytes), nbytes)
    assert str(ei.value).startswith(PREFIX) and "pickled" in str(ei.value) and "get()" in str(ei.value)


# ------------------------------------------------- outputs that cannot receive


def test_non_contiguous_and_read_only_outputs():
    value = np.zeros((4, 4), np.float32)
    refused(value, np.empty((4, 8), np.float32)[:, ::2], "get_into needs a C-contiguous output array")
    ro = np.empty((4, 4), np.float32)
    ro.flags.writeable = False
    refused(value, ro, "get_into needs a writable output array")
    refused(value, torch.empty((4, 4)).t()[:, :], "get_into needs a contiguous output tensor")
    refused(value, torch.empty((4, 8))[:, ::2], "get_into needs a contiguous output tensor")
    refused(b"x" * 64, bytes(64), "get_into needs a writable buffer")
    refused(b"x" * 64, memoryview(bytearray(64)).toreadonly(), "get_into needs a writable buffer")
    refused(b"x" * 32, memoryview(bytearray(64))[::2], "contiguous")


def test_sparse_tensor_out_refused():
    refused(np.zeros(4, np.float32), torch.zeros(4).to_sparse(), "dense")


def test_not_a_buffer_is_a_type_error():
    refused(b"x" * 3, [0, 0, 0], "not list", exc=TypeError)


def test_unreadable_header_is_corrupt():
    for meta in (b"Z", b"N;<f4", b"T;nosuchdtype;3"):
        with pytest.raises(CorruptObjectError):
            codec.check_into(KEY, meta, np.empty(3, np.float32), 12)


def test_numpy_only_check_does_not_need_torch_imported():
    """A numpy value read into an ndarray never touches torch (it may be absent)."""
    import subprocess
    import sys

    code = ("import sys, numpy as np\n"
            "from yrcache import codec\n"
            "m, _, n = codec.encode(np.zeros(3, np.float32))\n"
            "codec.check_into('k', m, np.empty(3, np.float32), n)\n"
            "codec.check_into('k', b'B', bytearray(4), 4)\n"
            "try:\n"
            "    codec.check_into('k', m, np.empty(3, np.int32), n)\n"
            "except ValueError:\n"
            "    pass\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ------------------------------------------------------------- encode


def test_masked_array_refused_with_a_hint():
    m = np.ma.masked_array([1.0, 2.0, 3.0], mask=[False, True, False])
    with pytest.raises(TypeError) as ei:
        codec.encode(m)
    msg = str(ei.value)
    assert "mask" in msg and "lost" in msg and ".filled(" in msg, msg
    # the same for a masked array with nothing masked, and for 0-d / non-contiguous ones
    for value in (np.ma.masked_array(np.arange(4)), np.ma.masked_array(np.arange(8.0))[::2],
                  np.ma.masked_array(1.5, mask=True)):
        with pytest.raises(TypeError, match="mask"):
            codec.encode(value)


def test_masked_array_with_pickle_keeps_its_mask():
    m = np.ma.masked_array([1.0, 2.0, 3.0], mask=[False, True, False])
    meta, payload, n = codec.encode(m, allow_pickle=True)
    assert meta == b"P"
    back = codec.decoder(meta)(payload, n)
    assert isinstance(back, np.ma.MaskedArray)
    np.testing.assert_array_equal(np.ma.getmaskarray(back), [False, True, False])


def test_masked_array_refused_by_the_store(make_store):
    s = make_store(dram="1MiB")
    m = np.ma.masked_array(np.arange(4.0), mask=[0, 1, 0, 0])
    with pytest.raises(TypeError, match="mask"):
        s["m"] = m
    with pytest.raises(TypeError, match="mask"):
        s.mset({"a": b"1", "m": m})
    assert "m" not in s
    s["m"] = m.filled(np.nan)                       # what the message suggests works
    assert np.isnan(s["m"][1])


def test_first_puts_and_samples_in_a_new_process_import_nothing_heavy(make_store):
    """Telling a masked array apart must not import ``numpy.ma`` (``np.ma``'s first use,
    ~20 ms, which every process's first put of an array, every DataLoader worker's
    first sample, used to pay): a new process stores and reads arrays, tensors and a
    CachedDataset-style sample without it, and still refuses a masked array."""
    from procs import fresh_python
    s = make_store(dram="4MiB")
    script = (
        "import sys, numpy as np, torch\n"
        "from yrcache import TieredStore\n"
        "from yrcache._sample import _encode\n"
        f"s = TieredStore.attach({s.name!r})\n"
        "s.put('a', np.arange(12.0).reshape(3, 4)); s.put('t', torch.ones(5)); s.mset({'b': b'x', 'c': np.ones(3)})\n"
        "assert s.get('a')[2, 3] == 11.0 and float(s.get('t').sum()) == 5.0 and list(s.mget(['b', 'c'])[1]) == [1, 1, 1]\n"
        "_encode({'x': np.ones((2, 2)), 'y': [torch.zeros(3), 7]}, False)\n"
        "print('numpy.ma' in sys.modules)\n"
        "import numpy.ma\n"
        "try:\n"
        "    s.put('m', numpy.ma.masked_array([1.0, 2.0], mask=[0, 1]))\n"
        "except TypeError as e:\n"
        "    print('refused', 'mask' in str(e))\n"
        "s.close()\n")
    out = fresh_python(script)
    assert out.split() == ["False", "refused", "True"], out


def test_conjugate_and_negative_views_are_stored_as_their_values(make_store):
    """A conjugate (or negative) view keeps its data unconjugated and a bit aside; what
    is stored is the values it shows, small (copied out) or large (a pinned view)."""
    s = make_store(dram="16MiB")
    for n in (3, 20_000):
        z = torch.complex(torch.arange(n, dtype=torch.float32), torch.ones(n))
        c = z.conj()
        assert c.is_conj()
        s["c"] = c
        assert torch.equal(s["c"], c.resolve_conj()) and s["c"][1].imag == -1
        neg = c.imag            # a negative view of c's imaginary parts
        assert neg.is_neg()
        s["n"] = neg
        assert torch.equal(s["n"], torch.full((n,), -1.0))


def test_tensor_headers_are_cached_and_values_keep_their_dtype(make_store):
    """Encoding a tensor reuses the header of its (dtype, shape); a stored tensor comes
    back with its dtype and shape whether torch converts its dtype to numpy (float32)
    or not (bfloat16 travels as int16, float8 as bytes)."""
    s = make_store(dram="16MiB")
    for dt in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.bool, torch.int64):
        for shape in ((), (5,), (2, 3), (2, 0)):
            t = torch.ones(shape).to(dt)
            meta, payload, n = codec.encode(t)
            assert codec.encode(torch.zeros(shape).to(dt))[0] is meta      # cached
            assert n == t.numel() * t.element_size() and len(memoryview(payload).cast("B")) == n
            s["t"] = t
            got = s["t"]
            assert (got.dtype, tuple(got.shape)) == (dt, shape) and torch.equal(got, t)
