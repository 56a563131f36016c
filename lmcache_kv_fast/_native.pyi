"""Type stub of the native core (csrc/, built as ``lmcache_kv_fast._native``).

Addresses are plain ints (``tensor.data_ptr()``). ``scatter``/``gather`` validate every
range they are given before any byte moves, but a region address that has no owning
:class:`Mapping` is trusted: the Python layer (``copy.native_backend``) only passes such
addresses after checking them against the tensor (and its storage) that backs the region.
``memcpy`` only refuses null, overlapping and unmapped ranges (benchmark/roofline helper).
"""

from collections.abc import Sequence
from typing import Any, Literal

__version__: str

#: Most copy threads :func:`set_threads` accepts (CPU_SETSIZE).
MAX_THREADS: int

class TensorSpanError(ValueError):
    """The tensor span of a ``scatter``/``gather`` cannot hold the shape.

    Null ``tensor_ptr``, or ``tensor_nbytes`` below ``P*L*T*Dfull*itemsize``. The copy
    backend turns it into ``InvalidArgumentError`` naming the tensor.
    """

PopulateMode = Literal[
    "auto", "none", "map_populate", "madvise", "parallel", "parallel_read", "resident"
]
CopyKernel = Literal["auto", "libc", "stream", "stream_avx2", "stream_sse2"]

class Mapping:
    """A read-write MAP_SHARED mapping of ``/dev/shm/<name>``.

    Args:
        name: Segment name, optionally with one leading ``/``; no other ``/``, no ``..``,
            no NUL, at most 255 characters (ValueError otherwise).
        size: If given, the segment must hold at least this many bytes (ValueError).
        populate: Pre-fault mode. ``"auto"`` = ``"resident"``: MADV_POPULATE_READ on the
            pool threads for pages already resident in the segment (mincore), so a lazily
            allocated pool is not forced into memory.

    Raises:
        ValueError: Bad name, empty segment, too small, unknown populate mode.
        OSError: shm_open/mmap failed (FileNotFoundError, PermissionError, ...).
    """

    def __init__(self, name: str, size: int | None = None,
                 populate: PopulateMode = "auto") -> None: ...
    @property
    def name(self) -> str:
        """Bare segment name (no leading ``/``)."""
    @property
    def size(self) -> int:
        """Mapped bytes (the segment's size when mapped)."""
    @property
    def address(self) -> int:
        """Base address; ValueError once closed."""
    @property
    def closed(self) -> bool: ...
    @property
    def populate(self) -> str:
        """Pre-fault mode actually used."""
    @property
    def populate_seconds(self) -> float:
        """Seconds spent in mmap + pre-faulting."""
    def regions(self, offsets: Sequence[int], lengths: Sequence[int], expected_nbytes: int,
                align: int) -> list[int]:
        """Validate slots and return their absolute addresses.

        Every slot must have ``length == expected_nbytes``, ``offset >= 0``,
        ``offset + length <= min(size, current file size)`` (no overflow),
        ``offset % align == 0`` when ``align > 0``, and not overlap another slot.

        Raises:
            ValueError: Naming the first bad slot; or the mapping is closed.
            TypeError: A non-integer offset/length.
        """
    def populate_resident(self, offset: int, length: int) -> int:
        """Map the pages of ``[offset, offset + length)`` the segment already has.

        Copies into them then take no page fault. Returns the pages mapped.

        Raises:
            ValueError: Range outside the segment, or the mapping is closed.
        """

    def close(self) -> None:
        """Unmap (idempotent); deferred while a copy using the mapping runs."""
    def __enter__(self) -> Mapping: ...
    def __exit__(self, *args: object) -> None: ...

class ResultBuffer:
    """Writable buffer (buffer protocol, uint8) for a result tensor.

    Reuses a pooled, already-faulted buffer of capacity in ``[nbytes, 2 * nbytes]`` when
    ``pool`` is true, else maps a 2 MiB-aligned anonymous region advised MADV_HUGEPAGE.
    When the object dies the memory goes back to the bounded pool (or is unmapped).

    Args:
        nbytes: Size in bytes, >= 1.
        prefault: For freshly mapped buffers: ``"none"`` (fault during the fill) or
            ``"populate"`` (MADV_POPULATE_WRITE on the pool threads; = ``"auto"``).
        pool: Take from / return to the recycling pool.
    """

    def __init__(self, nbytes: int, prefault: Literal["auto", "none", "populate"] = "auto",
                 pool: bool = True) -> None: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def recycled(self) -> bool:
        """Whether the memory came from the pool."""
    @property
    def address(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

def scatter(tensor_ptr: int, tensor_nbytes: int, shape: Sequence[int], itemsize: int,
            width: int, col_offset: int, chunk_tokens: int, chunk_ids: Sequence[int],
            region_addrs: Sequence[int], region_nbytes: Sequence[int],
            owners: Sequence[Mapping | None] | None = None) -> None:
    """Copy chunk ``chunk_ids[j]`` of the ``[P, L, T, Dfull]`` tensor into region j.

    ``shape`` is ``(P, L, T, Dfull)``; columns ``[col_offset, col_offset + width)`` are
    copied; region j holds ``[P, L, chunk_tokens, width]`` C-order. ``tensor_nbytes`` is
    the memory backing the tensor from ``tensor_ptr`` (the backend passes what the
    tensor's storage really holds from there). ``owners[j]`` (if given and not None) is
    the mapping region j must lie in; it stays mapped during the copy. Runs with the GIL
    released, on the thread pool for large copies.

    Raises:
        TensorSpanError: Null ``tensor_ptr`` or ``tensor_nbytes`` below the shape's bytes.
        ValueError: Any other inconsistent size, index or range (before any byte moves).
    """

def gather(tensor_ptr: int, tensor_nbytes: int, shape: Sequence[int], itemsize: int,
           width: int, col_offset: int, chunk_tokens: int, chunk_ids: Sequence[int],
           region_addrs: Sequence[int], region_nbytes: Sequence[int],
           owners: Sequence[Mapping | None] | None = None) -> None:
    """Copy region j into chunk ``chunk_ids[j]`` of the tensor (see :func:`scatter`)."""

def memcpy(dst: int, src: int, n: int) -> None:
    """Parallel copy of ``n`` bytes on the pool (benchmark roofline helper, not SDK).

    ValueError for null, overlapping or unmapped ranges; otherwise UNCHECKED: nothing
    tells the core which buffer backs a raw address, so the caller guarantees both
    ranges belong to live buffers (and ``dst`` to a writable one).
    """

def index_rows(dst: int, dst_nbytes: int, dst_offset: int, src: int, src_nbytes: int,
               src_offset: int, idx: int, idx_nbytes: int, idx_offset: int, idx_itemsize: int,
               n_idx: int, outer: int, rows: int, row_bytes: int) -> None:
    """``dst[o][i] = src[o][index[i]]``: a row gather (``index_select`` of a contiguous tensor).

    ``src`` is ``[outer, rows, row_bytes]`` and ``dst`` ``[outer, n_idx, row_bytes]`` bytes,
    both C-order from ``*_offset`` bytes into buffers of ``*_nbytes`` at ``dst`` / ``src``;
    the index is ``n_idx`` integers of ``idx_itemsize`` (4 or 8) bytes at ``idx +
    idx_offset``. Consecutive indices are copied as one run, on the copy pool with the GIL
    released.

    Raises:
        ValueError: An index outside ``[0, rows)``, a span outside its buffer, overlapping
            buffers, or another itemsize (before any byte moves).
    """

Span = tuple[int, int, int]  # (buffer address, buffer bytes, view offset)

def rope_gather(dst: Span, src: Span, idx: Span, cos: Span, sin: Span, planes: int,
                layers: int, rows: int, n: int, width: int, head_dim: int, rotary_dim: int,
                interleaved: bool, dtype: str) -> None:
    """``dst[p][l][j] = src[p][l][idx[j]]``, plane 0's rotary pairs turned by cos/sin[j].

    ``src`` ``[planes, layers, rows, width]`` and ``dst`` ``[planes, layers, n, width]`` of
    ``dtype`` ("bfloat16" / "float32"), ``idx`` int64 ``[n]``, ``cos`` / ``sin`` float32
    ``[n, rotary_dim / 2]``; ``rotary_dim`` 0 is a plain gather. Bit-identical to
    ``edits.rerotate``'s torch code. On the copy pool without the GIL.

    Raises:
        ValueError: An index outside ``[0, rows)``, a span outside its buffer, the
            destination overlapping an input, an odd or too wide ``rotary_dim`` (before
            any byte moves).
    """

def fused_rows(src_addrs: Sequence[int], src_nbytes: Sequence[int],
               src_owners: Sequence[Mapping | None] | None, dst_ids: Sequence[int],
               dst_addrs: Sequence[int], dst_nbytes: Sequence[int],
               dst_owners: Sequence[Mapping | None] | None, idx: Span, n_out: int,
               geometry: tuple[int, int, int, int, int], cos: Span, sin: Span, head_dim: int,
               rotary_dim: int, interleaved: bool, dtype: str) -> None:
    """Token rows from chunk regions straight into chunk regions, K optionally re-rotated.

    Every region holds one ``[P, L, C, W]`` object (``geometry`` = ``(P, L, C, W,
    itemsize)``; a region may be longer). Source token ``s`` is row ``s % C`` of source
    region ``s // C``; destination region ``j`` gets output chunk ``dst_ids[j]``, whose
    token ``t`` takes source token ``idx[t]`` (int64 ``[n_out]``) on every plane and layer.
    ``rotary_dim > 0``: plane 0's rows turned by ``cos`` / ``sin`` ``[n_out, rotary_dim /
    2]`` of their output token, as :func:`rope_gather` (``dtype`` "bfloat16" / "float32");
    else bytes are copied. Owners (a :class:`Mapping` or None per region, or None) are
    pinned and must contain their regions. On the copy pool without the GIL.

    Raises:
        ValueError: A region smaller than a chunk, ids not one per destination, repeated
            or past the index, an index value outside ``[0, n_src * C)``, a destination
            overlapping a source, another destination or a table, a closed or foreign
            owner, a bad rotation geometry or table span, a size overflow (before any byte
            moves).
    """

def fused_blocks(src_addrs: Sequence[int], src_nbytes: Sequence[int],
                 src_owners: Sequence[Mapping | None] | None, dst_ids: Sequence[int],
                 dst_addrs: Sequence[int], dst_nbytes: Sequence[int],
                 dst_owners: Sequence[Mapping | None] | None, idx: Span, n_out: int,
                 geometry: tuple[int, int, int, int, int, int], tok_off: Sequence[int],
                 dim_off: Sequence[int], cos: Span, sin: Span, head_dim: int, rotary_dim: int,
                 interleaved: bool, dtype: str) -> None:
    """:func:`fused_rows` for a CPU engine's raw chunk objects, where K/V are not rows.

    Every region holds one ``[L, C, W]`` object (``geometry`` = ``(L, C, W, itemsize, BS,
    HS)``, W = NH * 2 * HS, C a multiple of BS). Element (plane p, layer l, token t, head
    h, dim d) is at element ``l*C*W + (t//BS)*BS*W + h*2*HS + tok_off[p][t%BS] +
    dim_off[p][d]`` (``tok_off`` [2, BS] and ``dim_off`` [2, HS] flat, row-major). Output
    token ``t`` of destination region ``j`` (output chunk ``dst_ids[j]``) takes source token
    ``idx[t]``'s K and V on every layer and head; ``rotary_dim > 0``: K turned by ``cos`` /
    ``sin`` (``head_dim`` must be HS) as :func:`fused_rows` turns it. Owners pinned, cold
    destination pages need room (else OSError ENOSPC). On the copy pool without the GIL.

    Raises:
        ValueError: What :func:`fused_rows` refuses, plus a block geometry that is not
            whole (BS, heads), tables of the wrong shape, or tables that are not a
            bijection of (p, t % BS, d) onto one block's head cells (before any byte
            moves).
    """

def fused_blocks_isa() -> str:
    """``"avx512"`` or ``"generic"``: how :func:`fused_blocks` moves consecutive tokens here."""

def _set_fused_blocks_isa(name: str) -> None:
    """Force ``"avx512"`` / ``"generic"`` or back to ``"auto"`` (tests; ValueError otherwise)."""

def window_scores(q: Span, k: Span, out: Span, layers: int, tokens: int, tq: int,
                  n_kv: int, group: int, head_dim: int, window: int, at_end: bool,
                  scale: float) -> None:
    """SnapKV's window attention, summed over the window: float32 ``out [L, Hq, T]``.

    From bfloat16 ``q [L, tq, Hq * head_dim]`` (its last ``window`` rows) and ``k [L, T,
    n_kv * head_dim]``; ``Hq = n_kv * group``. AMX tiles or AVX512-BF16 where the CPU has
    them (:func:`window_scores_isa`), else a portable loop.

    Raises:
        ValueError: A window outside ``1 .. tq`` (or past T when ``at_end``), a scale not
            > 0, a span outside its buffer, ``out`` overlapping an input.
    """

def score_pool(buf: Span, rows: int, n: int, ld: int, kernel: int, is_max: bool) -> None:
    """Max- or mean-pool the first ``n`` of each float32 row (``ld`` apart) in place.

    Raises:
        ValueError: An even kernel, ``n > ld``, a span outside its buffer.
    """

def key_scores(k: Span, out: Span, layers: int, tokens: int, n_kv: int, head_dim: int,
               keydiff: bool) -> None:
    """KeyDiff (``keydiff``) or L2 scores: float32 ``out [L, n_kv, T]`` from bfloat16 ``k``.

    Raises:
        ValueError: A span outside its buffer, ``out`` overlapping ``k``, no heads.
    """

def key_redundancy(k: Span, out: Span, layers: int, tokens: int, n_kv: int, head_dim: int,
                   threshold: float) -> None:
    """R-KV's redundancy sums: float32 ``out [L, n_kv, T]`` from bfloat16 ``k``.

    ``out[l][h][i]`` sums ``cos(k_i, k_j)`` over the head's other keys with a cosine
    above ``threshold``. AMX or AVX512-BF16 only (:func:`key_redundancy_supported`).

    Raises:
        ValueError: No fast path for this head size (or forced isa), a span outside its buffer,
            ``out`` overlapping ``k`` (before any work).
    """

def key_redundancy_supported(head_dim: int) -> bool:
    """Whether :func:`key_redundancy` runs here for this head size (and forced isa)."""

def window_scores_isa(head_dim: int | None = None) -> str:
    """``"amx"``, ``"avx512"`` or ``"generic"``: the path :func:`window_scores` takes here.

    Without ``head_dim``, the fastest this CPU runs and the forced isa allows; with it,
    the one for that head size (AMX: multiples of 32 up to 128; AVX-512: even sizes).
    """

def _set_window_scores_isa(name: str) -> None:
    """Cap window_scores' and key_redundancy's path (tests; ``"auto"`` lifts the cap).

    ``"amx"`` (the same as ``"auto"``), ``"avx512"`` or ``"generic"``; ValueError for
    another name or a path this CPU cannot run.
    """

def set_threads(n: int) -> None:
    """Copy threads including the caller, 1..MAX_THREADS (ValueError otherwise)."""

def get_threads() -> int:
    """Copy threads (default: LMCACHE_KV_FAST_THREADS, else usable CPUs)."""

def set_call_threads(n: int) -> None:
    """Cap the threads of this thread's own copies (0: no cap); thread-local.

    ValueError outside ``[0, MAX_THREADS]``.
    """

def get_call_threads() -> int:
    """This thread's cap (0: none)."""

def set_parallel_threshold(nbytes: int) -> None:
    """Copies smaller than this stay on the calling thread."""

def get_parallel_threshold() -> int: ...
def set_copy_kernel(name: CopyKernel) -> None:
    """Byte-copy kernel (``auto``: glibc memcpy below the streaming threshold)."""

def get_copy_kernel() -> str: ...
def set_stream_threshold(nbytes: int) -> None:
    """Copies of at least this many bytes use streaming stores under ``auto``."""

def get_stream_threshold() -> int: ...
def set_stream_interleave(pages: int) -> None:
    """Streaming copies walk this many 4 KiB pages in lock step (1: linear), 1..64.

    Raises:
        ValueError: ``pages`` outside ``[1, 64]``.
    """

def get_stream_interleave() -> int: ...
def set_cold_write_fraction(fraction: float) -> None:
    """Share of a scatter's not-yet-allocated segment regions written with ``pwritev``.

    A store into pages the server's pool segment does not have yet (fresh or released L1)
    is cheaper through the segment file: the kernel skips zeroing pages a write covers
    and takes no page fault per 4 KiB; writes to one file serialise, so the rest of the
    cold regions go through the mapping (cached stores) on the other threads. ``-1``:
    auto (by thread count; all of them when the file system has too little room, so a
    full ``/dev/shm`` gives ``OSError(ENOSPC)`` instead of SIGBUS), ``0``: never, ``1``: all.

    Raises:
        ValueError: Not -1 and not in [0, 1].
    """

def get_cold_write_fraction() -> float: ...
def copy_stats() -> dict[str, int]:
    """Process totals of the cold-store path.

    Keys: ``file_write_bytes``, ``cold_mapped_bytes``, ``cold_regions``,
    ``file_write_fallbacks`` (scatters redone through the mapping after a refused write),
    ``file_writes_disabled`` (1 once a write failed other than with ENOSPC/EDQUOT),
    ``uffd_fill_bytes`` (placed with ``UFFDIO_COPY``), ``uffd_unavailable`` (1 when
    userfaultfd could not be used in this process), ``staged_box_bytes`` (strided
    copies moved through per-thread staging boxes, ``csrc/strided_copy.cpp``),
    ``staged_box_direct_bytes`` (of those, the ones whose 32 x 32 tiles were streamed
    from the staged source straight to the destination), ``pool_jobs`` (copies
    split over the copy pool) and ``fused_block_tables`` (engine block geometries
    ``fused_blocks`` checked and planned; calls with kept tables do not count).
    """

def set_cold_uffd(enabled: bool) -> None:
    """Fill not-yet-allocated segment pages with ``UFFDIO_COPY`` on the copy threads.

    On by default and used when the pool has two or more threads and userfaultfd works
    (Linux with ``UFFD_USER_MODE_ONLY`` since 5.11 needs no privilege; sandboxes may
    refuse it): the kernel allocates each page, copies into it and maps it, with no
    zeroing, no fault and no inode lock, so every thread fills at once. Otherwise the
    ``pwritev`` / mapping split of :func:`set_cold_write_fraction` runs. Enabling also
    retries a userfaultfd found unusable before.
    """

def get_cold_uffd() -> bool: ...
def _set_uffd_fault(err: int) -> None:
    """Testing only: every ``UFFDIO_COPY`` places half its pages, then fails with ``err``."""

def _set_box_staging_fault(on: bool) -> None:
    """Testing only: strided copies get no staging buffer for their boxes."""

def _set_cold_room_margin(margin: int) -> int: ...
def _set_file_write_fault(err: int) -> None:
    """Testing only: every ``pwritev`` of a cold scatter fails with errno ``err`` (0: off)."""

def config() -> dict[str, Any]:
    """Threads, thresholds, kernel, streaming ISA and usable CPUs."""

def result_pool_stats() -> dict[str, int]:
    """limit, pooled_bytes, entries, hits, misses, evictions, reserved."""

def set_result_pool_limit(nbytes: int) -> None:
    """Bound idle pooled bytes and evict down to it.

    Default: LMCACHE_KV_FAST_RESULT_POOL_MB, else min(4 GiB, RAM / 8).
    """

def result_pool_trim() -> None:
    """Unmap every idle pooled buffer."""

def result_pool_reserve(nbytes: int, count: int) -> int:
    """Make the pool hold ``count`` idle buffers that serve a result of ``nbytes``.

    Buffers already pooled that would serve it count; never beyond the pool's limit.
    New ones are mapped and every page populated on the calling thread (releases the
    GIL). Returns how many were mapped. ValueError: ``nbytes`` above 2**46 or ``count``
    above 4096.
    """

def validate_segment_name(name: str) -> str:
    """Return the bare name or raise ValueError."""

def strided_copy(dst: int, dst_nbytes: int, dst_offset: int, src: int, src_nbytes: int,
                 src_offset: int, itemsize: int, sizes: Sequence[int],
                 dst_strides: Sequence[int], src_strides: Sequence[int]) -> None:
    """Copy an N-d strided view of ``src`` into one of ``dst`` (a permutation copy).

    Views: the buffer at ``dst`` / ``src`` of ``*_nbytes`` bytes, starting ``*_offset``
    elements in, with per-dimension element ``*_strides`` over ``sizes``. Tiled over the
    dimension with the smallest destination stride and the one with the smallest source
    stride; runs on the copy pool with the GIL released.

    Raises:
        ValueError: A negative size/stride/offset, a view reaching outside its buffer,
            overlapping buffers, a destination writing one element twice, or more than 16
            dimensions.
    """
