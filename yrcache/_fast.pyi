# Types of yrcache._fast, the C hot paths of get, put and mget (yrcache/_csrc/fast*.c).
from typing import Any, Literal

def keys_valid(keys: list, max_key: int, /) -> bool:
    """Every key an exact str of 1 to ``max_key`` UTF-8 bytes without NUL (False: check them
    one by one, for the error)."""
def wire_entries(keys: list, max_key: int, /) -> bytes | None:
    """An MGET request body (cluster/wire.py's entry list, versions 0) for keys ``keys_valid``
    accepts; None for any other."""
def wire_puts(items: list, max_key: int, max_meta: int, small: int, /) -> bytes | None:
    """An MPUT body for put items (key, meta, payload, nbytes, (hlc, writer), priority,
    expire_at), each payload one contiguous buffer of ``nbytes`` <= ``small``; None when one
    is not (the Python encoder takes them)."""
def wire_mput(body: bytearray, n: int, max_key: int, max_meta: int, /) -> list | None:
    """The ``n`` items of an MPUT body held whole, each (key, meta, payload bytes, (hlc,
    writer), priority, expire_at) as ``wire.parse_mput`` gives them; None for a malformed body."""
def wire_items(body: bytearray, n: int, max_meta: int, got: type, /) -> list | None:
    """The ``n`` items of an MGET reply body, each None or ``got(meta, view of body, (hlc,
    writer), -1)``; None for a malformed body."""
def round_trip(fds: tuple[int, ...], frame: Any, op: int, poll_ns: int, /) -> list[int | bytes | tuple[bool, int]]:
    """``frame`` sent whole on every socket (at most 16), then each reply's 72-byte header
    read, the GIL released: per socket the reply's status (a well-formed reply to ``op`` with
    nothing after its header), the header's bytes (anything else: the caller parses it and
    what follows), or ``(sent, errno)`` if the socket failed (``sent``: the frame went out
    whole; errno 0: the peer closed it). A signal whose handler raises stops the round.

    The replies are polled for first (non-blocking receives) for up to twice the process's
    recent reply latency to ``op`` requests, at most ``poll_ns`` (none when they take longer;
    0: never)."""
def await_replies(fds: tuple[int, ...], poll_ns: int, timeouts_ms: tuple[int, ...], op: int, /) -> tuple[int, ...] | None:
    """After requests (``op``, of cluster/wire.py) went out on the sockets (at most 1,024), wait until each has something
    to read (or is closed or failed): polled for first as ``round_trip`` polls, then slept for
    in poll(2), each within its timeout from the call (-1: no limit). Nothing is consumed.
    None, or the indexes of the sockets still silent at their limit; ``poll_ns`` 0: None at once."""
def round_stats(op: int, /) -> tuple[int, int, int]:
    """``(reply_ns, polled, slept)``: this process's recent reply latency to ``op`` requests (an
    average) and how many rounds with ``poll_ns`` > 0 got every reply while polling / slept."""

class HotPath:
    """Small gets and puts of one arena mapping, each in one C call (made by tiers/dram.py)."""

    slot: int
    """This process's slot in the arena (0: none yet, e.g. in a child right after fork);
    setting it records the process, whose pins the views built here release in C."""

    anchor: Any
    """A weak reference to the Arena that owns the mapping (the views ``get`` builds hold it)."""

    def __init__(self, *addresses_base_max_key_cap: int) -> None:
        """HotPath(read, put, mread, unpin, mput, base, max_key, cap): C function and mapping addresses."""
    def mread(self, keys: list, /) -> list | Literal[False]:
        """Per key None, (data, meta_len) or (meta, payload_off, nbytes, pin, block), in one
        lock hold; False: take the general path (nothing is pinned then)."""
    def mget(self, keys: list, /) -> list | Literal[False]:
        """``mread``, except that small bytes values and 1-D arrays of registered headers
        come back as ``get`` returns them."""
    def read(self, key: Any, /) -> tuple[bytes, int] | tuple[bytes, int, int, int, int] | None | Literal[False]:
        """(header + payload, header length) of a small DRAM value; (header, payload offset,
        size, pin, block) of a larger one it pinned; None for a miss; else False."""
    def get(self, key: Any, /) -> memoryview | Any | tuple[bytes, int] | tuple[bytes, int, int, int, int] | None | Literal[False]:
        """``read``, except that a small bytes value, a small 1-D array of a header
        registered with ``flat`` (both read-only, over a private copy) and a pinned ndarray
        of a header registered with ``shaped`` (a read-only view holding the pin) come back
        as ``TieredStore.get`` returns them."""
    def flat(self, meta: bytes, dtype: Any, itemsize: int, frombuffer: Any, /) -> bool:
        """From now on ``get`` builds the small values with this 1-D ndarray header as
        ``frombuffer(private copy, dtype)``; False when 16 headers are registered already."""
    def shaped(self, meta: bytes, dtype: Any, itemsize: int, shape: tuple | None, frombuffer: Any,
               post: Any = ..., view_as: Any = ..., /) -> bool:
        """From now on ``get`` and ``mget`` build a pinned value with this header as
        ``frombuffer(pinned bytes, dtype)``, reshaped to ``shape`` unless it is None; for a
        tensor header then ``post(array)`` (``torch.from_numpy``) and ``.view(view_as)``
        unless it is None (16 headers, the oldest replaced)."""
    def put(self, key: Any, meta: bytes, payload: Any, prefaulted: bool, /) -> bool:
        """True once the payload is stored in DRAM (priority 0, no ttl), else False (general path)."""
    def mput(self, rows: list, priority: int, expire_at: float, /) -> tuple[int, int] | int:
        """Rows of (key bytes, header, payload buffer, nbytes), validated by the caller, stored
        in DRAM, 256 per hold of the arena lock, until one does not fit: (stored, how many replaced a
        lower-tier copy); or the arena's negative error code. TypeError/ValueError for a
        row that is not of that form, or a mapping closed or without this process's slot."""
    def mput_values(self, pairs: list, priority: int, expire_at: float, small: int, /) -> tuple[int, int] | int | None | Literal[False]:
        """``mput`` of (key, value) pairs, keys checked and headers found in C (the values
        ``put_value`` takes, each of at most ``small`` bytes); None: an ndarray of a layout
        not learned yet; False: a key or value for the general path (nothing stored then)."""
    def put_value(self, key: Any, value: Any, prefaulted: bool, /) -> bool | None:
        """``put`` of bytes, a bytearray or a C-contiguous ndarray of a learned layout, the
        header found in C; None: an ndarray whose layout is not learned yet (encode it, then
        ``learn``); False: take the general path."""
    def learn(self, array: Any, meta: bytes, /) -> bool:
        """From now on ``put_value`` stores ndarrays of this one's layout under ``meta`` (32
        layouts, the oldest replaced); False for a layout a buffer cannot describe here, or
        for anything but a plain ndarray (bytes have a buffer layout too, not an array header)."""
    def mreply(self, body: Any, versions: dict, /) -> tuple[int, bytes] | Literal[False]:
        """A cluster MGET's reply body for the request body ``body`` (cluster/wire.py's entry
        list), read in one lock hold and copied into one bytes object, each key's version from
        ``versions`` (key -> (hlc, writer)), and how many keys it answers; False: take the
        general path (an object outside DRAM, pickled or over 64 KiB; a malformed list)."""
    def close(self) -> None:
        """Forget the mapping: later calls return False."""

class Clock:
    """A hybrid logical clock: versions ``(hlc, writer)``, hlc = microseconds << 8 | a
    counter, never going back (cluster/replication.py)."""

    writer: int
    """This process's writer id (random, 63 bits)."""
    last: int
    """The latest hlc handed out or observed (tests set it back to hand out an older version)."""

    def next(self) -> tuple[int, int]:
        """A version after every one handed out or observed here."""
    def next_many(self, n: int, /) -> int:
        """The first of ``n`` consecutive hlcs (the writer is ``writer``)."""
    def observe(self, hlc: int, /) -> None:
        """Later versions come after ``hlc`` (a version applied from another writer)."""

class KeyLock:
    """The lock of a group of keys on a member: ``threading.Lock``'s API (``acquire(blocking)``,
    ``release``, ``locked``, ``with``), taken by ``OwnPuts`` without calling into Python."""

    def acquire(self, blocking: bool = True, /) -> bool: ...
    def release(self) -> None: ...
    def locked(self) -> bool: ...
    def __enter__(self) -> bool: ...
    def __exit__(self, *exc: object) -> None: ...

class OwnPuts:
    """A cluster member's own ASYNC puts in one C call (cluster/member.py's ``Node.own``)."""

    active: bool
    """This member is in the ring now (False: every put returns False)."""

    def __init__(self, hot: HotPath, clock: Clock, versions: dict, tombs: dict, single: set, locks: list,
                 forwarder: Any, queue: Any, modes: tuple, queue_max: int, batch: int, prefaulted: bool) -> None: ...
    def put(self, key: Any, value: Any, /, *options: Any) -> bool | tuple[int, int] | None:
        """The key's lock, a version, the local put and the forwarder's queue, for an ASYNC put:
        ``put(key, value)``, or with ClusterStore.put's ``tier, priority, ttl, write_mode``
        (``write_mode`` one of ``modes`` or "async", the others their defaults): True done (or a
        newer version held here), a version: stored, ``Forwarder.add`` it (the queue is full
        or the forwarder asleep), None: an ndarray layout to learn first, False: the general
        path (nothing stored)."""
    def serve(self, buf: bytearray, start: int, end: int, /) -> tuple | None:
        """A whole, plain PUT or GET frame at ``buf[start:end]`` answered here: ``(consumed,
        reply)``, or ``(consumed, reply, key, version)`` (then ``Forwarder.add`` them); None:
        the general path (nothing consumed)."""
