"""0.5.7 inline data plane: msgpack ``TensorEnvelope`` frames, built and read in place.

LMCache 0.5.7 replaced the pickled tensor lists of the non-SHM plane by a msgpack map
``{"version": 1, "tensors": [{"dtype": "bfloat16", "shape": [...], "data": bin}, ...]}``
(docs/protocol.md §7.6). The server decodes it with unknown fields forbidden and checks
every tensor's count, dtype, shape and byte length exactly; any mismatch gets no reply.

* :class:`EnvelopeFrameBuilder` lays out a whole ``commit_store`` payload frame (the msgpack
  ``bin`` around the envelope) in one buffer with each tensor's data region aligned, so a
  store copies the KV once, straight into the frame ZMQ sends. msgpack has no padding, so
  the alignment comes from writing some headers in a wider form than the narrowest
  (``str8`` for a ``fixstr``, ``uint64`` for a ``fixint``): the same document to any
  decoder. With ``align=1`` the frame is byte for byte ``msgspec.msgpack.encode``'s.
* :func:`locate_tensors` reads a received envelope against that one schema and the
  expected layout and returns where each tensor's bytes lie in the buffer, for a gather
  that copies them once, straight into the result. It is not a msgpack decoder: anything
  else than the schema is a :class:`~lmcache_kv_fast.errors.ProtocolError`.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import Sequence
from typing import NamedTuple, NoReturn

import torch

from lmcache_kv_fast.errors import InvalidArgumentError, ProtocolError
from lmcache_kv_fast.protocol.constants import (
    ENVELOPE_MAX_RANK,
    ENVELOPE_MAX_TENSOR_BYTES,
    ENVELOPE_MAX_TENSORS,
    ENVELOPE_MAX_TOTAL_BYTES,
    ENVELOPE_VERSION,
)

logger = logging.getLogger(__name__)

# msgpack headers of the families the schema uses: the "fix" form (prefix | value, up to a
# limit) and the sized forms (tag byte + big-endian value of _WIDTH[tag] bytes), narrow first.
_FIX = {"uint": (0x00, 0x7F), "map": (0x80, 0x0F), "array": (0x90, 0x0F), "str": (0xA0, 0x1F)}
_SIZED = {"uint": (0xCC, 0xCD, 0xCE, 0xCF), "bin": (0xC4, 0xC5, 0xC6),
          "str": (0xD9, 0xDA, 0xDB), "array": (0xDC, 0xDD), "map": (0xDE, 0xDF)}
_WIDTH = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2,
          0xDB: 4, 0xDC: 2, 0xDD: 4, 0xDE: 2, 0xDF: 4}
_FAMILY = {tag: family for family, tags in _SIZED.items() for tag in tags}


def dtype_name(dtype: torch.dtype) -> str:
    """The envelope's name of a dtype: torch's without ``torch.`` (``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def _forms(family: str, value: int) -> tuple[bytes, ...]:
    """Every msgpack header of ``family`` that can hold ``value``, narrowest first."""
    out = []
    fix = _FIX.get(family)
    if fix is not None and value <= fix[1]:
        out.append(bytes([fix[0] | value]))
    for tag in _SIZED[family]:
        if value < 1 << (8 * _WIDTH[tag]):
            out.append(bytes([tag]) + value.to_bytes(_WIDTH[tag], "big"))
    return tuple(out)


class _Part(NamedTuple):
    """One msgpack element: its possible headers (narrowest first) and its payload."""

    forms: tuple[bytes, ...]
    payload: bytes = b""


def _hdr(family: str, value: int) -> _Part:
    return _Part(_forms(family, value))


def _str(text: str) -> _Part:
    raw = text.encode()
    return _Part(_forms("str", len(raw)), raw)


def _min_len(parts: Sequence[_Part]) -> int:
    return sum(len(p.forms[0]) + len(p.payload) for p in parts)


@functools.lru_cache(maxsize=512)
def _widen(options: tuple[tuple[int, ...], ...], extra: int) -> tuple[int, ...] | None:
    """Pick one header form per element so the forms' extra bytes sum to ``extra``.

    ``options[i]`` lists element i's extra bytes per form; None when no choice sums up.
    """
    reach: dict[int, tuple[int, ...]] = {0: ()}
    for opts in options:
        nxt: dict[int, tuple[int, ...]] = {}
        for total, picks in reach.items():
            for k, more in enumerate(opts):
                if total + more <= extra:
                    nxt.setdefault(total + more, (*picks, k))
        reach = nxt
    return reach.get(extra)


def _encode(parts: Sequence[_Part], extra: int) -> bytes | None:
    """``parts`` encoded exactly ``extra`` bytes longer than their narrowest form (or None)."""
    picks = _widen(tuple(tuple(len(f) - len(p.forms[0]) for f in p.forms) for p in parts),
                   extra)
    if picks is None:
        return None
    return b"".join(p.forms[k] + p.payload for p, k in zip(parts, picks, strict=True))


class EnvelopeFrameBuilder:
    """Builds 0.5.7 ``commit_store`` payload frames for chunks of one shape and dtype.

    Same contract as :class:`~lmcache_kv_fast.dataplane.pickle_fast.ChunkFrameBuilder`.

    Args:
        shape: Object shape of one chunk (what the server registered).
        dtype: Element dtype (the registration's).
        align: Alignment of each chunk's data region (absolute address). Kept when the
            headers leave room for it (every usual chunk shape); otherwise the largest
            power of two below it that they do (at least 32 for any shape of rank >= 2).

    Raises:
        InvalidArgumentError: A chunk the server's envelope cannot carry.
    """

    #: Idle frame buffers kept for reuse (a fresh one faults and zeroes every page).
    KEEP_BUFFERS = 2

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, align: int = 64) -> None:
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype
        self.dtype_name = dtype_name(dtype)
        self.numel = math.prod(self.shape)
        self.nbytes = self.numel * dtype.itemsize
        if len(self.shape) > ENVELOPE_MAX_RANK or min(self.shape, default=0) < 0:
            raise InvalidArgumentError(
                f"inline envelope: chunk shape {list(self.shape)} has to have at most "
                f"{ENVELOPE_MAX_RANK} non-negative dimensions")
        if self.nbytes > ENVELOPE_MAX_TENSOR_BYTES:
            raise InvalidArgumentError(
                f"inline envelope: a chunk of {self.nbytes} bytes, the server takes at "
                f"most {ENVELOPE_MAX_TENSOR_BYTES} per tensor")
        self._item = (_hdr("map", 3), _str("dtype"), _str(self.dtype_name), _str("shape"),
                      _hdr("array", len(self.shape)), *(_hdr("uint", d) for d in self.shape),
                      _str("data"), _hdr("bin", self.nbytes))
        self.align, self._head = align, b""
        self._leads: dict[int, bytes] = {}  # frame heads by chunk count
        self._set_align(align)
        self._idle: list[bytearray] = []
        self._idle_lock = threading.Lock()

    def _set_align(self, align: int) -> None:
        """Align to ``align``, or the largest power of two below it the headers allow."""
        while True:  # every tensor after the first: widened so its data lands aligned
            head = _encode(self._item, (-(_min_len(self._item) + self.nbytes)) % align)
            if head is not None:
                break
            align //= 2
        if align != self.align:
            logger.debug("inline envelope: %s chunks aligned to %d bytes, not %d",
                         list(self.shape), align, self.align)
        self.align, self._head = align, head
        self._leads.clear()  # built for the old alignment

    def _lead(self, n: int, outer: int) -> bytes | None:
        """The envelope's start through the first tensor's header (None: no room to align).

        Widened so the first data region lands aligned after an ``outer``-byte ``bin`` header.
        """
        parts = [_hdr("map", 2), _str("version"), _hdr("uint", ENVELOPE_VERSION),
                 _str("tensors"), _hdr("array", n)]
        if n:
            parts += self._item
        return _encode(parts, (-(outer + _min_len(parts))) % self.align if n else 0)

    def _frame_head(self, n: int) -> bytes:
        """The frame's bytes up to the first data region: ``bin`` header + envelope start."""
        outer = 2  # the bin header: the narrowest that holds the length (grows only)
        while True:
            lead = self._lead(n, outer)
            while lead is None:  # rare: the first header has less room than the others
                self._set_align(self.align // 2)
                lead = self._lead(n, outer)
            body = n * self.nbytes + max(0, n - 1) * len(self._head)
            forms = _forms("bin", len(lead) + body)
            if len(forms[0]) <= outer:
                return next(f for f in forms if len(f) == outer) + lead
            outer = len(forms[0])

    def build(self, n: int) -> tuple[bytearray, memoryview, list[int]]:
        """Lay out a frame for ``n`` chunks.

        Returns:
            ``(backing, frame, offsets)``: ``frame`` (a view of ``backing``) is the msgpack
            ``bin`` frame to send; ``offsets[j]`` is where chunk j's bytes go in ``frame``.

        Raises:
            InvalidArgumentError: More chunks or bytes than one envelope may carry.
        """
        if not 0 <= n <= ENVELOPE_MAX_TENSORS or n * self.nbytes > ENVELOPE_MAX_TOTAL_BYTES:
            raise InvalidArgumentError(
                f"inline envelope: {n} chunks of {self.nbytes} bytes; the server takes at "
                f"most {ENVELOPE_MAX_TENSORS} tensors and {ENVELOPE_MAX_TOTAL_BYTES} bytes "
                "per commit_store")
        with self._idle_lock:  # _frame_head may lower align / change _head (once)
            lead = self._leads.get(n)
            if lead is None:
                if len(self._leads) >= 64:
                    self._leads.clear()
                lead = self._leads[n] = self._frame_head(n)
            head, align = self._head, self.align
        size = len(lead) + n * self.nbytes + max(0, n - 1) * len(head)
        backing = self._take(size + align)
        shift = (-torch.frombuffer(backing, dtype=torch.uint8).data_ptr()) % align
        frame = memoryview(backing)[shift:shift + size]
        frame[:len(lead)] = lead
        pos, offsets = len(lead), []
        for j in range(n):
            if j:
                frame[pos:pos + len(head)] = head
                pos += len(head)
            offsets.append(pos)
            pos += self.nbytes
        return backing, frame, offsets

    def _take(self, need: int) -> bytearray:
        """An idle buffer of ``need`` to ``2 * need`` bytes, or a new one."""
        with self._idle_lock:
            fits = [b for b in self._idle if need <= len(b) <= 2 * need]
            if fits:
                backing = min(fits, key=len)
                self._idle = [b for b in self._idle if b is not backing]  # not by value
                return backing
        return bytearray(need)

    def release(self, backing: bytearray) -> None:
        """Give back a frame's buffer once nothing reads it any more (the server replied).

        Every byte of the next frame built in it is rewritten; the rest is never sent.
        """
        with self._idle_lock:
            if len(self._idle) < self.KEEP_BUFFERS and all(b is not backing for b in self._idle):
                self._idle.append(backing)


# --------------------------------------------------------------------------- read
class _Reader:
    """A cursor over a received envelope that reads only the schema's element kinds."""

    def __init__(self, buf: memoryview, what: str) -> None:
        self.buf, self.pos, self.end, self.what = buf, 0, len(buf), what

    def fail(self, expected: str, got: object) -> NoReturn:
        raise ProtocolError(f"{self.what}: inline tensor envelope, byte {self.pos}: "
                            f"expected {expected}, got {got}")

    def header(self, family: str) -> int:
        """Read a header of ``family``; return its value (a length for str/bin/array/map)."""
        pos = self.pos
        if pos >= self.end:
            self.fail(f"a msgpack {family}", "the end of the data")
        b = self.buf[pos]
        if b in _WIDTH:
            got, size = _FAMILY[b], 1 + _WIDTH[b]
            if pos + size > self.end:
                self.fail(f"a {size}-byte msgpack header", "the end of the data")
            value = int.from_bytes(self.buf[pos + 1:pos + size], "big")
        else:
            size, got, value = 1, "", b
            for fam, (prefix, limit) in _FIX.items():
                if prefix <= b <= prefix + limit:
                    got, value = fam, b - prefix
        if got != family:
            self.fail(f"a msgpack {family}", f"msgpack byte {b:#04x}")
        self.pos = pos + size
        return value

    def take(self, k: int) -> int:
        """Skip ``k`` payload bytes; return where they start."""
        if k > self.end - self.pos:
            self.fail(f"{k} more bytes", f"{self.end - self.pos}")
        self.pos += k
        return self.pos - k

    def text(self) -> str:
        n = self.header("str")
        off = self.take(n)
        return bytes(self.buf[off:off + n]).decode("utf-8", "replace")


def _map(r: _Reader, names: tuple[str, ...]) -> None:
    """Read a map header of exactly ``len(names)`` fields (each key then checked by _key)."""
    count = r.header("map")
    if count != len(names):
        r.fail(f"a map of the {len(names)} fields {list(names)}", f"{count} fields")


def _key(r: _Reader, seen: set[str], names: tuple[str, ...]) -> str:
    key = r.text()
    if key not in names or key in seen:
        r.fail(f"one of the fields {[k for k in names if k not in seen]}", repr(key[:40]))
    seen.add(key)
    return key


def _tensor(r: _Reader, j: int, name: str, shape: tuple[int, ...], nbytes: int) -> int:
    """Read tensor ``j``'s map; return where its ``nbytes`` data bytes start."""
    names = ("dtype", "shape", "data")
    seen: set[str] = set()
    off = -1
    _map(r, names)
    for _ in names:
        key = _key(r, seen, names)
        if key == "dtype":
            got = r.text()
            if got != name:
                r.fail(f"tensor {j} of dtype {name!r}", repr(got[:40]))
        elif key == "shape":
            rank = r.header("array")
            if rank != len(shape):
                r.fail(f"tensor {j} of shape {list(shape)}", f"{rank} dimensions")
            dims = [r.header("uint") for _ in range(rank)]
            if tuple(dims) != shape:
                r.fail(f"tensor {j} of shape {list(shape)}", dims)
        else:
            got_len = r.header("bin")
            if got_len != nbytes:
                r.fail(f"tensor {j} of {nbytes} data bytes", got_len)
            off = r.take(nbytes)
    return off


def locate_tensors(buf: bytes | bytearray | memoryview, count: int, shape: Sequence[int],
                   dtype: torch.dtype, what: str) -> list[tuple[int, int]]:
    """Find each tensor's raw bytes in a received 0.5.7 ``TensorEnvelope``.

    Args:
        buf: The envelope bytes (kept alive by the caller while the offsets are used).
        count: Expected number of tensors (chunks).
        shape: Expected shape of every tensor (the registered object shape).
        dtype: Expected dtype.
        what: Operation name for messages.

    Returns:
        ``[(offset, nbytes)]`` per tensor, each inside ``buf``.

    Raises:
        ProtocolError: Anything but version 1 and ``count`` tensors of exactly that dtype,
            shape and byte length, with no other field and nothing after the envelope.
    """
    mv = memoryview(buf).cast("B")
    r = _Reader(mv, what)
    want, name = tuple(int(d) for d in shape), dtype_name(dtype)
    nbytes = math.prod(want) * dtype.itemsize
    names = ("version", "tensors")
    seen: set[str] = set()
    spans: list[tuple[int, int]] = []
    _map(r, names)
    for _ in names:
        if _key(r, seen, names) == "version":
            version = r.header("uint")
            if version != ENVELOPE_VERSION:
                r.fail(f"version {ENVELOPE_VERSION}", version)
            continue
        got = r.header("array")
        if got != count:
            r.fail(f"{count} tensors", got)
        known: tuple[bytes, bytes] | None = None  # tensor 0's bytes around its data
        for j in range(count):
            start = r.pos
            if known is not None:  # the same bytes as tensor 0's: the same, valid, map
                pre, post = known
                off = start + len(pre)
                stop = off + nbytes + len(post)
                if stop <= r.end and mv[start:off] == pre and mv[off + nbytes:stop] == post:
                    spans.append((off, nbytes))
                    r.pos = stop
                    continue
            off = _tensor(r, j, name, want, nbytes)
            spans.append((off, nbytes))
            if known is None:
                known = (bytes(mv[start:off]), bytes(mv[off + nbytes:r.pos]))
    if r.pos != r.end:
        r.fail("the end of the envelope", f"{r.end - r.pos} more bytes")
    return spans
