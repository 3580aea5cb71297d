"""Type aliases used in yrcache's public signatures.

torch is an optional dependency and a stored value may be any of several
unrelated types, so signatures name what they mean with these aliases; to a
type checker each is ``Any`` (as a ``dict``'s values would be), never a union
the caller has to narrow after every read.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Value", "Array", "DType"]

#: A value a store holds: ``bytes``/``bytearray``/``memoryview`` (read back
#: as a read-only ``memoryview``), a ``numpy.ndarray`` (read back as a
#: read-only ndarray) or a ``torch.Tensor`` (read back as a CPU tensor over the
#: stored bytes, or a device tensor from the HBM tier); with ``pickle=True``
#: any picklable object.
Value = Any

#: A ``numpy.ndarray`` or a ``torch.Tensor`` (on any device).
Array = Any

#: A ``torch.dtype`` (e.g. ``torch.bfloat16``) or anything ``numpy.dtype()``
#: accepts (``"float32"``, ``np.float16``).
DType = Any
