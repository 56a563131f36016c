"""Zero-copy pickle plane: parse and build the server's chunk-list pickles without ``pickle``.

The server sends (and accepts) ``pickle.dumps([t0, t1, ...])`` of CPU tensors: per tensor
``torch._utils._rebuild_tensor_v2(torch.storage._load_from_bytes(<torch.save zip>), 0,
size, stride, False, OrderedDict())``; the zip stores the raw bytes uncompressed.

* :func:`locate_chunks` walks that opcode stream with a tiny, closed interpreter (only the
  opcodes and the three globals of a tensor pickle; nothing is ever called) and returns,
  for each tensor, where its raw bytes lie in the received buffer — so retrieve copies them
  once, straight into the result, with no unpickling, no ``torch.load`` and no extra
  buffers. Anything unexpected returns None and the caller falls back to the restricted
  unpickler.
* :class:`ChunkFrameBuilder` lays out the whole ``commit_store`` payload frame (msgpack
  ``bin`` header + pickle + one torch.save zip per chunk) in one buffer, leaving each
  chunk's data region 64-byte aligned, so the store copies the KV once, straight into the
  frame that ZMQ then sends without another copy.
"""

from __future__ import annotations

import io
import pickle
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_kv_fast.errors import ProtocolError

_STORAGE_DTYPES = {
    "BFloat16Storage": torch.bfloat16, "HalfStorage": torch.float16,
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64,
    "CharStorage": torch.int8, "ByteStorage": torch.uint8, "ShortStorage": torch.int16,
    "IntStorage": torch.int32, "LongStorage": torch.int64,
    "Float8_e4m3fnStorage": torch.float8_e4m3fn, "Float8_e5m2Storage": torch.float8_e5m2,
}
_G_REBUILD = ("torch._utils", "_rebuild_tensor_v2")
_G_LOAD = ("torch.storage", "_load_from_bytes")
_G_ODICT = ("collections", "OrderedDict")
_MARK = object()


class _Unsupported(Exception):
    """The stream uses something outside the tensor-pickle subset."""


@dataclass(frozen=True)
class _Bytes:
    offset: int
    length: int


@dataclass(frozen=True)
class _TensorRef:
    storage: _Bytes
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _interpret(buf: memoryview) -> Any:
    """Run the closed tensor-pickle interpreter; return the top-level object."""
    stack: list[Any] = []
    memo: list[Any] = []
    memo_map: dict[int, Any] = {}
    pos, end = 0, len(buf)
    u8 = struct.Struct("<B").unpack_from
    u16 = struct.Struct("<H").unpack_from
    i32 = struct.Struct("<i").unpack_from
    u32 = struct.Struct("<I").unpack_from
    u64 = struct.Struct("<Q").unpack_from

    def pop_mark() -> list[Any]:
        for k in range(len(stack) - 1, -1, -1):
            if stack[k] is _MARK:
                items = stack[k + 1:]
                del stack[k:]
                return items
        raise _Unsupported("no mark")

    while pos < end:
        op = buf[pos]
        pos += 1
        if op == 0x80:  # PROTO
            pos += 1
        elif op == 0x95:  # FRAME
            pos += 8
        elif op == 0x5D:  # EMPTY_LIST
            stack.append([])
        elif op == 0x29:  # EMPTY_TUPLE
            stack.append(())
        elif op == 0x7D:  # EMPTY_DICT
            stack.append({})
        elif op == 0x28:  # MARK
            stack.append(_MARK)
        elif op == 0x30:  # POP
            stack.pop()
        elif op == 0x31:  # POP_MARK
            pop_mark()
        elif op == 0x94:  # MEMOIZE
            memo.append(stack[-1])
        elif op == 0x71:  # BINPUT
            memo_map[u8(buf, pos)[0]] = stack[-1]
            pos += 1
        elif op == 0x72:  # LONG_BINPUT
            memo_map[u32(buf, pos)[0]] = stack[-1]
            pos += 4
        elif op in (0x68, 0x6A):  # BINGET, LONG_BINGET
            if op == 0x68:
                idx, pos = u8(buf, pos)[0], pos + 1
            else:
                idx, pos = u32(buf, pos)[0], pos + 4
            stack.append(memo_map[idx] if idx in memo_map else memo[idx])
        elif op == 0x8C:  # SHORT_BINUNICODE
            n = buf[pos]
            stack.append(bytes(buf[pos + 1:pos + 1 + n]).decode())
            pos += 1 + n
        elif op == 0x58:  # BINUNICODE
            n = u32(buf, pos)[0]
            stack.append(bytes(buf[pos + 4:pos + 4 + n]).decode())
            pos += 4 + n
        elif op == 0x93:  # STACK_GLOBAL
            name, module = stack.pop(), stack.pop()
            g = (module, name)
            if g not in (_G_REBUILD, _G_LOAD, _G_ODICT):
                raise _Unsupported(f"global {module}.{name}")
            stack.append(g)
        elif op == 0x63:  # GLOBAL "module\nname\n"
            nl1 = bytes(buf[pos:pos + 256]).index(b"\n")
            module = bytes(buf[pos:pos + nl1]).decode()
            nl2 = bytes(buf[pos + nl1 + 1:pos + nl1 + 257]).index(b"\n")
            name = bytes(buf[pos + nl1 + 1:pos + nl1 + 1 + nl2]).decode()
            pos += nl1 + nl2 + 2
            g = (module, name)
            if g not in (_G_REBUILD, _G_LOAD, _G_ODICT):
                raise _Unsupported(f"global {module}.{name}")
            stack.append(g)
        elif op in (0x42, 0x8E, 0x43):  # BINBYTES, BINBYTES8, SHORT_BINBYTES
            if op == 0x42:
                n, pos = u32(buf, pos)[0], pos + 4
            elif op == 0x8E:
                n, pos = u64(buf, pos)[0], pos + 8
            else:
                n, pos = buf[pos], pos + 1
            if pos + n > end:
                raise _Unsupported("bytes beyond the buffer")
            stack.append(_Bytes(pos, n))
            pos += n
        elif op == 0x4B:  # BININT1
            stack.append(buf[pos])
            pos += 1
        elif op == 0x4D:  # BININT2
            stack.append(u16(buf, pos)[0])
            pos += 2
        elif op == 0x4A:  # BININT
            stack.append(i32(buf, pos)[0])
            pos += 4
        elif op == 0x8A:  # LONG1
            n = buf[pos]
            stack.append(int.from_bytes(bytes(buf[pos + 1:pos + 1 + n]), "little", signed=True))
            pos += 1 + n
        elif op == 0x89:  # NEWFALSE
            stack.append(False)
        elif op == 0x88:  # NEWTRUE
            stack.append(True)
        elif op == 0x4E:  # NONE
            stack.append(None)
        elif op == 0x85:  # TUPLE1
            stack[-1] = (stack[-1],)
        elif op == 0x86:  # TUPLE2
            b, a = stack.pop(), stack.pop()
            stack.append((a, b))
        elif op == 0x87:  # TUPLE3
            c, b, a = stack.pop(), stack.pop(), stack.pop()
            stack.append((a, b, c))
        elif op == 0x74:  # TUPLE
            stack.append(tuple(pop_mark()))
        elif op == 0x52:  # REDUCE
            args, func = stack.pop(), stack.pop()
            stack.append(_reduce(func, args))
        elif op == 0x61:  # APPEND
            item = stack.pop()
            if not isinstance(stack[-1], list):
                raise _Unsupported("append to a non-list")
            stack[-1].append(item)
        elif op == 0x65:  # APPENDS
            items = pop_mark()
            if not isinstance(stack[-1], list):
                raise _Unsupported("appends to a non-list")
            stack[-1].extend(items)
        elif op == 0x2E:  # STOP
            if len(stack) != 1:
                raise _Unsupported("unbalanced stack at STOP")
            return stack[0]
        else:
            raise _Unsupported(f"opcode 0x{op:02x}")
    raise _Unsupported("no STOP")


def _reduce(func: Any, args: Any) -> Any:
    if func == _G_ODICT and args == ():
        return {}
    if func == _G_LOAD and isinstance(args, tuple) and len(args) == 1 and \
            isinstance(args[0], _Bytes):
        return args[0]
    if func == _G_REBUILD and isinstance(args, tuple) and len(args) in (6, 7):
        storage, off, size, stride, requires_grad, hooks = args[:6]
        if not isinstance(storage, _Bytes) or type(off) is not int or \
                not isinstance(size, tuple) or not isinstance(stride, tuple) or \
                not all(type(x) is int and x >= 0 for x in (*size, *stride)) or \
                hooks != {} or requires_grad is not False:
            raise _Unsupported("unexpected tensor arguments")
        return _TensorRef(storage, off, size, stride)
    raise _Unsupported(f"call of {func!r}")


# --------------------------------------------------------------------------- storage bytes
#: torch's legacy serialization magic number (``torch.serialization.MAGIC_NUMBER``).
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001
_MAX_HEAD = 1 << 16


class _HeadUnpickler(pickle.Unpickler):
    """Reads the small pickles in front of a legacy ``torch.save`` storage.

    Only the storage classes are resolved; the storage reference is a persistent id that is
    never loaded.
    """

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise _Unsupported(f"storage header global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return ("pid", pid)


def _storage_region(buf: memoryview, ref: _Bytes, dtype: torch.dtype) -> tuple[int, int]:
    """Return (absolute offset, nbytes) of the raw bytes of a ``_load_from_bytes`` argument.

    That argument is torch's legacy format: magic, protocol, sys info, the storage's
    persistent id, the key list (5 small pickles), then an int64 element count and the bytes.
    """
    f = io.BytesIO(bytes(buf[ref.offset:ref.offset + min(ref.length, _MAX_HEAD)]))
    u = _HeadUnpickler(f)
    magic, proto, info = u.load(), u.load(), u.load()
    if magic != _LEGACY_MAGIC or proto != _LEGACY_PROTOCOL or not isinstance(info, dict) or \
            info.get("little_endian") is not True:
        raise _Unsupported("storage header")
    obj = _HeadUnpickler(f).load()
    keys = _HeadUnpickler(f).load()
    if not (isinstance(obj, tuple) and len(obj) == 2 and obj[0] == "pid"):
        raise _Unsupported("not a single storage")
    pid = obj[1]
    if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
        raise _Unsupported("storage id")
    sdtype, key, location, numel = pid[1], pid[2], pid[3], pid[4]
    if sdtype != dtype or location != "cpu":
        raise ProtocolError(f"server pickle holds a {sdtype} storage on {location}, expected {dtype}")
    if keys != [key] or type(numel) is not int or numel < 0:
        raise _Unsupported("storage keys")
    head = f.tell()
    if head + 8 > ref.length:
        raise _Unsupported("truncated storage")
    count = struct.unpack_from("<q", buf, ref.offset + head)[0]
    nbytes = numel * dtype.itemsize
    if count != numel or head + 8 + nbytes != ref.length:
        raise _Unsupported("storage size record")
    return ref.offset + head + 8, nbytes


def locate_chunks(buf: memoryview, count: int, numel: int, dtype: torch.dtype,
                  what: str, shape: Sequence[int] | None = None,
                  ) -> list[tuple[int, int]] | None:
    """Find each chunk tensor's raw bytes in a server chunk-list pickle.

    Args:
        buf: The pickle bytes (kept alive by the caller while the offsets are used).
        count: Expected number of chunk tensors.
        numel: Expected elements per chunk.
        dtype: Expected dtype.
        what: Operation name for messages.
        shape: Expected chunk shape ``[P, L, C, W]`` (for ``P == 1`` also ``[L, C, W]``);
            same-size tensors of another shape are refused, never reinterpreted.

    Returns:
        ``[(offset, nbytes)]`` per chunk, or None when the stream is outside the subset
        this parser reads (the caller then uses the restricted unpickler).

    Raises:
        ProtocolError: A well-formed tensor list of the wrong count, size or dtype.
    """
    try:
        obj = _interpret(buf)
        if not isinstance(obj, list) or not all(isinstance(t, _TensorRef) for t in obj):
            return None
        if len(obj) != count:
            raise ProtocolError(f"{what}: expected {count} chunk tensors, got {len(obj)}")
        out = []
        for k, t in enumerate(obj):
            n = 1
            expect = 1
            for d in t.size:
                n *= d
            if n != numel:
                raise ProtocolError(f"{what}: chunk {k} has {n} elements, expected {numel}")
            if shape is not None and list(t.size) != list(shape) and not (
                    shape[0] == 1 and list(t.size) == list(shape[1:])):
                raise ProtocolError(
                    f"{what}: chunk {k} has shape {list(t.size)}, expected {list(shape)}"
                )
            for d, s in zip(reversed(t.size), reversed(t.stride), strict=True):
                if d > 1 and s != expect:
                    return None  # not contiguous: let the general path handle it
                expect *= d
            data_off, data_len = _storage_region(buf, t.storage, dtype)
            start = data_off + t.storage_offset * dtype.itemsize
            nbytes = numel * dtype.itemsize
            if t.storage_offset < 0 or start + nbytes > data_off + data_len:
                raise ProtocolError(f"{what}: chunk {k} view exceeds its storage")
            out.append((start, nbytes))
        return out
    except ProtocolError:
        raise
    except Exception:  # hostile bytes: anything odd goes to the safe (refusing) path
        return None


# --------------------------------------------------------------------------- build
_NOOPS = {2: b"(1", 3: b"K\x000"}  # MARK POP_MARK / BININT1 0 POP


def _noop(n: int) -> bytes:
    """A no-op pickle opcode sequence of exactly ``n`` bytes (n == 0 or n >= 2)."""
    if n == 0:
        return b""
    if n == 1:
        raise ValueError("no 1-byte no-op")
    parts = []
    while n > 3 and n != 4:
        parts.append(_NOOPS[2])
        n -= 2
    if n == 4:
        parts.append(_NOOPS[2] * 2)
    else:
        parts.append(_NOOPS[n])
    return b"".join(parts)


class ChunkFrameBuilder:
    """Builds ``commit_store`` payload frames for chunks of one shape and dtype.

    Args:
        shape: Object shape of one chunk (what the server allocated).
        dtype: Element dtype.
        align: Alignment of each chunk's data region (absolute address).
    """

    #: Idle frame buffers kept for reuse (a fresh one costs a page fault per 4 KiB plus
    #: zeroing: ~40 ms for a 64 MiB frame).
    KEEP_BUFFERS = 2

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, align: int = 64) -> None:
        self.shape = tuple(shape)
        self.dtype = dtype
        self.align = align
        self._idle: list[bytearray] = []
        self._idle_lock = threading.Lock()
        # Template: one small tensor of the dtype, pickled without memo (protocol 3), whose
        # storage record is then resized to a chunk.
        tiny = torch.zeros(_TEMPLATE_NUMEL, dtype=dtype)  # > 255 bytes: a BINBYTES record
        raw = io.BytesIO()
        p = pickle.Pickler(raw, protocol=3)
        p.fast = True  # no memo: every item segment is self-contained and identical
        p.dump(tiny)
        stream = raw.getvalue()
        if stream[:2] != b"\x80\x03" or stream[-1:] != b".":
            raise RuntimeError("unexpected template pickle")
        body = stream[2:-1]
        probe = memoryview(b"]" + body + b"a.")
        (ref,) = _interpret(probe)
        data_off, data_len = _storage_region(probe, ref.storage, dtype)
        # absolute positions inside `body`
        bin_at, storage_at = ref.storage.offset - 1 - 5, ref.storage.offset - 1
        if body[bin_at:bin_at + 1] != b"B":
            raise RuntimeError("template storage is not BINBYTES")
        storage_head = body[storage_at:data_off - 1 - 8]  # up to the int64 element count
        numel = 1
        for d in self.shape:
            numel *= d
        self.numel = numel
        self.nbytes = numel * dtype.itemsize
        self._storage_head = _retag_numel(storage_head, _TEMPLATE_NUMEL, numel)
        storage_len = len(self._storage_head) + 8 + self.nbytes
        self._head = (bytes(body[:bin_at]) + b"B" + struct.pack("<I", storage_len)
                      + self._storage_head + struct.pack("<q", numel))
        tail = body[data_off - 1 + data_len:]
        self._tail = _retag_shape(bytes(tail), self.shape)
        self.item_len = len(self._head) + self.nbytes + len(self._tail)

    def build(self, n: int) -> tuple[bytearray, memoryview, list[int]]:
        """Lay out a frame for ``n`` chunks.

        Returns:
            ``(backing, frame, offsets)``: ``frame`` (a view of ``backing``) is the msgpack
            ``bin`` frame to send; ``offsets[j]`` is where chunk j's bytes go in ``frame``.
        """
        a = self.align
        head, tail = self._head, self._tail
        need = 5 + 4 + n * (self.item_len + a + 3) + 2 + 2 * a
        backing = None
        with self._idle_lock:
            fits = [b for b in self._idle if need <= len(b) <= 2 * need]
            if fits:
                backing = min(fits, key=len)
                self._idle.remove(backing)
        if backing is None:
            backing = bytearray(need)
        base_addr = torch.frombuffer(backing, dtype=torch.uint8).data_ptr()
        shift = (-base_addr) % a  # the frame starts 64-byte aligned
        frame_full = memoryview(backing)[shift:]
        pos = 5
        frame_full[pos:pos + 4] = b"\x80\x03]("
        pos += 4
        offsets = []
        for _ in range(n):
            pad = (-(pos + len(head))) % a
            if pad == 1:
                pad += a
            nop = _noop(pad)
            frame_full[pos:pos + pad] = nop
            pos += pad
            frame_full[pos:pos + len(head)] = head
            pos += len(head)
            offsets.append(pos)
            pos += self.nbytes
            frame_full[pos:pos + len(tail)] = tail
            pos += len(tail)
        frame_full[pos:pos + 2] = b"e."
        pos += 2
        frame_full[0] = 0xC6
        frame_full[1:5] = struct.pack(">I", pos - 5)
        return backing, frame_full[:pos], offsets

    def release(self, backing: bytearray) -> None:
        """Give back a frame's buffer once nothing reads it any more (the server replied).

        Every byte of the next frame built in it is rewritten; the rest is never sent.
        """
        with self._idle_lock:
            if len(self._idle) < self.KEEP_BUFFERS and all(b is not backing for b in self._idle):
                self._idle.append(backing)


_TEMPLATE_NUMEL = 300


def _retag_numel(storage_head: bytes, old: int, new: int) -> bytes:
    """Rewrite the element count inside the storage's persistent-id pickle.

    The persistent id tuple ends with ``..., 'cpu', <numel>, None)``; the template has
    numel ``_TEMPLATE_NUMEL``, replaced by a BININT/LONG encoding of ``new``.
    """
    needle = b"X\x03\x00\x00\x00cpuq"
    k = storage_head.find(needle)
    if k < 0:
        needle = b"X\x03\x00\x00\x00cpu"
        k = storage_head.find(needle)
        if k < 0:
            raise RuntimeError("template storage id not found")
        j = k + len(needle)
    else:
        j = k + len(needle) + 1  # BINPUT index byte
    old_op = _int_op(old)
    if storage_head[j:j + len(old_op)] != old_op:
        raise RuntimeError("template numel not found")
    return storage_head[:j] + _int_op(new) + storage_head[j + len(old_op):]


def _retag_shape(tail: bytes, shape: tuple[int, ...]) -> bytes:
    """Rewrite the ``(1,), (1,)`` size/stride tuples after the storage of the template."""
    old = b"K\x00" + _int_op(_TEMPLATE_NUMEL) + b"\x85K\x01\x85"  # offset 0, size (n,), stride (1,)
    k = tail.find(old)
    if k < 0:
        raise RuntimeError("template size/stride not found")
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    strides.reverse()
    new = b"K\x00" + _tuple_op(shape) + _tuple_op(tuple(strides))
    return tail[:k] + new + tail[k + len(old):]


def _int_op(v: int) -> bytes:
    if 0 <= v < 256:
        return b"K" + bytes([v])
    if 0 <= v < 65536:
        return b"M" + struct.pack("<H", v)
    if -(2**31) <= v < 2**31:
        return b"J" + struct.pack("<i", v)
    raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _tuple_op(vals: tuple[int, ...]) -> bytes:
    return b"(" + b"".join(_int_op(v) for v in vals) + b"t"
